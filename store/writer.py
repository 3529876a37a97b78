"""The cache writer: one background thread that runs disk jobs in order, coalescing per key.

The asyncio side must never block on disk, and the generation thread must not either, so both
hand cache writes to a :class:`CacheWriter` and get a ``concurrent.futures.Future`` back. Jobs
touch plain bytes and numpy only, never MLX (MLX belongs to the generation thread).

Ordering: jobs run one at a time in submission order. Coalescing: a job submitted for a ``key``
that still has a job waiting (not started) replaces that job *in its queue slot*; the stale
job's future resolves to ``None`` with ``skipped`` set. Keeping the slot, rather than moving to
the end, means a key that is updated faster than the disk keeps its place and is not starved.
Per-key order is preserved either way: a job never runs before one submitted earlier for its key.

From asyncio, await a future with ``await asyncio.wrap_future(future)``, or use :meth:`aflush`
and :meth:`aclose`.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import numpy as np

from store.cache_files import CacheFileInfo, write_cache_file
from store.errors import CacheWriterClosedError

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


@dataclass(frozen=True, slots=True)
class WriterStats:
    """A snapshot of a writer's counters.

    Attributes:
        num_run: Jobs that ran, whether they returned or raised.
        num_failed: Jobs that ran and raised.
        num_skipped: Jobs that never ran: superseded by a newer job for their key, or cancelled.
        queue_depth: Jobs waiting to run, not counting the one running.
    """

    num_run: int
    num_failed: int
    num_skipped: int
    queue_depth: int

    @property
    def num_succeeded(self) -> int:
        return self.num_run - self.num_failed


@dataclass(slots=True)
class _Slot:
    """A place in the queue; coalescing swaps its job and future, never its position."""

    key: str
    job: Callable[[], Any]
    future: JobFuture[Any]
    # Resolved once the slot's job has finished. Marked running so flush callers cannot cancel it.
    done: Future[None]


class CacheWriter:
    """Runs disk jobs on one daemon thread, ``agentkv-cache-writer``; see the module docstring."""

    def __init__(self, root: Path) -> None:
        """Start the writer thread.

        Args:
            root: The cache directory; :meth:`write` resolves relative paths against it.
        """
        self.root = Path(root)
        self._lock = threading.Condition()
        self._queue: collections.deque[_Slot] = collections.deque()
        self._waiting: dict[str, _Slot] = {}  # key -> its slot that has not started
        self._running: _Slot | None = None
        self._closing = False
        self._num_run = self._num_failed = self._num_skipped = 0
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
                raise CacheWriterClosedError(
                    f"cache writer for {self.root} is closed; job for {key!r} not queued"
                )
            slot = self._waiting.get(key)
            if slot is None:
                slot = _Slot(key, job, future, _running_future())
                self._waiting[key] = slot
                self._queue.append(slot)
                self._lock.notify()
                return future
            stale, slot.job, slot.future = slot.future, job, future
            self._num_skipped += 1
        stale._skip()  # outside the lock: it runs the stale future's callbacks
        return future

    def write(
        self,
        key: str,
        relative_path: str,
        tensors: Mapping[str, np.ndarray],
        metadata: Mapping[str, str],
    ) -> JobFuture[CacheFileInfo | None]:
        """Queue :func:`~store.cache_files.write_cache_file` of ``root / relative_path``.

        The arrays are read on the writer thread: do not modify them after this call. Only
        record the file in the registry if the future resolves to a ``CacheFileInfo``; ``None``
        means a newer write for ``key`` superseded this one and the file was never written.

        Raises:
            ValueError: ``relative_path`` is empty, absolute or has ``..`` parts.
            CacheWriterClosedError: ``close()`` was called.
        """
        relative = PurePosixPath(relative_path)
        if not relative.parts or relative.is_absolute() or ".." in relative.parts:
            raise ValueError(
                f"relative_path={relative_path!r}: expected a path inside {self.root} "
                "with '/' separators and no '..' parts"
            )
        job = partial(write_cache_file, self.root / relative, tensors, metadata)
        return self.submit(key, job)

    def flush(self, key: str | None = None) -> Future[None]:
        """A future resolved once every job submitted so far (for ``key``, or all) has finished.

        A job that was skipped counts as finished once the job that replaced it has.
        """
        with self._lock:
            if key is None:
                last = self._queue[-1] if self._queue else self._running
            else:
                last = self._waiting.get(key)
                if last is None and self._running is not None and self._running.key == key:
                    last = self._running
        # Slots finish in queue order, so the last relevant one finishing implies the rest.
        return _finished_future() if last is None else last.done

    async def aflush(self, key: str | None = None) -> None:
        """Await :meth:`flush` without blocking the event loop."""
        await asyncio.wrap_future(self.flush(key))

    def close(self) -> None:
        """Refuse new jobs, finish the queued ones, and join the thread. Idempotent."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("CacheWriter.close() called from a writer job would wait on itself")
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join()

    async def aclose(self) -> None:
        """:meth:`close` on a worker thread, so the event loop keeps running while jobs drain."""
        await asyncio.to_thread(self.close)

    @property
    def is_closed(self) -> bool:
        return self._closing

    @property
    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(self._num_run, self._num_failed, self._num_skipped, len(self._queue))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if not self._queue:  # closing, and drained
                    return
                slot = self._running = self._queue.popleft()
                del self._waiting[slot.key]
            self._run(slot)
            with self._lock:
                self._running = None
            slot.done.set_result(None)

    def _run(self, slot: _Slot) -> None:
        future = slot.future
        if not future.set_running_or_notify_cancel():
            with self._lock:
                self._num_skipped += 1
            return
        # Counters change before the future resolves, so a caller that awaited it sees them.
        try:
            result = slot.job()
        except BaseException as exc:  # delivered to the caller; the thread must keep going
            with self._lock:
                self._num_run += 1
                self._num_failed += 1
            future.set_exception(exc)
        else:
            with self._lock:
                self._num_run += 1
            future.set_result(result)


def _running_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()
    return future


def _finished_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future
