"""OpenAI Responses API end to end: the official SDK, a replayed Codex request, and the real
``codex`` CLI when it is installed, against a real server on tiny:tools.

``tests/data/codex/exec.json`` is the request Codex CLI 0.169.0 sent for ``codex exec "say
hi"`` (body and the headers that matter: ``session-id``).
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_server import metric

from agentkv import RuntimeConfig
from agentkv.server.background import serve_in_thread

MODEL = "tiny:tools"
DATA = Path(__file__).parent / "data" / "codex"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path_factory.mktemp("responses"))
    with serve_in_thread(config) as url:
        yield url


@pytest.fixture
def client(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="sk-local", max_retries=0) as gpt:
        yield gpt


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=300, headers={"x-api-key": "sk-local"}) as c:
        yield c


def sse(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line.removeprefix("data: "))
        for line in response.iter_lines()
        if line.startswith("data: ")
    ]


def test_a_response_and_a_follow_up_resumed_from_its_session(client):
    first = client.responses.create(
        model="m",
        instructions="Answer briefly.",
        input="Say hi",
        max_output_tokens=1,
        prompt_cache_key="s-follow-up",
    )
    assert first.object == "response" and first.status == "incomplete"  # cut at 1 token
    assert first.incomplete_details.reason == "max_output_tokens"
    [message] = first.output
    assert message.type == "message" and message.role == "assistant"
    assert first.output_text == message.content[0].text
    assert first.usage.output_tokens == 1 and first.usage.input_tokens_details.cached_tokens == 0
    count = client.responses.input_tokens.count(
        model="m", instructions="Answer briefly.", input="Say hi"
    )
    assert first.usage.input_tokens == count.input_tokens
    # The whole conversation again, with the reply as the client got it: the session's agent
    # resumes its cache, reply included, and prefills only the new user turn.
    history = [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And again"},
    ]
    second = client.responses.create(
        model="m",
        instructions="Answer briefly.",
        input=history,
        max_output_tokens=6,
        prompt_cache_key="s-follow-up",
    )
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == first.usage.input_tokens + first.usage.output_tokens


def test_streamed_events_carry_the_text_and_end_with_completed(client, http):
    with client.responses.stream(model="m", input="Say hi", max_output_tokens=50) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()  # (the SDK's helper needs response.completed)
    assert final.status == "completed" and final.output_text == "".join(deltas)
    # Cut by max_output_tokens: response.incomplete, as OpenAI's API ends such a stream.
    # The order Codex needs: the item is added before any delta, done before the end.
    body = {"model": "m", "input": "Say hi", "stream": True, "max_output_tokens": 1}
    body["instructions"] = "Answer briefly."
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        events = sse(response)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["id"].startswith("resp_")


def test_a_function_call_round_trip_resumes_the_cache(client, force_tool_call, caplog):
    namespace = {
        "type": "namespace",
        "name": "travel",
        "description": "Travel tools.",
        "tools": [{**WEATHER, "name": "book_train"}],
    }
    tools = [WEATHER, namespace, {"type": "web_search", "external_web_access": False}]
    force_tool_call("book_train", {"city": "Lyon"}, text="Booking. ")
    with caplog.at_level(logging.INFO, logger="agentkv.server.api.responses_input"):
        called = client.responses.create(
            model="m", input="A train to Lyon?", tools=tools, prompt_cache_key="s-tools"
        )
    assert "a 'web_search' tool is hosted by OpenAI, not run here: left out" in caplog.text
    message, call = called.output
    assert message.content[0].text == "Booking. "
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "book_train",
        {"city": "Lyon"},
    )
    assert call.to_dict()["namespace"] == "travel" and call.call_id.startswith("call_")
    # The call's result, sent back with the conversation (as Codex does, store: false).
    answered = client.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "A train to Lyon?"},
            *(item.to_dict() for item in called.output),
            {"type": "function_call_output", "call_id": call.call_id, "output": "Booked: 9:04."},
        ],
        tools=tools,
        store=False,
        prompt_cache_key="s-tools",
        max_output_tokens=4,
    )
    assert answered.usage.input_tokens_details.cached_tokens == (
        called.usage.input_tokens + called.usage.output_tokens
    )


def test_a_streamed_call_follows_the_text_before_it_argument_by_argument(client, force_tool_call):
    force_tool_call("get_weather", {"city": "Oslo"}, text="Checking. ")
    asked = {"model": "m", "input": "Weather in Oslo?", "tools": [WEATHER], "store": True}
    with client.responses.stream(**asked) as stream:
        events = list(stream)
        response = stream.get_final_response()
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    # The message is done before the call's item opens; then the arguments come in pieces.
    message_done = kinds.index(("response.output_item.done", 0))
    call_added = kinds.index(("response.output_item.added", 1))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert message_done < call_added and len(pieces) > 3
    assert json.loads("".join(pieces)) == {"city": "Oslo"}
    message, call = response.output
    assert message.content[0].text == "Checking. " and call.arguments == "".join(pieces)
    added = events[call_added].item
    # The call's id is the same in the stream, the final response and the stored one.
    stored = client.responses.retrieve(response.id).output[1]
    assert added.call_id == call.call_id == stored.call_id and call.name == "get_weather"


INSTRUCTIONS = "You are a terse assistant. " * 60  # a prompt worth caching


def test_a_previous_response_id_chain_resumes_the_agent_that_answered(client):
    previous, agent_id, said = None, None, []
    for turn in range(5):
        asked = {"model": "m", "instructions": INSTRUCTIONS, "max_output_tokens": 3}
        asked |= {"input": f"Question {turn}?", "previous_response_id": previous}
        if turn % 2:
            with client.responses.stream(**asked) as stream:
                response = stream.get_final_response()
        else:
            raw = client.responses.with_raw_response.create(**asked)
            agent_id = agent_id or raw.headers["x-agent-id"]
            assert raw.headers["x-agent-id"] == agent_id  # one agent holds the conversation
            response = raw.parse()
        assert response.previous_response_id == previous
        usage = response.usage
        if previous is not None:
            # Only the new input is prefilled: the rest is the agent's cache, reply included.
            last = client.responses.retrieve(previous).usage
            assert (
                usage.input_tokens_details.cached_tokens == last.input_tokens + last.output_tokens
            )
            assert usage.input_tokens_details.cached_tokens >= 0.95 * usage.input_tokens
        stored = client.responses.retrieve(response.id)
        assert stored.output_text == response.output_text and stored.usage == usage
        previous = response.id
        said += [{"role": "user", "content": asked["input"]}, *response.to_dict()["output"]]
    # The chain is the conversation: counted as if it were resent whole.
    counted = [
        client.responses.input_tokens.count(model="m", instructions=INSTRUCTIONS, **asked)
        for asked in (
            {"input": "Next?", "previous_response_id": previous},
            {"input": [*said, {"role": "user", "content": "Next?"}]},
        )
    ]
    assert counted[0].input_tokens == counted[1].input_tokens > usage.input_tokens


def test_a_branch_leaves_the_named_agent_alone(http):
    def ask(text: str, previous: str | None = None, **headers: str) -> httpx.Response:
        body = {"model": "m", "input": text, "max_output_tokens": 2, "instructions": INSTRUCTIONS}
        response = http.post(
            "/v1/responses", json=body | {"previous_response_id": previous}, headers=headers
        )
        assert response.status_code == 200, response.text
        return response

    first = ask("One?", **{"x-agent-id": "chained"})
    second = ask("Two?", first.json()["id"])
    assert second.headers["x-agent-id"] == "chained"  # its latest reply: the agent goes on
    transcript = http.get("/v1/agents/chained/messages").json()
    # Continuing the first response again is a branch: another agent answers, resuming the
    # shared prefix from the named agent's cache, whose transcript stays as it was.
    branch = ask("Three?", first.json()["id"])
    assert branch.headers["x-agent-id"] != "chained"
    used = first.json()["usage"]
    cached = branch.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == used["input_tokens"] + used["output_tokens"]
    assert http.get("/v1/agents/chained/messages").json() == transcript
    third = ask("Four?", second.json()["id"])
    assert third.headers["x-agent-id"] == "chained"


def test_two_continuations_at_once_branch_instead_of_overwriting(http):
    body = {"model": "m", "instructions": INSTRUCTIONS, "max_output_tokens": 6}
    first = http.post(
        "/v1/responses", json=body | {"input": "Start"}, headers={"x-agent-id": "raced"}
    ).json()
    before = len(http.get("/v1/agents/raced/messages").json()["data"])

    def follow(text: str) -> httpx.Response:
        asked = body | {"input": text, "previous_response_id": first["id"]}
        return http.post("/v1/responses", json=asked)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(follow, ["Left?", "Right?"]))
    assert [a.status_code for a in answers] == [200, 200]
    agents = sorted(a.headers["x-agent-id"] for a in answers)
    assert agents[0] == "raced" != agents[1]  # one continued it, the other branched
    messages = http.get("/v1/agents/raced/messages").json()["data"]
    assert len(messages) == before + 2  # its transcript holds one continuation, whole


def test_stored_responses_are_read_deleted_and_not_kept_when_store_is_false(http):
    def ask(**extra: object) -> dict:
        body = {"model": "m", "input": "Hi", "max_output_tokens": 2} | extra
        response = http.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    unstored = ask(store=False)
    assert unstored["store"] is False
    missing = http.get(f"/v1/responses/{unstored['id']}")
    assert missing.status_code == 404 and unstored["id"] in missing.json()["error"]["message"]
    first = ask()
    assert first["store"] is True and http.get(f"/v1/responses/{first['id']}").json() == first
    second = ask(input="And?", previous_response_id=first["id"])
    deleted = http.delete(f"/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    assert http.get(f"/v1/responses/{first['id']}").status_code == 404
    assert http.delete(f"/v1/responses/{first['id']}").status_code == 404
    gone = http.post(
        "/v1/responses", json={"model": "m", "input": "x", "previous_response_id": first["id"]}
    )
    error = gone.json()["error"]
    assert gone.status_code == 400 and error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id"
    # The response that continued the deleted one still holds its whole conversation.
    third = ask(input="Again?", previous_response_id=second["id"], max_output_tokens=1)
    cached = third["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == second["usage"]["input_tokens"] + second["usage"]["output_tokens"]


@pytest.mark.parametrize(
    ("extra", "field", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "no stored response"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"top_logprobs": 21}, "top_logprobs", "must be 0 to 20"),
        ({"include": ["file_search_call.results"]}, "include", "not supported"),
        ({"truncation": "auto"}, "truncation", "not cut"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.image_url",
            "image URLs are not fetched by this server",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
            "input.0.call_id",
            "names no function_call",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "not supported"),
        (
            {"input": [{"type": "function_call_output", "call_id": ["c1"], "output": "x"}]},
            "input.0.call_id",
            "names no function_call",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]}]},
            "input.0.content.0",
            "parts are not supported",
        ),
        ({"tools": ["get_weather"]}, "tools.0", "a tool must be an object"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
            "tools.0.parameters",
            "must be a JSON Schema object",
        ),
        ({"input": [{"role": "assistant", "content": "hi"}]}, "input", "must end with a user"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(http, extra, field, says):
    body = {"model": "m", "input": "Hi", **extra}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and says in error["message"], error


def test_unknown_fields_are_logged_not_silently_dropped(http, caplog):
    with caplog.at_level(logging.INFO, logger="agentkv.server.bodies"):
        response = http.post(
            "/v1/responses",
            json={"model": "m", "input": "Hi", "max_output_tokens": 2, "future_knob": 1},
        )
    assert response.status_code == 200
    assert "field 'future_knob' is not known to this server: not used" in caplog.text


def test_a_replayed_codex_request_is_answered_as_codex_reads_it(http):
    captured = json.loads((DATA / "exec.json").read_text(encoding="utf-8"))
    body = copy.deepcopy(captured["body"]) | {"max_output_tokens": 4}
    with http.stream("POST", "/v1/responses", json=body, headers=captured["headers"]) as response:
        assert response.status_code == 200, response.read()
        agent_id = response.headers["x-agent-id"]
        events = sse(response)
    # Codex's session id names the agent (its tools in the name: side requests differ).
    assert agent_id.startswith(f"session-{captured['headers']['session-id']}-")
    done = events[-1]
    assert done["type"] in ("response.completed", "response.incomplete")
    assert done["response"]["usage"]["input_tokens"] > 10_000
    # The next turn, with the reply as Codex keeps it: the session's cache serves all of it
    # but the new user turn.
    [reply] = done["response"]["output"]
    body["input"].append({"role": "assistant", "content": reply["content"]})
    body["input"].append({"role": "user", "content": [{"type": "input_text", "text": "again"}]})
    with http.stream("POST", "/v1/responses", json=body, headers=captured["headers"]) as response:
        usage = sse(response)[-1]["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] / usage["input_tokens"] > 0.99


def codex_env(server: str, home: Path) -> dict[str, str]:
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "agentkv"\n\n[model_providers.agentkv]\n'
        f'name = "agentkv"\nbase_url = "{server}/v1"\nwire_api = "responses"\n'
        'env_key = "AGENTKV_API_KEY"\n'
    )
    return {"PATH": os.environ["PATH"], "HOME": str(home), "AGENTKV_API_KEY": "sk-local"}


@pytest.mark.skipif(shutil.which("codex") is None, reason="the codex CLI is not installed")
def test_codex_cli_exec_and_resume(server, http, tmp_path):
    env = codex_env(server, tmp_path / "home")
    project = tmp_path / "project"
    project.mkdir()

    def codex(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["codex", "exec", "--skip-git-repo-check", *args],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = codex("say hi")
    assert first.returncode == 0, first.stderr
    assert "tokens used" in first.stderr
    cached = metric(http, "agentkv_input_tokens_total", kind="cached")
    prefilled = metric(http, "agentkv_input_tokens_total", kind="prefilled")
    again = codex("resume", "--last", "and again")
    assert again.returncode == 0, again.stderr
    cached = metric(http, "agentkv_input_tokens_total", kind="cached") - cached
    prefilled = metric(http, "agentkv_input_tokens_total", kind="prefilled") - prefilled
    assert cached / (cached + prefilled) >= 0.95


TITLE = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 10}, "n": {"enum": [1, 2, 3]}},
    "required": ["title", "n"],
    "additionalProperties": False,
}


def test_structured_outputs_on_every_api(client, http):
    # OpenAI Responses: text.format.
    made = client.responses.create(
        model="m",
        input="Name it.",
        max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "t", "schema": TITLE, "strict": True}},
    )
    assert set(json.loads(made.output_text)) == {"title", "n"}
    assert made.text.format.type == "json_schema"
    # OpenAI Chat Completions: response_format, json_schema and json_object.
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Name it."}],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": TITLE}},
    )
    assert json.loads(chat.choices[0].message.content)["n"] in (1, 2, 3)
    anything = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Any object."}],
        max_tokens=64,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    # Anthropic Messages: output_config.format (Claude Code's title requests send it).
    anthropic_body = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Name it."}],
        "output_config": {"format": {"type": "json_schema", "schema": TITLE}},
    }
    message = http.post("/v1/messages", json=anthropic_body).json()
    assert set(json.loads(message["content"][0]["text"])) == {"title", "n"}


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": {}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            "/v1/responses",
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "t", "schema": {}}}},
            "text.format.schema",
        ),
        (
            "/v1/messages",
            {"max_tokens": 4, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
            "output_config.format.schema",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_cannot_compile_is_a_400_naming_it_as_the_api_does(
    http, path, body, field, stream
):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **body}
    if path == "/v1/responses":
        del body["messages"]
    fmt = body.get("response_format") or body.get("text") or body["output_config"]
    spec = fmt.get("json_schema") or fmt.get("format")
    spec["schema"] = {"type": "strin"}
    response = http.post(path, json=body | {"stream": stream})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith(f"{field}: cannot be compiled") and "strin" in message
    if path != "/v1/messages":
        assert response.json()["error"]["param"] == field


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_a_forced_tool_call_on_every_api(client, http):
    weather = {**WEATHER, "parameters": CITY}
    train = {**WEATHER, "name": "book_train", "parameters": CITY}
    # Responses: a named function.
    made = client.responses.create(
        model="m",
        input="Weather?",
        tools=[weather, train],
        tool_choice={"type": "function", "name": "book_train"},
        max_output_tokens=64,
    )
    [call] = [item for item in made.output if item.type == "function_call"]
    assert call.name == "book_train" and set(json.loads(call.arguments)) == {"city"}
    # Chat Completions: "required" (one of the tools).
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"type": "function", "function": weather}, {"type": "function", "function": train}],
        tool_choice="required",
        max_tokens=64,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    [called] = choice.message.tool_calls
    assert called.function.name in ("get_weather", "book_train")
    assert len(json.loads(called.function.arguments)["city"]) <= 8
    # Anthropic Messages: {"type": "tool", "name": ...}.
    body = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": CITY}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    message = http.post("/v1/messages", json=body).json()
    assert message["stop_reason"] == "tool_use"
    [use] = [b for b in message["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and set(use["input"]) == {"city"}


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        (
            "/v1/responses",
            {"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            "tool_choice: 'x' is not among the tools ('get_weather')",
        ),
        ("/v1/responses", {"input": "Hi", "tool_choice": "required"}, "needs tools"),
        (
            "/v1/messages",
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [{"name": "t", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "every"},
            },
            "tool_choice: must be",
        ),
    ],
)
def test_a_tool_choice_that_cannot_be_forced_is_a_400(http, path, body, says):
    response = http.post(path, json={"model": "m", **body})
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


def test_chat_completions_fields_are_honoured_refused_or_logged(client, http, caplog):
    from mlx_lm.utils import load_tokenizer

    from agentkv.models.tiny import tiny_model_dir

    tokenizer = load_tokenizer(tiny_model_dir(MODEL))
    token = tokenizer.encode("e", add_special_tokens=False)[0]
    ask = [{"role": "user", "content": "Hi"}]
    # logit_bias over HTTP: +100 makes greedy decoding pick that token every time.
    raw = client.chat.completions.with_raw_response.create(
        model="m",
        messages=ask,
        max_tokens=3,
        logit_bias={str(token): 100},
        prompt_cache_key="chat-session",
    )
    assert raw.parse().choices[0].message.content == tokenizer.decode([token] * 3)
    # prompt_cache_key names a session agent, as on the Responses API.
    assert raw.headers["x-agent-id"].startswith("session-chat-session-")
    for body, field in (
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"e": 1}}, "logit_bias"),
        ({"modalities": ["audio"]}, "modalities"),
    ):
        response = http.post("/v1/chat/completions", json={"model": "m", "messages": ask, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == field
    with caplog.at_level(logging.INFO, logger="agentkv.server.bodies"):
        response = http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": ask, "max_tokens": 1, "new_knob": 1},
        )
    assert response.status_code == 200
    assert "field 'new_knob' is not known to this server: not used" in caplog.text


def test_anthropic_fields_unknown_to_the_server_are_logged(http, caplog):
    body = {
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "disabled"},  # known: accepted without effect
        "brand_new_option": True,
    }
    with caplog.at_level(logging.INFO, logger="agentkv.server.bodies"):
        assert http.post("/v1/messages", json=body).status_code == 200
    assert "Anthropic Messages: field 'brand_new_option' is not known" in caplog.text
    assert "'thinking'" not in caplog.text


def test_logprobs_on_chat_completions_and_responses(client):
    ask = {"model": "m", "messages": [{"role": "user", "content": "Count to five"}]}
    ask |= {"max_tokens": 8, "logprobs": True, "top_logprobs": 3}
    completion = client.chat.completions.create(**ask)
    plain, entries = completion.choices[0], completion.choices[0].logprobs.content
    ended = plain.finish_reason == "stop"  # on an end-of-sequence token: it is not listed
    assert entries and len(entries) == completion.usage.completion_tokens - ended
    # The tokens' bytes are the reply's text.
    assert (
        b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
        == plain.message.content
    )
    for e in entries:
        top = e.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted(
            (t.logprob for t in top), reverse=True
        )
        assert e.logprob <= 0 and (e.token, e.logprob) == (top[0].token, top[0].logprob)  # greedy

    def same(got: list, want: list) -> None:
        assert [(e.token, e.bytes) for e in got] == [(e.token, e.bytes) for e in want]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-3)

    # Streamed, each chunk carries its own tokens' logprobs: the same tokens in all.
    chunks = client.chat.completions.create(**ask, stream=True)
    same(
        [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content], entries
    )
    assert (
        client.chat.completions.create(**(ask | {"logprobs": None, "top_logprobs": None}))
        .choices[0]
        .logprobs
        is None
    )
    # The Responses API: include message.output_text.logprobs, streamed or not.
    asked = {"model": "m", "input": "Count to five", "max_output_tokens": 8, "top_logprobs": 3}
    asked["include"] = ["message.output_text.logprobs"]
    response = client.responses.create(**asked)
    same(response.output[0].content[0].logprobs, entries)
    with client.responses.stream(**asked) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    same([lp for d in deltas for lp in d.logprobs], entries)
    same(final.output[0].content[0].logprobs, entries)
