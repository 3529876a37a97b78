"""The cache writer thread: ordering, per-key coalescing, failures and close."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from agentkv.store.errors import CacheWriterClosedError, StoreError
from agentkv.store.writer import THREAD_NAME, CacheWriter, JobFuture

TIMEOUT = 10  # seconds; only reached when a test is about to fail


class Gate:
    """A job that holds the writer thread until ``open()``; ``started`` is set once it runs."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.release.wait(TIMEOUT)
        return "gate"

    def open(self) -> None:
        self.release.set()


@pytest.fixture
def writer() -> Iterator[CacheWriter]:
    writer = CacheWriter()
    yield writer
    writer.close()


@pytest.fixture
def gate(writer: CacheWriter) -> Iterator[Gate]:
    """The writer thread, busy with a job under key "gate" until the test opens it."""
    gate = Gate()
    writer.submit("gate", gate)
    assert gate.started.wait(TIMEOUT)
    yield gate
    gate.open()


def recorder(ran: list[str]) -> Callable[[str], Callable[[], str]]:
    def job(name: str) -> Callable[[], str]:
        def run() -> str:
            ran.append(name)
            return name

        return run

    return job


def test_jobs_run_in_submission_order(writer: CacheWriter) -> None:
    ran: list[str] = []
    job = recorder(ran)
    futures = [writer.submit(f"k{i}", job(f"j{i}")) for i in range(50)]
    futures[-1].result(TIMEOUT)  # jobs run in order: the last one done means all are
    assert ran == [f"j{i}" for i in range(50)]
    assert [future.result(0) for future in futures] == ran


def test_a_waiting_job_is_replaced_by_a_newer_one_for_its_key(
    writer: CacheWriter, gate: Gate
) -> None:
    ran: list[str] = []
    job = recorder(ran)
    first = writer.submit("a", job("a1"))
    second = writer.submit("a", job("a2"))

    assert (first.done(), first.result(), first.skipped) == (True, None, True)
    assert [slot.future for slot in writer._queue] == [second]  # one slot, the newer job in it
    gate.open()
    assert second.result(TIMEOUT) == "a2"
    assert second.skipped is False
    assert ran == ["a2"]
    assert len(writer._queue) == 0


def test_the_replacement_keeps_the_older_slot(writer: CacheWriter, gate: Gate) -> None:
    ran: list[str] = []
    job = recorder(ran)
    writer.submit("a", job("a1"))
    writer.submit("b", job("b1"))
    writer.submit("a", job("a2"))
    last = writer.submit("c", job("c1"))
    gate.open()
    assert last.result(TIMEOUT) == "c1"
    assert ran == ["a2", "b1", "c1"]


def test_different_keys_never_coalesce(writer: CacheWriter, gate: Gate) -> None:
    ran: list[str] = []
    job = recorder(ran)
    futures = [writer.submit(key, job(key)) for key in ("a", "b", "c", "A", "a ")]
    assert len(writer._queue) == 5
    gate.open()
    assert [future.result(TIMEOUT) for future in futures] == ["a", "b", "c", "A", "a "]
    assert not any(future.skipped for future in futures)
    assert ran == ["a", "b", "c", "A", "a "]


def test_a_started_job_is_not_replaced(writer: CacheWriter) -> None:
    ran: list[str] = []
    gate = Gate()
    running = writer.submit("a", gate)
    assert gate.started.wait(TIMEOUT)
    newer = writer.submit("a", recorder(ran)("a2"))
    gate.open()
    assert (running.result(TIMEOUT), newer.result(TIMEOUT)) == ("gate", "a2")
    assert (running.skipped, newer.skipped) == (False, False)
    assert ran == ["a2"]


def test_a_failing_job_gets_its_exception_and_the_thread_survives(writer: CacheWriter) -> None:
    def boom() -> None:
        raise OSError(28, "No space left on device")

    failed = writer.submit("a", boom)
    after = writer.submit("b", lambda: "still running")
    assert after.result(TIMEOUT) == "still running"
    error = failed.exception(TIMEOUT)
    assert isinstance(error, OSError) and error.errno == 28
    with pytest.raises(OSError, match="No space left"):
        failed.result()
    assert (failed.skipped, after.skipped) == (False, False)
    assert writer._thread.is_alive()
    assert writer.submit("c", lambda: "and after").result(TIMEOUT) == "and after"


def test_concurrent_submitters_keep_per_key_order_and_the_last_job(writer: CacheWriter) -> None:
    ran: list[tuple[str, int]] = []
    futures: dict[tuple[str, int], JobFuture[tuple[str, int] | None]] = {}
    keys = [f"agent-{i}" for i in range(4)]

    def submitter(key: str) -> None:
        for seq in range(200):
            item = (key, seq)
            futures[item] = writer.submit(key, lambda item=item: ran.append(item) or item)

    threads = [threading.Thread(target=submitter, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)
    # A key's last job is never replaced, and every job of a key runs or is skipped before it.
    for key in keys:
        futures[key, 199].result(TIMEOUT)

    for key in keys:
        seqs = [seq for k, seq in ran if k == key]
        assert seqs == sorted(seqs) and seqs[-1] == 199, key
    skipped = {item for item, future in futures.items() if future.skipped}
    assert skipped.isdisjoint(ran) and len(skipped) + len(ran) == 800
    assert all(futures[item].result(0) == item for item in ran)
    assert len(futures) == 800 and all(future.done() for future in futures.values())
    assert all(futures[item].result(0) is None for item in skipped)
    assert len(writer._queue) == 0


def test_close_drains_the_queue_and_refuses_new_jobs() -> None:
    writer = CacheWriter()
    gate = Gate()
    writer.submit("gate", gate)
    assert gate.started.wait(TIMEOUT)
    ran: list[str] = []
    futures = [writer.submit(f"k{i}", recorder(ran)(f"j{i}")) for i in range(5)]
    closer = threading.Thread(target=writer.close)
    closer.start()
    deadline = time.monotonic() + TIMEOUT
    while not writer._closing and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(CacheWriterClosedError, match="closed") as info:
        writer.submit("late", lambda: None)
    assert isinstance(info.value, StoreError) and isinstance(info.value, RuntimeError)

    gate.open()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert ran == [f"j{i}" for i in range(5)]
    assert [future.result(0) for future in futures] == ran
    assert not writer._thread.is_alive()
    writer.close()  # idempotent
    with pytest.raises(CacheWriterClosedError):
        writer.submit("later", lambda: None)


def test_close_from_a_job_is_refused(writer: CacheWriter) -> None:
    future = writer.submit("a", writer.close)
    with pytest.raises(RuntimeError, match="wait on itself"):
        future.result(TIMEOUT)


def test_a_cancelled_job_does_not_run(writer: CacheWriter, gate: Gate) -> None:
    ran: list[str] = []
    cancelled = writer.submit("a", recorder(ran)("a"))
    assert cancelled.cancel()
    kept = writer.submit("b", recorder(ran)("b"))
    gate.open()
    assert kept.result(TIMEOUT) == "b"
    assert ran == ["b"]
    assert cancelled.cancelled() and not cancelled.skipped


def test_the_thread_is_a_named_daemon(writer: CacheWriter) -> None:
    assert writer._thread.name == THREAD_NAME
    assert writer._thread.daemon


async def test_asyncio_callers_await_without_blocking() -> None:
    writer = CacheWriter()
    release = threading.Event()
    started = writer.submit("slow", lambda: release.wait(TIMEOUT))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while not release.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    ticker = asyncio.create_task(tick())
    result = writer.submit("fast", lambda: 42)
    asyncio.get_running_loop().call_later(0.05, release.set)
    assert await asyncio.wrap_future(result) == 42
    assert started.done() and started.result(0) is True
    await ticker
    assert ticks > 1  # the loop kept running while the writer was busy
    await asyncio.to_thread(writer.close)
    assert not writer._thread.is_alive()
