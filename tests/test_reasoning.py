"""A reasoning model's thinking, kept apart from its answer (tiny:thinking: Qwen3's chat
template, <think> … </think>, with Qwen 3.5's XML tool calls), across turns and in the
engine's logits (a budget, a grammar after the thinking)."""

from __future__ import annotations

import itertools
import json

import pytest
from mlx_lm.utils import load_tokenizer

from agentkv import AgentRuntime, ReasoningDelta, Reply, RuntimeConfig, TextDelta
from agentkv.engine.sampling import SamplingParams
from agentkv.errors import ChatTemplateError, InvalidMessageError
from agentkv.models.tiny import tiny_model_dir
from agentkv.reasoning import ReasoningFormat, ReasoningSplitter
from tests.conftest import ForcedTokens

MODEL = "tiny:thinking"
THOUGHT = "The user greets me. I greet back."
ANSWER = "Hello there, friend."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_model_dir(MODEL))


@pytest.fixture
def say(monkeypatch, tokenizer):
    """``say(text)``: the next request answers ``text`` (forced token by token), then ends."""
    scripts: list[list[int]] = []
    make = SamplingParams.make_logits_processors

    def processors(self: SamplingParams, vocab_size: int) -> list:
        forced = [ForcedTokens(scripts.pop(0))] if scripts else []
        return forced + make(self, vocab_size)

    monkeypatch.setattr(SamplingParams, "make_logits_processors", processors)

    def script(text: str, end: bool = True) -> None:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        scripts.append([*tokens, *([tokenizer.convert_tokens_to_ids("<|im_end|>")] * end)])

    return script


def thought(thinking: str, answer: str) -> str:
    return f"<think>\n{thinking}\n</think>\n\n{answer}"


def config(tmp_path) -> RuntimeConfig:
    return RuntimeConfig(model=MODEL, data_dir=tmp_path)


def test_the_reasoning_format_comes_from_the_tokenizer(tokenizer):
    form = ReasoningFormat.of(tokenizer)
    assert form is not None and (form.start, form.end) == ("<think>", "</think>")
    assert ReasoningFormat.of(load_tokenizer(tiny_model_dir("tiny:tools"))) is None
    assert form.split(thought(THOUGHT, ANSWER)) == (THOUGHT, ANSWER)
    assert form.split(f"{THOUGHT}\n</think>\n\n{ANSWER}", opened=True) == (THOUGHT, ANSWER)
    assert form.split(ANSWER) == ("", ANSWER)
    assert form.split("<think>\ncut off mid-thought") == ("cut off mid-thought", "")
    # Streamed in pieces of any size (a marker split across them), the same parts.
    text = thought("line one\nline two", "An answer\n\nin two paragraphs.")
    for size in (1, 2, 3, 7):
        splitter, parts = ReasoningSplitter(form), []
        for i in range(0, len(text), size):
            parts += splitter.feed(text[i : i + size])
        parts += splitter.flush()
        assert "".join(p for inside, p in parts if inside) == "line one\nline two"
        assert "".join(p for inside, p in parts if not inside) == "An answer\n\nin two paragraphs."
    # Where the template opened the thinking (its generation prompt ends with <think>).
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tokenizer.encode(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False
    )
    assert form.opened(opened) and not form.opened(closed) and not form.opened([1, 2, 3])


def test_thinking_markers_are_markers_only_in_replies(tokenizer):
    # A user cannot open a thinking block; a reply stored with its thinking (as transcripts
    # keep it) is taken apart by the template, which drops earlier reasoning.
    from agentkv.prompt import ChatRenderer

    renderer = ChatRenderer(tokenizer, frozenset(tokenizer.eos_token_ids))
    start = tokenizer.think_start_id
    as_user = renderer.full_prompt([{"role": "user", "content": thought(THOUGHT, ANSWER)}])
    assert start not in as_user
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": thought(THOUGHT, ANSWER)},
        {"role": "user", "content": "And?"},
    ]
    text = tokenizer.decode(renderer.full_prompt(history))
    assert THOUGHT not in text and f"<|im_start|>assistant\n{ANSWER}<|im_end|>" in text


async def test_a_reply_keeps_its_reasoning_apart_streamed_and_not(tmp_path, say):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("thinker", system_prompt="Be kind.")
        say(thought(THOUGHT, ANSWER))
        reply = await rt.chat("thinker", "Hi!", max_tokens=64)
        assert (reply.reasoning, reply.text) == (THOUGHT, ANSWER)
        say(thought(THOUGHT, ANSWER))
        events = [e async for e in rt.stream("thinker", "Hi again!", max_tokens=64)]
        streamed = events[-1]
        assert isinstance(streamed, Reply) and streamed.reasoning == THOUGHT
        thinking = [e.text for e in events if isinstance(e, ReasoningDelta)]
        answer = [e.text for e in events if isinstance(e, TextDelta)]
        assert "".join(thinking) == THOUGHT and "".join(answer) == ANSWER
        # Each piece is one or the other: no marker or newline of the template's in either.
        first_answer = next(i for i, e in enumerate(events) if isinstance(e, TextDelta))
        assert all(isinstance(e, ReasoningDelta) for e in events[:first_answer])
        # The transcript keeps what the model saw (the template drops earlier reasoning when
        # it renders the history again); the next turn resumes all of the cache.
        transcript = await rt.transcript("thinker")
        assert transcript[-1].content == thought(THOUGHT, ANSWER)
        say(ANSWER)
        third = await rt.chat("thinker", "Bye.", max_tokens=64)
        held = streamed.usage.prompt_tokens + streamed.usage.completion_tokens
        assert third.cache_source == "hot" and third.usage.cached_tokens == held


async def test_turn_n_plus_one_of_a_thinking_conversation_resumes_its_reasoning(
    tmp_path, say, tokenizer
):
    # A client resending the conversation sends the answer back without its reasoning (as
    # OpenAI-compatible clients do), and Qwen3's template drops earlier reasoning anyway: the
    # reply the model generated is spliced back in, so the next turn prefills only its own
    # message, not the whole last reply.
    conversation = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]
    replies = []
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("doc")
        for question in ("How are you?", "And today?", "Tell me more."):
            say(thought(THOUGHT * 3, ANSWER))
            reply = None
            async for event in rt.respond("doc", conversation, max_tokens=200):
                reply = event
            assert (reply.reasoning, reply.text) == (THOUGHT * 3, ANSWER)
            replies.append(reply)
            conversation += [
                {"role": "assistant", "content": reply.text},
                {"role": "user", "content": question},
            ]
    questions = ("How are you?", "And today?")
    for earlier, later, question in zip(replies, replies[1:], questions, strict=False):
        held = earlier.usage.prompt_tokens + earlier.usage.completion_tokens
        assert later.cache_source == "hot" and later.usage.cached_tokens == held
        # Prefilled: the new message and the template's tokens around it, nothing else.
        new = f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        prefilled = later.usage.prompt_tokens - later.usage.cached_tokens
        assert prefilled == len(tokenizer.encode(new, add_special_tokens=False))


async def test_template_kwargs_reach_the_template_and_the_next_turn_resumes(tmp_path, say):
    off = {"enable_thinking": False}
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        for agent_id in ("plain", "off"):
            await rt.create_agent(agent_id, system_prompt="Be kind.")
        say(ANSWER)
        on = await rt.chat("plain", "Hi!", max_tokens=64)
        say(ANSWER)
        without = await rt.chat("off", "Hi!", max_tokens=64, template_kwargs=off)
        # The generation prompt's empty reasoning block: <think>, "\n\n", </think>, "\n\n".
        empty = rt.engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
        assert without.usage.prompt_tokens == on.usage.prompt_tokens + len(empty)
        assert (without.reasoning, without.text) == ("", ANSWER)
        # The history renders the reply without that block; the cache holds what the model
        # saw, and the next turn extends it.
        say(ANSWER)
        again = await rt.chat("off", "More?", max_tokens=64, template_kwargs=off)
        held = without.usage.prompt_tokens + without.usage.completion_tokens
        assert again.cache_source == "hot" and again.usage.cached_tokens == held
        with pytest.raises(ChatTemplateError, match="'add_generation_prompt' is set by"):
            await rt.chat("off", "x", template_kwargs={"add_generation_prompt": False})
        with pytest.raises(ChatTemplateError, match="not a JSON value"):
            await rt.chat("off", "x", template_kwargs={"enable_thinking": object()})


async def test_a_reasoning_budget_ends_the_thinking_after_that_many_tokens(tmp_path, say):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("brief")
        tokenizer = rt.engine.tokenizer
        start, end = tokenizer.think_start_id, tokenizer.think_end_id
        say(thought("one two three four five six seven eight nine ten " * 3, ANSWER), end=False)
        reply = await rt.chat("brief", "Think hard.", max_tokens=40, reasoning_budget=5)
        ids = reply.token_ids
        assert ids[0] == start and ids[6] == end  # five tokens of thinking, then its end
        assert end not in ids[1:6] and reply.reasoning and reply.text
        with pytest.raises(InvalidMessageError, match="reasoning_budget must be"):
            await rt.chat("brief", "x", reasoning_budget=-1)
    async with await AgentRuntime.open(
        RuntimeConfig(model="tiny:tools", data_dir=tmp_path / "t")
    ) as rt:
        await rt.create_agent("plain")
        with pytest.raises(InvalidMessageError, match="has no thinking markers"):
            await rt.chat("plain", "x", reasoning_budget=10)


async def test_a_forced_tool_call_follows_the_thinking(tmp_path, say):
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Oslo", "Bergen"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    conversation = [{"role": "user", "content": "Weather in Oslo?"}]
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("caller")
        # The model opens its thinking, thinks, closes it: then the grammar holds the call.
        say("<think>\nI need the weather tool.\n</think>", end=False)
        reply = None
        async for event in rt.respond(
            "caller", conversation, tools=[weather], tool_choice="required", max_tokens=120
        ):
            reply = event
        assert reply.reasoning == "I need the weather tool."
        (call,) = reply.content.tool_calls
        assert call.name == "weather" and call.arguments["city"] in ("Oslo", "Bergen")
        assert reply.content.text.strip() == ""


# ---- over HTTP, with the official SDKs -----------------------------------------------------

WEATHER = {
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Bergen"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# Qwen 3.5's XML tool call (mlx-lm's qwen3_coder parser reads it).
CALL = (
    "<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
    "</tool_call>"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from agentkv.server.background import serve_in_thread

    data = tmp_path_factory.mktemp("reasoning-server")
    with serve_in_thread(RuntimeConfig(model=MODEL, data_dir=data)) as url:
        yield url


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
def test_chat_completions_return_reasoning_content(server, say, stream, tools):
    import openai

    say(thought(THOUGHT, CALL if tools else ANSWER))
    extra = {"tools": [{"type": "function", "function": WEATHER}]} if tools else {}
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as client:
        asked = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "max_tokens": 120,
            **extra,
        }
        if not stream:
            done = client.chat.completions.create(**asked)
            message = done.choices[0].message
            reasoning, content = message.reasoning_content, message.content
            assert message.model_extra["reasoning"] == THOUGHT
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            details = done.usage.completion_tokens_details
            assert 0 < details.reasoning_tokens < done.usage.completion_tokens
        else:
            reasoning, content, calls, alias = "", "", [], ""
            for chunk in client.chat.completions.create(**asked, stream=True):
                delta = chunk.choices[0].delta if chunk.choices else None
                extra_fields = (delta.model_extra or {}) if delta else {}
                reasoning += extra_fields.get("reasoning_content") or ""
                alias += extra_fields.get("reasoning") or ""
                content += (delta.content or "") if delta else ""
                for call in (delta.tool_calls or []) if delta else []:
                    calls.append((call.function.name, call.function.arguments))
            assert alias == reasoning
    assert reasoning == THOUGHT
    if tools:
        assert calls == [("weather", '{"city": "Oslo"}')] and not content
    else:
        assert content == ANSWER and not calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
def test_anthropic_messages_return_thinking_blocks(server, say, stream, tools):
    import anthropic

    say(thought(THOUGHT, CALL if tools else ANSWER))
    extra = {}
    if tools:
        schema = WEATHER["parameters"]
        extra["tools"] = [{"name": "weather", "description": "w", "input_schema": schema}]
    with anthropic.Anthropic(base_url=server, api_key="x", max_retries=0) as client:
        asked = {
            "model": MODEL,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            **extra,
        }
        if stream:
            with client.messages.stream(**asked) as events:
                kinds = [e.type for e in events]
                message = events.get_final_message()
            assert "thinking" in kinds  # the SDK's thinking_delta events
        else:
            message = client.messages.create(**asked)
    blocks = [block.type for block in message.content]
    assert blocks == (["thinking", "tool_use"] if tools else ["thinking", "text"])
    assert message.content[0].thinking == THOUGHT
    if tools:
        assert message.content[1].input == {"city": "Oslo"} and message.stop_reason == "tool_use"
    else:
        assert message.content[1].text == ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
def test_responses_return_reasoning_items(server, say, stream, tools):
    import openai

    say(thought(THOUGHT, CALL if tools else ANSWER))
    extra = {"tools": [{"type": "function", **WEATHER}]} if tools else {}
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as client:
        asked = {
            "model": MODEL,
            "input": "Weather in Oslo?",
            "max_output_tokens": 200,
            "reasoning": {"effort": "medium"},
            **extra,
        }
        if stream:
            deltas = ""
            with client.responses.stream(**asked) as events:
                for event in events:
                    if event.type == "response.reasoning_text.delta":
                        deltas += event.delta
                response = events.get_final_response()
            assert deltas == THOUGHT
        else:
            response = client.responses.create(**asked)
    kinds = [item.type for item in response.output]
    assert kinds == (["reasoning", "function_call"] if tools else ["reasoning", "message"])
    assert response.output[0].content[0].text == THOUGHT
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    if tools:
        assert response.output[1].name == "weather"
    else:
        assert response.output_text == ANSWER


def test_the_apis_switch_thinking_off_and_refuse_bad_values(server, say):
    import anthropic
    import openai

    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as client:
        asked = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        say(ANSWER)
        on = client.chat.completions.create(**asked)
        # reasoning_effort "none" and chat_template_kwargs both reach the template: its
        # generation prompt closes the thinking at once (4 tokens more).
        say(ANSWER)
        off = client.chat.completions.create(**asked, reasoning_effort="none")
        say(ANSWER)
        kwargs = client.chat.completions.create(
            **asked, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert off.usage.prompt_tokens == kwargs.usage.prompt_tokens == on.usage.prompt_tokens + 4
        with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
            client.chat.completions.create(**asked, reasoning_effort="extreme")
        with pytest.raises(openai.BadRequestError, match="tokenize"):
            client.chat.completions.create(
                **asked, extra_body={"chat_template_kwargs": {"tokenize": True}}
            )
        say(ANSWER)
        quiet = client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=8, reasoning={"effort": "minimal"}
        )
        assert quiet.usage.input_tokens == on.usage.prompt_tokens + 4
    with anthropic.Anthropic(base_url=server, api_key="x", max_retries=0) as client:
        asked = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
        say(ANSWER)
        disabled = client.messages.create(**asked, thinking={"type": "disabled"})
        usage = disabled.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == on.usage.prompt_tokens + 4
        with pytest.raises(anthropic.BadRequestError, match="thinking"):
            client.messages.create(**asked, thinking={"type": "enabled"})


def test_a_forced_xml_tool_call_on_every_api(server):
    # No scripted reply: the grammar of Qwen 3.5's XML format writes the call. Thinking off
    # (reasoning_effort "none"), or capped at 5 tokens (Anthropic's budget_tokens): the
    # grammar holds the answer after the thinking's forced end.
    import anthropic
    import openai

    tool = {"type": "function", "function": WEATHER}
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as client:
        done = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[tool],
            tool_choice="required",
            reasoning_effort="none",
            max_tokens=200,
        )
        (call,) = done.choices[0].message.tool_calls
        assert call.function.name == "weather"
        assert json.loads(call.function.arguments)["city"] in ("Oslo", "Bergen")
        assert done.choices[0].finish_reason == "tool_calls"
        response = client.responses.create(
            model=MODEL,
            input="Weather?",
            tools=[{"type": "function", **WEATHER}],
            tool_choice={"type": "function", "name": "weather"},
            reasoning={"effort": "none"},
            max_output_tokens=200,
        )
        (item,) = [i for i in response.output if i.type == "function_call"]
        assert json.loads(item.arguments)["city"] in ("Oslo", "Bergen")
    with anthropic.Anthropic(base_url=server, api_key="x", max_retries=0) as client:
        message = client.messages.create(
            model=MODEL,
            max_tokens=300,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[{"name": "weather", "description": "w", "input_schema": WEATHER["parameters"]}],
            tool_choice={"type": "tool", "name": "weather"},
            thinking={"type": "enabled", "budget_tokens": 5},
        )
    kinds = [block.type for block in message.content]
    assert kinds[-1] == "tool_use" and message.content[-1].input["city"] in ("Oslo", "Bergen")
    if "thinking" in kinds:  # the model opened its thinking: at most 5 tokens of it
        assert len(message.content[0].thinking) > 0


async def test_transcripts_store_xml_tool_calls_as_the_template_writes_them(tmp_path):
    from agentkv.tool_calls import ToolCall

    async with await AgentRuntime.open(config(tmp_path)) as rt:
        form = rt.tool_format
        assert form.style == "qwen3_coder" and form.forcible
        call = ToolCall("weather", {"city": "Oslo", "days": 3})
        message = {"role": "assistant", "content": "Checking.", "tool_calls": [call.as_template()]}
        stored = rt.stored_text(message)
        assert stored == (
            "Checking.<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        )
        tools = [
            {
                "type": "function",
                "function": WEATHER
                | {
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    }
                },
            }
        ]
        parsed = form.parse(stored, tools)
        assert parsed.text == "Checking." and parsed.tool_calls == (call,)


def test_reasoning_sent_back_reaches_the_template_on_every_api(server, tokenizer):
    # A tool loop's assistant turn sent back with its thinking (Chat Completions'
    # reasoning_content, an Anthropic thinking block, a Responses reasoning item): Qwen3's
    # template keeps reasoning within the turn, so the prompt holds it. Each request names a
    # new agent: no cache of its own to splice a generated reply from.
    import uuid

    import anthropic
    import openai

    question = {"role": "user", "content": "Weather in Oslo?"}
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    result = {"role": "tool", "tool_call_id": "c1", "content": "Sunny."}
    tools = [{"type": "function", "function": WEATHER}]

    def rendered(reasoning: str | None) -> int:
        template_call = {"id": "c1", "type": "function", "function": {"name": "weather"}}
        template_call["function"]["arguments"] = {}
        reply = {"role": "assistant", "content": "", "tool_calls": [template_call]}
        if reasoning:
            reply["reasoning_content"] = reasoning
        messages = [question, reply, result]
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer.encode(text, add_special_tokens=False))

    def agent() -> dict:
        return {"x-agent-id": f"r-{uuid.uuid4().hex[:12]}"}

    expected = rendered(THOUGHT) - rendered(None)
    assert expected > 0
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as client:

        def chat(reasoning: str | None) -> int:
            reply = {"role": "assistant", "content": None, "tool_calls": [call]}
            if reasoning:
                reply["reasoning_content"] = reasoning
            done = client.chat.completions.create(
                model=MODEL,
                messages=[question, reply, result],
                tools=tools,
                max_tokens=1,
                extra_headers=agent(),
            )
            return done.usage.prompt_tokens

        assert chat(THOUGHT) - chat(None) == expected

        def responses(reasoning: str | None) -> int:
            items = [{"role": "user", "content": "Weather in Oslo?"}]
            if reasoning:
                text = [{"type": "reasoning_text", "text": reasoning}]
                items.append({"type": "reasoning", "id": "rs_1", "summary": [], "content": text})
            items += [
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "Sunny."},
            ]
            done = client.responses.create(
                model=MODEL,
                input=items,
                tools=[{"type": "function", **WEATHER}],
                max_output_tokens=16,
                extra_headers=agent(),
            )
            return done.usage.input_tokens

        assert responses(THOUGHT) - responses(None) == expected
    with anthropic.Anthropic(base_url=server, api_key="x", max_retries=0) as client:

        def messages(reasoning: str | None) -> int:
            use = {"type": "tool_use", "id": "c1", "name": "weather", "input": {}}
            thinking = [{"type": "thinking", "thinking": reasoning, "signature": ""}]
            done = client.messages.create(
                model=MODEL,
                max_tokens=1,
                tools=[{"name": "weather", "input_schema": WEATHER["parameters"]}],
                messages=[
                    {"role": "user", "content": "Weather in Oslo?"},
                    {"role": "assistant", "content": (thinking if reasoning else []) + [use]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "c1", "content": "Sunny."}
                        ],
                    },
                ],
                extra_headers=agent(),
            )
            return done.usage.input_tokens + done.usage.cache_read_input_tokens

        assert messages(THOUGHT) - messages(None) == expected


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "opened-by-template"])
async def test_a_generation_prompt_the_history_leaves_out_is_spliced_back_too(
    tmp_path, say, tokenizer, thinking, monkeypatch
):
    # The generation prompt may hold reasoning markers the template does not render in the
    # history: an empty block (enable_thinking=False), or an opened one (templates that start
    # the reply inside its thinking, as DeepSeek-R1's and Qwen3-Thinking-2507's do). The
    # spliced reply carries them, so turn N+1 still resumes all the agent held.
    from agentkv.models import chat_formats

    if thinking:  # Qwen3's template, its generation prompt opening the thinking
        template = chat_formats.QWEN3_TEMPLATE.replace(
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}",
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}",
        )
        assert template != chat_formats.QWEN3_TEMPLATE
        model_dir = tmp_path / "model"
        import shutil

        from agentkv.models.tiny import tiny_model_dir

        shutil.copytree(tiny_model_dir(MODEL), model_dir)
        config_file = model_dir / "tokenizer_config.json"
        spec = json.loads(config_file.read_text())
        spec["chat_template"] = template
        config_file.write_text(json.dumps(spec))
        cfg = RuntimeConfig(model=str(model_dir), data_dir=tmp_path / "data")
        reply_text, kwargs = f"{THOUGHT}\n</think>\n\n{ANSWER}", {}
    else:
        cfg = config(tmp_path)
        reply_text, kwargs = ANSWER, {"template_kwargs": {"enable_thinking": False}}
    conversation = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]
    replies = []
    async with await AgentRuntime.open(cfg) as rt:
        await rt.create_agent("doc")
        for question in ("How are you?", "And today?"):
            say(reply_text)
            reply = None
            async for event in rt.respond("doc", conversation, max_tokens=100, **kwargs):
                reply = event
            assert reply.text == ANSWER
            assert reply.reasoning == (THOUGHT if thinking else "")
            replies.append(reply)
            conversation += [
                {"role": "assistant", "content": reply.text},
                {"role": "user", "content": question},
            ]
    # After a restart too: the replies are found again in the cache on disk, opener included.
    async with await AgentRuntime.open(cfg) as rt:
        say(reply_text)
        async for event in rt.respond("doc", conversation, max_tokens=100, **kwargs):
            reply = event
        replies.append(reply)
    for (earlier, later), source in zip(itertools.pairwise(replies), ("hot", "disk"), strict=True):
        held = earlier.usage.prompt_tokens + earlier.usage.completion_tokens
        assert later.cache_source == source and later.usage.cached_tokens == held
