"""The batch's growing per-layer buffers: mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``
by :func:`growth` tokens (at least ``MIN_GROWTH``, else 1/16 of the size) instead of mlx-lm's
fixed 256, so a few hundred short sequences do not each carry 256 empty positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
)

from agentkv.engine.mlxlm import recast, ring_offset, set_batch_extent, set_write_index, write_index

MIN_GROWTH = 32


FenceRows = Sequence[Sequence[int]] | None
"""Per row of a step, each of its positions' fence (see :class:`QuantizedLayer`)."""


def growth(size: int) -> int:
    """Tokens a buffer of ``size`` positions grows by when it is full."""
    return max(MIN_GROWTH, (size // 16 + MIN_GROWTH - 1) // MIN_GROWTH * MIN_GROWTH)


class GroupKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache growing by :func:`growth` instead of 256 positions."""

    @property
    def step(self) -> int:
        return growth(write_index(self))

    @classmethod
    def merge(cls, caches: list[Any]) -> GroupKVCache:
        return recast(super().merge(caches), cls)  # (mlx-lm's own class for empty caches)


class GroupRotatingKVCache(BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache growing by :func:`growth` up to its window."""

    @property
    def step(self) -> int:
        return growth(ring_offset(self))

    def extract(self, idx: int) -> Any:
        """mlx-lm's extract, cut to the row's newest ``max_size`` positions: what any later
        step reads (the next decode step's write keeps as many, a prompt's chunk one fewer),
        where a prompt's last chunk leaves up to ``chunk - 1`` more. A ring of q4 key groups
        (``per_channel``) is given whole: its groups' scales lie over their positions."""
        row = super().extract(idx)
        over = row.keys.shape[2] - self.max_size
        if over > 0 and not getattr(self, "per_channel", False):
            row.keys = mx.contiguous(row.keys[:, :, over:])
            row.values = mx.contiguous(row.values[:, :, over:])
            set_write_index(row, row.keys.shape[2])
        return row


def merge_global(parts: list[Any]) -> GroupKVCache:
    """mlx-lm's merge of single-row caches (none: one empty row)."""
    return GroupKVCache.merge(parts) if parts else GroupKVCache([0])


def held_arrays(layer: Any) -> list[mx.array]:
    """The arrays a batch layer's buffer holds (a :class:`QuantizedLayer`'s halves too): what
    a step evaluates after writing it (a recurrent layer's: its state)."""
    if not hasattr(layer, "keys"):
        return [x for x in layer.cache if x is not None]
    arrays = [layer.keys, layer.values]
    halves = getattr(layer, "halves", None)
    return arrays if halves is None else [*arrays, halves.keys, halves.values]


def merge_ring(rows: list[Any], size: int) -> GroupRotatingKVCache:
    """mlx-lm's merge of rotating caches, taking every column a packed row holds (its first
    key group whole, which can be more than the window)."""
    lengths = [0 if row.keys is None else row.keys.shape[2] for row in rows]
    longest = max(lengths, default=0)
    if longest == 0:
        return GroupRotatingKVCache(size, [0] * max(1, len(rows)))
    padding = [longest - n for n in lengths]
    some = next(row for row in rows if row.keys is not None)
    B, H = len(rows), some.keys.shape[1]
    keys = mx.zeros((B, H, longest, some.keys.shape[3]), some.keys.dtype)
    values = mx.zeros((B, H, longest, some.values.shape[3]), some.values.dtype)
    for i, (p, row) in enumerate(zip(padding, rows, strict=True)):
        if row.keys is not None:
            keys[i : i + 1, :, p:] = row.keys
            values[i : i + 1, :, p:] = row.values
    merged = GroupRotatingKVCache(size, padding)
    merged.keys, merged.values = keys, values
    merged.offset = mx.array([row.offset for row in rows])
    set_batch_extent(merged, longest)
    return merged
