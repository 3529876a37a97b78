"""Constrained decoding (engine.grammar): replies held to a JSON Schema in a shared batch."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.grammar import GrammarError
from agentkv.engine.request import FinishReason, GenerationRequest
from agentkv.engine.sampling import SamplingParams

TITLE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "words": {"type": "integer", "maximum": 999},
    },
    "required": ["title", "words"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    eng = asyncio.run(Engine.open("tiny:gemma3", EngineConfig()))
    yield eng
    asyncio.run(eng.close())


def prompt(eng: Engine, n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 * salt) % (eng.model.vocab_size - 16) + 16 for i in range(n)]


async def test_a_constrained_reply_is_valid_json_and_its_neighbours_are_untouched(engine):
    grammar = await asyncio.to_thread(engine.grammars.json_schema, TITLE)
    free = [GenerationRequest(prompt(engine, 20 + i, salt=i), max_tokens=16) for i in range(2)]
    alone = [(await engine.generate(r)).token_ids for r in free]
    held = [
        GenerationRequest(prompt(engine, 9, salt=5), max_tokens=64, grammar=grammar),
        GenerationRequest(
            prompt(engine, 30, salt=6),
            max_tokens=64,
            grammar=grammar,
            sampling=SamplingParams(temperature=1.0, seed=3),
        ),
    ]
    results = await asyncio.gather(*(engine.generate(r) for r in [*held, *free]))
    for result in results[:2]:
        assert result.finish_reason == FinishReason.STOP, result.text
        value = json.loads(result.text)
        assert set(value) == {"title", "words"} and isinstance(value["words"], int)
        assert isinstance(value["title"], str) and len(value["title"]) <= 12
        assert result.token_ids[-1] in engine.model.eos_token_ids
    # Unconstrained requests in the same batch give the tokens they give alone.
    assert [r.token_ids for r in results[2:]] == alone


async def test_any_json_object_without_a_schema(engine):
    grammar = await asyncio.to_thread(engine.grammars.json_schema, None)
    result = await engine.generate(
        GenerationRequest(prompt(engine, 12, salt=9), max_tokens=64, grammar=grammar)
    )
    assert result.finish_reason == FinishReason.STOP
    assert isinstance(json.loads(result.text), dict)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "/nope"),
        ({"type": "strin"}, "strin"),
        ("not a schema", "must be an object"),
    ],
)
def test_a_schema_that_cannot_compile_names_the_problem(engine, schema, says):
    with pytest.raises(GrammarError, match=says):
        engine.grammars.json_schema(schema)


async def test_the_runtime_holds_a_reply_to_a_response_format(tmp_path):
    from agentkv import AgentRuntime, InvalidResponseFormatError, RuntimeConfig

    config = RuntimeConfig(model="tiny:gemma3", data_dir=tmp_path)
    schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": TITLE}}
    async with await AgentRuntime.open(config) as rt:
        await rt.create_agent("a")
        reply = await rt.chat("a", "Name it.", max_tokens=64, response_format=schema)
        value = json.loads(reply.text)
        assert set(value) == {"title", "words"}
        # The transcript holds the JSON reply; the next turn is free text again.
        assert (await rt.transcript("a"))[-1].content == reply.text
        with pytest.raises(InvalidResponseFormatError, match=r"response_format\.type"):
            await rt.chat("a", "Again.", response_format={"type": "yaml"})
        bad = {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}
        with pytest.raises(InvalidResponseFormatError, match="cannot be compiled"):
            await rt.chat("a", "Again.", response_format=bad)
        assert len(await rt.transcript("a")) == 2  # refused turns store nothing


async def test_a_failing_grammar_ends_its_reply_not_the_batch(engine, monkeypatch, caplog):
    from agentkv.engine.grammar import GrammarProcessor

    grammar = await asyncio.to_thread(engine.grammars.json_schema, TITLE)
    free = GenerationRequest(prompt(engine, 21, salt=2), max_tokens=16)
    alone = (await engine.generate(free)).token_ids

    def broken(self, tokens):
        raise RuntimeError("matcher broke")

    monkeypatch.setattr(GrammarProcessor, "_allowed", broken)
    held = GenerationRequest(prompt(engine, 9, salt=5), max_tokens=16, grammar=grammar)
    ended, neighbour = await asyncio.gather(engine.generate(held), engine.generate(free))
    assert ended.finish_reason == FinishReason.STOP
    assert ended.token_ids[-1] in engine.model.eos_token_ids and len(ended.token_ids) == 1
    assert neighbour.token_ids == alone
    assert "constrained decoding failed; ending the reply" in caplog.text


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    import mlx.core as mx

    from agentkv.engine.sampling import OccurrencePenalty

    penalty = OccurrencePenalty(presence=0.5, frequency=0.25)
    logits = mx.zeros((1, 8))
    assert penalty(mx.array([1, 2, 3]), logits).tolist() == [[0.0] * 8]  # the prompt
    once = penalty(mx.array([1, 2, 3, 5]), logits).tolist()[0]
    assert once[5] == -0.75 and once[1] == 0.0
    twice = penalty(mx.array([1, 2, 3, 5, 5]), logits).tolist()[0]
    assert twice[5] == -1.0 and sum(twice) == -1.0
