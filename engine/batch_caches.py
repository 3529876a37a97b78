"""The batch's per-layer buffers: mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``, growing
by :func:`growth` (see ``engine.kv_batch`` for the groups that hold them), and quantized KV
inside the running batch (``EngineConfig.batch_kv_bits``).

Buffers grow by ``growth(size)`` tokens (at least ``MIN_GROWTH``, else 1/16 of the size) instead
of mlx-lm's fixed 256, so a few hundred short sequences do not each carry 256 empty positions.

:class:`GroupQuantizedKVCache` and :class:`GroupQuantizedRotatingKVCache` hold a layer's keys and
values quantized: each position's ``mx.quantize`` words, float16 scales and float16 biases
packed into one uint32 row (:func:`packed`). That is exactly what a q8 cache file stores
(``engine.kv``: the values cast to float16, then quantized), so a row read from a q8 file of
the same group size joins the batch without a dequantize, and a finished row is stored and
held in the hot tier as the batch held it: the bytes never drift across resumes. (q4 files
quantize keys per channel and rotate values first, which a batch row does not: a q4 row is
expanded on its way from or to a file.)

mlx-lm's batch caches only move positions along one axis (grow, rotate, pad, merge, extend,
filter, extract, trim), so they run unchanged on packed arrays; a token's keys are quantized
once, when written, and attention gets them back as (words, scales, biases) with the cache's
``bits``, which sends mlx-lm's attention down its quantized path. Padding positions are zero
words, scales and biases (they read as 0 and are masked anyway). A row extracted from a group
is a ``KVCache`` / ``RotatingKVCache`` of packed arrays; its :class:`Packing` says how to read
it (:meth:`Packing.expand` gives the float cache).
"""

from __future__ import annotations

from dataclasses import dataclass
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


SCALE_DTYPE = mx.float16  # of scales and biases, as a quantized cache file stores them
FLOAT16_MAX = 65504.0


def as_float16(x: mx.array) -> mx.array:
    """``x`` cast to float16 for quantizing, clipped to its range first (a larger value would
    be inf, and its group's scale NaN): what a batch and a cache file both quantize."""
    if x.dtype == mx.float16:
        return x
    return mx.clip(x, -FLOAT16_MAX, FLOAT16_MAX).astype(mx.float16)


def quantized_token_bytes(heads: int, key_dim: int, value_dim: int, bits: int, group: int) -> int:
    """K+V bytes of one token of one layer, quantized: the words and a float16 scale and bias
    per group of each head."""
    return 4 * heads * (packed_dim(key_dim, bits, group) + packed_dim(value_dim, bits, group))


def packed_dim(dim: int, bits: int, group: int) -> int:
    """uint32 words a head of ``dim`` takes packed: its quantized words, then a float16 scale
    and bias per group (one word)."""
    return dim * bits // 32 + dim // group


def packed(x: mx.array, bits: int, group_size: int) -> mx.array:
    """``x`` cast to float16 (:func:`as_float16`) and quantized along its last axis (as a
    quantized cache file stores it), as one uint32 array: ``mx.quantize``'s words, then its
    float16 scales and biases as raw bits."""
    words, scales, biases = mx.quantize(as_float16(x), group_size=group_size, bits=bits)
    return join_packed(words, scales, biases)


def join_packed(words: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """One uint32 array of quantized ``words`` and their float16 ``scales`` and ``biases``."""
    extra = mx.concatenate([scales, biases], axis=-1).view(mx.uint32)
    return mx.concatenate([words, extra], axis=-1)


def unpacked(
    x: mx.array, dim: int, bits: int, group_size: int
) -> tuple[mx.array, mx.array, mx.array]:
    """The (words, float16 scales, float16 biases) of a :func:`packed` array of heads of
    ``dim``."""
    n_words, groups = dim * bits // 32, dim // group_size
    extra = x[..., n_words:].view(SCALE_DTYPE)
    return x[..., :n_words], extra[..., :groups], extra[..., groups:]


def expand(x: mx.array, dim: int, dtype: mx.Dtype, bits: int, group_size: int) -> mx.array:
    """A :func:`packed` array as values of ``dtype``, dequantized in float32 (as a cache file
    is read)."""
    if x.size == 0:  # (mx.dequantize takes no empty array)
        return mx.zeros((*x.shape[:-1], dim), dtype)
    words, scales, biases = unpacked(x, dim, bits, group_size)
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    out = mx.dequantize(words, scales, biases, group_size=group_size, bits=bits)
    return out.astype(dtype)


@dataclass(frozen=True, slots=True)
class Packing:
    """How the packed layers of a cache hold their keys and values (see :func:`packed`).

    Attributes:
        bits: 8 or 4.
        group_sizes: per layer, its quantization group size; None: the layer is held in
            ``dtype`` (no group size divides its heads).
        dims: per layer, its (key, value) head sizes.
        dtype: the model's KV dtype, what :meth:`expand` gives back.
    """

    bits: int
    group_sizes: tuple[int | None, ...]
    dims: tuple[tuple[int, int], ...]
    dtype: Any

    def quantized(self, i: int) -> bool:
        """Whether layer ``i`` is held packed."""
        return self.group_sizes[i] is not None

    def packed_dims(self, i: int) -> tuple[int, int]:
        """Layer ``i``'s (key, value) words per head, packed."""
        group = self.group_sizes[i]
        return tuple(packed_dim(d, self.bits, group) for d in self.dims[i])  # type: ignore[return-value]

    def pack(self, i: int, row: Any) -> Any:
        """Layer ``i``'s single-row cache packed (as it is when it is already)."""
        if is_packed(row):
            return row
        return _with(row, lambda x: packed(x, self.bits, self.group_sizes[i]))

    def parts(self, i: int, x: mx.array, kind: str) -> tuple[mx.array, mx.array, mx.array]:
        """Layer ``i``'s packed keys (``kind`` "keys") or values as (words, float16 scales,
        float16 biases): what ``mx.quantize`` made of them, as a cache file stores it."""
        dim = self.dims[i][0 if kind == "keys" else 1]
        return unpacked(x, dim, self.bits, self.group_sizes[i])

    def values(self, i: int, x: mx.array, kind: str) -> mx.array:
        """Layer ``i``'s packed keys (``kind`` "keys") or values in the model's dtype."""
        dim = self.dims[i][0 if kind == "keys" else 1]
        return expand(x, dim, self.dtype, self.bits, self.group_sizes[i])

    def stores_as(self, i: int, bits: int | None, group_size: int | None) -> bool:
        """Whether layer ``i``'s packed words are what a file of ``bits`` quantizing the layer
        in groups of ``group_size`` stores."""
        return bits == self.bits and group_size == self.group_sizes[i]

    def expand(self, layers: list[Any]) -> list[Any]:
        """The rows of a cache in the model's precision (the packed ones dequantized)."""
        out = []
        for i, row in enumerate(layers):
            if is_packed(row):
                row = _with(row, lambda x, kind, i=i: self.values(i, x, kind), "keys", "values")
            out.append(row)
        return out


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
            _for_attention(unpacked(held_keys, keys.shape[-1], bits, group), keys.dtype),
            _for_attention(unpacked(held_values, values.shape[-1], bits, group), values.dtype),
        )


def _for_attention(parts: tuple[mx.array, mx.array, mx.array], dtype: mx.Dtype) -> tuple:
    """(words, scales, biases) with the scales and biases in the queries' ``dtype``, so the
    attention's output stays in it (a float16 scale promotes a bfloat16 query to float32)."""
    words, scales, biases = parts
    if dtype == SCALE_DTYPE:
        return parts
    return words, scales.astype(dtype), biases.astype(dtype)


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


def _with(row: Any, fn: Any, *kinds: str) -> Any:
    """A copy of a single-row cache with ``fn`` applied to its keys and values."""
    out = RotatingKVCache(row.max_size) if isinstance(row, RotatingKVCache) else KVCache()
    n = 0 if row.keys is None else row.keys.shape[2]
    if not isinstance(row, RotatingKVCache):
        n = min(n, row.offset)
    if n:  # (a row with no positions stays empty)
        keys, values = row.keys[..., :n, :], row.values[..., :n, :]
        out.keys = fn(keys, *kinds[:1])
        out.values = fn(values, *kinds[1:])
    out.offset = row.offset
    if isinstance(row, RotatingKVCache):
        out._idx = row._idx
    return out
