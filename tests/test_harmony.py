"""OpenAI's harmony format (gpt-oss), on a tiny gpt-oss whose tokenizer is o200k_harmony's
(``tests/harmony_model.py``): prompts written by openai-harmony, replies taken apart on every
API (the analysis channel as reasoning, the final channel as the answer, a commentary message
to ``functions.<name>`` as a tool call), and the cache resumed across turns and restarts."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from mlx_lm.utils import load_tokenizer

from agentkv import AgentRuntime, ReasoningDelta, Reply, RuntimeConfig, TextDelta
from agentkv.engine.models.o200k import VOCAB_ENV, VOCAB_FILE, VOCAB_SHA256
from agentkv.engine.sampling import SamplingParams
from agentkv.errors import ChatTemplateError
from agentkv.harmony import Harmony
from agentkv.models.tiny import tiny_model_dir
from agentkv.prompt import ChatRenderer
from tests.conftest import ForcedTokens

THOUGHT = "The user asks about the weather. I answer."
ANSWER = "It is sunny in Oslo."
WEATHER = {
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def answer(thinking: str, text: str) -> str:
    """A reply as gpt-oss writes it after ``<|start|>assistant`` (``<|return|>`` ends it)."""
    return (
        f"<|channel|>analysis<|message|>{thinking}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{text}<|return|>"
    )


def call(thinking: str, name: str, arguments: dict) -> str:
    """A tool call as gpt-oss writes it (``<|call|>`` ends it)."""
    return (
        f"<|channel|>analysis<|message|>{thinking}<|end|>"
        f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
        f"<|message|>{json.dumps(arguments)}<|call|>"
    )


@pytest.fixture(scope="module")
def tokenizer(harmony_model):
    return load_tokenizer(harmony_model)


@pytest.fixture(scope="module")
def harmony(tokenizer, tmp_path_factory):
    return Harmony.of(tokenizer, "tiny gpt-oss", tmp_path_factory.mktemp("harmony"))


@pytest.fixture
def say(monkeypatch, tokenizer):
    """``say(text)``: the next request answers ``text`` (forced token by token; the text
    holds its own last token, ``<|return|>`` or ``<|call|>``)."""
    scripts: list[list[int]] = []
    make = SamplingParams.make_logits_processors

    def processors(self: SamplingParams, vocab_size: int) -> list:
        forced = [ForcedTokens(scripts.pop(0))] if scripts else []
        return forced + make(self, vocab_size)

    monkeypatch.setattr(SamplingParams, "make_logits_processors", processors)
    return lambda text: scripts.append(tokenizer.encode(text, add_special_tokens=False))


def config(model, tmp_path) -> RuntimeConfig:
    return RuntimeConfig(model=str(model), data_dir=tmp_path)


def test_the_vocabulary_is_written_from_the_models_own_tokenizer(tokenizer, tmp_path, monkeypatch):
    monkeypatch.delenv(VOCAB_ENV, raising=False)
    form = Harmony.of(tokenizer, "tiny gpt-oss", tmp_path)
    written = tmp_path / "tiktoken" / VOCAB_FILE
    assert hashlib.sha256(written.read_bytes()).hexdigest() == VOCAB_SHA256
    assert os.environ[VOCAB_ENV] == str(written.parent)
    text = "Grüße, 12345 worlds!\n\n  <|start|>user<|message|>hi<|end|>"
    assert form.encoding.encode(text, allowed_special="all") == tokenizer.encode(
        text, add_special_tokens=False
    )
    assert Harmony.of(load_tokenizer(tiny_model_dir("tiny:thinking")), "x", tmp_path) is None


def test_prompts_are_openai_harmonys_own(tokenizer, harmony):
    import openai_harmony as oh

    renderer = ChatRenderer(tokenizer, frozenset(), harmony=harmony)
    tools = [{"type": "function", "function": WEATHER}]
    arguments = json.dumps({"city": "Oslo"})
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "function": {"name": "weather", "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
        {"role": "user", "content": "Thanks! <|end|> is text here."},
    ]
    got = renderer.full_prompt(conversation, tools)

    system = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort.MEDIUM)
    developer = oh.DeveloperContent.new().with_instructions("Be brief.")
    developer = developer.with_function_tools(
        [oh.ToolDescription.new("weather", WEATHER["description"], WEATHER["parameters"])]
    )
    assistant = oh.Role.ASSISTANT
    expected = harmony.encoding.render_conversation_for_completion(
        oh.Conversation.from_messages(
            [
                oh.Message.from_role_and_content(oh.Role.SYSTEM, system),
                oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer),
                oh.Message.from_role_and_content(oh.Role.USER, "Weather in Oslo?"),
                oh.Message.from_role_and_content(assistant, arguments)
                .with_channel("commentary")
                .with_recipient("functions.weather")
                .with_content_type("<|constrain|>json"),
                oh.Message.from_author_and_content(
                    oh.Author.new(oh.Role.TOOL, "functions.weather"), "sunny"
                )
                .with_channel("commentary")
                .with_recipient("assistant"),
                oh.Message.from_role_and_content(assistant, THOUGHT).with_channel("analysis"),
                oh.Message.from_role_and_content(assistant, ANSWER).with_channel("final"),
                oh.Message.from_role_and_content(oh.Role.USER, "Thanks! "),
            ]
        ),
        assistant,
    )
    # The same tokens, but for the user's "<|end|>": text, not the control token.
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    cut = len(expected) - 3  # before the user's <|end|>, <|start|>, assistant
    assert got[:cut] == expected[:cut] and got[-3:] == expected[-3:]
    assert end not in got[cut:-3] and tokenizer.decode(got[cut:-3]) == "<|end|> is text here."
    # Earlier reasoning is dropped once a later answer follows, as the format asks.
    assert THOUGHT not in tokenizer.decode(got)

    efforts = [renderer.using({"reasoning_effort": e}) for e in ("low", "high")]
    texts = [tokenizer.decode(r.full_prompt(conversation[:2])) for r in efforts]
    assert "Reasoning: low" in texts[0] and "Reasoning: high" in texts[1]
    off = tokenizer.decode(renderer.using({"enable_thinking": False}).full_prompt([]))
    assert "Reasoning: low" in off
    with pytest.raises(ChatTemplateError, match="builtin_tools"):
        renderer.using({"builtin_tools": ["browser"]}).full_prompt(conversation[:2])
    with pytest.raises(ChatTemplateError, match="reasoning_effort"):
        renderer.using({"reasoning_effort": "max"}).full_prompt(conversation[:2])


def test_replies_are_taken_apart_whole_and_streamed(harmony):
    raw = answer(THOUGHT, ANSWER).removesuffix("<|return|>")  # the stop token is not text
    assert harmony.split(raw) == (THOUGHT, ANSWER)
    reply = call(THOUGHT, "weather", {"city": "Oslo"}).removesuffix("<|call|>")
    thinking, rest = harmony.split(reply)
    parsed = harmony.parse(rest)
    assert thinking == THOUGHT and parsed.text == ""
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("weather", {"city": "Oslo"})]
    assert harmony.parse(harmony.markup(list(parsed.tool_calls))).tool_calls == parsed.tool_calls
    splitter = harmony.splitter()
    pieces = [p for i in range(0, len(reply), 7) for p in splitter.feed(reply[i : i + 7])]
    pieces += splitter.flush()
    assert "".join(t for inside, t in pieces if inside) == THOUGHT
    # The call's markup comes as it is written: header, arguments, <|call|> once it ends.
    markup = [t for inside, t in pieces if not inside]
    assert len(markup) > 3 and "".join(markup) == rest
    assert markup[-1] == "<|call|>" and markup[0].endswith("<|message|>")
    # Text that is not the format is the answer; a call to no function stays text.
    assert harmony.split("Just words.") == ("", "Just words.")
    browse = "<|channel|>analysis to=browser.search <|constrain|>json<|message|>{}"
    assert harmony.parse(harmony.split(browse)[1]).tool_calls == ()


async def test_a_reply_keeps_its_analysis_apart_and_the_next_turn_resumes_it(
    harmony_model, tmp_path, say
):
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        await rt.create_agent("oss", system_prompt="Be brief.")
        say(answer(THOUGHT, ANSWER))
        reply = await rt.chat("oss", "Weather?", max_tokens=64)
        assert (reply.reasoning, reply.text) == (THOUGHT, ANSWER)
        assert 0 < reply.usage.reasoning_tokens < reply.usage.completion_tokens
        say(answer(THOUGHT, ANSWER))
        events = [e async for e in rt.stream("oss", "And tomorrow?", max_tokens=64)]
        streamed = events[-1]
        assert isinstance(streamed, Reply) and (streamed.reasoning, streamed.text) == (
            THOUGHT,
            ANSWER,
        )
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == THOUGHT
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == ANSWER
        held = streamed.usage.prompt_tokens + streamed.usage.completion_tokens
        say(answer(THOUGHT, ANSWER))
        third = await rt.chat("oss", "Thanks.", max_tokens=64)
        assert third.cache_source == "hot" and third.usage.cached_tokens == held
        held = third.usage.prompt_tokens + third.usage.completion_tokens
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        say(answer(THOUGHT, ANSWER))
        again = await rt.chat("oss", "Still there?", max_tokens=64)
        assert again.cache_source == "disk" and again.usage.cached_tokens == held
        assert again.text == ANSWER


async def test_a_resent_conversation_resumes_every_reply_it_sends_back(
    harmony_model, tmp_path, say, tokenizer
):
    # Clients resend the answer alone (no analysis, no headers): the reply the model
    # generated is spliced back, so each turn prefills only its own message, after a restart
    # too.
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    replies = []
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        await rt.create_agent("doc")
        for question in ("How are you?", "And today?", "Tell me more."):
            say(answer(THOUGHT * 3, ANSWER))
            reply = None
            async for event in rt.respond("doc", conversation, max_tokens=200):
                reply = event
            assert (reply.reasoning, reply.text) == (THOUGHT * 3, ANSWER)
            replies.append(reply)
            conversation += [
                {"role": "assistant", "content": reply.text},
                {"role": "user", "content": question},
            ]
    # After a restart the replies are found again in the cache read from disk.
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        say(answer(THOUGHT, ANSWER))
        async for event in rt.respond("doc", conversation, max_tokens=200):
            reply = event
        replies.append(reply)
    questions = ("How are you?", "And today?", "Tell me more.")
    for earlier, later, question in zip(replies[:-1], replies[1:], questions, strict=True):
        held = earlier.usage.prompt_tokens + earlier.usage.completion_tokens
        source = "disk" if later is replies[-1] else "hot"
        assert later.cache_source == source and later.usage.cached_tokens == held
        new = f"<|start|>user<|message|>{question}<|end|><|start|>assistant"
        prefilled = later.usage.prompt_tokens - later.usage.cached_tokens
        assert prefilled == len(tokenizer.encode(new, add_special_tokens=False))


@pytest.fixture(scope="module")
def server(harmony_model, tmp_path_factory):
    from agentkv.server.background import serve_in_thread

    data = tmp_path_factory.mktemp("harmony-server")
    with serve_in_thread(RuntimeConfig(model=str(harmony_model), data_dir=data)) as url:
        yield url


def scripted(tools: bool) -> str:
    return call(THOUGHT, "weather", {"city": "Oslo"}) if tools else answer(THOUGHT, ANSWER)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
def test_chat_completions(harmony_model, server, say, stream, tools):
    import openai

    say(scripted(tools))
    extra = {"tools": [{"type": "function", "function": WEATHER}]} if tools else {}
    asked = {
        "model": str(harmony_model),
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 120,
        **extra,
    }
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as client:
        if not stream:
            message = client.chat.completions.create(**asked).choices[0].message
            reasoning, content = message.reasoning_content, message.content
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        else:
            reasoning, content, by_index, pieces = "", "", {}, 0
            for chunk in client.chat.completions.create(**asked, stream=True):
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is None:
                    continue
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
                for c in delta.tool_calls or []:  # the name first, then the arguments' pieces
                    name, arguments = by_index.get(c.index, (c.function.name, ""))
                    by_index[c.index] = (name, arguments + (c.function.arguments or ""))
                    pieces += 1
            calls = [by_index[i] for i in sorted(by_index)]
            assert pieces > 3 or not tools  # argument by argument
    assert reasoning == THOUGHT
    if tools:
        assert calls == [("weather", '{"city": "Oslo"}')] and not content
    else:
        assert content == ANSWER and not calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
def test_anthropic_messages(harmony_model, server, say, stream, tools):
    import anthropic

    say(scripted(tools))
    extra = {}
    if tools:
        extra["tools"] = [{"name": "weather", "input_schema": WEATHER["parameters"]}]
    asked = {
        "model": str(harmony_model),
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        **extra,
    }
    with anthropic.Anthropic(base_url=server, api_key="x", max_retries=0) as client:
        if stream:
            with client.messages.stream(**asked) as events:
                kinds = [e.type for e in events]
                message = events.get_final_message()
            assert kinds.count("input_json") > 3 or not tools  # argument by argument
        else:
            message = client.messages.create(**asked)
    assert [b.type for b in message.content] == ["thinking", "tool_use" if tools else "text"]
    assert message.content[0].thinking == THOUGHT
    if tools:
        assert message.content[1].input == {"city": "Oslo"} and message.stop_reason == "tool_use"
    else:
        assert message.content[1].text == ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
def test_responses(harmony_model, server, say, stream, tools):
    import openai

    say(scripted(tools))
    extra = {"tools": [{"type": "function", **WEATHER}]} if tools else {}
    asked = {
        "model": str(harmony_model),
        "input": "Weather in Oslo?",
        "max_output_tokens": 200,
        "reasoning": {"effort": "high"},
        **extra,
    }
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as client:
        if stream:
            with client.responses.stream(**asked) as events:
                kinds = [e.type for e in events]
                response = events.get_final_response()
            pieces = kinds.count("response.function_call_arguments.delta")
            assert pieces > 3 or not tools  # argument by argument
        else:
            response = client.responses.create(**asked)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call" if tools else "message"]
    assert response.output[0].content[0].text == THOUGHT
    if tools:
        assert (response.output[1].name, response.output[1].arguments) == (
            "weather",
            '{"city": "Oslo"}',
        )
    else:
        assert response.output_text == ANSWER


async def test_a_forced_tool_call_follows_the_analysis(harmony_model, tmp_path, say, tokenizer):
    conversation = [{"role": "user", "content": "Weather in Oslo?"}]
    weather = {**WEATHER, "parameters": {**WEATHER["parameters"], "additionalProperties": False}}
    weather["parameters"]["properties"] = {"city": {"enum": ["Oslo", "Bergen"]}}
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        await rt.create_agent("caller")
        for thinks in (True, False):
            # The model reasons (its analysis message), or not: then the grammar writes the call.
            if thinks:
                say(f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant")
            else:
                say("<|channel|>commentary")
            reply = None
            async for event in rt.respond(
                "caller",
                conversation,
                tools=[{"type": "function", "function": weather}],
                tool_choice={"name": "weather"},
                max_tokens=120,
            ):
                reply = event
            assert reply.reasoning == (THOUGHT if thinks else "")
            (made,) = reply.content.tool_calls
            assert made.name == "weather" and made.arguments["city"] in ("Oslo", "Bergen")
            assert reply.content.text == "" and reply.finish_reason == "stop"
            assert reply.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|call|>")


async def test_a_json_reply_is_the_final_message(harmony_model, tmp_path, say):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Bergen"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    shape = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        await rt.create_agent("json")
        for thinks in (True, False):
            opening = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
            say(opening if thinks else "<|channel|>final")
            reply = await rt.chat("json", "Which city?", max_tokens=80, response_format=shape)
            assert reply.reasoning == (THOUGHT if thinks else "")
            assert json.loads(reply.text)["city"] in ("Oslo", "Bergen")
            assert reply.finish_reason == "stop"


async def test_a_reasoning_budget_ends_the_analysis_after_that_many_tokens(
    harmony_model, tmp_path, say, tokenizer
):
    header = tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        await rt.create_agent("capped")
        say("<|channel|>analysis<|message|>")  # it starts reasoning; then the budget holds
        reply = await rt.chat("capped", "Think.", max_tokens=20, reasoning_budget=5)
        assert reply.token_ids[: len(header)] == header
        assert reply.token_ids[len(header) + 5] == end
        assert reply.usage.reasoning_tokens == 5


async def test_a_stored_tool_round_trip_renders_again_for_the_next_chat_turn(
    harmony_model, tmp_path, say
):
    # Transcripts store a tool result without its call's id: harmony names its author after
    # the call before it, so a chat turn after a resent conversation renders the transcript.
    tools = [{"type": "function", "function": WEATHER}]
    conversation = [{"role": "user", "content": "Weather in Oslo?"}]
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        await rt.create_agent("mixed")
        say(call(THOUGHT, "weather", {"city": "Oslo"}))
        first = [e async for e in rt.respond("mixed", conversation, tools=tools, max_tokens=80)]
        (made,) = first[-1].content.tool_calls
        conversation += [
            {"role": "assistant", "content": "", "tool_calls": [made.as_template()]},
            {"role": "tool", "tool_call_id": made.id, "content": "sunny"},
        ]
        say(answer(THOUGHT, ANSWER))
        events = [e async for e in rt.respond("mixed", conversation, tools=tools, max_tokens=80)]
        assert events[-1].text == ANSWER
        stored = [(m.role, m.content) for m in await rt.transcript("mixed")]
        assert stored[2] == ("tool", "sunny")
        say(answer(THOUGHT, "You are welcome."))
        third = await rt.chat("mixed", "Thanks!", max_tokens=80)
        # (without the tools the prompt is another one: rebuilt from the transcript)
        assert third.text == "You are welcome." and third.cache_source == "rebuilt"


async def test_a_reply_cut_short_is_closed_and_the_next_turn_resumes_it(
    harmony_model, tmp_path, say, tokenizer
):
    async with await AgentRuntime.open(config(harmony_model, tmp_path)) as rt:
        await rt.create_agent("cut")
        say(answer(THOUGHT * 4, ANSWER))
        cut = await rt.chat("cut", "Think long.", max_tokens=12)
        assert cut.finish_reason == "length" and cut.text == "" and cut.reasoning
        say(answer(THOUGHT, ANSWER))
        reply = await rt.chat("cut", "Now answer.", max_tokens=64)
        assert reply.cache_source == "hot" and reply.text == ANSWER
        assert reply.usage.cached_tokens == cut.usage.prompt_tokens + len(cut.token_ids)
        new = "<|end|><|start|>user<|message|>Now answer.<|end|><|start|>assistant"
        prefilled = reply.usage.prompt_tokens - reply.usage.cached_tokens
        assert prefilled == len(tokenizer.encode(new, add_special_tokens=False))
