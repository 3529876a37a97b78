"""The batch's per-layer buffers: mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``, growing
by :func:`growth` (see ``engine.kv_batch`` for the groups that hold them), and quantized KV
inside the running batch (``EngineConfig.batch_kv_bits``).

Buffers grow by ``growth(size)`` tokens (at least ``MIN_GROWTH``, else 1/16 of the size) instead
of mlx-lm's fixed 256, so a few hundred short sequences do not each carry 256 empty positions.

:class:`GroupQuantizedKVCache` is :class:`GroupKVCache` with each of its keys and
values a ``(words, scales, biases)`` triple, as mlx-lm's ``QuantizedKVCache`` holds them: a
token's keys are quantized once, when they are written, and the model attends to them through
mlx-lm's quantized attention (it takes that path for any cache with ``bits``). Left padding,
masks, merging, extending, filtering and extracting work as for the float buffers, on each
array of the triples; padding positions are zero words, scales and biases (they read as 0 and
are masked anyway). A row extracted from the group is a ``QuantizedKVCache``, so a paused
sequence rejoins exactly as it left; :func:`dequantized` gives a finished one's float cache.

Also the group-size rule of ``mx.quantize`` (what divides a head), shared with the disk codec.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
)

from engine.config import DEFAULT_GROUP_SIZE
from engine.errors import InvalidCacheError

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


BATCH_KV_BITS = (8, 4)


def quantized_token_bytes(
    heads: int, key_dim: int, value_dim: int, bits: int, group: int, scale_bytes: int
) -> int:
    """K+V bytes of one token of one layer, quantized: the words and a scale and a bias per
    group of each head."""
    per_dim = lambda d: d * bits // 8 + 2 * (d // group) * scale_bytes  # noqa: E731
    return heads * (per_dim(key_dim) + per_dim(value_dim))


Triple = tuple[mx.array, mx.array, mx.array]


class GroupQuantizedKVCache(GroupKVCache):
    """A group's buffer for one global-attention layer, its keys and values quantized."""

    def __init__(
        self, left_padding: list[int], bits: int = 8, group_size: int = DEFAULT_GROUP_SIZE
    ):
        super().__init__(left_padding)
        self.bits = bits
        self.group_size = group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, n = self._idx, keys.shape[2]
        new_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            size = (self.step + n - 1) // self.step * self.step
            self.keys = _grown(self.keys, new_keys, prev, size)
            self.values = _grown(self.values, new_values, prev, size)
        for held, new in ((self.keys, new_keys), (self.values, new_values)):
            for x, part in zip(held, new, strict=True):
                x[..., prev : prev + n, :] = part
        self.offset = self.offset + n
        self._idx += n
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        idx = self._idx
        return _map(lambda x: x[..., :idx, :], self.keys), _map(
            lambda x: x[..., :idx, :], self.values
        )

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            self.keys = _map(lambda x: x[batch_indices], self.keys)
            self.values = _map(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys = _map(lambda x: x[..., shift:, :], self.keys)
                self.values = _map(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: GroupQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other

        def aligned(c: GroupQuantizedKVCache) -> tuple[Triple, Triple, mx.array]:
            """``c``'s buffers right-aligned at ``idx``, ``size`` positions long."""
            left = idx - c._idx
            if c.keys is None:
                rows = c.offset.shape[0]
                empty = lambda t: tuple(  # noqa: E731
                    mx.zeros((rows, x.shape[1], size, x.shape[3]), x.dtype) for x in t
                )
                return empty(like.keys), empty(like.values), c.left_padding + left
            right = size - c.keys[0].shape[2] - left

            def fit(x: mx.array) -> mx.array:
                if right < 0:
                    x = x[..., :right, :]
                if left or right > 0:
                    x = mx.pad(x, [(0, 0), (0, 0), (left, max(right, 0)), (0, 0)])
                return x

            return _map(fit, c.keys), _map(fit, c.values), c.left_padding + left

        (k1, v1, p1), (k2, v2, p2) = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate(pair) for pair in zip(k1, k2, strict=True))
        self.values = tuple(mx.concatenate(pair) for pair in zip(v1, v2, strict=True))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        padding = self.left_padding.tolist()[idx]
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        cut = lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx])  # noqa: E731
        cache.keys, cache.values = _map(cut, self.keys), _map(cut, self.values)
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(  # type: ignore[override]
        cls, caches: list[Any], bits: int | None = None, group_size: int | None = None
    ) -> GroupQuantizedKVCache:
        """One group of ``caches`` (``QuantizedKVCache`` or float ``KVCache``, quantized here;
        ``bits`` and ``group_size`` default to those of the first quantized one)."""
        held = [c for c in caches if isinstance(c, QuantizedKVCache)]
        bits = bits or (held[0].bits if held else 8)
        group_size = group_size or (held[0].group_size if held else DEFAULT_GROUP_SIZE)
        parts = [_triples(c, bits, group_size) for c in caches]
        lengths = [0 if p is None else p[0][0].shape[2] for p in parts]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        cache = cls(padding, bits, group_size)
        if longest == 0:
            return cache
        some = next(p for p in parts if p is not None)

        def stacked(which: int) -> Triple:
            out = []
            for j in range(3):
                like = some[which][j]
                rows = [
                    mx.zeros((1, like.shape[1], longest, like.shape[3]), like.dtype)
                    if p is None
                    else mx.pad(p[which][j], [(0, 0), (0, 0), (pad, 0), (0, 0)])
                    for p, pad in zip(parts, padding, strict=True)
                ]
                out.append(mx.concatenate(rows))
            return tuple(out)

        cache.keys, cache.values = stacked(0), stacked(1)
        cache.offset = cache.offset + longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def dequantized(layer: Any) -> Any:
    """``layer`` as a float ``KVCache`` when it is a ``QuantizedKVCache``, else itself."""
    if not isinstance(layer, QuantizedKVCache):
        return layer
    cache = KVCache()
    if layer.keys is not None:
        n = layer.offset

        def expand(triple: Triple) -> mx.array:
            parts = (x[..., :n, :] for x in triple)
            return mx.dequantize(*parts, group_size=layer.group_size, bits=layer.bits)

        cache.keys, cache.values = expand(layer.keys), expand(layer.values)
        cache.offset = n
    return cache


def _triples(cache: Any, bits: int, group_size: int) -> tuple[Triple, Triple] | None:
    """A single-row cache's keys and values as quantized triples (None: empty)."""
    if cache.keys is None or cache.offset == 0:
        return None
    n = cache.offset
    if isinstance(cache, QuantizedKVCache):
        if (cache.bits, cache.group_size) != (bits, group_size):
            raise InvalidCacheError(
                f"a cache quantized to {cache.bits} bits in groups of {cache.group_size} "
                f"cannot join a {bits}-bit group of {group_size}"
            )
        return _map(lambda x: x[..., :n, :], cache.keys), _map(
            lambda x: x[..., :n, :], cache.values
        )
    quantize = lambda x: mx.quantize(x[..., :n, :], group_size=group_size, bits=bits)  # noqa: E731
    return quantize(cache.keys), quantize(cache.values)


def _grown(held: Triple | None, new: Triple, used: int, size: int) -> Triple:
    """``held``'s first ``used`` positions, then room: ``size`` more positions in all."""
    rows, heads = new[0].shape[0], new[0].shape[1]
    room = tuple(mx.zeros((rows, heads, size, x.shape[3]), x.dtype) for x in new)
    if held is None:
        return room
    return tuple(
        mx.concatenate([x[..., :used, :], r], axis=2) for x, r in zip(held, room, strict=True)
    )


def _map(fn: Any, triple: Triple) -> Triple:
    return tuple(fn(x) for x in triple)  # type: ignore[return-value]
