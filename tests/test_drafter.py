"""The draft model (``agentkv.engine.drafter``): its drafts never change a greedy reply, on
every family of attention layers it drafts with (drafting for itself, every draft right but
for rounding; another model's, most of them wrong); a conversation's next turn feeds it only
its new tokens; its KV catches up over several steps and starts again past its context; a
draft model it cannot drive is refused by name; the runtime and ``agentkv serve`` take it."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from pydantic import ValidationError

from agentkv import AgentKVError, AgentRuntime, RuntimeConfig, UnsupportedModelError
from agentkv.engine import drafter as drafter_module
from agentkv.engine.config import EngineConfig
from agentkv.engine.drafter import RETRY, TRIALS
from agentkv.engine.engine import Engine
from agentkv.engine.request import GenerationRequest
from agentkv.engine.sampling import SamplingParams
from agentkv.engine.speculative import MODEL_TRIAL, PromptLookup
from agentkv.server.cli import main
from tests.architectures import build_architecture

PROMPT = [(7 * i + 3) % 400 + 16 for i in range(48)]
FOLLOW = [20, 21, 22, 23]
FAMILIES = ["llama", "gemma3_text", "gpt_oss", "cohere2", "deepseek_v2", "gemma4_text-shared_kv"]
"""Full attention, sliding windows (attended through a mask over a plain KV), attention
sinks, MLA, layers reading another layer's KV."""


@pytest.fixture
def no_lookup(monkeypatch):
    """Drafts come from the draft model alone (random models repeat tokens the lookup would
    draft first), and it costs nothing: its acceptance alone decides whether it drafts on (a
    tiny model drafting for itself costs as much as it saves)."""
    monkeypatch.setattr(PromptLookup, "draft", lambda self, k, last: [])
    monkeypatch.setattr(drafter_module, "weight_bytes", lambda model: 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("drafter"), {}

    class Dirs(dict):
        def __missing__(self, name: str) -> str:
            built[name] = str(build_architecture(name, root / name))
            return built[name]

    return Dirs()


async def two_turns(model: str, config: EngineConfig, max_tokens: int = 40):
    """A reply, the reply to ``FOLLOW`` from the cache it leaves, the engine's stats and the
    tokens fed to its draft model in each turn."""
    eng = await Engine.open(model, config)
    try:
        drafter = eng._thread.drafter
        first = await eng.generate(
            GenerationRequest(PROMPT, max_tokens=max_tokens, ignore_eos=True, return_cache=True)
        )
        fed = drafter.fed_tokens if drafter else 0
        after = GenerationRequest(FOLLOW, max_tokens=max_tokens, ignore_eos=True, cache=first.cache)
        second = await eng.generate(after)
        fed_after = drafter.fed_tokens - fed if drafter else 0
        return first, second, eng.stats(), (fed, fed_after), drafter
    finally:
        await eng.close()


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_draft_models_drafts_never_change_a_greedy_reply(family, models, no_lookup):
    model = models[family]
    plain, plain_after, _, _, _ = await two_turns(model, EngineConfig(speculative="off"))
    for draft, good in ((model, True), ("tiny:llama", False)):
        config = EngineConfig(speculative="draft", draft_model=draft)
        got, after, stats, _, _ = await two_turns(model, config)
        assert got.token_ids == plain.token_ids and after.token_ids == plain_after.token_ids
        assert got.cache.tokens == plain.cache.tokens
        assert stats.drafted_tokens > 0
        if good:  # drafting for itself: its drafts are the reply, but where rounding differs
            assert stats.accepted_tokens > 0.8 * stats.drafted_tokens
        assert got.stats.drafted_tokens + after.stats.drafted_tokens == stats.drafted_tokens


async def test_a_conversations_next_turn_feeds_the_draft_model_its_new_tokens(no_lookup):
    config = EngineConfig(speculative="draft", draft_model="tiny:gemma3")
    first, second, _, (fed, fed_after), drafter = await two_turns("tiny:gemma3", config, 16)
    # the first turn: its prompt and reply (a draft fed after each step's tokens, some twice)
    assert len(PROMPT) + len(first.token_ids) - 1 <= fed
    # the next: its new tokens and reply, its history's draft KV kept from the first
    assert fed_after <= len(FOLLOW) + 2 * len(second.token_ids) < len(PROMPT)
    assert second.stats.accepted_tokens > 0
    kept = list(drafter.kept.values())
    assert len(kept) == 1 and kept[0].tokens == second_history(first, second)[: len(kept[0].tokens)]
    assert drafter.kept_bytes == kept[0].nbytes > 0


def second_history(first, second) -> list[int]:
    return first.cache.tokens + FOLLOW + second.token_ids


async def test_a_draft_kv_catches_up_in_chunks_and_starts_again_past_its_context(
    no_lookup, monkeypatch
):
    monkeypatch.setattr(drafter_module, "CATCH_UP", 24)
    monkeypatch.setattr(drafter_module, "CONTEXT", 64)
    plain, plain_after, _, _, _ = await two_turns("tiny:llama", EngineConfig(speculative="off"))
    config = EngineConfig(speculative="draft", draft_model="tiny:llama")
    got, after, stats, _, drafter = await two_turns("tiny:llama", config)
    assert got.token_ids == plain.token_ids and after.token_ids == plain_after.token_ids
    assert stats.accepted_tokens > 0  # (from a shorter context than the reply's: fewer)
    (kept,) = drafter.kept.values()
    history = second_history(got, after)
    assert kept.start > 0 and len(kept.tokens) <= 64 + 1
    assert kept.tokens == history[kept.start : kept.start + len(kept.tokens)]


async def test_a_draft_model_it_cannot_drive_is_refused_by_name():
    hybrid = EngineConfig(speculative="draft", draft_model="tiny:hybrid")
    with pytest.raises(UnsupportedModelError, match=r"'tiny:hybrid'.*cannot be cut back") as err:
        await Engine.open("tiny:llama", hybrid)
    assert isinstance(err.value, AgentKVError)
    other = EngineConfig(speculative="draft", draft_model="tiny:gemma3")
    with pytest.raises(UnsupportedModelError, match=r"'tiny:gemma3'.*tokenizer is not"):
        await Engine.open("tiny:llama", other)


def test_speculative_draft_and_a_draft_model_go_together(tmp_path, capsys):
    with pytest.raises(ValidationError, match="needs a draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValidationError, match="needs a draft_model"):
        EngineConfig(draft_model="tiny:llama")  # (speculative "lookup")
    with pytest.raises(ValidationError, match="needs a draft_model"):
        RuntimeConfig(model="tiny:llama", data_dir=tmp_path, speculative="draft")
    config = RuntimeConfig(model="tiny:llama", data_dir=tmp_path, draft_model="tiny:thinking")
    engine = config.engine_config()
    assert (engine.speculative, engine.draft_model) == ("draft", "tiny:thinking")
    for argv in (["--speculative", "draft"], ["--speculative", "off", "--draft-model", "x"]):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--model", "tiny:llama", *argv])
        assert exit_.value.code == 2
        assert "--speculative draft and --draft-model go together" in capsys.readouterr().err


async def test_the_runtime_drafts_with_its_draft_model(tmp_path, no_lookup):
    plain_config = RuntimeConfig(model="tiny:llama", data_dir=tmp_path / "off", speculative="off")
    async with await AgentRuntime.open(plain_config) as rt:
        await rt.create_agent("a")
        plain = [await rt.chat("a", m, max_tokens=24) for m in ("Hello.", "And then?")]
    config = RuntimeConfig(
        model="tiny:llama", data_dir=tmp_path / "draft", draft_model="tiny:llama"
    )
    async with await AgentRuntime.open(config) as rt:
        await rt.create_agent("a")
        got = [await rt.chat("a", m, max_tokens=24) for m in ("Hello.", "And then?")]
    assert [r.text for r in got] == [r.text for r in plain]
    assert all(r.timings.drafted_tokens > 0 for r in got)
    assert got[1].usage.cached_tokens == plain[1].usage.cached_tokens > 0
    assert got[1].cache_source == plain[1].cache_source


async def test_a_model_whose_steps_cannot_be_cut_back_runs_without_its_draft_model(caplog):
    config = EngineConfig(speculative="draft", draft_model="tiny:hybrid")
    eng = await Engine.open("tiny:hybrid", config)
    try:
        reply = await eng.generate(GenerationRequest(PROMPT, max_tokens=8, ignore_eos=True))
        assert eng._thread.drafter is None and len(reply.token_ids) == 8
        assert eng.stats().drafted_tokens == 0
    finally:
        await eng.close()
    assert "draft model tiny:hybrid not loaded: tiny:hybrid's layers" in caplog.text


async def test_sampled_replies_keep_their_distribution_with_a_draft_model(no_lookup):
    """The draft model's greedy draft is deterministic, kept with the probability the model
    gives it: the second token of a sampled reply is distributed alike with it and without."""
    runs = 160

    async def seconds(config: EngineConfig) -> tuple[Counter, int]:
        eng = await Engine.open("tiny:llama", config)
        try:
            replies = await asyncio.gather(
                *(
                    eng.generate(
                        GenerationRequest(
                            PROMPT,
                            max_tokens=3,
                            ignore_eos=True,
                            sampling=SamplingParams(temperature=1.0, seed=seed),
                        )
                    )
                    for seed in range(runs)
                )
            )
            return Counter(r.token_ids[1] for r in replies), eng.stats().drafted_tokens
        finally:
            await eng.close()

    without, _ = await seconds(EngineConfig(speculative="off"))
    drafted, fed = await seconds(EngineConfig(speculative="draft", draft_model="tiny:llama"))
    assert fed > 0
    tokens = [t for t, n in without.items() if n >= 8]  # (a chi-square over the common ones)
    chi = sum((drafted[t] - without[t]) ** 2 / (drafted[t] + without[t]) for t in tokens)
    assert chi < 3 * len(tokens) + 10


async def test_a_draft_model_whose_drafts_do_not_pay_for_their_cost_stops(monkeypatch):
    # Drafting for itself, a draft costs what it saves (its cost is 1): after MODEL_TRIAL
    # steps of its drafts the turn goes on without them.
    monkeypatch.setattr(PromptLookup, "draft", lambda self, k, last: [])
    config = EngineConfig(speculative="draft", draft_model="tiny:llama", speculative_tokens=4)
    plain, _, _, _, _ = await two_turns("tiny:llama", EngineConfig(speculative="off"))
    got, after, _, _, drafter = await two_turns("tiny:llama", config)
    assert drafter.cost == 1.0
    assert got.token_ids == plain.token_ids
    for turn in (got, after):
        assert 0 < turn.stats.drafted_tokens <= MODEL_TRIAL * 4


async def test_a_draft_model_that_has_not_paid_is_tried_by_one_sequence_in_eight(monkeypatch):
    monkeypatch.setattr(PromptLookup, "draft", lambda self, k, last: [])
    config = EngineConfig(speculative="draft", draft_model="tiny:llama", speculative_tokens=4)
    eng = await Engine.open("tiny:llama", config)
    try:
        drafted = []
        for i in range(TRIALS + 2 * RETRY):
            prompt = [16 + i, *PROMPT]  # (each its own: no kept draft KV continues it)
            reply = await eng.generate(GenerationRequest(prompt, max_tokens=16, ignore_eos=True))
            drafted.append(reply.stats.drafted_tokens > 0)
        assert list(eng._thread.drafter.trials) == [False] * TRIALS
    finally:
        await eng.close()
    assert drafted[:TRIALS] == [True] * TRIALS  # each tried it, and it did not pay (cost 1)
    assert sum(drafted[TRIALS:]) == 2  # then one in RETRY
