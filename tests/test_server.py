"""The HTTP server end to end: a real uvicorn server on 127.0.0.1, the official SDK clients."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import itertools
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from agentkv import EngineConfig, RuntimeConfig
from agentkv.config import default_hot_cache_bytes
from agentkv.server.background import serve_in_thread
from agentkv.server.cli import build_parser, main
from agentkv.store import NewMessage, Registry

MODEL = "tiny:gemma3"
KEY = "sk-test-key"


@dataclass
class Server:
    url: str
    data_dir: Path
    api_key: str = "unused"

    def anthropic(self, **kw) -> anthropic.Anthropic:
        kw.setdefault("api_key", self.api_key)
        return anthropic.Anthropic(base_url=self.url, max_retries=0, **kw)

    def openai(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", self.api_key)
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, **kw)

    def http(self) -> httpx.Client:
        headers = {"x-api-key": self.api_key}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@contextlib.contextmanager
def serve(config: RuntimeConfig, api_key: str | None = None) -> Iterator[Server]:
    """A real uvicorn server on a free loopback port, in a background thread."""
    with serve_in_thread(config, api_key) as url:
        yield Server(url, config.data_dir, api_key or "unused")


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Server]:
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path_factory.mktemp("server"))
    with serve(config) as server:
        yield server


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[Server]:
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path_factory.mktemp("keyed"))
    with serve(config, api_key=KEY) as server:
        yield server


@pytest.fixture
def claude(srv) -> Iterator[anthropic.Anthropic]:
    with srv.anthropic() as client:
        yield client


@pytest.fixture
def gpt(srv) -> Iterator[openai.OpenAI]:
    with srv.openai() as client:
        yield client


@pytest.fixture
def http(srv) -> Iterator[httpx.Client]:
    with srv.http() as client:
        yield client


_names = itertools.count()


def unique(prefix: str) -> str:
    """A fresh name, the same sequence every run (so the greedy replies are reproducible)."""
    return f"{prefix}-{next(_names)}"


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def transcript(http: httpx.Client, agent_id: str) -> list[tuple[str, str]]:
    response = http.get(f"/v1/agents/{agent_id}/messages")
    assert response.status_code == 200
    return [(m["role"], m["content"]) for m in response.json()["data"]]


def all_agent_ids(http: httpx.Client) -> list[str]:
    """Every agent's id, following the list's pages."""
    ids, params = [], {"limit": 1000}
    while True:
        body = http.get("/v1/agents", params=params).json()
        ids += [a["id"] for a in body["data"]]
        if not body["has_more"]:
            return ids
        params["after_id"] = body["last_id"]


def agent_count(http: httpx.Client) -> int:
    return len(all_agent_ids(http))


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when the labelled series does not exist yet)."""
    text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


# ---- Anthropic Messages ------------------------------------------------------------------------


def test_anthropic_message_shape_and_usage(claude, http):
    system = unique("You are terse")
    messages = [user("Hello there")]
    raw = claude.messages.with_raw_response.create(
        model="claude-test", max_tokens=16, system=system, messages=messages
    )
    message = raw.parse()
    agent_id = raw.headers["x-agent-id"]
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "claude-test"
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 16
    else:  # an end-of-turn token, which may also be the 16th
        assert 0 < message.usage.output_tokens <= 16
    count = claude.messages.count_tokens(model="claude-test", system=system, messages=messages)
    assert message.usage.input_tokens == count.input_tokens > 0  # a new agent: nothing cached
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0
    assert transcript(http, agent_id) == [
        ("user", "Hello there"),
        ("assistant", message.content[0].text),
    ]


def test_anthropic_streaming(claude, http):
    system, messages = unique("Stream"), [user("Tell me a story")]
    with claude.messages.stream(
        model="m", max_tokens=16, system=system, messages=messages
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")
    count = claude.messages.count_tokens(model="m", system=system, messages=messages)
    assert final.usage.input_tokens == count.input_tokens  # from message_delta's usage
    assert 0 < final.usage.output_tokens <= 16

    # The raw event sequence, and the same text as the same request unstreamed (greedy, and a
    # new agent each time).
    body = {"model": "m", "max_tokens": 8, "system": system, "messages": messages}
    with http.stream("POST", "/v1/messages", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    names = [name for name, _ in events]
    deltas = [data["delta"]["text"] for name, data in events if name == "content_block_delta"]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    plain = http.post("/v1/messages", json=body).json()
    assert "".join(deltas) == plain["content"][0]["text"]
    assert events[-2][1]["delta"] == {"stop_reason": plain["stop_reason"], "stop_sequence": None}
    streamed, again = events[-2][1]["usage"], plain["usage"]
    assert streamed["output_tokens"] == again["output_tokens"]
    held = [u["input_tokens"] + u["cache_read_input_tokens"] for u in (streamed, again)]
    assert held[0] == held[1]
    # The same request again is the same conversation's agent: all but its generation
    # prompt resumed (the checkpoint where its history ended), on this sliding-window model.
    assert streamed["cache_read_input_tokens"] == 0 < again["cache_read_input_tokens"]


def test_anthropic_resume_reads_the_agent_cache(claude, http):
    agent_id = unique("claude")
    headers = {"x-agent-id": agent_id}
    first = claude.messages.create(
        model="m", max_tokens=12, system="Be brief.", messages=[user("Hi")], extra_headers=headers
    )
    # Earlier request messages are ignored once the agent has a transcript (it is the document).
    ignored = [user("something else"), assistant("never said"), user("Go on")]
    second = claude.messages.create(
        model="m", max_tokens=12, messages=ignored, extra_headers=headers
    )
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens == (
        first.usage.input_tokens + first.usage.output_tokens
    )
    assert second.usage.input_tokens > 0
    assert transcript(http, agent_id) == [
        ("user", "Hi"),
        ("assistant", first.content[0].text),
        ("user", "Go on"),
        ("assistant", second.content[0].text),
    ]
    assert http.get(f"/v1/agents/{agent_id}").json()["system_prompt"] == "Be brief."


def test_metadata_user_id_names_the_agent_and_imports_history(claude, http):
    agent_id = unique("meta")
    history = [user("First"), assistant("An answer I gave elsewhere"), user("Second")]
    reply = claude.messages.create(
        model="m", max_tokens=8, messages=history, metadata={"user_id": agent_id}
    )
    assert transcript(http, agent_id) == [
        ("user", "First"),
        ("assistant", "An answer I gave elsewhere"),
        ("user", "Second"),
        ("assistant", reply.content[0].text),
    ]


def test_stop_sequences(claude, gpt):
    system, messages = unique("Stops"), [user("Count to ten")]
    # Greedy decoding on a new agent is deterministic: the same request gives the same text.
    free = (
        claude.messages.create(
            model="m",
            max_tokens=16,
            system=system,
            messages=messages,
            metadata={"user_id": unique("a")},
        )
        .content[0]
        .text
    )
    assert len(free) >= 6
    stop = free[3:5]
    stopped = claude.messages.create(
        model="m",
        max_tokens=16,
        system=system,
        messages=messages,
        stop_sequences=["never-there", stop],
        metadata={"user_id": unique("b")},
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == free[: free.find(stop)]

    completion = gpt.chat.completions.create(
        model="m",
        max_tokens=16,
        messages=[{"role": "system", "content": system}, *messages],
        stop=stop,
        user=unique("c"),
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == free[: free.find(stop)]


# ---- OpenAI chat completions -------------------------------------------------------------------


def test_openai_completion_and_stream(gpt):
    messages = [{"role": "system", "content": unique("Sys")}, user("Write a haiku")]
    raw = gpt.chat.completions.with_raw_response.create(
        model="gpt-x", max_tokens=16, messages=messages
    )
    done = raw.parse()
    assert raw.headers["x-agent-id"]
    assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"
    assert done.model == "gpt-x" and len(done.choices) == 1
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert done.usage.completion_tokens == 16
    else:  # an end-of-turn token, which may also be the 16th
        assert 0 < done.usage.completion_tokens <= 16
    assert done.usage.prompt_tokens_details.cached_tokens == 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    spent = done.model_extra["timings"]  # where the turn's time went, as llama.cpp sends it
    assert set(spent) == {"cache_load_s", "queue_s", "prefill_s", "ttft_s", "decode_s"}
    assert spent["ttft_s"] >= spent["queue_s"] + spent["prefill_s"] > 0

    # The same request streamed (a new agent again, greedy): the same text, in pieces.
    chunks = list(
        gpt.chat.completions.create(
            model="gpt-x",
            max_completion_tokens=16,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert set(chunks[-1].model_extra["timings"]) == set(spent)


def test_openai_resume_reports_cached_tokens(gpt, http):
    agent_id = unique("gpt")
    first = gpt.chat.completions.create(
        model="m", max_tokens=10, messages=[user("Hello")], user=agent_id
    )
    second = gpt.chat.completions.create(
        model="m",
        max_tokens=10,
        messages=[user("Hello"), assistant(first.choices[0].message.content), user("More")],
        extra_headers={"x-agent-id": agent_id},
    )
    assert second.usage.prompt_tokens_details.cached_tokens == (
        first.usage.prompt_tokens + first.usage.completion_tokens
    )
    assert len(transcript(http, agent_id)) == 4


def test_models_list_in_both_sdks(claude, gpt):
    assert [m.id for m in gpt.models.list().data] == [MODEL]
    assert [m.id for m in claude.models.list().data] == [MODEL]
    assert gpt.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        gpt.models.retrieve("gpt-5")


# ---- identity of stateless clients -------------------------------------------------------------


def test_stateless_anthropic_client_resumes_one_agent(claude, http):
    system, history, before = unique("Stateless A"), [], agent_count(http)
    usages, agents = [], set()
    for text in ("One", "Two", "Three"):
        history.append(user(text))
        raw = claude.messages.with_raw_response.create(
            model="m", max_tokens=10, system=system, messages=history
        )
        reply = raw.parse()
        agents.add(raw.headers["x-agent-id"])
        usages.append(reply.usage)
        history.append(assistant(reply.content[0].text))
    assert agent_count(http) == before + 1 and len(agents) == 1
    assert usages[0].cache_read_input_tokens == 0
    for previous, current in itertools.pairwise(usages):
        assert current.cache_read_input_tokens == (
            previous.cache_read_input_tokens + previous.input_tokens + previous.output_tokens
        )
    assert transcript(http, agents.pop()) == [(m["role"], m["content"]) for m in history]


def test_stateless_openai_client_resumes_one_agent(gpt, http):
    history = [{"role": "system", "content": unique("Stateless O")}]
    before, cached, agents = agent_count(http), [], set()
    for text in ("One", "Two", "Three"):
        history.append(user(text))
        raw = gpt.chat.completions.with_raw_response.create(
            model="m", max_tokens=10, messages=history
        )
        completion = raw.parse()
        agents.add(raw.headers["x-agent-id"])
        cached.append(completion.usage.prompt_tokens_details.cached_tokens)
        history.append(assistant(completion.choices[0].message.content))
    assert agent_count(http) == before + 1 and len(agents) == 1
    assert cached[0] == 0 and 0 < cached[1] < cached[2]


def test_stateless_client_with_prior_history_imports_it_once(claude, http):
    system = unique("Imported")
    history = [user("Old question"), assistant("Old answer"), user("New question")]
    before = agent_count(http)
    first = claude.messages.create(model="m", max_tokens=8, system=system, messages=history)
    history += [assistant(first.content[0].text), user("Follow-up")]
    second = claude.messages.create(model="m", max_tokens=8, system=system, messages=history)
    assert agent_count(http) == before + 1
    assert first.usage.cache_read_input_tokens == 0 and second.usage.cache_read_input_tokens > 0


def test_stateless_match_checks_the_transcript(srv, claude, http, caplog):
    async def append_behind_the_servers_back(agent_id: str) -> None:
        async with await Registry.open(srv.data_dir / "agentkv.sqlite") as registry:
            await registry.append_messages(
                agent_id, [NewMessage("user", "elsewhere"), NewMessage("assistant", "noted")]
            )

    system = unique("Changed")
    raw = claude.messages.with_raw_response.create(
        model="m", max_tokens=6, system=system, messages=[user("Q1")]
    )
    changed = raw.headers["x-agent-id"]
    asyncio.run(append_behind_the_servers_back(changed))
    history = [user("Q1"), assistant(raw.parse().content[0].text), user("Q2")]
    with caplog.at_level(logging.INFO, logger="agentkv.server.stateless"):
        raw = claude.messages.with_raw_response.create(
            model="m", max_tokens=6, system=system, messages=history
        )
    assert f"agent {changed!r} changed outside this server" in caplog.text
    # The index still pointed at the changed agent; its transcript no longer matches.
    assert raw.headers["x-agent-id"] != changed
    assert raw.parse().usage.cache_read_input_tokens == 0
    assert transcript(http, raw.headers["x-agent-id"]) == [
        *[(m["role"], m["content"]) for m in history],
        ("assistant", raw.parse().content[0].text),
    ]


def test_concurrent_clients(srv):
    def named(i: int) -> list[int]:
        agent_id = unique(f"conc-{i}")
        with srv.anthropic() as claude, srv.openai() as gpt, srv.http() as http:
            a = claude.messages.create(
                model="m",
                max_tokens=8,
                messages=[user(f"Hi {i}")],
                extra_headers={"x-agent-id": agent_id},
            )
            b = gpt.chat.completions.create(
                model="m", max_tokens=8, messages=[user(f"More {i}")], user=agent_id
            )
            assert len(transcript(http, agent_id)) == 4
        return [a.usage.cache_read_input_tokens, b.usage.prompt_tokens_details.cached_tokens]

    def stateless(i: int) -> list[int]:
        history = [{"role": "system", "content": unique(f"conc {i}")}, user("Start")]
        with srv.openai() as gpt:
            first = gpt.chat.completions.create(model="m", max_tokens=8, messages=history)
            history += [assistant(first.choices[0].message.content), user("Next")]
            second = gpt.chat.completions.create(model="m", max_tokens=8, messages=history)
        return [
            first.usage.prompt_tokens_details.cached_tokens,
            second.usage.prompt_tokens_details.cached_tokens,
        ]

    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(named, i) for i in range(4)]
        jobs += [pool.submit(stateless, i) for i in range(2)]
        results = [job.result(timeout=120) for job in jobs]
    for first, second in results:
        assert first == 0 and second > 0


def test_concurrent_stateless_requests_never_share_an_agent(srv, claude, http):
    system = unique("Twins")
    first = claude.messages.create(model="m", max_tokens=8, system=system, messages=[user("Go")])
    history = [user("Go"), assistant(first.content[0].text), user("Next")]
    before, barrier = agent_count(http), threading.Barrier(2)

    def call(_: int) -> tuple[str, anthropic.types.Message]:
        with srv.anthropic() as client:
            barrier.wait()
            raw = client.messages.with_raw_response.create(
                model="m", max_tokens=8, system=system, messages=history
            )
            return raw.headers["x-agent-id"], raw.parse()

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(call, range(2)))
    # One request resumes the agent of the first turn; the other cannot share it while it is
    # busy (their replies may differ), so it gets a new agent with the history imported.
    assert agent_count(http) == before + 1
    assert results[0][0] != results[1][0]
    assert sorted(r.usage.cache_read_input_tokens > 0 for _, r in results) == [False, True]
    for agent_id, reply in results:
        assert transcript(http, agent_id) == [
            *[(m["role"], m["content"]) for m in history],
            ("assistant", reply.content[0].text),
        ]


def test_stateless_requests_never_match_agents_created_by_name(claude, http):
    system = unique("Named")
    named = http.post("/v1/agents", json={"id": unique("named"), "system_prompt": system}).json()
    raw = claude.messages.with_raw_response.create(
        model="m", max_tokens=4, system=system, messages=[user("Hi")]
    )
    assert raw.headers["x-agent-id"] != named["id"]
    assert raw.headers["x-agent-id"].startswith("stateless-")
    assert transcript(http, named["id"]) == []


def test_identical_stateless_requests_resume_one_agent(claude, gpt, http):
    messages, before = [user(unique("Same"))], agent_count(http)
    raws = [
        claude.messages.with_raw_response.create(model="m", max_tokens=4, messages=messages)
        for _ in range(3)
    ]
    agent_id = raws[0].headers["x-agent-id"]
    assert [raw.headers["x-agent-id"] for raw in raws] == [agent_id] * 3
    assert agent_count(http) == before + 1
    first, *again = [raw.parse() for raw in raws]
    for reply in again:  # the last reply is replaced, the cache reused up to it
        usage = reply.usage
        assert (usage.cache_read_input_tokens, usage.input_tokens) == (
            first.usage.input_tokens - 1,
            1,
        )
    assert transcript(http, agent_id) == [
        ("user", messages[0]["content"]),
        ("assistant", again[-1].content[0].text),
    ]
    # A whole conversation (a system message among the messages) resent: the same.
    late = {"role": "system", "content": "Be brief."}
    conversation = [user(unique("Doc")), late]
    ids = [
        gpt.chat.completions.with_raw_response.create(
            model="m", max_tokens=4, messages=conversation
        ).headers["x-agent-id"]
        for _ in range(2)
    ]
    assert ids[0] == ids[1] and agent_count(http) == before + 2


# ---- Claude Code shapes (the model without tools; tool calls: tests/test_claude_code.py) -------


def test_claude_code_session_is_one_agent_resumed_from_cache(claude, http):
    session = f"0d5c1a7e-{next(_names):04d}-4c1e-9d7a-3b2f8e6a1c90"
    user_id = json.dumps({"device_id": "ab12", "account_uuid": "", "session_id": session})
    late_system = {"role": "system", "content": "Reminder: be brief."}  # may come last
    messages = [user("Hi"), late_system]
    raw = claude.messages.with_raw_response.create(
        model="m", max_tokens=8, system="Sys", messages=messages, metadata={"user_id": user_id}
    )
    first = raw.parse()
    agent_id = raw.headers["x-agent-id"]
    assert agent_id.startswith(f"claude-code-{session}-")
    thinking = {"type": "thinking", "thinking": "Let me see.", "signature": "c2ln"}
    messages += [
        {"role": "assistant", "content": [thinking, *[b.model_dump() for b in first.content]]},
        user("Next"),
    ]
    raw = claude.messages.with_raw_response.create(
        model="m",
        max_tokens=8,
        system="Sys",
        messages=messages,
        extra_headers={"x-claude-code-session-id": session},
        extra_body={"thinking": {"type": "adaptive"}, "context_management": {"edits": []}},
    )
    second = raw.parse()
    assert raw.headers["x-agent-id"] == agent_id
    assert second.usage.cache_read_input_tokens == (
        first.usage.input_tokens + first.usage.output_tokens
    )
    assert transcript(http, agent_id) == [
        ("user", "Hi"),
        ("system", "Reminder: be brief."),
        ("assistant", first.content[0].text),
        ("user", "Next"),
        ("assistant", second.content[0].text),
    ]


def test_a_user_id_that_is_not_an_agent_id_is_ignored(claude):
    raw = claude.messages.with_raw_response.create(
        model="m", max_tokens=4, messages=[user("Hi")], metadata={"user_id": "someone@example.com"}
    )
    assert raw.headers["x-agent-id"].startswith("stateless-")


def test_tools_need_a_model_that_can_call_them(claude, gpt):
    tool = {"name": "t", "input_schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError, match="cannot call tools"):
        claude.messages.create(model="m", max_tokens=4, messages=[user("x")], tools=[tool])
    function = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="cannot call tools"):
        gpt.chat.completions.create(model="m", messages=[user("x")], tools=[function])


def test_prompt_too_long_has_anthropics_wording(claude, gpt):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="m", max_tokens=16_000, messages=[user("hi " * 9000)])
    assert re.match(
        r"prompt is too long: \d+ tokens > 8191 maximum", info.value.body["error"]["message"]
    )
    with pytest.raises(openai.BadRequestError, match="prompt is too long") as oinfo:
        gpt.chat.completions.create(model="m", messages=[user("hi " * 9000)])
    assert oinfo.value.code == "context_length_exceeded"


def test_head_preflight_needs_no_key(keyed):
    with httpx.Client(base_url=keyed.url) as bare:
        assert bare.head("/").status_code == 200
        assert bare.head("/api/hello").status_code == 200  # Claude Code's interactive start
        assert bare.get("/v1/models").status_code == 401


# ---- errors ------------------------------------------------------------------------------------


def test_bad_requests_are_400_in_each_api_shape(claude, gpt, http):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="m", max_tokens=0, messages=[user("x")])
    assert info.value.status_code == 400
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model="m", max_tokens=4, messages=[user("x")], extra_body={"temperature": -1}
        )
    with pytest.raises(anthropic.BadRequestError, match="last message must be a user"):
        claude.messages.create(model="m", max_tokens=4, messages=[user("x"), assistant("y")])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="the image's base64 data is missing"):
        claude.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    image["source"]["data"] = base64.b64encode(png.getvalue()).decode()
    with pytest.raises(anthropic.BadRequestError, match="not a vision-language model"):
        claude.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    with pytest.raises(anthropic.BadRequestError, match="agent id"):
        claude.messages.create(
            model="m", max_tokens=4, messages=[user("x")], extra_headers={"x-agent-id": "../etc"}
        )

    with pytest.raises(openai.BadRequestError) as oinfo:
        gpt.chat.completions.create(model="m", temperature=-1, messages=[user("x")])
    assert oinfo.value.status_code == 400 and oinfo.value.param == "temperature"
    assert oinfo.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        gpt.chat.completions.create(model="m", max_tokens=0, messages=[user("x")])
    with pytest.raises(openai.BadRequestError, match="last message must be a user"):
        gpt.chat.completions.create(
            model="m", messages=[user("x"), {"role": "system", "content": "late"}, assistant("y")]
        )

    response = http.post(
        "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["type"] == "error"


def test_unknown_agent_is_404_in_the_callers_shape(http):
    response = http.get("/v1/agents/nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "not_found"
    assert "nope" in error["message"]
    response = http.get("/v1/agents/nope/messages", headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == 404
    assert response.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": response.json()["error"]["message"]},
    }
    assert http.delete("/v1/agents/nope").status_code == 404


def test_api_key_is_required_when_set(keyed):
    with keyed.anthropic(api_key="wrong") as claude, pytest.raises(anthropic.AuthenticationError):
        claude.messages.create(model="m", max_tokens=4, messages=[user("x")])
    with keyed.openai(api_key="wrong") as gpt, pytest.raises(openai.AuthenticationError):
        gpt.chat.completions.create(model="m", max_tokens=4, messages=[user("x")])
    with keyed.anthropic() as claude:
        assert (
            claude.messages.create(
                model="m", max_tokens=4, messages=[user("x")]
            ).usage.output_tokens
            > 0
        )
    with keyed.openai() as gpt:  # a bearer token, on another route
        assert [m.id for m in gpt.models.list().data] == [MODEL]
    with httpx.Client(base_url=keyed.url) as bare:
        for path in ("/metrics", "/v1/agents", "/v1/models"):
            assert bare.get(path).status_code == 401
        assert bare.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def test_full_engine_queue_is_529_and_429(tmp_path):
    tight = EngineConfig(completion_batch_size=1, prefill_batch_size=1, max_queue_size=1)
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path, engine=tight)
    # Each its own from the first word: prompts that start alike would wait for one another's
    # shared start (agentkv.caches.tiers) instead of all asking the engine at once.
    long_prompt = "Tell me everything about the sea, the mountains and the sky. " * 10

    def fire(server: Server, call) -> list[BaseException | None]:
        barrier = threading.Barrier(6)

        def one(i: int) -> BaseException | None:
            barrier.wait()
            try:
                call(i)
            except (anthropic.APIStatusError, openai.APIStatusError) as exc:
                return exc
            return None

        with ThreadPoolExecutor(6) as pool:
            return list(pool.map(one, range(6)))

    with serve(config) as server, server.anthropic() as claude, server.openai() as gpt:
        outcomes = fire(
            server,
            lambda i: claude.messages.create(
                model="m",
                max_tokens=64,
                messages=[user(f"{i}: {long_prompt}")],
                metadata={"user_id": f"a{i}"},
            ),
        )
        refused = [e for e in outcomes if e is not None]
        assert refused and None in outcomes
        assert all(
            isinstance(e, anthropic.APIStatusError) and e.status_code == 529 for e in refused
        )
        assert refused[0].body["error"]["type"] == "overloaded_error"

        outcomes = fire(
            server,
            lambda i: gpt.chat.completions.create(
                model="m",
                max_tokens=64,
                messages=[user(f"{i}: {long_prompt}")],
                user=f"o{i}",
            ),
        )
        refused = [e for e in outcomes if e is not None]
        assert refused and None in outcomes
        assert all(isinstance(e, openai.RateLimitError) for e in refused)


def test_client_disconnect_cancels_the_turn(srv, http):
    agent_id = unique("gone")
    headers = {"x-agent-id": agent_id}
    assert (
        http.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 8, "messages": [user("Hi")]},
            headers=headers,
        ).status_code
        == 200
    )
    before = transcript(http, agent_id)
    body = {"model": "m", "max_tokens": 4000, "stream": True, "messages": [user("Talk a lot")]}
    with http.stream("POST", "/v1/messages", json=body, headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if "content_block_delta" in line:
                break  # leaving the block closes the connection mid-generation
    deadline = time.monotonic() + 30
    while metric(http, "agentkv_engine_active_requests") or metric(
        http, "agentkv_engine_queue_depth"
    ):
        assert time.monotonic() < deadline, "the cancelled turn kept generating"
        time.sleep(0.05)
    assert transcript(http, agent_id) == before
    # The agent is free again and its next turn resumes from the old cache.
    again = http.post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 4, "messages": [user("Back")]},
        headers=headers,
    )
    assert again.status_code == 200 and again.json()["usage"]["cache_read_input_tokens"] > 0
    assert len(transcript(http, agent_id)) == 4


# ---- agents API, metrics, CLI ------------------------------------------------------------------


def test_agents_rest_api(claude, http):
    agent_id = unique("rest")
    created = http.post(
        "/v1/agents", json={"id": agent_id, "name": "Rest", "system_prompt": "Sys."}
    )
    assert created.status_code == 201
    assert created.json() | {"created_at": None, "updated_at": None, "model_fingerprint": None} == {
        "id": agent_id,
        "object": "agent",
        "name": "Rest",
        "system_prompt": "Sys.",
        "sampling": {},
        "message_count": 0,
        "created_at": None,
        "updated_at": None,
        "model_fingerprint": None,
        "idle_ttl_s": None,
    }
    assert http.post("/v1/agents", json={"id": agent_id}).status_code == 409
    assert agent_id in all_agent_ids(http)
    assert http.get(f"/v1/agents/{agent_id}/messages").json()["data"] == []

    reply = claude.messages.create(
        model="m", max_tokens=4, messages=[user("Hi")], extra_headers={"x-agent-id": agent_id}
    )
    count = claude.messages.count_tokens(model="m", system="Sys.", messages=[user("Hi")])
    assert reply.usage.input_tokens == count.input_tokens  # the agent's system prompt was used
    assert http.get(f"/v1/agents/{agent_id}").json()["message_count"] == 2
    messages = http.get(f"/v1/agents/{agent_id}/messages").json()["data"]
    assert [(m["position"], m["role"]) for m in messages] == [(0, "user"), (1, "assistant")]

    generated = http.post("/v1/agents", json={}).json()["id"]
    assert generated.startswith("agent-")
    deleted = http.delete(f"/v1/agents/{agent_id}")
    assert deleted.json() == {"id": agent_id, "object": "agent.deleted", "deleted": True}
    assert http.get(f"/v1/agents/{agent_id}").status_code == 404
    assert http.post("/v1/agents", json={"id": "bad..id"}).status_code == 400


def test_metrics_count_requests_tokens_and_cache_sources(claude, http):
    labels = {"route": "/v1/messages", "method": "POST", "status": "200"}
    requests = metric(http, "agentkv_http_requests_total", **labels)
    output = metric(http, "agentkv_output_tokens_total")
    cached = metric(http, "agentkv_input_tokens_total", kind="cached")
    ttft = metric(http, "agentkv_time_to_first_token_seconds_count")
    none, hot = (metric(http, "agentkv_turns_total", cache_source=s) for s in ("none", "hot"))

    agent = {"x-agent-id": unique("metrics")}
    first = claude.messages.create(
        model="m", max_tokens=6, messages=[user("a")], extra_headers=agent
    )
    second = claude.messages.create(
        model="m", max_tokens=6, messages=[user("b")], extra_headers=agent
    )

    assert metric(http, "agentkv_http_requests_total", **labels) == requests + 2
    assert metric(http, "agentkv_output_tokens_total") == (
        output + first.usage.output_tokens + second.usage.output_tokens
    )
    assert metric(http, "agentkv_input_tokens_total", kind="cached") == (
        cached + second.usage.cache_read_input_tokens
    )
    assert metric(http, "agentkv_time_to_first_token_seconds_count") == ttft + 2
    assert metric(http, "agentkv_turns_total", cache_source="none") == none + 1
    assert metric(http, "agentkv_turns_total", cache_source="hot") == hot + 1
    text = http.get("/metrics").text
    for name in ("agentkv_engine_queue_depth", "agentkv_engine_batch_size", "agentkv_turns_total"):
        assert f"\n{name}" in text


def test_cli_serve_arguments(tmp_path, capsys):
    args = build_parser().parse_args(["serve", "--model", MODEL, "--kv-bits", "none"])
    assert (args.host, args.port, args.api_key, args.kv_bits) == ("127.0.0.1", 8000, None, "none")
    assert main(["serve", "--model", "tiny:nope", "--data-dir", str(tmp_path)]) == 2
    assert "unknown tiny model" in capsys.readouterr().err
    assert not Path(tmp_path, "agentkv.sqlite").exists()


def test_cli_budget_and_stateless_flags():
    def parse(*flags: str):
        return build_parser().parse_args(["serve", "--model", MODEL, *flags])

    defaults = parse()
    assert (defaults.disk_budget_bytes, defaults.stateless_ttl) == (None, None)
    assert defaults.max_stateless_agents is None
    given = parse("--disk-budget-bytes", "20G", "--max-stateless-agents", "0")
    assert (given.disk_budget_bytes, given.max_stateless_agents) == (20 * 1024**3, 0)
    assert parse("--disk-budget-bytes", "0").disk_budget_bytes == 0  # no budget


def test_agentkv_serve_reports_its_budgets_and_stateless_agents_expire_in_an_hour(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data, log = tmp_path / "data", tmp_path / "serve.log"
    args = ["serve", "--model", MODEL, "--data-dir", str(data), "--port", str(port)]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "agentkv.server.cli", *args],
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            for _ in range(600):
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/v1/models").status_code == 200:
                        break
                time.sleep(0.1)
            body = {"model": "m", "max_tokens": 4, "messages": [user("Hi")]}
            agent_id = http.post("/v1/messages", json=body).headers["x-agent-id"]
            assert http.get(f"/v1/agents/{agent_id}").json()["idle_ttl_s"] == 3600
            hot = metric(http, "agentkv_cache_hot_budget_bytes")
            disk = metric(http, "agentkv_cache_disk_budget_bytes")
            held = {
                name: metric(http, f"agentkv_cache_hot_{name}", precision="model")
                for name in (
                    "precision_agents",
                    "precision_bytes",
                    "precision_tokens",
                    "token_bytes",
                )
            }
    finally:
        process.terminate()
        process.wait(60)
    assert hot == default_hot_cache_bytes() > 0 and disk > 0
    assert held["precision_agents"] == 1 and held["precision_tokens"] > 0
    assert 0 < held["token_bytes"] <= held["precision_bytes"] / held["precision_tokens"]
    assert log.read_text().splitlines()[0] == (
        f"agentkv: hot tier budget {hot / 1024**3:.2f} GiB (10% of memory, at most 4.00 GiB), "
        f"disk budget {disk / 1024**3:.2f} GiB (25% of the space for {data / 'caches'})"
    )


def test_conversations_with_one_long_system_prompt_share_it(claude, http):
    system = " ".join(f"Rule {i}: answer politely and briefly about parcels." for i in range(40))
    prefix = metric(http, "agentkv_turns_total", cache_source="prefix")
    hits = metric(http, "agentkv_cache_prefix_hits")
    first = claude.messages.create(
        model="m", max_tokens=4, system=system, messages=[user("Where is parcel one?")]
    )
    second = claude.messages.create(
        model="m", max_tokens=4, system=system, messages=[user("And parcel two?")]
    )
    assert first.usage.cache_read_input_tokens == 0
    # No agent named, a new conversation: it starts from all of the first one's system prompt,
    # to the token where the user's turn begins, not only its whole blocks of 256.
    count = claude.messages.count_tokens(
        model="m", system=system, messages=[user("And parcel two?")]
    )
    assert second.usage.cache_read_input_tokens + second.usage.input_tokens == count.input_tokens
    assert second.usage.cache_read_input_tokens > 5 * 256
    assert second.usage.input_tokens == 18  # "<start_of_turn>user\nAnd parcel two?..." only
    assert metric(http, "agentkv_turns_total", cache_source="prefix") == prefix + 1
    assert metric(http, "agentkv_cache_prefix_hits") == hits + 1


def test_a_turn_over_the_kv_budget_is_413_and_the_budget_is_in_metrics(tmp_path):
    budget = 2 * 1024 * 1024  # room for a few hundred tokens of tiny:gemma3
    config = RuntimeConfig(
        model=MODEL, data_dir=tmp_path, engine=EngineConfig(kv_budget_bytes=budget)
    )
    long = "hello " * 2000
    with serve(config) as server, server.anthropic() as claude, server.openai() as gpt:
        with pytest.raises(anthropic.APIStatusError) as refused:
            claude.messages.create(model="m", max_tokens=8, messages=[user(long)])
        assert refused.value.status_code == 413
        assert refused.value.body["error"]["type"] == "request_too_large"
        message = refused.value.body["error"]["message"]
        assert "1 generated" in message and f"kv_budget_bytes={budget}" in message
        with pytest.raises(openai.APIStatusError) as refused:
            gpt.chat.completions.create(model="m", messages=[user(long)], user="budget")
        assert refused.value.status_code == 413
        error = refused.value.body  # the OpenAI SDK unwraps {"error": ...}
        assert (error["code"], error["param"]) == ("kv_budget_exceeded", "messages")
        ok = claude.messages.create(model="m", max_tokens=5000, messages=[user("hello")])
        assert ok.usage.output_tokens > 0  # nothing was stored of the refused turns
        with server.http() as http:
            assert metric(http, "agentkv_engine_kv_budget_bytes") == budget
            assert metric(http, "agentkv_engine_policy", policy="fair") == 1
            assert metric(http, "agentkv_engine_tokens_generated") >= ok.usage.output_tokens
            for name in ("kv_reserved_bytes", "kv_held_bytes", "waiting_for_memory", "paused"):
                assert metric(http, f"agentkv_engine_{name}") == 0  # idle now


def test_cli_batch_flags_are_checked_and_named(tmp_path, capsys):
    args = build_parser().parse_args(
        ["serve", "--model", MODEL, "--kv-budget-bytes", "1.5G", "--policy", "latency_first"]
    )
    assert (args.kv_budget_bytes, args.policy) == (int(1.5 * 1024**3), "latency_first")
    assert (args.max_decode_stall, args.max_prefill_step_s) == (2.0, 0.5)
    for flag, value in [
        ("--kv-budget-bytes", "-5"),
        ("--kv-budget-bytes", "lots"),
        ("--policy", "shortest_job"),
        ("--max-decode-stall", "abc"),
        ("--max-decode-stall", "0.5"),
        ("--max-prefill-step-s", "0"),
        ("--max-prefill-step-s", "soon"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--model", MODEL, flag, value])
        assert exited.value.code == 2
        assert f"argument {flag}" in capsys.readouterr().err
    data = tmp_path / "small"
    tiny = ["serve", "--model", MODEL, "--data-dir", str(data), "--port", "0"]
    assert main([*tiny, "--kv-budget-bytes", "1000"]) == 2
    assert "kv_budget_bytes=1000 is smaller than the smallest turn" in capsys.readouterr().err


def test_volatile_lines_are_dropped_from_system_prompts_only():
    from agentkv.server.sessions import without_volatile_lines

    line = "x-anthropic-billing-header: cc_version=2.1.330.7c2; cc_entrypoint=cli;"
    blocks = [{"type": "text", "text": line}, {"type": "text", "text": "Be brief.", "x": 1}]
    assert without_volatile_lines(blocks) == [blocks[1]]
    assert without_volatile_lines(f"{line}\nBe brief.") == "Be brief."
    assert without_volatile_lines(f"Be brief.\n{line}") == "Be brief.\n"
    # Only whole lines that start with the header name go; instructions mentioning it stay.
    kept = f"Never print {line}"
    assert without_volatile_lines(kept) == kept
    assert without_volatile_lines([{"type": "text", "text": f"{line}\nRules."}]) == [
        {"type": "text", "text": "Rules."}
    ]
    assert without_volatile_lines(None) is None
