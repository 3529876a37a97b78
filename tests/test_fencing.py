"""Workers sharing one registry and one cache directory: each agent's turns run on one worker at
a time (its lease), a stale writer stores nothing (the agent's version), and a worker never
resumes from a copy in memory another worker has moved past.

Two runtimes in one process stand for two workers: each has its own engine, hot tier, locks
and leases, and they share only the database (SQLite and PostgreSQL) and the directory, as
separate machines would.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from agentkv import AgentChangedError, AgentRuntime, RuntimeConfig, TextDelta
from agentkv.leases import Leases, WorkerClaim
from agentkv.store import AgentNotFoundError, NewMessage, Registry
from agentkv.store.models import AgentLease, utcnow

MODEL = "tiny:gemma3"


def worker(tmp_path: Path, db_url: str, name: str, **kw) -> RuntimeConfig:
    return RuntimeConfig(
        model=MODEL,
        data_dir=tmp_path / name,
        db_url=db_url,
        cache_dir=tmp_path / "shared-caches",
        worker_id=name,
        **kw,
    )


@pytest.fixture
def db_url(registry_url: str) -> str:
    """The shared registry: a SQLite file, or a PostgreSQL database (``registry_url``)."""
    return registry_url


async def leases(rt: AgentRuntime) -> list[AgentLease]:
    async with rt._registry._db.read() as session:  # the rows as stored
        return list(await session.scalars(select(AgentLease)))


async def test_a_turn_from_a_stale_version_stores_nothing(db_url: str) -> None:
    async with await Registry.open(db_url) as registry:
        agent = await registry.create_agent("a")
        assert agent.version == 0
        await registry.append_messages("a", [NewMessage("user", "hi")], expected_version=0)
        assert (await registry.get_agent("a")).version == 1
        with pytest.raises(AgentChangedError, match=r"version 1, the turn read 0"):
            await registry.append_messages("a", [NewMessage("user", "late")], expected_version=0)
        assert [m.content for m in await registry.transcript("a")] == ["hi"]
        await registry.append_messages("a", [NewMessage("assistant", "hello")])  # unchecked
        assert (await registry.get_agent("a")).version == 2


async def test_a_lease_excludes_other_holders_until_released_or_expired(db_url: str) -> None:
    async with await Registry.open(db_url) as registry:
        await registry.create_agent("a")
        leases = registry.leases
        first = await leases.acquire("a", "w1#1", "w1", 30)
        assert first is not None and first.token == 1 and first.worker_id == "w1"
        assert await leases.acquire("a", "w2#1", "w2", 30) is None
        again = await leases.acquire("a", "w1#1", "w1", 30)  # its own: taken again
        assert again is not None and again.token == 2
        assert not await leases.release("a", "w1#1", first.token)  # an earlier hold's release
        assert (await leases.get(["a"]))["a"].holder == "w1#1"
        assert await leases.release("a", "w1#1", again.token)
        assert await leases.get(["a"]) == {}
        taken = await leases.acquire("a", "w2#1", "w2", 0)  # expires at once: a dead worker
        assert taken is not None
        assert await leases.get(["a"]) == {}  # expired: not held
        assert await leases.renew("w2#1", 30, ["a"]) == {"a"}  # not taken meanwhile: renewed
        assert await leases.acquire("a", "w1#1", "w1", 30) is None
        await registry.leases.acquire("a", "w2#1", "w2", 0)
        assert await leases.acquire("a", "w1#1", "w1", 30) is not None  # expired: taken over
        assert await leases.renew("w2#1", 30, ["a"]) == set()  # the old holder learns it lost it
        assert await leases.release_all("w1#1") == 1
        with pytest.raises(AgentNotFoundError):
            await leases.acquire("nobody", "w1#1", "w1", 30)
        await leases.acquire("a", "w1#1", "w1", 30)
        await registry.delete_agent("a")  # the lease goes with the agent
        assert await leases.get(["a"]) == {}


async def test_two_workers_hammering_one_agent_take_turns(tmp_path: Path, db_url: str) -> None:
    async with (
        await AgentRuntime.open(worker(tmp_path, db_url, "w1")) as one,
        await AgentRuntime.open(worker(tmp_path, db_url, "w2")) as two,
    ):
        await one.create_agent("shared", system_prompt="Be brief.")

        async def turns(rt: AgentRuntime, name: str) -> list[tuple[str, str]]:
            sent = []
            for i in range(5):
                message = f"{name} asks question {i}"
                reply = await rt.chat("shared", message, max_tokens=6)
                sent.append((message, reply.text))
            return sent

        sent = await asyncio.gather(turns(one, "w1"), turns(two, "w2"))
        transcript = await one.transcript("shared")
        pairs = [
            (u.content, a.content) for u, a in zip(transcript[::2], transcript[1::2], strict=True)
        ]
        assert len(transcript) == 20 and [m.role for m in transcript] == ["user", "assistant"] * 10
        # Every turn once, its reply right after its message, each worker's in its order.
        assert sorted(pairs) == sorted(sent[0] + sent[1])
        for mine in sent:
            assert [p for p in pairs if p in mine] == mine
        assert one.leases.waits + two.leases.waits > 0  # they did contend
        for rt in (one, two):
            await rt.flush()
            await rt.leases.settled()
        assert one.stats()["leases"]["held"] == two.stats()["leases"]["held"] == 0
        assert await leases(one) == []  # given back once the saves landed


async def test_a_worker_resumes_from_disk_after_another_advanced_the_agent(
    tmp_path: Path, db_url: str
) -> None:
    async with (
        await AgentRuntime.open(worker(tmp_path, db_url, "w1")) as one,
        await AgentRuntime.open(worker(tmp_path, db_url, "w2")) as two,
    ):
        await one.create_agent("a", system_prompt="Be brief.")
        first = await one.chat("a", "Hello there", max_tokens=6)
        assert (await one.chat("a", "And again", max_tokens=6)).cache_source == "hot"
        moved = await two.chat("a", "A turn on the other worker", max_tokens=6)
        assert moved.cache_source == "disk"  # w1's save had landed: w1 held the lease till then
        back = await one.chat("a", "Back on the first", max_tokens=6)
        # w1's copy in memory predates w2's turn: not resumed; w2's cache on disk covers it.
        assert back.cache_source == "disk"
        assert back.usage.cached_tokens == moved.usage.prompt_tokens + len(moved.token_ids)
        assert first.usage.cached_tokens == 0
        texts = [m.content for m in await one.transcript("a")]
        assert texts[4:] == [
            "A turn on the other worker",
            moved.text,
            "Back on the first",
            back.text,
        ]


async def test_a_worker_whose_lease_was_taken_stores_nothing(tmp_path: Path, db_url: str) -> None:
    """A worker that lost its lease mid-turn (it stalled past the lease time) cannot append:
    the other worker's turn is stored, the late one is refused, nothing interleaves."""
    config = {"lease_s": 60.0}  # no renewal during the test: the lease is taken by hand
    async with (
        await AgentRuntime.open(worker(tmp_path, db_url, "w1", **config)) as one,
        await AgentRuntime.open(worker(tmp_path, db_url, "w2", **config)) as two,
    ):
        await one.create_agent("a")
        stream = one.stream("a", "The slow turn", max_tokens=12)
        assert isinstance(await anext(stream), TextDelta)  # w1 holds the lease, mid-turn
        async with one._registry._db.write() as session:  # w1 stalled: expired
            await session.execute(update(AgentLease).values(expires_at=utcnow() - timedelta(1)))
        fast = await two.chat("a", "The other worker's turn", max_tokens=6)
        with pytest.raises(AgentChangedError, match="'a' changed while this turn ran"):
            async for _ in stream:
                pass
        texts = [m.content for m in await one.transcript("a")]
        assert texts == ["The other worker's turn", fast.text]
        after = await one.chat("a", "Back on the first", max_tokens=6)  # w1 takes it again
        assert after.cache_source == "disk"
        assert len(await one.transcript("a")) == 4


async def test_a_dead_workers_lease_expires(tmp_path: Path, db_url: str) -> None:
    async with await AgentRuntime.open(worker(tmp_path, db_url, "w1")) as rt:
        await rt.create_agent("a")
        dead = await rt._registry.leases.acquire("a", "w0#dead", "w0", 1.5)
        assert dead is not None
        started = time.monotonic()
        reply = await rt.chat("a", "Anyone there?", max_tokens=4)
        waited = time.monotonic() - started
        assert waited >= 1.0, waited  # it waited for the lease to expire
        assert rt.leases.waits == 1 and reply.text
        await rt.flush()
    async with await Registry.open(db_url) as registry:
        assert await registry.leases.get(["a"]) == {}  # closing gave every lease back


async def test_a_lease_lost_at_a_renewal_is_taken_again(db_url: str) -> None:
    """A worker that renewed too late and lost an agent it still holds (a save of it pending)
    notices at its next renewal, once, and takes the lease again before it next runs it."""
    async with await Registry.open(db_url) as registry:
        await registry.create_agent("a")
        mine = Leases(registry.leases, WorkerClaim("w1", None), 0.9)
        await mine.hold("a")
        mine.hold_more("a")  # the turn's save
        mine.drop("a")  # the turn is over; the save is not
        async with registry._db.write() as session:  # w1 stalled: its lease expired
            await session.execute(update(AgentLease).values(expires_at=utcnow() - timedelta(1)))
        theirs = await registry.leases.acquire("a", "w2#1", "w2", 30)
        assert theirs is not None
        await asyncio.sleep(0.6)  # a renewal (every 0.3 s) finds it taken
        assert mine.lost == 1 and mine.held == 1
        await asyncio.sleep(0.4)
        assert mine.lost == 1  # counted once
        holding = asyncio.create_task(mine.hold("a"))  # w1's next turn: waits for w2
        await asyncio.sleep(0.2)
        assert not holding.done() and mine.waits == 1
        await registry.leases.release("a", "w2#1", theirs.token)
        await holding
        assert (await registry.leases.get(["a"]))["a"].holder == mine.holder
        mine.drop("a")
        mine.drop("a")  # the old save lands too: given back
        await mine.settled()
        assert await registry.leases.get(["a"]) == {}
        await mine.close()


def test_the_sweep_grace_defaults_to_the_janitors() -> None:
    from agentkv.caches.janitor import SWEEP_GRACE_S

    assert RuntimeConfig(model=MODEL).sweep_grace_s == SWEEP_GRACE_S
