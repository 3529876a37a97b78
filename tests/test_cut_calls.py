"""A tool call cut short by ``max_tokens`` comes back one way on every API, streamed and not:
as a call (its name, its arguments as far as they were written), never as markup in the text,
with ``length`` / ``max_tokens`` / ``incomplete`` as the reason; a client that sends it back
resumes the whole reply from the cache. Real server, official SDKs, tiny:tools (Hermes JSON
calls) and tiny:thinking (Qwen 3.5's XML calls)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from agentkv import RuntimeConfig
from agentkv.cut_calls import partial_object
from agentkv.models.tiny import tiny_model_dir
from agentkv.server.background import serve_in_thread
from tests.conftest import scripted_tool_replies

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
CALL = {"name": "weather", "arguments": {"days": 3, "city": "Oslo"}}
REPLY = f"Checking. <tool_call>\n{json.dumps(CALL)}\n</tool_call>"
XML_REPLY = (
    "<think>\nThe weather tool.\n</think>\n\nChecking. <tool_call>\n<function=weather>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
    "</tool_call>"
)


@pytest.fixture(scope="module", params=["tiny:tools", "tiny:thinking"])
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(model, tmp_path_factory) -> Iterator[str]:
    config = RuntimeConfig(model=model, data_dir=tmp_path_factory.mktemp("cut-calls"))
    with serve_in_thread(config) as url:
        yield url


@pytest.fixture
def say(monkeypatch, model):
    return scripted_tool_replies(monkeypatch, model)


@pytest.fixture
def question(request) -> str:
    """A first message of the test's own (each conversation its own agent)."""
    return f"What is the weather in Oslo? ({request.node.name})"


def cut_at(model: str, text: str, within: str) -> tuple[int, str]:
    """``max_tokens`` that cuts the scripted ``text`` inside ``within``, and what the model
    has written of it then."""
    tokenizer = load_tokenizer(Path(tiny_model_dir(model)))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    goal = text.index(within) + len(within) // 2
    n = next(n for n in range(len(tokens)) if len(tokenizer.decode(tokens[:n])) >= goal)
    return n, tokenizer.decode(tokens[:n])


def expected(model: str) -> tuple[str, int, str, dict]:
    """The scripted reply, its max_tokens, the arguments text and object a client gets."""
    if model == "tiny:tools":
        n, written = cut_at(model, REPLY, '"Oslo"')
        arguments = written[written.index('"arguments": ') + len('"arguments": ') :]
        return REPLY, n, arguments, partial_object(arguments)
    n, _ = cut_at(model, XML_REPLY, "Oslo")  # the city's value is being written: left out
    return XML_REPLY, n, '{"days": 3', {"days": 3}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions(server, say, model, question, stream):
    script, max_tokens, written, arguments = expected(model)
    messages = [{"role": "user", "content": question}]
    with openai.OpenAI(base_url=f"{server}/v1", api_key="k", max_retries=0) as gpt:
        say(script)
        asked = dict(model="m", messages=messages, tools=[WEATHER], max_tokens=max_tokens)
        if stream:
            streamed = gpt.chat.completions.create(
                **asked, stream=True, stream_options={"include_usage": True}
            )
            chunks = list(streamed)
            held = chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            assert {d.index for d in deltas} == {0}
            name = next(d.function.name for d in deltas if d.function.name)
            call_id = next(d.id for d in deltas if d.id)
            sent = "".join(d.function.arguments or "" for d in deltas)
            finish = chunks[-2].choices[0].finish_reason  # (the last: usage)
        else:
            reply = gpt.chat.completions.create(**asked)
            held = reply.usage.prompt_tokens + reply.usage.completion_tokens
            message, finish = reply.choices[0].message, reply.choices[0].finish_reason
            content, [call] = message.content, message.tool_calls
            name, call_id, sent = call.function.name, call.id, call.function.arguments
        assert (content, finish) == ("Checking. ", "length")
        assert (name, sent) == ("weather", written)
        with pytest.raises(ValueError):
            json.loads(sent)  # cut short: not complete JSON, as OpenAI's API answers
        # The client sends the call back as it got it, with its result: the reply is resumed.
        messages += [
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": sent},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "Sunny"},
        ]
        say("Sunny it is.")
        after = gpt.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    assert after.choices[0].message.content == "Sunny it is."
    assert after.choices[0].finish_reason == "stop"  # no max_tokens: to the model's end
    # Every token the agent held, the cut reply's included, was resumed.
    assert after.usage.prompt_tokens_details.cached_tokens == held
    assert arguments == partial_object(sent)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_messages(server, say, model, question, stream):
    script, max_tokens, _, arguments = expected(model)
    tool = {"name": "weather", "input_schema": WEATHER["function"]["parameters"]}
    messages = [{"role": "user", "content": question}]
    with anthropic.Anthropic(base_url=server, api_key="k", max_retries=0) as claude:
        say(script)
        asked = dict(model="m", max_tokens=max_tokens, tools=[tool], messages=messages)
        if stream:
            with claude.messages.stream(**asked) as events:
                reply = events.get_final_message()
        else:
            reply = claude.messages.create(**asked)
        assert reply.stop_reason == "max_tokens"
        blocks = [b for b in reply.content if b.type != "thinking"]
        assert [b.type for b in blocks] == ["text", "tool_use"]
        assert blocks[0].text == "Checking. "
        assert (blocks[1].name, blocks[1].input) == ("weather", arguments)
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": blocks[1].id, "content": "Sunny"}
                ],
            },
        ]
        say("Sunny it is.")
        after = claude.messages.create(model="m", max_tokens=64, tools=[tool], messages=messages)
    assert after.stop_reason == "end_turn"
    held = reply.usage.input_tokens + reply.usage.cache_read_input_tokens + max_tokens
    assert reply.usage.output_tokens == max_tokens
    assert after.usage.cache_read_input_tokens == held


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses(server, say, model, question, stream):
    script, max_tokens, written, _ = expected(model)
    tool = {"type": "function", **WEATHER["function"]}
    with openai.OpenAI(base_url=f"{server}/v1", api_key="k", max_retries=0) as gpt:
        say(script)
        asked = dict(model="m", input=question, tools=[tool], max_output_tokens=max_tokens)
        if stream:  # (the SDK's stream helper wants response.completed: the raw events)
            events = list(gpt.responses.create(**asked, stream=True))
            assert events[-1].type == "response.incomplete"
            response = events[-1].response
        else:
            response = gpt.responses.create(**asked)
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        items = [i for i in response.output if i.type != "reasoning"]
        assert [(i.type, i.status) for i in items] == [
            ("message", "incomplete"),
            ("function_call", "incomplete"),
        ]
        assert items[0].content[0].text == "Checking. "
        assert (items[1].name, items[1].arguments) == ("weather", written)
        say("Sunny it is.")
        after = gpt.responses.create(
            model="m",
            previous_response_id=response.id,
            input=[{"type": "function_call_output", "call_id": items[1].call_id, "output": "ok"}],
            tools=[tool],
        )
    assert after.status == "completed"
    held = response.usage.input_tokens + response.usage.output_tokens
    assert after.usage.input_tokens_details.cached_tokens == held
