"""The batch's per-layer buffers: mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``, growing
by :func:`growth` (see ``engine.kv_batch`` for the groups that hold them), and quantized KV
inside the running batch (``EngineConfig.batch_kv_bits``).

Buffers grow by ``growth(size)`` tokens (at least ``MIN_GROWTH``, else 1/16 of the size) instead
of mlx-lm's fixed 256, so a few hundred short sequences do not each carry 256 empty positions.

:class:`GroupQuantizedKVCache` and :class:`GroupQuantizedRotatingKVCache` hold a layer's keys and
values quantized: each position's ``mx.quantize`` words, scales and biases packed into one
uint32 row (:func:`packed`). mlx-lm's batch caches only move positions along one axis (grow,
rotate, pad, merge, extend, filter, extract, trim), so they run unchanged on packed arrays; a
token's keys are quantized once, when written, and attention gets them back as (words, scales,
biases) with the cache's ``bits``, which sends mlx-lm's attention down its quantized path.
Padding positions are zero words, scales and biases (they read as 0 and are masked anyway). A
row extracted from a group is a ``KVCache`` / ``RotatingKVCache`` of packed arrays, so a paused
sequence rejoins bit for bit as it left; :func:`expanded_row` gives a finished one's float
cache.

"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)

MIN_GROWTH = 32


def growth(size: int) -> int:
    """Tokens a buffer of ``size`` positions grows by when it is full."""
    return max(MIN_GROWTH, (size // 16 + MIN_GROWTH - 1) // MIN_GROWTH * MIN_GROWTH)


class GroupKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache growing by :func:`growth` instead of 256 positions."""

    @property
    def step(self) -> int:
        return growth(self._idx)

    @classmethod
    def merge(cls, caches: list[Any]) -> GroupKVCache:
        merged = super().merge(caches)
        merged.__class__ = cls  # mlx-lm makes a plain BatchKVCache of empty caches
        return merged


class GroupRotatingKVCache(BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache growing by :func:`growth` up to its window."""

    @property
    def step(self) -> int:
        return growth(self._offset)


def quantized_token_bytes(
    heads: int, key_dim: int, value_dim: int, bits: int, group: int, scale_bytes: int
) -> int:
    """K+V bytes of one token of one layer, quantized: the words and a scale and a bias per
    group of each head."""
    return (
        4
        * heads
        * (
            packed_dim(key_dim, bits, group, scale_bytes)
            + packed_dim(value_dim, bits, group, scale_bytes)
        )
    )


def packed_dim(dim: int, bits: int, group: int, scale_bytes: int) -> int:
    """uint32 words a head of ``dim`` takes packed: its quantized words, then its scales and
    biases (``scale_bytes`` each) as raw bits."""
    return dim * bits // 32 + 2 * (dim // group) * scale_bytes // 4


def packed(x: mx.array, bits: int, group_size: int) -> mx.array:
    """``x`` quantized along its last axis, as one uint32 array: ``mx.quantize``'s words, then
    its scales and biases (in ``x``'s dtype) as raw bits."""
    words, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    extra = mx.concatenate([scales, biases], axis=-1).view(mx.uint32)
    return mx.concatenate([words, extra], axis=-1)


def unpacked(
    x: mx.array, dim: int, dtype: mx.Dtype, bits: int, group_size: int
) -> tuple[mx.array, mx.array, mx.array]:
    """The (words, scales, biases) of a :func:`packed` array of heads of ``dim``."""
    n_words, groups = dim * bits // 32, dim // group_size
    extra = x[..., n_words:].view(dtype)
    return x[..., :n_words], extra[..., :groups], extra[..., groups:]


class _Quantized:
    """Keys and values held :func:`packed`: every batch operation of mlx-lm's caches (growth,
    rotation, padding, merging, extending, filtering, extracting, trimming) moves positions
    along one axis, so it runs unchanged on the packed arrays; writing packs the new positions
    and reading hands attention their (words, scales, biases), with ``bits`` and
    ``group_size`` set, so mlx-lm's attention takes its quantized path."""

    bits: int
    group_size: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        bits, group = self.bits, self.group_size
        held_keys, held_values = super().update_and_fetch(  # type: ignore[misc]
            packed(keys, bits, group), packed(values, bits, group)
        )
        return (
            unpacked(held_keys, keys.shape[-1], keys.dtype, bits, group),
            unpacked(held_values, values.shape[-1], values.dtype, bits, group),
        )


class GroupQuantizedKVCache(_Quantized, GroupKVCache):
    """A group's buffer for one global-attention layer, its keys and values quantized."""

    def __init__(self, left_padding: list[int], bits: int, group_size: int):
        super().__init__(left_padding)
        self.bits, self.group_size = bits, group_size


class GroupQuantizedRotatingKVCache(_Quantized, GroupRotatingKVCache):
    """A group's buffer for one sliding-window layer, its keys and values quantized."""

    def __init__(self, max_size: int, left_padding: list[int], bits: int, group_size: int):
        super().__init__(max_size, left_padding)
        self.bits, self.group_size = bits, group_size


def quantized_buffer(
    rows: list[Any], window: int | None, bits: int, group_size: int
) -> GroupKVCache | GroupRotatingKVCache:
    """One group buffer of packed single-row caches (none: one empty row), quantized."""
    if not rows:
        if window is None:
            return GroupQuantizedKVCache([0], bits, group_size)
        return GroupQuantizedRotatingKVCache(window, [0], bits, group_size)
    if window is None:
        merged = GroupKVCache.merge(rows)
        merged.__class__ = GroupQuantizedKVCache
    else:
        merged = GroupRotatingKVCache.merge(rows)
        merged.__class__ = GroupQuantizedRotatingKVCache
    merged.bits, merged.group_size = bits, group_size
    return merged


def is_packed(row: Any) -> bool:
    """Whether a single-row cache holds :func:`packed` keys and values."""
    return row.keys is not None and row.keys.dtype == mx.uint32


def packed_row(row: Any, bits: int, group_size: int) -> Any:
    """A float single-row cache (KVCache / RotatingKVCache) with its keys and values
    :func:`packed`, positions as they are."""
    return _with(row, lambda x: packed(x, bits, group_size))


def expanded_row(
    row: Any, key_dim: int, value_dim: int, dtype: mx.Dtype, bits: int, group_size: int
) -> Any:
    """A packed single-row cache in ``dtype`` again (``mx.dequantize``)."""

    def expand(x: mx.array, dim: int) -> mx.array:
        parts = unpacked(x, dim, dtype, bits, group_size)
        return mx.dequantize(*parts, group_size=group_size, bits=bits)

    return _with(row, expand, key_dim, value_dim)


def _with(row: Any, fn: Any, *dims: int) -> Any:
    """A copy of a single-row cache with ``fn`` applied to its keys and values."""
    out = RotatingKVCache(row.max_size) if isinstance(row, RotatingKVCache) else KVCache()
    n = 0 if row.keys is None else row.keys.shape[2]
    if not isinstance(row, RotatingKVCache):
        n = min(n, row.offset)
    if n:  # (a row with no positions stays empty: mx.dequantize takes no empty array)
        keys, values = row.keys[..., :n, :], row.values[..., :n, :]
        out.keys = fn(keys, *dims[:1])
        out.values = fn(values, *dims[1:])
    out.offset = row.offset
    if isinstance(row, RotatingKVCache):
        out._idx = row._idx
    return out
