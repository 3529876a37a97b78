"""The cache writer: one background thread that runs disk jobs in order, coalescing per key.

The asyncio side must never block on disk, and the generation thread must not either, so both
hand cache writes to a :class:`CacheWriter` and get a ``concurrent.futures.Future`` back. Jobs
touch plain bytes and numpy only, never MLX (MLX belongs to the generation thread).

Ordering: jobs run one at a time in submission order. Coalescing: a job submitted for a ``key``
that still has a job waiting (not started) replaces that job *in its queue slot*; the stale
job's future resolves to ``None`` with ``skipped`` set. Keeping the slot, rather than moving to
the end, means a key that is updated faster than the disk keeps its place and is not starved.
Per-key order is preserved either way: a job never runs before one submitted earlier for its key.

From asyncio, await a job with ``await asyncio.wrap_future(future)`` and close the writer with
``await asyncio.to_thread(writer.close)``, so the event loop keeps running while jobs drain.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from agentkv.store.errors import CacheWriterClosedError

T = TypeVar("T")
THREAD_NAME = "agentkv-cache-writer"


class JobFuture(Future[T], Generic[T]):
    """The future of one writer job; ``skipped`` tells a superseded job from one returning None."""

    def __init__(self) -> None:
        super().__init__()
        self._skipped = False

    @property
    def skipped(self) -> bool:
        """True if a newer job for the same key replaced this one before it started."""
        return self._skipped

    def _skip(self) -> None:
        if self.set_running_or_notify_cancel():  # False if the caller cancelled it already
            self._skipped = True
            self.set_result(None)  # type: ignore[arg-type]  # submit() returns JobFuture[T | None]


@dataclass(slots=True)
class _Slot:
    """A place in the queue; coalescing swaps its job and future, never its position."""

    key: str
    job: Callable[[], Any]
    future: JobFuture[Any]


class CacheWriter:
    """Runs disk jobs on one daemon thread, ``agentkv-cache-writer``; see the module docstring."""

    def __init__(self) -> None:
        """Start the writer thread."""
        self._lock = threading.Condition()
        self._queue: collections.deque[_Slot] = collections.deque()
        self._waiting: dict[str, _Slot] = {}  # key -> its slot that has not started
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def submit(self, key: str, job: Callable[[], T]) -> JobFuture[T | None]:
        """Queue ``job`` to run on the writer thread, replacing a waiting job for ``key``.

        Returns:
            A future with the job's result or exception, or ``None`` with ``skipped`` set if a
            newer job for ``key`` replaced this one before it started.

        Raises:
            CacheWriterClosedError: ``close()`` was called.
        """
        if not callable(job):
            raise TypeError(f"job must be callable, got {type(job).__name__}")
        future: JobFuture[T | None] = JobFuture()
        with self._lock:
            if self._closing:
                raise CacheWriterClosedError(f"cache writer is closed; job for {key!r} not queued")
            slot = self._waiting.get(key)
            if slot is None:
                slot = _Slot(key, job, future)
                self._waiting[key] = slot
                self._queue.append(slot)
                self._lock.notify()
                return future
            stale, slot.job, slot.future = slot.future, job, future
        stale._skip()  # outside the lock: it runs the stale future's callbacks
        return future

    def close(self) -> None:
        """Refuse new jobs, finish the queued ones, and join the thread. Idempotent."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("CacheWriter.close() called from a writer job would wait on itself")
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if not self._queue:  # closing, and drained
                    return
                slot = self._queue.popleft()
                del self._waiting[slot.key]
            self._run(slot)

    def _run(self, slot: _Slot) -> None:
        future = slot.future
        if not future.set_running_or_notify_cancel():  # cancelled by the caller while waiting
            return
        try:
            result = slot.job()
        except BaseException as exc:  # delivered to the caller; the thread must keep going
            future.set_exception(exc)
        else:
            future.set_result(result)
