"""The writer thread and the saves in flight: jobs go to one ``CacheWriter`` thread (a newer
job for the same key replaces one that has not started), registry calls come back to the event
loop, and every scheduled write is tracked until it lands."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from agentkv.store.writer import CacheWriter

T = TypeVar("T")


class Writes:
    """Writer thread, loop bridge and the tasks in flight, by key (an agent id, or a key of
    the store's own such as shared-prefix writes)."""

    def __init__(self) -> None:
        self._writer = CacheWriter()
        self._loop = asyncio.get_running_loop()
        self._pending: dict[str, set[asyncio.Task]] = {}

    def submit(self, key: str, job: Callable[[], T]) -> Future[T | None]:
        """Run ``job`` on the writer thread (None: a newer job for ``key`` replaced it)."""
        return self._writer.submit(key, job)

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """From the writer thread: run a registry call on the event loop, wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def track(self, key: str, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run ``coroutine`` as a task that :meth:`wait` waits for."""
        task = asyncio.create_task(coroutine)
        tasks = self._pending.setdefault(key, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def busy(self, key: str) -> bool:
        return bool(self._pending.get(key))

    @property
    def in_flight(self) -> int:
        return sum(len(tasks) for tasks in self._pending.values())

    async def wait(self, key: str | None = None) -> None:
        """Wait for the tracked tasks (of one key, or all) to finish."""
        while True:
            keys = [key] if key is not None else list(self._pending)
            tasks = [t for k in keys for t in self._pending.get(k, ())]
            if not tasks:
                return
            await asyncio.wait(tasks)  # a cancelled caller does not cancel the writes

    def forget(self, key: str) -> None:
        self._pending.pop(key, None)

    async def close(self) -> None:
        await self.wait()
        await asyncio.to_thread(self._writer.close)
