"""The cache writer thread: ordering, per-key coalescing, failures, flush and close."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from store.cache_files import CacheFileInfo, read_cache_file
from store.errors import CacheWriterClosedError, StoreError
from store.writer import THREAD_NAME, CacheWriter, JobFuture, WriterStats

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
def writer(tmp_path: Path) -> Iterator[CacheWriter]:
    writer = CacheWriter(tmp_path / "caches")
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
    writer.flush().result(TIMEOUT)
    assert ran == [f"j{i}" for i in range(50)]
    assert [future.result() for future in futures] == ran


def test_a_waiting_job_is_replaced_by_a_newer_one_for_its_key(
    writer: CacheWriter, gate: Gate
) -> None:
    ran: list[str] = []
    job = recorder(ran)
    first = writer.submit("a", job("a1"))
    second = writer.submit("a", job("a2"))

    assert (first.done(), first.result(), first.skipped) == (True, None, True)
    assert writer.stats == WriterStats(num_run=0, num_failed=0, num_skipped=1, queue_depth=1)
    gate.open()
    assert second.result(TIMEOUT) == "a2"
    assert second.skipped is False
    writer.flush().result(TIMEOUT)
    assert ran == ["a2"]
    assert writer.stats == WriterStats(num_run=2, num_failed=0, num_skipped=1, queue_depth=0)


def test_the_replacement_keeps_the_older_slot(writer: CacheWriter, gate: Gate) -> None:
    ran: list[str] = []
    job = recorder(ran)
    writer.submit("a", job("a1"))
    writer.submit("b", job("b1"))
    writer.submit("a", job("a2"))
    writer.submit("c", job("c1"))
    gate.open()
    writer.flush().result(TIMEOUT)
    assert ran == ["a2", "b1", "c1"]


def test_different_keys_never_coalesce(writer: CacheWriter, gate: Gate) -> None:
    ran: list[str] = []
    job = recorder(ran)
    futures = [writer.submit(key, job(key)) for key in ("a", "b", "c", "A", "a ")]
    assert writer.stats.queue_depth == 5
    gate.open()
    assert [future.result(TIMEOUT) for future in futures] == ["a", "b", "c", "A", "a "]
    assert not any(future.skipped for future in futures)
    assert writer.stats.num_skipped == 0


def test_a_started_job_is_not_replaced(writer: CacheWriter) -> None:
    ran: list[str] = []
    gate = Gate()
    running = writer.submit("a", gate)
    assert gate.started.wait(TIMEOUT)
    newer = writer.submit("a", recorder(ran)("a2"))
    gate.open()
    assert (running.result(TIMEOUT), newer.result(TIMEOUT)) == ("gate", "a2")
    assert writer.stats.num_skipped == 0


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
    assert writer.stats == WriterStats(num_run=2, num_failed=1, num_skipped=0, queue_depth=0)
    assert writer.stats.num_succeeded == 1
    assert writer._thread.is_alive()


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
    writer.flush().result(TIMEOUT)

    for key in keys:
        seqs = [seq for k, seq in ran if k == key]
        assert seqs == sorted(seqs) and seqs[-1] == 199, key
    skipped = {item for item, future in futures.items() if future.skipped}
    assert skipped.isdisjoint(ran) and len(skipped) + len(ran) == 800
    assert all(futures[item].result(0) == item for item in ran)
    stats = writer.stats
    assert (stats.num_run, stats.num_skipped, stats.queue_depth) == (len(ran), len(skipped), 0)


def test_flush_waits_for_its_key_only(writer: CacheWriter, gate: Gate) -> None:
    assert writer.flush("a").done()  # nothing for "a", even though the thread is busy
    assert not writer.flush("gate").done()
    assert not writer.flush().done()

    ran: list[str] = []
    job = recorder(ran)
    stale = writer.submit("a", job("a1"))
    flushed = writer.flush("a")
    newer = writer.submit("a", job("a2"))
    # The job flush waited for was replaced; flush now waits for its replacement.
    assert stale.done() and not flushed.done()
    gate.open()
    flushed.result(TIMEOUT)
    assert newer.done() and ran == ["a2"]


def test_flush_of_everything_covers_earlier_jobs(writer: CacheWriter, gate: Gate) -> None:
    ran: list[str] = []
    job = recorder(ran)
    for name in ("a", "b", "c"):
        writer.submit(name, job(name))
    flushed = writer.flush()
    gate.open()
    flushed.result(TIMEOUT)
    assert ran == ["a", "b", "c"]
    assert writer.flush().done()


def test_close_drains_the_queue_and_refuses_new_jobs(tmp_path: Path) -> None:
    writer = CacheWriter(tmp_path)
    gate = Gate()
    writer.submit("gate", gate)
    assert gate.started.wait(TIMEOUT)
    ran: list[str] = []
    futures = [writer.submit(f"k{i}", recorder(ran)(f"j{i}")) for i in range(5)]
    closer = threading.Thread(target=writer.close)
    closer.start()
    deadline = time.monotonic() + TIMEOUT
    while not writer.is_closed and time.monotonic() < deadline:
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
    assert writer.flush().done()


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
    assert writer.stats.num_skipped == 1


def test_the_thread_is_a_named_daemon(writer: CacheWriter) -> None:
    assert writer._thread.name == THREAD_NAME
    assert writer._thread.daemon


def test_write_puts_only_the_newest_file_on_disk(writer: CacheWriter, gate: Gate) -> None:
    old = {"k": np.zeros(4, np.float32)}
    new = {"k": np.ones(4, np.float32)}
    superseded = writer.write("agent", "agent/1.safetensors", old, {"turn": "1"})
    latest = writer.write("agent", "agent/2.safetensors", new, {"turn": "2"})
    gate.open()
    info = latest.result(TIMEOUT)

    assert superseded.result(0) is None and superseded.skipped
    assert isinstance(info, CacheFileInfo)
    assert info.path == writer.root / "agent" / "2.safetensors"
    assert sorted(p.name for p in (writer.root / "agent").iterdir()) == ["2.safetensors"]
    loaded = read_cache_file(info.path, expected_checksum=info.checksum)
    assert loaded.metadata == {"turn": "2"}
    assert loaded.tensors["k"].tobytes() == new["k"].tobytes()


@pytest.mark.parametrize("bad", ["", ".", "/abs/x.safetensors", "a/../../x.safetensors"])
def test_write_refuses_paths_outside_the_root(writer: CacheWriter, bad: str) -> None:
    with pytest.raises(ValueError, match="relative_path"):
        writer.write("a", bad, {"k": np.zeros(1)}, {})
    assert writer.stats.queue_depth == 0


async def test_asyncio_callers_await_without_blocking(tmp_path: Path) -> None:
    writer = CacheWriter(tmp_path)
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
    await writer.aflush()
    assert await asyncio.wrap_future(result) == 42
    assert await asyncio.wrap_future(started) is True
    await ticker
    assert ticks > 1  # the loop kept running while the writer was busy
    await writer.aclose()
    assert writer.is_closed and not writer._thread.is_alive()
