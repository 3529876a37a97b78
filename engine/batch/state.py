"""Recurrent state in the batch: the layers of hybrid models (Qwen 3.5, Qwen3-Next, Nemotron-H,
Granite 4, LFM2, Jamba, Kimi Linear) that keep a fixed-size state per sequence (a convolution's
last inputs, an SSM's or a gated-delta rule's matrix) in mlx-lm's ``ArraysCache`` instead of
keys and values.

A length group holds, for each recurrent layer, a :class:`GroupStateCache`: an ``ArraysCache``
whose row ``i`` is the group's ``i``-th sequence's state. A step runs the layer's own code once
per span of rows against it (``agentkv.engine.attention.spans``).

A sequence's state is its whole history in a few arrays: it cannot be cut back to an earlier
token. Where a cache must be (a shared head, a rewritten last turn), it resumes from a state
*checkpoint* kept where that point was (``agentkv.engine.request.Checkpoint``), as sliding-window
layers that have moved on do; the batch therefore treats a state layer as a window of no positions.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from agentkv.engine.models.caches import is_state


def row_arrays(row: Any) -> list[mx.array]:
    """A single row's arrays: its state's, or its keys and values."""
    if is_state(row):
        return [x for x in row.cache if x is not None]
    return [row.keys, row.values]


def state_row(entries: list[mx.array | None]) -> ArraysCache:
    """One sequence's recurrent state as mlx-lm holds it (what ``save_prompt_cache`` and
    ``BatchGenerator`` take): the cache's tokens say how many it has consumed."""
    row = ArraysCache(len(entries))
    row.cache = list(entries)
    return row


class GroupStateCache(ArraysCache):
    """A length group's recurrent state for one layer: entry ``e`` is ``(rows, ...)``, row
    ``i`` the group's ``i``-th sequence's (``None``: no row has any yet, as before a first
    prefill chunk, which starts from zeros as mlx-lm's layers do)."""

    def __init__(self, size: int, rows: int):
        super().__init__(size)
        self.rows = rows

    @property
    def batch_size(self) -> int:
        return self.rows

    @classmethod
    def merge(cls, caches: list[Any]) -> GroupStateCache:
        """The rows of single-row caches, copied (an empty one: zeros)."""
        size = len(caches[0].cache)
        merged = cls(size, len(caches))
        for e in range(size):
            some = next((c[e] for c in caches if c[e] is not None), None)
            if some is None:
                continue
            if len(caches) == 1:  # a copy: a layer may write its entry in place
                merged[e] = mx.array(some)
                continue
            rows = [c[e] if c[e] is not None else mx.zeros_like(some) for c in caches]
            merged[e] = mx.concatenate(rows)
        return merged

    @classmethod
    def empty(cls, size: int) -> GroupStateCache:
        return cls(size, 1)

    def extract(self, idx: int) -> ArraysCache:
        """Row ``idx``'s state (copied)."""
        return state_row(
            [None if c is None else mx.contiguous(c[idx : idx + 1]) for c in self.cache]
        )

    def filter(self, batch_indices: list[int]) -> None:
        if list(batch_indices) != list(range(self.rows)):
            index = mx.array(batch_indices)
            self.cache = [None if c is None else c[index] for c in self.cache]
        self.rows = len(batch_indices)

    def extend(self, other: GroupStateCache) -> None:
        def cat(a: mx.array | None, b: mx.array | None) -> mx.array | None:
            if a is None and b is None:
                return None
            some = a if a is not None else b
            a = mx.zeros((self.rows, *some.shape[1:]), some.dtype) if a is None else a
            b = mx.zeros((other.rows, *some.shape[1:]), some.dtype) if b is None else b
            return mx.concatenate([a, b])

        self.cache = [cat(a, b) for a, b in zip(self.cache, other.cache, strict=True)]
        self.rows += other.rows
