"""Nothing acknowledged is lost, across workers too: racing first turns of create-on-first-use
agents with clients that go away, a restarted worker taking its leases back at once, a lease
taken during a renewal, a runtime opening on a full disk, internal markers in user text.

Two runtimes in one process stand for two workers (as in ``test_fencing``): each has its own
engine, leases and request resolver (``agentkv.server.identity``), and they share the registry
(SQLite and PostgreSQL) and the cache directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from agentkv import AgentRuntime, RegistryStorageError, Reply, RuntimeConfig, WorkerIdInUseError
from agentkv.leases import Leases, WorkerClaim
from agentkv.server.conversation import TurnRequest
from agentkv.server.identity import Identity
from agentkv.server.metrics import ServerMetrics
from agentkv.server.state import ModelInfo, ServerState
from agentkv.server.turns import TurnStream, run_turn
from agentkv.store import Registry

MODEL = "tiny:gemma3"


def worker(tmp_path: Path, db_url: str, name: str | None, **kw) -> RuntimeConfig:
    return RuntimeConfig(
        model=MODEL,
        data_dir=tmp_path / (name or "default"),
        db_url=db_url,
        cache_dir=tmp_path / "shared-caches",
        worker_id=name,
        **kw,
    )


@asynccontextmanager
async def serving(config: RuntimeConfig) -> AsyncIterator[ServerState]:
    async with await AgentRuntime.open(config) as rt:
        identity = Identity(rt, None)
        await identity.load()
        yield ServerState(rt, identity, ServerMetrics(), ModelInfo.of(rt))


class Outcome:
    """What a client saw of one request: its reply (acknowledged) or the error."""

    def __init__(self) -> None:
        self.reply: Reply | None = None
        self.error: BaseException | None = None


async def streamed(state: ServerState, request: TurnRequest, leave_early: bool) -> Outcome:
    """A streaming request; ``leave_early``: the client goes after the first piece."""
    outcome = Outcome()
    try:
        turn = await TurnStream(state, request).start()
        try:
            async for event in turn.events():
                if leave_early:
                    break
                if isinstance(event, Reply):
                    outcome.reply = event
        finally:
            await turn.aclose()
    except Exception as exc:
        outcome.error = exc
    return outcome


async def whole(state: ServerState, request: TurnRequest) -> Outcome:
    """A request answered whole (the server's ``run_turn`` without HTTP)."""
    outcome = Outcome()
    try:
        outcome.reply = await run_turn(state, request, _Connected())  # type: ignore[arg-type]
    except Exception as exc:
        outcome.error = exc
    return outcome


class _Connected:
    """An HTTP request whose client stays."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {}


def ask(agent_id: str, text: str) -> TurnRequest:
    return TurnRequest(agent_id, "Be brief.", [], text, max_tokens=3)


@pytest.fixture
def db_url(registry_url: str) -> str:
    return registry_url


async def test_racing_first_turns_across_two_workers_lose_nothing(
    tmp_path: Path, db_url: str
) -> None:
    """Each agent's first turn arrives at both workers at once, on an id neither has seen;
    one client of each pair leaves after its first piece (its worker created the agent, say,
    and discards it), some turns are answered whole. Every acknowledged turn is stored
    exactly once, in order, and no request is told its agent does not exist."""
    rng = random.Random(53)
    async with (
        serving(worker(tmp_path, db_url, "w1")) as one,
        serving(worker(tmp_path, db_url, "w2")) as two,
    ):
        outcomes: list[tuple[str, str, Outcome]] = []

        async def race(i: int) -> None:
            agent_id, states = f"race-{i}", [one, two]
            rng.shuffle(states)
            sends = []
            for k, state in enumerate(states):
                text = f"turn {k} of agent {i}"
                if k == 0:
                    send = streamed(state, ask(agent_id, text), leave_early=rng.random() < 0.7)
                elif rng.random() < 0.5:
                    send = streamed(state, ask(agent_id, text), leave_early=False)
                else:
                    send = whole(state, ask(agent_id, text))
                sends.append((text, asyncio.ensure_future(send)))
                await asyncio.sleep(rng.choice([0, 0.005, 0.015]))
            for text, send in sends:
                outcomes.append((agent_id, text, await send))

        await asyncio.gather(*(race(i) for i in range(12)))
        errors = [o.error for _, _, o in outcomes if o.error is not None]
        assert not [e for e in errors if "no agent" in str(e)], errors  # never a wrong 404
        acknowledged = [(a, t, o.reply) for a, t, o in outcomes if o.reply is not None]
        assert len(acknowledged) >= 12  # every second request was read to its end
        for agent_id in {a for a, _, _ in acknowledged}:
            stored = [(m.role, m.content) for m in await one.runtime.transcript(agent_id)]
            mine = [(t, r) for a, t, r in acknowledged if a == agent_id]
            for text, reply in mine:
                assert stored.count(("user", text)) == 1, (agent_id, stored)
                at = stored.index(("user", text))
                assert stored[at + 1] == ("assistant", reply.text)
            # Nothing stored that nobody acknowledged, but a turn whose client left late.
            assert len(stored) <= 4


async def test_a_failed_first_turn_keeps_the_agent_another_worker_stored_a_turn_of(
    tmp_path: Path, db_url: str
) -> None:
    async with (
        serving(worker(tmp_path, db_url, "w1")) as one,
        serving(worker(tmp_path, db_url, "w2")) as two,
    ):
        first = await TurnStream(one, ask("kept", "the first, left early")).start()
        assert first._claim is not None and first._claim.created  # w1 created it
        second = asyncio.ensure_future(whole(two, ask("kept", "the second")))
        await asyncio.sleep(0.05)  # w2 found the agent and waits for its lease
        await first.aclose()  # the client leaves: w1 discards what it created, unless...
        outcome = await second
        assert outcome.error is None and outcome.reply is not None
        stored = [m.content for m in await one.runtime.transcript("kept")]
        assert stored == ["the second", outcome.reply.text]


async def test_a_restarted_worker_takes_its_leases_back_at_once(
    tmp_path: Path, db_url: str
) -> None:
    for name in ("w1", None):  # an explicit id, and the default one
        config = worker(tmp_path, db_url, name, lease_s=30.0)
        async with await AgentRuntime.open(config) as rt:
            me = rt.leases.worker_id
            agent = await rt.create_agent()
            await rt.chat(agent.id, "hello", max_tokens=2)
        if name is None:
            assert me.endswith("-0")  # the first free default id on its data directory
        async with await Registry.open(db_url) as registry:  # it was killed mid-turn
            dead = await registry.leases.acquire(agent.id, f"{me}#dead", me, 30)
            assert dead is not None
        async with await AgentRuntime.open(config) as rt:
            assert rt.leases.worker_id == me
            started = time.monotonic()
            await rt.chat(agent.id, "back again", max_tokens=2)
            assert time.monotonic() - started < 10 and rt.leases.waits == 0


async def test_a_worker_id_runs_in_one_process_at_a_time(tmp_path: Path) -> None:
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path, worker_id="w1")
    async with await AgentRuntime.open(config) as rt:
        with pytest.raises(WorkerIdInUseError, match="'w1' is in use"):
            await AgentRuntime.open(config)
        default = RuntimeConfig(model=MODEL, data_dir=tmp_path)
        async with await AgentRuntime.open(default) as a, await AgentRuntime.open(default) as b:
            assert (a.leases.worker_id[-2:], b.leases.worker_id[-2:]) == ("-0", "-1")
        # Another data directory sharing the registry: another name, though its first.
        other = RuntimeConfig(model=MODEL, data_dir=tmp_path / "b", db_url=default.database)
        async with await AgentRuntime.open(default) as a, await AgentRuntime.open(other) as b:
            assert a.leases.worker_id.endswith("-0") and b.leases.worker_id.endswith("-0")
            assert a.leases.worker_id != b.leases.worker_id
        assert rt.leases.worker_id == "w1"
    async with await AgentRuntime.open(config) as rt:  # given back at close
        assert rt.leases.worker_id == "w1"


async def test_a_lease_taken_during_a_renewal_is_not_reported_lost(db_url: str) -> None:
    """A hold that takes its lease while a renewal is under way: the renewal must neither
    give it back nor, at the next one, call it lost."""
    async with await Registry.open(db_url) as registry:
        await registry.create_agent("a")
        leases = Leases(registry.leases, WorkerClaim("w1", None), 0.9)
        index = registry.leases
        acquire, renewed = index.acquire, asyncio.Event()

        async def slow_acquire(*args, **kw):
            lease = await acquire(*args, **kw)
            renewed.clear()
            await renewed.wait()  # a renewal runs between taking the lease and recording it
            return lease

        renew = index.renew

        async def noted_renew(*args, **kw):
            still = await renew(*args, **kw)
            renewed.set()
            return still

        await registry.create_agent("b")
        index.renew = noted_renew  # type: ignore[method-assign]
        await leases.hold("b")  # starts the renewer (every 0.3 s)
        index.acquire = slow_acquire  # type: ignore[method-assign]
        await leases.hold("a")  # taken while a renewal runs
        index.acquire = acquire  # type: ignore[method-assign]
        assert (await registry.leases.get(["a"]))["a"].holder == leases.holder  # not given back
        await asyncio.sleep(1.0)  # three more renewals
        assert leases.lost == 0
        held = await registry.leases.get(["a", "b"])
        assert {k: v.holder for k, v in held.items()} == {"a": leases.holder, "b": leases.holder}
        await leases.close()


def _mount_small_disk(path: Path, megabytes: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
        capture_output=True,
    )
    return done.returncode == 0


async def test_the_runtime_opens_on_a_full_disk_and_recovers(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    if not _mount_small_disk(disk, 24):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        config = RuntimeConfig(model=MODEL, data_dir=disk, kv_bits=None)
        async with await AgentRuntime.open(config) as rt:
            agent = await rt.create_agent(system_prompt="Be brief.")
            first = await rt.chat(agent.id, "Remember the word AMBER.", max_tokens=4)
        filler = disk / "filler"

        def fill() -> None:  # to the last byte
            with open(filler, "ab") as f, pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()

        fill()
        async with await AgentRuntime.open(config) as rt:  # it gives its reserve up to open
            transcript = [m.content for m in await rt.transcript(agent.id)]
            assert transcript == ["Remember the word AMBER.", first.text]
            fill()  # and the reserve is gone too
            with pytest.raises(RegistryStorageError, match="SQLITE_FULL") as refused:
                await rt.chat(agent.id, "What was the word?", max_tokens=4)
            assert refused.value.is_full and "free disk space" in str(refused.value)
            assert [m.content for m in await rt.transcript(agent.id)] == transcript
            filler.unlink()  # space returns
            reply = await rt.chat(agent.id, "What was the word?", max_tokens=4)
            # The "auto" disk budget measured on a full disk is a quarter of what the caches
            # held: opening evicted them (freeing space), so the turn rebuilt its cache.
            assert rt.stats()["disk"]["evictions"] == 1 and reply.cache_source == "rebuilt"
            assert len(await rt.transcript(agent.id)) == 4
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


async def test_a_message_spelling_the_renderers_markers_is_only_text(tmp_path: Path) -> None:
    """Text a user sends can hold any characters, those of the markers the renderer cuts
    and splices with included: the next turns still resume their cache."""
    markers = (
        "\u27e6agentkv-cache-ends-here\u27e7 \U000f0000\U0010ffff \U000f0000 "
        "\u27e6agentkv-reply-0\u27e7 \U000f0000\U0010fffe"
    )
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path)
    async with await AgentRuntime.open(config) as rt:
        agent = await rt.create_agent(system_prompt="Be brief.")
        await rt.chat(agent.id, f"Say {markers} back.", max_tokens=4)
        again = await rt.chat(agent.id, "And once more.", max_tokens=4)
        assert again.cache_source == "hot" and again.usage.cached_tokens > 0
        messages = [
            {"role": "user", "content": f"Say {markers} back."},
            {"role": "assistant", "content": again.text},
        ]
        doc = await rt.create_agent()

        async def respond(conversation: list[dict]) -> Reply:
            events = [e async for e in rt.respond(doc.id, conversation, max_tokens=4)]
            assert isinstance(events[-1], Reply)
            return events[-1]

        first = await respond([messages[0]])
        second = await respond(
            [messages[0], {"role": "assistant", "content": first.text}, messages[0]]
        )
        assert second.cache_source == "hot"
        assert second.usage.cached_tokens >= first.usage.prompt_tokens + len(first.token_ids) - 1
    async with await AgentRuntime.open(config) as rt:
        after = await rt.chat(agent.id, "After the restart.", max_tokens=4)
        assert after.cache_source == "disk" and after.usage.cached_tokens > 0


def test_ctrl_c_stops_agentkv_serve_cleanly(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["serve", "--model", MODEL, "--data-dir", str(tmp_path), "--port", str(port)]
    process = subprocess.Popen(
        [sys.executable, "-m", "agentkv.server.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/live", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert "Application shutdown complete" in stderr  # the runtime closed, caches flushed
