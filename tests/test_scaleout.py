"""Scale-out end to end: real ``agentkv serve`` workers sharing one registry and one cache
directory, behind a real HAProxy with the shipped config (``server/scaleout/haproxy.cfg``).

The ``cluster`` fixture starts two (``scaleout`` any number; ``agentkv.server.scaleout.local``): the
router at ``cluster.url``, each worker at ``cluster.worker("w1").url``, its process and log.
``db_url`` says which database they share: each test runs on a SQLite file and on a
PostgreSQL server. HAProxy missing: these tests skip, unless ``CI=true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import httpx
import pytest

from agentkv import RuntimeConfig
from agentkv.server.background import serve_in_thread
from agentkv.server.cli import build_parser, main
from agentkv.server.scaleout.local import (
    CONFIG,
    Cluster,
    RouterNotInstalledError,
    local_cluster,
    router_config,
)
from agentkv.server.worker import WORKER_HEADER
from benchmarks import bench_soak
from tests.conftest import DATABASES

MODEL = "tiny:gemma3"
CACHE_SOURCE = "x-agentkv-cache-source"
NO_EOS = {"1": -100, "5": -100}  # tiny:gemma3's end tokens: a turn runs to its max_tokens
LEASE_S = 1.0  # a killed worker's agents pass to another after this long
DETECTION_S = 3.0  # HAProxy: a check every 1 s, 0.5 s once one failed, 2 failures: down


@contextlib.contextmanager
def scaleout(
    root: Path, db_url: str, workers: int = 2, worker_args: Sequence[str] = ()
) -> Iterator[Cluster]:
    """``workers`` workers sharing ``db_url`` behind HAProxy (``local_cluster``), with
    ``--lease-s LEASE_S`` and ``worker_args``; skips when HAProxy is not installed, fails then
    under ``CI=true``."""
    args = ["--lease-s", str(LEASE_S), *worker_args]
    try:
        with local_cluster(root, db_url, workers, MODEL, args) as c:
            yield c
    except RouterNotInstalledError as exc:
        router_missing(str(exc))


def router_missing(reason: str) -> NoReturn:
    """Skip: HAProxy is needed. Under ``CI=true`` (which installs it), fail instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true, but {reason}")
    pytest.skip(reason)


@pytest.fixture(params=DATABASES)
def db_url(request, tmp_path) -> str:
    """The registry the workers share: a SQLite file (workers on one machine), or a database
    on a real PostgreSQL server (``postgres_url``: workers on many)."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_url")
    (tmp_path / "registry").mkdir()
    return f"sqlite+aiosqlite:///{tmp_path / 'registry' / 'agentkv.sqlite'}"


@pytest.fixture
def cluster(tmp_path, db_url) -> Iterator[Cluster]:
    """Two workers behind HAProxy (``scaleout`` for other shapes)."""
    with scaleout(tmp_path, db_url) as c:
        yield c


# ---- what the tests send -----------------------------------------------------------------------


@dataclass
class Turn:
    """One chat turn as the client saw it: acknowledged (200) or not."""

    agent: str
    text: str
    status: int | None = None  # None: no response (the connection failed)
    reply: str = ""
    worker: str = ""
    cache_source: str = ""
    sent_at: float = 0.0  # time.monotonic()
    answered_at: float = 0.0

    @property
    def acknowledged(self) -> bool:
        return self.status == 200


def send_turn(http: httpx.Client, agent: str, text: str, max_tokens: int = 3) -> Turn:
    turn = Turn(agent, text, sent_at=time.monotonic())
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }
    try:
        response = http.post("/v1/chat/completions", json=body, headers={"x-agent-id": agent})
    except httpx.TransportError:
        return turn
    turn.answered_at = time.monotonic()
    turn.status = response.status_code
    turn.worker = response.headers.get(WORKER_HEADER, "")
    if response.status_code == 200:
        turn.reply = response.json()["choices"][0]["message"]["content"]
        turn.cache_source = response.headers[CACHE_SOURCE]
    return turn


def transcript(http: httpx.Client, agent: str) -> list[tuple[str, str]]:
    response = http.get(f"/v1/agents/{agent}/messages")
    assert response.status_code == 200, response.text
    return [(m["role"], m["content"]) for m in response.json()["data"]]


def pairs(turns: list[Turn]) -> list[tuple[str, str]]:
    return [m for t in turns for m in (("user", t.text), ("assistant", t.reply))]


def run_agents(
    cluster: Cluster,
    agents: list[str],
    turns_each: int,
    stop: threading.Event | None = None,
    acknowledged: Counter[str] | None = None,
) -> dict[str, list[Turn]]:
    """Every agent's turns, one after another, all agents at once (a thread each), until
    ``stop`` is set; ``acknowledged`` counts the acknowledged turns by worker as they come."""
    lock = threading.Lock()

    def one_agent(agent: str) -> list[Turn]:
        with cluster.http() as http:
            done = []
            for i in range(turns_each):
                if stop is not None and stop.is_set():
                    break
                done.append(turn := send_turn(http, agent, f"{agent} turn {i}"))
                if acknowledged is not None and turn.acknowledged:
                    with lock:
                        acknowledged[turn.worker] += 1
            return done

    with ThreadPoolExecutor(len(agents)) as pool:
        return dict(zip(agents, pool.map(one_agent, agents), strict=True))


# ---- the tests ---------------------------------------------------------------------------------


def test_turns_keep_their_agent_worker_and_hot_cache(cluster):
    agents = [f"agent-{i:02d}" for i in range(20)]
    turns = run_agents(cluster, agents, turns_each=10)

    every = [t for ts in turns.values() for t in ts]
    assert len(every) == 200
    assert Counter(t.status for t in every) == {200: 200}
    with cluster.http() as http:
        for agent in agents:
            assert transcript(http, agent) == pairs(turns[agent])
    follow_ups = [
        (previous, turn) for ts in turns.values() for previous, turn in itertools.pairwise(ts)
    ]
    kept = [t for p, t in follow_ups if t.worker == p.worker and t.cache_source == "hot"]
    assert len(follow_ups) == 180
    assert len(kept) >= 0.9 * len(follow_ups), Counter(
        (t.worker == p.worker, t.cache_source) for p, t in follow_ups
    )
    assert {t.worker for t in every} == {"w1", "w2"}  # both took agents
    print(
        f"\n{len(kept)}/{len(follow_ups)} follow-ups hot on their worker;",
        Counter(t.worker for t in every),
    )


def test_a_killed_worker_loses_no_acknowledged_turn_and_its_agents_move(cluster):
    agents = [f"agent-{i:02d}" for i in range(8)]
    with cluster.http() as http:
        homes = {a: send_turn(http, a, f"{a} first").worker for a in agents}
    victim = Counter(homes.values()).most_common(1)[0][0]
    survivor = next(w.id for w in cluster.workers if w.id != victim)
    moved = [a for a in agents if homes[a] == victim]

    stop, before = threading.Event(), Counter[str]()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_agents, cluster, agents, 1000, stop, before)
        deadline = time.monotonic() + 60
        while before[victim] < 2 * len(moved):  # turns on both workers
            assert time.monotonic() < deadline, before
            time.sleep(0.05)
        cluster.worker(victim).process.kill()
        killed = time.monotonic()
        down_s = cluster.wait_router_state(victim, "DOWN", timeout_s=2 * DETECTION_S)
        time.sleep(DETECTION_S - down_s + 0.5)
        stop.set()
        turns = running.result()

    # Each of the victim's agents was answered by the survivor, through the router, within
    # the detection time of the kill (a connection refused is retried on the next worker).
    answered = {}
    for agent in moved:
        after = [t for t in turns[agent] if t.sent_at > killed and t.acknowledged]
        assert {t.worker for t in after} == {survivor}
        assert after[0].cache_source == "disk", after[0]  # the shared store's, not rebuilt
        answered[agent] = after[0].answered_at - killed
    assert max(answered.values()) <= DETECTION_S, answered
    assert down_s <= DETECTION_S
    # Every acknowledged turn is stored once, in order, whole. A turn the client saw fail is
    # stored whole or not at all (the worker may have died after storing it, before answering).
    with cluster.http() as http:
        for agent in agents:
            stored = transcript(http, agent)
            assert stored[0] == ("user", f"{agent} first")
            users = [text for role, text in stored if role == "user"]
            expected = iter(stored[2:])
            for turn in turns[agent]:
                if turn.acknowledged:
                    assert next(expected) == ("user", turn.text), (agent, turn)
                    assert next(expected) == ("assistant", turn.reply), (agent, turn)
                elif turn.text in users:
                    assert next(expected) == ("user", turn.text), (agent, turn)
                    assert next(expected)[0] == "assistant", (agent, turn)
            assert next(expected, None) is None
    acknowledged = Counter(t.worker for ts in turns.values() for t in ts if t.acknowledged)
    failed = [t for ts in turns.values() for t in ts if not t.acknowledged]
    assert acknowledged[victim] > 0 and acknowledged[survivor] > 0
    assert all(t.status in (None, 502, 503) for t in failed), failed
    print(f"\n{victim} down after {down_s:.2f} s; its agents answered after {answered}")
    print(f"turns: {dict(acknowledged)} acknowledged, {Counter(t.status for t in failed)} failed")


def test_two_workers_hammering_one_agent_directly_take_turns(cluster):
    """Bypassing the router: each worker gets turns of the same agent at once. Its lease makes
    them take turns: every turn stored once, whole, each worker's in the order it sent them."""
    agent, each = "hammered", 8

    def hammer(worker: str) -> list[Turn]:
        with httpx.Client(base_url=cluster.worker(worker).url, timeout=60) as http:
            return [send_turn(http, agent, f"{worker} turn {i}") for i in range(each)]

    with ThreadPoolExecutor(2) as pool:
        sent = dict(zip(["w1", "w2"], pool.map(hammer, ["w1", "w2"]), strict=True))
    assert all(t.acknowledged and t.worker == w for w, ts in sent.items() for t in ts), sent
    with cluster.http() as http:
        stored = transcript(http, agent)
    assert len(stored) == 4 * each
    assert [role for role, _ in stored] == ["user", "assistant"] * (2 * each)
    stored_pairs = list(zip(stored[::2], stored[1::2], strict=True))
    for turns in sent.values():
        mine = [(("user", t.text), ("assistant", t.reply)) for t in turns]
        assert [p for p in stored_pairs if p in mine] == mine  # once each, in its order
    assert len(set(stored_pairs)) == 2 * each


def test_sigterm_drains_a_worker_behind_the_router(cluster):
    with cluster.http() as http:
        homes = {}
        for i in range(12):  # agents on each worker
            agent = f"drain-{i}"
            homes[agent] = send_turn(http, agent, f"{agent} first").worker
    target = homes["drain-0"]
    neighbour = next(a for a, w in homes.items() if w == target and a != "drain-0")
    worker = cluster.worker(target)

    body = {
        "model": MODEL,
        "max_tokens": 600,
        "stream": True,
        "logit_bias": NO_EOS,
        "messages": [{"role": "user", "content": "a long one"}],
    }
    text, finish, ready_after = "", None, []
    with (
        cluster.http(timeout=120) as http,
        http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-agent-id": "drain-0"}
        ) as response,
    ):
        assert response.headers[WORKER_HEADER] == target
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                break
        worker.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        with httpx.Client(base_url=worker.url, timeout=5) as direct:
            ready = direct.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["reason"] == "draining (SIGTERM); requests in flight: 1"
        nolb_s = cluster.wait_router_state(target, "NOLB", timeout_s=DETECTION_S)
        # The router sends the worker's other agents elsewhere while its turn goes on.
        with cluster.http() as other:
            moved = send_turn(other, neighbour, f"{neighbour} during the drain")
        assert (moved.status, moved.worker != target) == (200, True)
        assert worker.process.poll() is None  # still streaming
        for line in lines:
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
            elif line == "data: [DONE]":
                ready_after.append(time.monotonic() - signalled)
    assert (finish, len(ready_after)) == ("length", 1)
    assert worker.process.wait(30) == 0
    assert "drained after" in worker.log_tail()
    with cluster.http() as http:
        assert transcript(http, "drain-0")[2:] == [("user", "a long one"), ("assistant", text)]
    print(f"NOLB after {nolb_s:.2f} s; stream done {ready_after[0]:.2f} s after SIGTERM")


def test_the_shipped_router_config_is_valid(tmp_path):
    haproxy = shutil.which("haproxy") or router_missing("haproxy is not installed")
    made = tmp_path / "haproxy.cfg"
    made.write_text(router_config(3, log_requests=True))
    workers = {f"AGENTKV_WORKER{n}": f"127.0.0.1:{8000 + n}" for n in (1, 2, 3)}
    for path, env in ((CONFIG, {}), (made, workers)):  # as shipped (its defaults); for tests
        command = [haproxy, "-c", "-f", str(path)]
        done = subprocess.run(command, env={"PATH": os.environ["PATH"], **env}, capture_output=True)
        assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


# ---- one worker, no router ---------------------------------------------------------------------


def test_health_routes_need_no_key_and_every_response_names_the_worker(tmp_path):
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path, worker_id="w-7")
    with serve_in_thread(config, api_key="sk-k") as url, httpx.Client(base_url=url) as http:
        ready = http.get("/ready")
        assert (ready.status_code, ready.json()) == (
            200,
            {"status": "ready", "worker": "w-7", "model": MODEL},
        )
        assert http.get("/live").json() == {"status": "live", "worker": "w-7"}
        assert http.get("/metrics").status_code == 401
        assert http.get("/ready", headers={"host": "elsewhere.example"}).status_code == 200
        assert http.get("/v1/models", headers={"host": "elsewhere.example"}).status_code == 421
        assert http.get("/ready?draining=200").status_code == 400
        for response in (
            ready,
            http.get("/metrics"),
            http.get("/nowhere", headers={"x-api-key": "sk-k"}),
            http.get("/v1/models", headers={"host": "elsewhere.example"}),
        ):
            assert response.headers[WORKER_HEADER] == "w-7"
        key = {"x-api-key": "sk-k", "x-agent-id": "solo"}
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        sources = [
            http.post("/v1/messages", json=body, headers=key).headers[CACHE_SOURCE]
            for _ in range(2)
        ]
        assert sources == ["none", "hot"]


def test_cli_scaleout_flags(tmp_path, capsys):
    def parse(*flags: str):
        return build_parser().parse_args(["serve", "--model", MODEL, *flags])

    defaults = parse()
    assert (defaults.db_url, defaults.cache_dir, defaults.worker_id) == (None, None, None)
    assert (defaults.lease_s, defaults.drain_grace_s) == (None, 0.0)
    given = parse(
        *("--db-url", "postgresql+asyncpg://agentkv@db/agentkv", "--cache-dir", "/mnt/caches"),
        *("--worker-id", "node-1.a:2", "--lease-s", "2.5", "--drain-grace-s", "2"),
    )
    assert (given.db_url, given.cache_dir) == (
        "postgresql+asyncpg://agentkv@db/agentkv",
        "/mnt/caches",
    )
    assert (given.worker_id, given.lease_s, given.drain_grace_s) == ("node-1.a:2", 2.5, 2.0)
    for flag, value in [
        ("--worker-id", "two words"),
        ("--worker-id", "-leading-dash"),
        ("--worker-id", "x" * 65),
        ("--lease-s", "0.5"),
        ("--lease-s", "soon"),
        ("--drain-grace-s", "-1"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--model", MODEL, flag, value])
        assert exited.value.code == 2
        assert f"argument {flag}" in capsys.readouterr().err
    data = tmp_path / "data"
    args = ["serve", "--model", MODEL, "--data-dir", str(data), "--port", "0"]
    assert main([*args, "--db-url", "mysql://agentkv@db/agentkv"]) == 2
    assert "unsupported database URL" in capsys.readouterr().err


def test_racing_first_turns_with_clients_leaving_lose_nothing_over_http(cluster: Cluster) -> None:
    """The soak of ``benchmarks.bench_soak``, small: first turns of new agents sent to both
    workers at once, turns of shared agents to either, a third of the clients leaving early.
    Every acknowledged turn is stored once, after its message; no 500, no wrong 404."""
    urls = {worker.id: worker.url for worker in cluster.workers}
    tally, checked = asyncio.run(bench_soak.soak(urls, 16, 24, 0.3, seed=7))
    assert checked == {"lost": 0, "duplicated": 0, "misplaced": 0}
    assert [s for s in tally.sent if s.status is not None and s.status >= 500] == []
    assert [s for s in tally.sent if s.status == 404] == []
    assert sum(s.reply is not None for s in tally.sent) >= 16
