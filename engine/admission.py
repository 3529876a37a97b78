"""The bounded queue of requests waiting to join the batch: priority with aging."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from agentkv.engine.errors import EngineOverloadedError

T = TypeVar("T")


class AdmissionQueue(Generic[T]):
    """Thread-safe priority queue for requests waiting to join the batch.

    Effective priority is ``priority + aging_per_s * (now - arrival)``. Since every waiting
    item ages at the same rate, ordering by ``priority - aging_per_s * arrival`` is the same
    order at any instant, so a plain heap stays correct as time passes. Ties go to the
    earlier arrival.
    """

    def __init__(
        self, max_size: int, aging_per_s: float, clock: Callable[[], float] = time.monotonic
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self._max_size = max_size
        self._aging = aging_per_s
        self._clock = clock
        self._heap: list[tuple[float, float, int, T]] = []
        self._removed: set[int] = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._heap) - len(self._removed)

    def push(
        self, item: T, priority: float, arrival: float | None = None, force: bool = False
    ) -> int:
        """Queue an item; raises EngineOverloadedError at once when the queue is full
        (unless ``force``: a preempted turn always gets its place back)."""
        with self._lock:
            if not force and len(self._heap) - len(self._removed) >= self._max_size:
                raise EngineOverloadedError(
                    f"admission queue is full ({self._max_size} waiting requests); retry later"
                )
            ticket = next(self._ids)
            arrival = self._clock() if arrival is None else arrival
            heapq.heappush(self._heap, (-(priority - self._aging * arrival), arrival, ticket, item))
            return ticket

    def peek(self) -> T | None:
        """The waiting item with the highest effective priority, left in the queue."""
        with self._lock:
            self._drop_removed()
            return self._heap[0][3] if self._heap else None

    def pop(self) -> T | None:
        """Remove and return the waiting item with the highest effective priority, or None."""
        with self._lock:
            self._drop_removed()
            return heapq.heappop(self._heap)[3] if self._heap else None

    def remove(self, ticket: int) -> bool:
        """Drop a waiting item by ticket. Returns False if it was already popped."""
        with self._lock:
            if ticket in self._removed or not any(e[2] == ticket for e in self._heap):
                return False
            self._removed.add(ticket)
            return True

    def drain(self) -> list[T]:
        """Remove and return every waiting item in admission order."""
        items = []
        while (item := self.pop()) is not None:
            items.append(item)
        return items

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2])
