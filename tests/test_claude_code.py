"""Claude Code end to end: replayed Claude Code requests, forced tool calls through the official
SDKs, and the real ``claude`` CLI when it is installed, against a real server on tiny:tools.

``tests/data/claude_code/*.json`` are request bodies and headers Claude Code 2.1.197 sent
(``claude -p "Say hi"``, its ``--continue``, a title side request, and a tool result turn).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from test_server import metric

from agentkv import RuntimeConfig
from agentkv.server.app import DEFAULT_STATELESS_TTL_S
from agentkv.server.background import serve_in_thread
from agentkv.store import Registry
from tests.conftest import scripted_tool_replies
from tests.test_document import generation_prompt

MODEL = "tiny:tools"
DATA = Path(__file__).parent / "data" / "claude_code"
READ_INPUT = {"file_path": "/tmp/cc/proj/hello.txt"}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def captured(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path_factory.mktemp("claude-code"))
    with serve_in_thread(config) as url:
        yield url


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=300, headers={"x-api-key": "sk-local"}) as client:
        yield client


def post_stream(http: httpx.Client, request: dict) -> tuple[list[tuple[str, dict]], httpx.Headers]:
    """POST a captured request (streamed, as Claude Code does); the SSE events and headers."""
    events, name = [], None
    with http.stream(
        "POST", request["path"], json=request["body"], headers=request["headers"]
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
        return events, response.headers


def final_message(events: list[tuple[str, dict]]) -> dict:
    """The message an SSE stream describes: its content blocks, stop reason and usage."""
    message = events[0][1]["message"]
    blocks: dict[int, dict] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"]) | {"partial": ""}
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["partial"] += delta["partial_json"]
        elif name == "message_delta":
            message = message | data["delta"] | {"usage": data["usage"]}
    content = []
    for _, block in sorted(blocks.items()):
        partial = block.pop("partial")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)
        content.append(block)
    return message | {"content": content}


def cached_fraction(usage: dict) -> float:
    return usage["cache_read_input_tokens"] / (
        usage["cache_read_input_tokens"] + usage["input_tokens"]
    )


def test_replayed_claude_code_session_resumes_from_cache(http):
    assert http.head("/").status_code == 200
    first, title, follow_up = captured("first"), captured("title"), captured("continue")
    assert "?beta=true" in first["path"] and len(first["body"]["tools"]) == 25
    assert first["body"]["messages"][-1]["role"] == "system"  # a conversation may end with one

    events, headers = post_stream(http, first)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    reply = final_message(events)
    assert reply["model"] == "claude-opus-4-8[1m]"  # Claude Code asked for the 1M variant
    assert reply["stop_reason"] == "end_turn" and reply["content"][0]["type"] == "text"
    usage = reply["usage"]
    assert usage["cache_read_input_tokens"] == 0 and usage["input_tokens"] > 50_000
    counted = http.post("/v1/messages/count_tokens", json=first["body"], headers=first["headers"])
    assert counted.json() == {"input_tokens": usage["input_tokens"]}
    agent_id = headers["x-agent-id"]
    session = first["headers"]["x-claude-code-session-id"]
    assert agent_id.startswith(f"claude-code-{session}-")
    # Session agents, like those of other stateless clients, expire when idle.
    assert http.get(f"/v1/agents/{agent_id}").json()["idle_ttl_s"] == DEFAULT_STATELESS_TTL_S

    # A side request of the same session (a title: another prompt, no tools) gets its own agent.
    _, title_headers = post_stream(http, title)
    assert title_headers["x-agent-id"] != agent_id

    # --continue: Claude Code sends back the reply it got; everything before it is cached.
    body = follow_up["body"]
    assert body["messages"][2]["role"] == "assistant"
    body["messages"][2]["content"] = [{"type": "text", "text": reply["content"][0]["text"]}]
    events, headers = post_stream(http, follow_up)
    again = final_message(events)["usage"]
    assert headers["x-agent-id"] == agent_id
    assert again["cache_read_input_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert cached_fraction(again) > 0.99


def billed(request: dict, suffix: str, session: str, prompt: str | None = None) -> dict:
    """A captured request as another Claude Code invocation sends it: its own billing line
    suffix (new for every prompt) and session, and perhaps another first prompt."""
    request = copy.deepcopy(request)
    system = request["body"]["system"]
    assert system[0]["text"].startswith("x-anthropic-billing-header: cc_version=2.1.197.")
    system[0]["text"] = (
        f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=cli;"
    )
    request["headers"]["x-claude-code-session-id"] = session
    if prompt is not None:
        request["body"]["messages"][0]["content"][-1]["text"] = prompt
    return request


def test_a_new_session_resumes_the_instructions_and_tools_despite_the_billing_line(http):
    first = billed(captured("first"), "a01", "5e55i0n-one", "say hello")
    second = billed(captured("first"), "b02", "5e55i0n-two", "count to three")
    # The billing line is dropped: both prompts count the same but for the user's words.
    counts = [
        http.post("/v1/messages/count_tokens", json=r["body"], headers=r["headers"]).json()
        for r in (first, second)
    ]
    plain = copy.deepcopy(first["body"])
    plain["system"] = plain["system"][1:]
    unbilled = http.post("/v1/messages/count_tokens", json=plain, headers=first["headers"])
    assert unbilled.json() == counts[0]
    post_stream(http, first)
    usage = final_message(post_stream(http, second)[0])["usage"]
    assert cached_fraction(usage) >= 0.9, usage
    # A title side request of another session, the same as the first but for its billing
    # line, resumes all of its prompt but the generation prompt (1,058 of its 1,065 tokens,
    # not just the 768 of its whole blocks or the 948 of its system prompt): from the first
    # title's agent, where that one's history ended (its checkpoint there), or all of it but
    # its last token where the two prompts part (agentkv.caches.tiers), whichever is kept
    # when it looks.
    titles = [billed(captured("title"), s, f"5e55i0n-{s}") for s in ("c03", "d04")]
    post_stream(http, titles[0])
    usage = final_message(post_stream(http, titles[1])[0])["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == 1065, usage
    assert 1065 - len(generation_prompt(MODEL)) <= usage["cache_read_input_tokens"] <= 1064, usage


def test_forced_tool_call_then_tool_result_resumes_from_cache(http, force_tool_call):
    request = captured("tool_result")
    *conversation, called, result = request["body"]["messages"]
    assert called["content"][-1]["type"] == "tool_use" and result["content"][0]["type"] == (
        "tool_result"
    )
    first = copy.deepcopy(request)
    first["body"]["messages"] = conversation
    force_tool_call("Read", READ_INPUT)
    events, _ = post_stream(http, first)
    tool_events = [(n, d) for n, d in events if d.get("index") == 1]
    kinds = [n for n, _ in tool_events]
    # The arguments stream as the model writes them: pieces of its JSON text.
    assert kinds[0] == "content_block_start" and kinds[-1] == "content_block_stop"
    assert len(kinds) > 4 and set(kinds[1:-1]) == {"content_block_delta"}
    pieces = [d["delta"] for _, d in tool_events[1:-1]]
    assert {p["type"] for p in pieces} == {"input_json_delta"}
    written = json.dumps(READ_INPUT, separators=(",", ":"))  # (the forced grammar's)
    assert "".join(p["partial_json"] for p in pieces) == written
    reply = final_message(events)
    assert reply["stop_reason"] == "tool_use"
    text, tool_use = reply["content"]
    assert text == {"type": "text", "text": ""}
    assert tool_use["name"] == "Read" and tool_use["input"] == READ_INPUT
    assert tool_use["id"].startswith("toolu_")

    # Claude Code runs the tool and sends the result: the turn resumes from the cache.
    called["content"] = [tool_use]
    result["content"][0]["tool_use_id"] = tool_use["id"]
    events, _ = post_stream(http, request)
    usage, before = final_message(events)["usage"], reply["usage"]
    prompt = before["cache_read_input_tokens"] + before["input_tokens"]  # disjoint counts
    assert usage["cache_read_input_tokens"] == prompt + before["output_tokens"]
    assert cached_fraction(usage) > 0.99


def test_anthropic_sdk_tool_use_round_trip(server, force_tool_call):
    with anthropic.Anthropic(base_url=server, api_key="sk-local", max_retries=0) as claude:
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        force_tool_call("get_weather", {"city": "Paris"})
        first = claude.messages.create(model="m", max_tokens=64, tools=[WEATHER], messages=messages)
        assert first.stop_reason == "tool_use"
        assert [block.type for block in first.content] == ["tool_use"]
        call = first.content[0]
        assert (call.name, call.input) == ("get_weather", {"city": "Paris"})

        messages += [
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
            },
        ]
        force_tool_call("get_weather", {"city": "Lyon"})
        with claude.messages.stream(
            model="m", max_tokens=64, tools=[WEATHER], messages=messages
        ) as stream:
            second = stream.get_final_message()
        assert second.stop_reason == "tool_use"
        assert second.content[-1].input == {"city": "Lyon"}  # assembled from input_json_delta
        assert second.usage.cache_read_input_tokens == (
            first.usage.input_tokens + first.usage.output_tokens
        )


def test_text_before_a_tool_call_streams_and_the_call_does_not(http, force_tool_call):
    body = {
        "model": "m",
        "max_tokens": 64,
        "stream": True,
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
    }
    force_tool_call("get_weather", {"city": "Rome"}, text="Let me check. ")
    events, _ = post_stream(http, {"path": "/v1/messages", "headers": {}, "body": body})
    texts = [
        d["delta"]["text"] for n, d in events if d.get("delta", {}).get("type") == "text_delta"
    ]
    assert "".join(texts) == "Let me check. "
    reply = final_message(events)
    assert reply["content"][1]["input"] == {"city": "Rome"}
    assert reply["stop_reason"] == "tool_use"


def test_openai_sdk_tool_call_round_trip(server, force_tool_call):
    tool = {
        "type": "function",
        "function": {
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
    with openai.OpenAI(base_url=f"{server}/v1", api_key="sk-local", max_retries=0) as gpt:
        messages = [
            {"role": "system", "content": "You call tools."},
            {"role": "user", "content": "Weather in Oslo?"},
        ]
        force_tool_call("get_weather", {"city": "Oslo"})
        first = gpt.chat.completions.create(
            model="m", max_tokens=64, tools=[tool], messages=messages
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Oslo"}

        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Rain"},
        ]
        force_tool_call("get_weather", {"city": "Bergen"})
        chunks = list(
            gpt.chat.completions.create(
                model="m",
                max_tokens=64,
                tools=[tool],
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        calls = [
            c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []
        ]
        # One call (index 0): its id and name first, then its arguments piece by piece.
        assert {c.index for c in calls} == {0} and len(calls) > 3
        assert calls[0].id and calls[0].function.name == "get_weather"
        arguments = "".join(c.function.arguments or "" for c in calls)
        assert json.loads(arguments) == {"city": "Bergen"}
        finish = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert finish == ["tool_calls"]
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens == (
            first.usage.prompt_tokens + first.usage.completion_tokens
        )


def claude_env(server: str, tmp_path) -> dict[str, str]:
    """What a user sets to point the claude CLI at agentkv: the base URL and a key (plus a
    fresh HOME and TMPDIR, so nothing is shared with another claude process or the user's)."""
    return claude_env_of(tmp_path) | {"ANTHROPIC_BASE_URL": server}


def claude_env_of(tmp_path) -> dict[str, str]:
    (tmp_path / "home").mkdir()
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path),
        "ANTHROPIC_API_KEY": "sk-local",
    }


@pytest.mark.skipif(shutil.which("claude") is None, reason="the claude CLI is not installed")
def test_claude_cli_print_and_continue(server, http, tmp_path, force_tool_call):
    # Each turn answers visible text: the tiny model's own answer can be empty for some
    # prompts (its date and paths vary), and the CLI then retries with an edited first
    # message and replaces the empty answer with its own words, which no cache can match.
    force_tool_call.say("Hi! How can I help?")
    force_tool_call.say("Hello again.")
    env = claude_env(server, tmp_path)
    (tmp_path / "project").mkdir()

    def claude(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["claude", "-p", *args],
            cwd=tmp_path / "project",
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = claude("Say hi")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "Hi! How can I help?"
    cached = metric(http, "agentkv_input_tokens_total", kind="cached")
    prefilled = metric(http, "agentkv_input_tokens_total", kind="prefilled")
    follow_up = claude("--continue", "And again")
    assert follow_up.returncode == 0, follow_up.stderr
    assert follow_up.stdout.strip() == "Hello again."
    cached = metric(http, "agentkv_input_tokens_total", kind="cached") - cached
    prefilled = metric(http, "agentkv_input_tokens_total", kind="prefilled") - prefilled
    assert cached / (cached + prefilled) >= 0.95


@pytest.mark.skipif(shutil.which("claude") is None, reason="the claude CLI is not installed")
def test_claude_cli_runs_the_tool_the_model_calls(server, http, tmp_path, force_tool_call):
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("the answer is 42\n")
    env = claude_env(server, tmp_path)
    force_tool_call("Read", {"file_path": str(project / "notes.txt")})
    cached = metric(http, "agentkv_input_tokens_total", kind="cached")
    done = subprocess.run(
        ["claude", "-p", "What is in notes.txt?"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # Claude Code ran the tool and sent its result back; that turn resumed from the cache.
    sessions = [a["id"] for a in http.get("/v1/agents", params={"limit": 1000}).json()["data"]]
    results = [
        m["content"]
        for agent_id in sessions
        if agent_id.startswith("claude-code-")
        for m in http.get(f"/v1/agents/{agent_id}/messages").json()["data"]
        if m["role"] == "tool"
    ]
    assert sum("the answer is 42" in content for content in results) == 1
    assert metric(http, "agentkv_input_tokens_total", kind="cached") - cached > 50_000


@pytest.mark.skipif(shutil.which("claude") is None, reason="the claude CLI is not installed")
def test_claude_cli_reads_a_screenshot_and_its_follow_up_resumes_it(tmp_path, monkeypatch):
    """The model calls Read on a PNG; Claude Code sends the image back in the tool result
    (an image block); a vision-language model reads it, and the next turn resumes it all."""
    from PIL import Image

    say = scripted_tool_replies(monkeypatch, "tiny:tools-vl")
    project = tmp_path / "project"
    project.mkdir()
    shot = project / "screen.png"
    Image.new("RGB", (120, 90), (30, 140, 220)).save(shot)
    call = json.dumps(
        {"name": "Read", "arguments": {"file_path": str(shot)}}, separators=(",", ":")
    )
    say(f"<tool_call>\n{call}\n</tool_call>")
    say("A blue screen.")
    say("Nothing else.")
    config = RuntimeConfig(model="tiny:tools-vl", data_dir=tmp_path / "data")
    env = claude_env_of(tmp_path)

    def claude(url: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["claude", "-p", *args],
            cwd=project,
            env=env | {"ANTHROPIC_BASE_URL": url},
            capture_output=True,
            text=True,
            timeout=300,
        )

    with serve_in_thread(config) as url, httpx.Client(base_url=url, timeout=60) as http:
        first = claude(url, "What does screen.png show?")
        assert first.returncode == 0, first.stderr
        assert first.stdout.strip() == "A blue screen."
        cached = metric(http, "agentkv_input_tokens_total", kind="cached")
        prefilled = metric(http, "agentkv_input_tokens_total", kind="prefilled")
        follow_up = claude(url, "--continue", "Anything else?")
        assert follow_up.returncode == 0, follow_up.stderr
        assert follow_up.stdout.strip() == "Nothing else."
        cached = metric(http, "agentkv_input_tokens_total", kind="cached") - cached
        prefilled = metric(http, "agentkv_input_tokens_total", kind="prefilled") - prefilled
        assert cached / (cached + prefilled) >= 0.95
    digest = hashlib.sha256(shot.read_bytes()).hexdigest()

    async def stored() -> tuple[list[str], list[tuple]]:
        async with await Registry.open(config.database) as registry:
            agents = [a.id for a in await registry.list_agents()]
            parts = [
                m.parts
                for agent_id in agents
                for m in await registry.transcript(agent_id)
                if m.role == "tool" and m.parts
            ]
            return agents, parts

    _, parts = asyncio.run(stored())
    # The screenshot reached the model as an image part of the tool's result, stored once.
    assert [[p["sha256"] for p in ps if p["type"] == "image"] for ps in parts] == [[digest]]
