"""The server under bad input and failure: refused requests store nothing, oversized bodies,
invalid text, a client that goes away, the registry's disk. Real uvicorn on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentkv import AgentRuntime, RegistryStorageError, RuntimeConfig
from agentkv.server.background import serve_in_thread
from agentkv.server.errors import Dialect, api_error
from agentkv.server.hosts import allowed_hosts, host_of

MODEL = "tiny:gemma3"
MAX_BODY = 256 * 1024
TOO_LONG = "word " * 20_000  # far past tiny:gemma3's 8192-token context


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def http(tmp_path_factory) -> Iterator[httpx.Client]:
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path_factory.mktemp("errors"))
    with (
        serve_in_thread(config, max_body_bytes=MAX_BODY) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client


def agent_ids(http: httpx.Client) -> list[str]:
    ids, after = [], None
    while True:
        params = {"limit": 100} | ({"after_id": after} if after else {})
        body = http.get("/v1/agents", params=params).json()
        ids += [a["id"] for a in body["data"]]
        if not body["has_more"]:
            return ids
        after = body["last_id"]


def transcript(http: httpx.Client, agent_id: str) -> list[tuple[str, str]]:
    response = http.get(f"/v1/agents/{agent_id}/messages")
    assert response.status_code == 200
    return [(m["role"], m["content"]) for m in response.json()["data"]]


def anthropic_body(messages: list[dict], **kw) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": messages, **kw}


@pytest.mark.parametrize("stream", [False, True])
def test_refused_stateless_request_leaves_no_agent_and_no_history(http, stream):
    before = agent_ids(http)
    history = [user(f"first {stream}"), assistant("an answer")]
    refused = http.post(
        "/v1/messages", json=anthropic_body([*history, user(TOO_LONG)], stream=stream)
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert agent_ids(http) == before
    # The same conversation, answerable, gets one new agent holding the history and the turn.
    ok = http.post("/v1/messages", json=anthropic_body([*history, user("short")]))
    assert ok.status_code == 200
    agent_id = ok.headers["x-agent-id"]
    assert agent_ids(http) == [*before, agent_id]
    reply = ok.json()["content"][0]["text"]
    assert transcript(http, agent_id) == [
        ("user", f"first {stream}"),
        ("assistant", "an answer"),
        ("user", "short"),
        ("assistant", reply),
    ]


def test_refused_request_naming_a_new_agent_creates_nothing(http):
    headers = {"x-agent-id": "named-refused"}
    body = anthropic_body([user("earlier"), assistant("reply"), user(TOO_LONG)])
    assert http.post("/v1/messages", json=body, headers=headers).status_code == 400
    assert http.get("/v1/agents/named-refused").status_code == 404
    # An existing agent keeps its (empty) transcript: the imported history was not stored.
    assert http.post("/v1/agents", json={"id": "named-empty"}).status_code == 201
    refused = http.post("/v1/messages", json=body, headers={"x-agent-id": "named-empty"})
    assert refused.status_code == 400
    assert transcript(http, "named-empty") == []


LONE_SURROGATE = '"caf\\ud800e"'  # JSON text: a valid escape that decodes to a lone surrogate


@pytest.mark.parametrize(
    ("path", "template"),
    [
        ("/v1/messages", '{"model":"m","max_tokens":4,"messages":[{"role":"user","content":%s}]}'),
        (
            "/v1/messages",
            '{"model":"m","max_tokens":4,"stream":true,"messages":[{"role":"user","content":%s}]}',
        ),
        (
            "/v1/messages",
            '{"model":"m","max_tokens":4,"system":%s,"messages":[{"role":"user","content":"x"}]}',
        ),
        ("/v1/messages/count_tokens", '{"model":"m","messages":[{"role":"user","content":%s}]}'),
        ("/v1/chat/completions", '{"model":"m","messages":[{"role":"user","content":%s}]}'),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_problem(http, path, template):
    before = agent_ids(http)
    response = http.post(
        path, content=template % LONE_SURROGATE, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    body = response.json()
    message = body["error"]["message"]
    assert "lone surrogate '\\ud800' at character 3" in message
    assert agent_ids(http) == before


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_oversized_bodies_are_refused_with_413_in_the_api_shape(http, path):
    big = json.dumps(
        {"model": "m", "max_tokens": 4, "messages": [user("x" * (MAX_BODY + 10))]}
    ).encode()
    announced = http.post(path, content=big, headers={"content-type": "application/json"})

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    chunked = http.post(path, content=chunks(), headers={"content-type": "application/json"})
    for response in (announced, chunked):
        assert response.status_code == 413
        error = response.json()["error"]
        assert f"limit of {MAX_BODY} bytes" in error["message"]
        if path == "/v1/messages":
            assert response.json()["type"] == "error"
            assert error["type"] == "request_too_large"
        else:
            assert error["code"] == "request_too_large"
    small = {"model": "m", "max_tokens": 2, "messages": [user("y" * 1000)]}
    assert http.post(path, json=small).status_code == 200


def test_non_streaming_client_that_disconnects_cancels_its_turn(http):
    # ~6000 prompt tokens: seconds of prefill here, whatever the sampling does after.
    body = {"model": "m", "max_tokens": 50, "messages": [user("word " * 2000)]}
    headers = {"x-agent-id": "leaves-early"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        http.post(
            "/v1/chat/completions", json=body, headers=headers, timeout=httpx.Timeout(60, read=0.4)
        )
    # Rolled back: nothing stored, and the agent this request created is gone again.
    deadline = time.monotonic() + 30
    while http.get("/v1/agents/leaves-early").status_code != 404:
        assert time.monotonic() < deadline, "the abandoned turn was not cancelled"
        time.sleep(0.02)
    assert active_requests(http) == 0
    short = {"model": "m", "max_tokens": 3, "messages": [user("Talk a little")]}
    again = http.post("/v1/chat/completions", json=short, headers=headers)
    assert again.status_code == 200
    assert len(transcript(http, "leaves-early")) == 2


class ErrorRecords(logging.Handler):
    """The ERROR records of the root logger and uvicorn's (which does not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @contextlib.contextmanager
    def attached(self) -> Iterator[list[logging.LogRecord]]:
        loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield self.records
        finally:
            for logger in loggers:
                logger.removeHandler(self)


def requests_by_status(http: httpx.Client, path: str) -> dict[str, float]:
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for sample in family.samples
        if sample.name == "agentkv_http_requests_total" and sample.labels["route"] == path
    }


CUT_SHORT = ["/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens", "/v1/agents"]


def test_a_client_that_leaves_before_its_body_arrives_is_a_499(http):
    """No traceback, no 5xx, nothing stored: the request is counted as nginx's 499."""
    host, port = http.base_url.host, http.base_url.port
    lines = ["POST {} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
    head = "\r\n".join([*lines, "x-agent-id: cut-short", "Content-Length: 100000", "", ""])
    part = json.dumps({"model": "m", "max_tokens": 2, "messages": [user("Hi")]})[:-3].encode()
    before = {path: requests_by_status(http, path) for path in CUT_SHORT}
    with ErrorRecords().attached() as errors:
        for path in CUT_SHORT:
            for _ in range(10):
                with socket.create_connection((host, port)) as sock:
                    sock.sendall(head.format(path).encode() + part)
        for path in CUT_SHORT:
            deadline = time.monotonic() + 30
            while sum(requests_by_status(http, path).values()) < sum(before[path].values()) + 10:
                assert time.monotonic() < deadline, f"{path}: the requests were not counted"
                time.sleep(0.02)
    assert [record.getMessage() for record in errors] == []
    for path in CUT_SHORT:
        counted = requests_by_status(http, path)
        new = {status: n - before[path].get(status, 0) for status, n in counted.items()}
        assert {status: n for status, n in new.items() if n} == {"499": 10}
    assert http.get("/v1/agents/cut-short").status_code == 404
    short = {"model": "m", "max_tokens": 2, "messages": [user("Hi")]}
    assert http.post("/v1/chat/completions", json=short).status_code == 200


def active_requests(http: httpx.Client) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "agentkv_engine_active_requests":
                return sample.value
    raise AssertionError("no agentkv_engine_active_requests in /metrics")


def test_registry_storage_errors_map_to_507_and_503():
    full = api_error(RegistryStorageError("SQLITE_FULL", "database or disk is full"))
    read_only = api_error(RegistryStorageError("SQLITE_READONLY", "attempt to write"))
    assert full.kind.status_in(Dialect.ANTHROPIC) == 507
    assert full.kind.status_in(Dialect.OPENAI) == 507
    assert read_only.kind.status_in(Dialect.OPENAI) == 503
    assert "free disk space" in full.message


async def test_a_turn_on_a_full_registry_fails_cleanly_and_loses_nothing(tmp_path: Path):
    """Disk full at the turn's commit: a clear error, the transcript as it was, and the agent
    answers again once there is room."""
    from sqlalchemy import event
    from sqlalchemy.pool import Pool

    full = False  # SQLite's page limit is per connection: set it on every checkout

    def limit(dbapi_connection, record, proxy) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA page_count")
        (pages,) = cursor.fetchone()
        cursor.execute(f"PRAGMA max_page_count={pages if full else 1_073_741_823}")
        cursor.fetchall()
        cursor.close()

    config = RuntimeConfig(model=MODEL, data_dir=tmp_path)
    event.listen(Pool, "checkout", limit)
    try:
        async with await AgentRuntime.open(config) as rt:
            await rt.create_agent("full")
            first = await rt.chat("full", "hello", max_tokens=3)
            await rt.flush()
            full = True
            with pytest.raises(RegistryStorageError, match="SQLITE_FULL"):
                await rt.chat("full", "x" * 6000, max_tokens=3)
            full = False
            assert [m.content for m in await rt.transcript("full")] == ["hello", first.text]
            again = await rt.chat("full", "room again", max_tokens=3)
            assert again.cache_source == "hot"
            assert len(await rt.transcript("full")) == 4
    finally:
        event.remove(Pool, "checkout", limit)


def test_agents_and_transcripts_paginate(http):
    before = agent_ids(http)
    created = [http.post("/v1/agents", json={"id": f"page-{i}"}).json()["id"] for i in range(5)]
    first = http.get("/v1/agents", params={"limit": 2, "after_id": before[-1]}).json()
    assert [a["id"] for a in first["data"]] == created[:2]
    assert (first["has_more"], first["first_id"], first["last_id"]) == (True, "page-0", "page-1")
    rest = http.get("/v1/agents", params={"limit": 1000, "after_id": "page-1"}).json()
    assert [a["id"] for a in rest["data"]] == created[2:]
    assert rest["has_more"] is False
    assert len(http.get("/v1/agents").json()["data"]) == min(20, len(before) + 5)
    for bad in ({"limit": 0}, {"limit": 1001}, {"limit": "x"}):
        assert http.get("/v1/agents", params=bad).status_code == 400
    assert http.get("/v1/agents", params={"after_id": "no-such-agent"}).status_code == 404

    reply = http.post(
        "/v1/messages",
        json=anthropic_body([user("one"), assistant("two"), user("three")]),
        headers={"x-agent-id": "page-0"},
    )
    assert reply.status_code == 200
    messages = http.get("/v1/agents/page-0/messages", params={"limit": 3}).json()
    assert [m["position"] for m in messages["data"]] == [0, 1, 2]
    assert (messages["has_more"], messages["last_id"]) == (True, 2)
    tail = http.get("/v1/agents/page-0/messages", params={"after_position": 2}).json()
    assert [(m["position"], m["role"]) for m in tail["data"]] == [(3, "assistant")]
    assert tail["has_more"] is False
    assert http.get("/v1/agents/page-0").json()["message_count"] == 4


def test_stateless_agents_expire_and_named_ones_stay(tmp_path):
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path)
    with (
        serve_in_thread(config, stateless_ttl_s=1) as url,
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        stateless = http.post("/v1/messages", json=anthropic_body([user("hello")]))
        named = http.post(
            "/v1/messages", json=anthropic_body([user("hello")]), headers={"x-agent-id": "kept"}
        )
        assert stateless.status_code == named.status_code == 200
        gone = stateless.headers["x-agent-id"]
        assert http.get(f"/v1/agents/{gone}").json()["idle_ttl_s"] == 1
        deadline = time.monotonic() + 30
        while (disk := disk_metrics(http))["agentkv_cache_disk_files"] != 2:  # saves are async
            assert time.monotonic() < deadline, disk
            time.sleep(0.05)
        assert disk["agentkv_cache_disk_bytes"] > 0
        while http.get(f"/v1/agents/{gone}").status_code != 404:
            assert time.monotonic() < deadline, "the idle stateless agent never expired"
            time.sleep(0.1)
        assert agent_ids(http) == ["kept"]
        assert not (tmp_path / "caches" / gone).exists()
        # The same conversation again starts a new agent (the expired one is out of the index).
        again = http.post("/v1/messages", json=anthropic_body([user("hello")]))
        assert again.status_code == 200 and again.headers["x-agent-id"] != gone


def disk_metrics(http: httpx.Client) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
        if s.name.startswith("agentkv_cache_")
    }


def test_fork_over_http(http):
    headers = {"x-agent-id": "fork-src"}
    first = http.post("/v1/messages", json=anthropic_body([user("Hello there")]), headers=headers)
    assert first.status_code == 200
    forked = http.post("/v1/agents/fork-src/fork", json={"id": "fork-dst", "name": "Dst"})
    assert forked.status_code == 201
    assert (forked.json()["id"], forked.json()["name"], forked.json()["message_count"]) == (
        "fork-dst",
        "Dst",
        2,
    )
    assert transcript(http, "fork-dst") == transcript(http, "fork-src")
    again = http.post(
        "/v1/messages", json=anthropic_body([user("Go on")]), headers={"x-agent-id": "fork-dst"}
    )
    assert again.json()["usage"]["cache_read_input_tokens"] > 0
    assert http.post("/v1/agents/fork-src/fork", json={"id": "fork-dst"}).status_code == 409
    assert http.post("/v1/agents/nope/fork", json={}).status_code == 404


def test_a_foreign_host_is_refused_on_loopback(http: httpx.Client):
    """DNS rebinding: a web page whose name resolves to 127.0.0.1 reaches the server with its
    own name in Host. The default loopback server answers only loopback names (any port)."""
    port = http.base_url.port
    for host in ("evil.example.com", f"evil.example.com:{port}", "127.0.0.1.example.com", ""):
        for path in ("/v1/models", "/v1/agents"):
            response = http.get(path, headers={"host": host})
            assert response.status_code == 421, (host, path)
            message = response.json()["error"]["message"]
            assert "is not allowed" in message and "--allowed-hosts" in message
            assert (repr(host) if host else "no Host header") in message
    openai = http.post("/v1/chat/completions", json={}, headers={"host": "evil.example.com"})
    assert openai.status_code == 421
    assert openai.json()["error"]["code"] == "host_not_allowed"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert http.get("/v1/models", headers={"host": host}).status_code == 200, host


def test_allowed_hosts_follow_the_bound_address_and_the_option():
    assert allowed_hosts("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("127.0.0.2") == {"localhost", "127.0.0.1", "::1", "127.0.0.2"}
    assert allowed_hosts("::1", ["Agents.Example.com"]) == {
        "localhost",
        "127.0.0.1",
        "::1",
        "agents.example.com",
    }
    assert allowed_hosts("0.0.0.0") is None  # bound elsewhere: an API key guards it instead
    assert allowed_hosts("0.0.0.0", ["agents.example.com"]) == {"agents.example.com"}
    assert allowed_hosts("127.0.0.1", ["*"]) is None
    assert [host_of(h) for h in ("a.b:80", "[::1]:8000", "[::1]", "::1", "A.B")] == [
        "a.b",
        "::1",
        "::1",
        "::1",
        "a.b",
    ]


def test_agentkv_serve_checks_the_host_unless_allowed(tmp_path: Path):
    def serve(*extra: str) -> tuple[subprocess.Popen, str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = ["serve", "--model", MODEL, "--data-dir", str(tmp_path), "--port", str(port)]
        process = subprocess.Popen(
            [sys.executable, "-m", "agentkv.server.cli", *args, *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    return process, url
            time.sleep(0.1)
        process.kill()
        raise AssertionError("agentkv serve did not start")

    evil = {"host": "evil.example.com"}
    for extra, expected in [((), 421), (("--allowed-hosts", "evil.example.com"), 200)]:
        process, url = serve(*extra)
        try:
            assert httpx.get(f"{url}/v1/models", headers=evil, timeout=30).status_code == expected
        finally:
            process.terminate()
            process.wait(60)
