"""Limits and strictness of the chat APIs: each bad field gets a 4xx naming it, too many
messages a 413 naming the limit and its flag, and a big body reads as a small one does (it is
parsed off the event loop). Real uvicorn on 127.0.0.1."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import httpx
import pytest

from agentkv import RuntimeConfig
from agentkv.server.app import SWITCH_INTERVAL_S
from agentkv.server.background import serve_in_thread
from agentkv.server.bodies import INLINE_BYTES

MODEL = "tiny:gemma3"
MAX_MESSAGES = 1000
ANTHROPIC, OPENAI = "/v1/messages", "/v1/chat/completions"


@pytest.fixture(scope="module")
def http(tmp_path_factory) -> Iterator[httpx.Client]:
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path_factory.mktemp("limits"))
    with (
        serve_in_thread(config, max_messages=MAX_MESSAGES) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client


def user(text: object) -> dict:
    return {"role": "user", "content": text}


def assistant(text: object) -> dict:
    return {"role": "assistant", "content": text}


def post_text(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST JSON text as it is (NaN, lone surrogate escapes)."""
    return http.post(path, content=text, headers={"content-type": "application/json"})


def error_of(response: httpx.Response) -> tuple[int, str, str | None]:
    """(status, message, OpenAI's param) of an error response in either API's shape."""
    error = response.json()["error"]
    return response.status_code, error["message"], error.get("param")


HI = [user("Hi")]
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# (path, body, the field named, what the message says of it)
CASES = [
    (ANTHROPIC, {"max_tokens": True}, "max_tokens", "Input should be a valid integer"),
    (OPENAI, {"max_tokens": True}, "max_tokens", "Input should be a valid integer"),
    (ANTHROPIC, {"stream": "yes"}, "stream", "Input should be a valid boolean"),
    (OPENAI, {"stream": "yes"}, "stream", "Input should be a valid boolean"),
    (OPENAI, {"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
    (ANTHROPIC, {"temperature": True}, "temperature", "Input should be a valid number"),
    (ANTHROPIC, {"stop_sequences": ["s"] * 2000}, "stop_sequences", "at most 16 items"),
    (OPENAI, {"stop": ["s"] * 17}, "stop", "at most 16 items"),
    (ANTHROPIC, {"stop_sequences": ["x" * 100_000]}, "stop_sequences.0", "at most 256 characters"),
    (OPENAI, {"stop": "x" * 257}, "stop.0", "at most 256 characters"),
    (
        ANTHROPIC,
        {"messages": [user("Hi"), assistant(""), user("Go on")]},
        "messages.1.content",
        "is empty; an assistant message needs text or tool calls",
    ),
    (
        ANTHROPIC,
        {"messages": [user("Hi"), assistant([]), user("Go on")]},
        "messages.1.content",
        "is empty; an assistant message needs text or tool calls",
    ),
    (
        OPENAI,
        {"messages": [user("Hi"), assistant(None), user("Go on")]},
        "messages.1.content",
        "is empty; an assistant message needs text or tool calls",
    ),
    (ANTHROPIC, {"messages": [user([])]}, "messages.0.content", "is empty; a user message"),
    (OPENAI, {"messages": [user([])]}, "messages.0.content", "is empty; a user message"),
    (ANTHROPIC, {"messages": [user("")]}, "messages.0.content", "is empty; a user message"),
    (
        ANTHROPIC,
        {"messages": [user([{"type": "text", "text": 5}])]},
        "messages.0.content.0.text",
        "must be a string, got number",
    ),
    (
        OPENAI,
        {"messages": [user([{"type": "text", "text": None}])]},
        "messages.0.content.0.text",
        "must be a string, got null",
    ),
    (
        OPENAI,
        {"messages": [user("Hi"), {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
        "messages.1.tool_call_id",
        "'c1' names no tool call of the assistant message before it",
    ),
    (
        OPENAI,
        {
            "messages": [
                user("Hi"),
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "content": "r"},
            ]
        },
        "messages.2.tool_call_id",
        "required: a tool message answers a tool call by its id",
    ),
]


@pytest.mark.parametrize(("path", "fields", "field", "says"), CASES)
def test_a_bad_field_is_a_400_naming_it(http, path, fields, field, says):
    body = {"model": "m", "max_tokens": 4, "messages": HI, **fields}
    status, message, param = error_of(http.post(path, json=body))
    assert status == 400
    assert message.startswith(f"{field}: ") and says in message, message
    if path == OPENAI:
        assert param is not None and field.startswith(param)


@pytest.mark.parametrize(
    ("path", "template", "field", "says"),
    [
        (ANTHROPIC, '{"model":"m","max_tokens":4,"temperature":NaN,%s}', "temperature", "finite"),
        (OPENAI, '{"model":"m","top_p":Infinity,%s}', "top_p", "Input should be a finite number"),
        (
            ANTHROPIC,
            '{"model":"m","max_tokens":4,"stop_sequences":["ok","\\ud800"],%s}',
            "stop_sequences.1",
            "not valid Unicode text: a lone surrogate '\\ud800' at character 0",
        ),
        (
            OPENAI,
            '{"model":"m","stop":"a\\ud800",%s}',
            "stop.0",
            "not valid Unicode text: a lone surrogate '\\ud800' at character 1",
        ),
    ],
)
def test_nan_and_lone_surrogates_are_a_400_naming_the_field(http, path, template, field, says):
    text = template % '"messages":[{"role":"user","content":"Hi"}]'
    status, message, _ = error_of(post_text(http, path, text))
    assert status == 400
    assert message.startswith(f"{field}: ") and says in message, message


def test_what_is_accepted_on_purpose(http):
    # Claude Code sends system messages among the messages; an OpenAI client replays an
    # empty reply as "".
    late_system = {"role": "system", "content": "Be brief."}
    body = {"model": "m", "max_tokens": 2, "messages": [user("Hi"), late_system]}
    assert http.post(ANTHROPIC, json=body).status_code == 200
    body = {"model": "m", "max_tokens": 2, "messages": [user("Hi"), assistant(""), user("Go")]}
    assert http.post(OPENAI, json=body).status_code == 200


@pytest.mark.parametrize("path", ["/v1/agents", "/v1/agents/limits-source/fork"])
def test_agent_names_are_limited(http, path):
    assert http.post("/v1/agents", json={"id": "limits-source"}).status_code in (201, 409)
    status, message, param = error_of(http.post(path, json={"name": "n" * 1_000_000}))
    assert (status, param) == (400, "name")
    assert message == "name: String should have at most 256 characters"
    ok = http.post(path, json={"name": "n" * 256})
    assert ok.status_code == 201 and ok.json()["name"] == "n" * 256


@pytest.mark.parametrize("path", [ANTHROPIC, OPENAI, "/v1/messages/count_tokens"])
def test_too_many_messages_are_a_413_naming_the_limit(http, path):
    turns = [user("Hi") if i % 2 == 0 else assistant("Yes") for i in range(MAX_MESSAGES + 1)]
    response = http.post(path, json={"model": "m", "max_tokens": 4, "messages": turns})
    status, message, param = error_of(response)
    assert status == 413
    assert message == (
        f"messages: {MAX_MESSAGES + 1} messages are more than this server's limit of "
        f"{MAX_MESSAGES}; send a shorter conversation (compact it) or raise the limit "
        "(agentkv serve --max-messages)"
    )
    if path == OPENAI:
        assert (param, response.json()["error"]["code"]) == ("messages", "request_too_large")
    else:
        assert response.json()["error"]["type"] == "request_too_large"
    allowed = {"model": "m", "messages": turns[: MAX_MESSAGES - 1]}
    assert http.post("/v1/messages/count_tokens", json=allowed).status_code == 200


def test_a_big_body_reads_as_a_small_one(http):
    """Bodies over INLINE_BYTES are parsed in a thread, their messages validated in chunks:
    the same counts, and errors that name the message by its place in the whole list."""
    turns = [user(f"Q{i}") if i % 2 == 0 else assistant(f"A{i}") for i in range(601)]
    body = json.dumps({"model": "m", "messages": turns})
    padded = body + " " * INLINE_BYTES  # the same request, parsed off the event loop
    counts = [
        post_text(http, "/v1/messages/count_tokens", text).json()["input_tokens"]
        for text in (body, padded)
    ]
    assert counts[0] == counts[1] > 600
    turns[300] = {"role": "robot", "content": "x"}
    bad = json.dumps({"model": "m", "messages": turns}) + " " * INLINE_BYTES
    status, message, _ = error_of(post_text(http, "/v1/messages/count_tokens", bad))
    assert status == 400
    assert message.startswith("messages.300.role: Input should be 'user', 'assistant' or")
    status, message, _ = error_of(post_text(http, ANTHROPIC, "{not json" + " " * INLINE_BYTES))
    assert status == 400 and message.startswith("body: not valid JSON: Expecting property name")


def test_a_big_agent_body_reads_as_a_small_one(http):
    """The agents API parses a body over INLINE_BYTES and writes an agent that long in a
    thread: the same agent, the same errors."""
    system = "Be brief. " * (INLINE_BYTES // 5)
    created = http.post("/v1/agents", json={"id": "big-system", "system_prompt": system})
    assert created.status_code == 201 and created.json()["system_prompt"] == system
    assert http.get("/v1/agents/big-system").json()["system_prompt"] == system
    listed = http.get("/v1/agents", params={"limit": 1000}).json()["data"]
    assert [a["system_prompt"] for a in listed if a["id"] == "big-system"] == [system]
    bad = {"system_prompt": system, "name": "n" * 1000}
    status, message, param = error_of(http.post("/v1/agents", json=bad))
    assert (status, param) == (400, "name")
    assert message == "name: String should have at most 256 characters"
    status, message, _ = error_of(post_text(http, "/v1/agents", "{" + " " * INLINE_BYTES))
    assert status == 400 and message.startswith("body: not valid JSON: ")


def test_the_switch_interval_is_short_while_the_server_serves(http):
    # A worker thread running Python hands the GIL to the event loop's thread this soon.
    assert sys.getswitchinterval() == SWITCH_INTERVAL_S == 0.001
