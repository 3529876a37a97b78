"""The batch's per-layer buffers: mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``, growing
by :func:`growth` (see ``engine.kv_batch`` for the groups that hold them), and quantized KV
inside the running batch (``EngineConfig.batch_kv_bits``).

Buffers grow by ``growth(size)`` tokens (at least ``MIN_GROWTH``, else 1/16 of the size) instead
of mlx-lm's fixed 256, so a few hundred short sequences do not each carry 256 empty positions.

**q8** (:class:`GroupQuantizedKVCache`, :class:`GroupQuantizedRotatingKVCache`): each
position's keys and values ``mx.quantize``d, its words, float16 scales and float16 biases
packed into one uint32 row (:func:`packed`), keys rotated first by :func:`hadamard` (a
power-of-two head size: ``Packing.rotated_keys``; attention rotates the query alike). That is
exactly what a q8 cache file stores (``engine.kv``: keys rotated, cast to float16, then
quantized), so a row read from a q8 file of the same group size (its keys rotated) joins the
batch without a dequantize, and a finished row is stored and held in the hot tier as the batch
held it: the bytes never drift across resumes. mlx-lm's batch caches only move positions along
one axis (grow, rotate, pad, merge, extend, filter, extract, trim), so they run unchanged on
quantized words; a token's keys are quantized once, when written, and attention reads them
through ``mx.quantized_matmul`` as they are (``engine.attention``; on a CPU a prompt's chunk
expands the positions it reads for one float matmul). A group buffer holds the
words and the words of their scales and biases in two such buffers moved alike
(:class:`QuantizedLayer`), so attention reads them whole, without a copy; rows come and go
packed. A row also keeps float
copies of its newest :data:`FLOAT_WINDOW` positions (:class:`QuantizedLayer`): each query
reads its own position and the :data:`FLOAT_WINDOW` before it from them instead of their
words, back to the last point a cache can start from (its fence: where the row joined, a
stored block's boundary, a shared head's end), so a position reads the same however it was
reached (and computes the same, to float32 rounding where a CPU's chunk sums in another
order than a decode step). Padding positions are zero words, scales and biases (they read
as 0 and are masked anyway).

**q4** (:class:`ChannelQuantizedKVCache`, :class:`ChannelQuantizedRotatingKVCache`): four
bits per position lose too much of the keys (a few channels are far larger than the rest), so
q4 holds them as a q4 cache file does: keys per channel over groups of
:data:`~engine.config.KEY_GROUP_SIZE` positions at :data:`~engine.config.KEY_BITS` bits (KIVI;
the group's scales spread over its positions' slots, so the packed rows keep per-position
shapes and mlx-lm's operations still move them), values rotated by :func:`hadamard` and
quantized to 4 bits per position in groups of the layer's group size, and the newest positions
(:data:`FLOAT_WINDOW` and the key group not yet whole) kept in float beside the buffer.
Attention scores the quantized keys as they are (each group's scales fold into the query) and
rotates its output back (``engine.attention``).
A sliding window's ring holds one key group more than the window (:func:`ring_size`), so no
group loses a scale slot while one of its positions is in the window.

A row extracted from a group is a ``KVCache`` / ``RotatingKVCache`` of packed arrays, which
also carries ``recent``, its float positions (q8: and ``float_count``, how many it reads; a
finished q8 turn leaves them behind, ``engine.loop``), and a q4 global layer's ``first_kv``,
its first position in float (a finished turn leaves it behind: the batch computes it again
from the first token); its :class:`Packing` says how to read it (:meth:`Packing.expand` gives
the float cache, from the words).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)

from agentkv.engine.config import KEY_BITS, KEY_GROUP_SIZE

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
            row._idx = row.keys.shape[2]
        return row


SCALE_DTYPE = mx.float16  # of scales and biases, as a quantized cache file stores them
FLOAT16_MAX = 65504.0


def as_float16(x: mx.array) -> mx.array:
    """``x`` cast to float16 for quantizing, clipped to its range first (a larger value would
    be inf, and its group's scale NaN): what a batch and a cache file both quantize."""
    if x.dtype == mx.float16:
        return x
    return mx.clip(x, -FLOAT16_MAX, FLOAT16_MAX).astype(mx.float16)


def quantized_token_bytes(
    heads: int,
    key_dim: int,
    value_dim: int,
    bits: int,
    group: int,
    key_group: int | None = None,
    key_bits: int | None = None,
) -> int:
    """K+V bytes of one token of one layer, quantized: the words and a float16 scale and bias
    per group of each head (keys in groups of ``key_group`` at ``key_bits``, default ``group``
    and ``bits``)."""
    key_words = packed_dim(key_dim, key_bits or bits, key_group or group)
    return 4 * heads * (key_words + packed_dim(value_dim, bits, group))


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
    n_words = dim * bits // 32
    return x[..., :n_words], *scales_of(x[..., n_words:], dim // group_size)


def scales_of(extra: mx.array, groups: int) -> tuple[mx.array, mx.array]:
    """The float16 scales and biases of ``groups`` groups a position held as words (a
    :func:`packed` head's last ``groups`` words)."""
    halves = extra.view(SCALE_DTYPE)
    return halves[..., :groups], halves[..., groups:]


def expand(x: mx.array, dim: int, dtype: mx.Dtype, bits: int, group_size: int) -> mx.array:
    """A :func:`packed` array as values of ``dtype``, dequantized in float32 (as a cache file
    is read)."""
    if x.size == 0:  # (mx.dequantize takes no empty array)
        return mx.zeros((*x.shape[:-1], dim), dtype)
    return dequantized(*unpacked(x, dim, bits, group_size), dtype, bits, group_size)


def dequantized(
    words: mx.array, scales: mx.array, biases: mx.array, dtype: mx.Dtype, bits: int, group: int
) -> mx.array:
    """``mx.quantize``'s ``words`` with their float16 ``scales`` and ``biases`` as values of
    ``dtype``, dequantized in float32."""
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    return mx.dequantize(words, scales, biases, group_size=group, bits=bits).astype(dtype)


SHIFTS = (0, 4, 8, 12, 16, 20, 24, 28)  # of the eight 4-bit values in a word, low first


def quantize_per_channel(x: mx.array, group: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Keys ``(..., L, D)`` (``L`` a multiple of ``group``) quantized to ``bits`` (4 or 5) per
    channel over each group of ``group`` positions: the words along the head dimension, as
    ``mx.quantize`` packs them, and each group's ``D`` float16 scales (and biases) spread over
    its positions' slots, ``D / group`` to a position, in channel order (``engine.kv.quant``)."""
    *lead, n, dim = x.shape
    g = x.astype(mx.float32).reshape(*lead, n // group, group, dim)
    q, scales, biases = _min_max_codes(g, -2, bits)
    slots = (*lead, n, dim // group)
    words = code_words(q.reshape(*lead, n, dim), bits)
    return words, scales.reshape(slots), biases.reshape(slots)


def quantize_per_position(
    x: mx.array, group: int, bits: int
) -> tuple[mx.array, mx.array, mx.array]:
    """``(..., L, D)`` quantized to ``bits`` (4 or 5) per position in groups of ``group``
    channels (any size dividing ``D``, 16 included, which ``mx.quantize`` does not take), by
    the rule of :func:`quantize_per_channel`: the words, and float16 scales and biases
    ``(..., L, D / group)``, as ``mx.quantize`` lays them out (q4 keys outside whole key
    groups)."""
    *lead, n, dim = x.shape
    g = x.astype(mx.float32).reshape(*lead, n, dim // group, group)
    q, scales, biases = _min_max_codes(g, -1, bits)
    slots = (*lead, n, dim // group)
    words = code_words(q.reshape(*lead, n, dim), bits)
    return words, scales.reshape(slots), biases.reshape(slots)


def _min_max_codes(g: mx.array, axis: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Float32 values ``g`` as codes of ``bits`` over ``axis``: a float16 scale ``(max - min)
    / (2**bits - 1)`` and bias ``min`` per group (kept on the axis), each code rounded against
    them as a reader reads them."""
    top = 2**bits - 1
    low, high = g.min(axis=axis, keepdims=True), g.max(axis=axis, keepdims=True)
    scales, biases = ((high - low) / top).astype(SCALE_DTYPE), low.astype(SCALE_DTYPE)
    step, base = scales.astype(mx.float32), biases.astype(mx.float32)
    q = mx.clip(mx.round((g - base) / mx.where(step > 0, step, 1)), 0, top).astype(mx.uint32)
    return q, scales, biases


def code_words(q: mx.array, bits: int) -> mx.array:
    """Codes ``(..., D)`` of ``bits`` (4 or 5; ``D`` a multiple of 32 at 5) packed into uint32
    words as ``mx.quantize`` packs them: one little-endian bit stream, each code's low bit
    first (at 4 bits: each byte's low nibble, then its high one)."""
    *lead, dim = q.shape
    if bits == 4:
        q = q.reshape(*lead, dim // 8, 8)
        return (q << mx.array(SHIFTS, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)
    # Eight codes fill ``bits`` bytes: one 64-bit integer of them, cut into its bytes.
    eight = q.astype(mx.uint64).reshape(*lead, dim // 8, 8)
    stream = (eight << (bits * mx.arange(8, dtype=mx.uint64))).sum(axis=-1, keepdims=True)
    octets = (stream >> (8 * mx.arange(bits, dtype=mx.uint64))) & 0xFF
    return octets.astype(mx.uint8).reshape(*lead, dim * bits // 8).view(mx.uint32)


def codes_of(words: mx.array, bits: int) -> mx.array:
    """The codes of ``bits`` (4 or 5) that ``mx.quantize``'s words hold, in float32, along the
    last axis (:func:`code_words` undone)."""
    octets = words.view(mx.uint8)
    *lead, n = octets.shape
    if bits == 4:  # each byte: low nibble first
        q = mx.stack([octets & 0xF, octets >> 4], axis=-1)
        return q.reshape(*lead, n * 2).astype(mx.float32)
    eight = octets.reshape(*lead, n // bits, bits).astype(mx.uint64)
    stream = (eight << (8 * mx.arange(bits, dtype=mx.uint64))).sum(axis=-1, keepdims=True)
    q = (stream >> (bits * mx.arange(8, dtype=mx.uint64))) & (2**bits - 1)
    return q.reshape(*lead, n * 8 // bits).astype(mx.float32)


def packed_per_position(x: mx.array, group: int, bits: int) -> mx.array:
    """:func:`packed` by :func:`quantize_per_position` (groups of any size)."""
    return join_packed(*quantize_per_position(as_float16(x), group, bits))


def hadamard(x: mx.array) -> mx.array:
    """The orthonormal Walsh-Hadamard transform of ``x``'s last axis (a power of two long), in
    ``x``'s dtype: its own inverse. ``mx.hadamard_transform``: butterflies of adds and
    subtracts, then one scaling, the float32 bits ``engine.kv.quant.hadamard_on_host``
    computes on a CPU."""
    return mx.hadamard_transform(x, scale=1 / math.sqrt(x.shape[-1]))


def rotates_keys(bits: int | None, key_dim: int) -> bool:
    """Whether keys of ``key_dim`` are held rotated by :func:`hadamard` at ``bits``: q8's, of
    a power-of-two head size (the batch and the cache files alike)."""
    return bits == 8 and key_dim & (key_dim - 1) == 0


def rotated_if(x: mx.array, rotate: bool) -> mx.array:
    """``x`` rotated by :func:`hadamard` in float32 when ``rotate``, else as it is."""
    return hadamard(x.astype(mx.float32)) if rotate and x.size else x


@dataclass(frozen=True, slots=True)
class Packing:
    """How the packed layers of a cache hold their keys and values (see :func:`packed`).

    Attributes:
        bits: 8 or 4.
        group_sizes: per layer, its quantization group size; None: the layer is held in
            ``dtype`` (no group size divides its heads).
        dims: per layer, its (key, value) head sizes.
        dtype: the model's KV dtype, what :meth:`expand` gives back.
        channel: per layer, held as :class:`ChannelQuantizedKVCache` holds it (q4; its
            values in groups of ``group_sizes[i]``, its keys in groups of
            :data:`KEY_GROUP_SIZE` positions, at :data:`KEY_BITS`).
        rotated_keys: per layer, its keys rotated by :func:`hadamard` before they are
            quantized per position (q8 with a power-of-two key head size).
    """

    bits: int
    group_sizes: tuple[int | None, ...]
    dims: tuple[tuple[int, int], ...]
    dtype: Any
    channel: tuple[bool, ...] = ()
    rotated_keys: tuple[bool, ...] = ()

    def quantized(self, i: int) -> bool:
        """Whether layer ``i`` is held packed."""
        return self.group_sizes[i] is not None

    def channel_keys(self, i: int) -> bool:
        """Whether layer ``i`` is held as :class:`ChannelQuantizedKVCache` holds it (keys per
        channel, values rotated, the newest positions in float)."""
        return bool(self.channel) and self.channel[i]

    @property
    def any_channel(self) -> bool:
        return any(self.channel)

    def key_group(self, i: int) -> int | None:
        """Layer ``i``'s keys' group size: :data:`KEY_GROUP_SIZE` positions per channel (q4),
        else its group size."""
        return KEY_GROUP_SIZE if self.channel_keys(i) else self.group_sizes[i]

    def group_of(self, i: int, kind: str) -> int | None:
        """Layer ``i``'s group size for its ``kind`` ("keys" or "values")."""
        return self.key_group(i) if kind == "keys" else self.group_sizes[i]

    def bits_of(self, i: int, kind: str) -> int:
        """The bits of layer ``i``'s ``kind`` ("keys" or "values"): q4's keys per channel at
        :data:`KEY_BITS`, else :attr:`bits`."""
        return KEY_BITS if kind == "keys" and self.channel_keys(i) else self.bits

    def keys_rotated(self, i: int) -> bool:
        """Whether layer ``i`` holds its keys rotated by :func:`hadamard` (q8)."""
        return bool(self.rotated_keys) and self.rotated_keys[i]

    def scheme(self, i: int) -> dict[str, bool | int]:
        """Layer ``i``'s layout fields as a cache file names them (``engine.kv.quant``)."""
        if self.channel_keys(i):
            return {
                "channel_keys": True,
                "key_group_size": KEY_GROUP_SIZE,
                "key_bits": KEY_BITS,
                "rotated_values": True,
            }
        return {"rotated_keys": True} if self.keys_rotated(i) else {}

    def packed_dims(self, i: int) -> tuple[int, int]:
        """Layer ``i``'s (key, value) words per head, packed."""
        dk, dv = self.dims[i]
        key_words = packed_dim(dk, self.bits_of(i, "keys"), self.key_group(i))  # type: ignore[arg-type]
        return key_words, packed_dim(dv, self.bits, self.group_sizes[i])  # type: ignore[arg-type]

    def pack(self, i: int, row: Any) -> Any:
        """Layer ``i``'s single-row cache packed (as it is when it is already)."""
        if is_packed(row):
            return row
        if self.channel_keys(i):
            return channel_row(row, self.group_sizes[i])
        rotated, bits, group = self.keys_rotated(i), self.bits, self.group_sizes[i]

        def pack(x: mx.array, kind: str) -> mx.array:
            return packed(rotated_if(x, rotated and kind == "keys"), bits, group)

        return _with(row, pack, "keys", "values")

    def parts(self, i: int, x: mx.array, kind: str) -> tuple[mx.array, mx.array, mx.array]:
        """Layer ``i``'s packed keys (``kind`` "keys") or values as (words, float16 scales,
        float16 biases): what ``mx.quantize`` made of them, as a cache file stores it."""
        dim = self.dims[i][0 if kind == "keys" else 1]
        return unpacked(x, dim, self.bits_of(i, kind), self.group_of(i, kind))

    def values(self, i: int, x: mx.array, kind: str) -> mx.array:
        """Layer ``i``'s packed keys (``kind`` "keys") or values in the model's dtype (keys
        held rotated rotated back)."""
        dim, group = self.dims[i][0 if kind == "keys" else 1], self.group_of(i, kind)
        bits = self.bits_of(i, kind)
        if kind == "keys" and self.keys_rotated(i):
            x = rotated_if(expand(x, dim, mx.float32, bits, group), True)
            return x.astype(self.dtype)
        return expand(x, dim, self.dtype, bits, group)

    def stores_as(
        self, i: int, bits: int | None, group_size: int | None, scheme: dict[str, bool]
    ) -> bool:
        """Whether layer ``i``'s packed words are what a file of ``bits`` quantizing the layer
        per position in groups of ``group_size``, under the layout flags ``scheme``, stores."""
        return (
            bits == self.bits
            and group_size == self.group_sizes[i]
            and not self.channel_keys(i)
            and scheme == self.scheme(i)
        )

    def expand_layer(self, i: int, row: Any) -> Any:
        """Layer ``i``'s single-row cache in the model's precision (dequantized if packed)."""
        if not is_packed(row):
            return row
        if self.channel_keys(i):
            return expanded_channel_row(row, self.group_sizes[i], self.dims[i], self.dtype)
        return _with(row, lambda x, kind: self.values(i, x, kind), "keys", "values")

    def expand(self, layers: list[Any]) -> list[Any]:
        """The rows of a cache in the model's precision (the packed ones dequantized)."""
        return [self.expand_layer(i, row) for i, row in enumerate(layers)]


FLOAT_WINDOW = 16  # newest positions a quantized layer holds in float (q4: beyond its open group)


def float_window(group: int) -> int:
    """Positions a channel-quantized layer's float buffer holds: the :data:`FLOAT_WINDOW`
    newest, and the positions of the key group not yet quantized."""
    return FLOAT_WINDOW + group


def channel_boundary(length: int, group: int) -> int:
    """Of a sequence of ``length`` positions, how many a channel-quantized layer holds
    quantized (whole key groups at least :data:`FLOAT_WINDOW` positions old); the rest are in
    float."""
    return max(0, (length - FLOAT_WINDOW) // group * group)


def ring_size(window: int, group: int) -> int:
    """Positions a channel-quantized sliding-window layer's ring holds: its window and one key
    group more, so a position is overwritten only once its whole group has left the window
    (the group's scales are spread over its positions' slots)."""
    return window + group


def channel_keys_f32(
    words: mx.array, extra: mx.array, group: int, pos: mx.array, wrap: bool, bits: int
) -> mx.array:
    """Keys ``(B, H, L, ·)`` held per channel at ``bits`` (their ``words``, and the ``extra``
    words of their scales and biases), in float32: column ``c`` of row ``b`` holds position
    ``pos[b, c]``, its group's scales in the slots of the group's columns (``wrap``: a ring,
    the columns counted modulo ``L``). Columns of no quantized group give finite values the
    caller replaces or masks."""
    dim = words.shape[3] * 32 // bits
    B, H, L, E = extra.shape
    first = mx.arange(L)[None] - pos % group  # the column of each one's group's first position
    cols = first[..., None] + mx.arange(group)
    cols = cols % L if wrap else mx.clip(cols, 0, L - 1)
    slots = mx.take_along_axis(extra, cols.reshape(B, 1, L * group, 1), axis=2)
    slots = slots.view(SCALE_DTYPE).reshape(B, H, L, group, 2, E)
    scales = slots[..., 0, :].reshape(B, H, L, dim).astype(mx.float32)
    biases = slots[..., 1, :].reshape(B, H, L, dim).astype(mx.float32)
    return codes_of(words, bits) * scales + biases


def _overlay(x: mx.array, recent: mx.array, floats: list[int], newest: int, wrap: bool) -> mx.array:
    """``x`` with the positions each row holds in float (its newest ``floats[b]``, at columns
    up to ``newest``) taken from ``recent`` (right-aligned: its last column is ``newest``)."""
    L, f = x.shape[2], recent.shape[2]
    m = min(f, L if wrap else newest + 1)
    if m <= 0:
        return x
    ages = mx.arange(m - 1, -1, -1)
    keep = (ages[None] < mx.array(floats)[:, None])[:, None, :, None]
    if wrap:
        cols: Any = (newest - m + 1 + mx.arange(m)) % L
    else:
        cols = slice(newest - m + 1, newest + 1)
    x[:, :, cols, :] = mx.where(keep, recent[..., f - m :, :].astype(x.dtype), x[:, :, cols, :])
    return x


@dataclass(frozen=True, slots=True)
class HeldQuantized:
    """A quantized layer as one step's attention reads it (``engine.attention`` attends over
    it without expanding the quantized keys; :meth:`expanded` expands them).

    Attributes:
        keys, values: the buffer's words ``(B, H, L', words)`` and the words of their float16
            scales and biases, each whole and row contiguous (what attention hands
            ``mx.quantized_matmul`` without copying them; q4's keys it gathers into whole key
            groups, a copy, at each step): keys per position, or (q4) per
            channel in whole groups (other columns per position); values per position,
            ``rotated`` by :func:`hadamard` (q4). The first ``columns`` positions are held;
            the rest are spare (zeros, or positions trimmed off).
        columns: ``L``, the columns the rows' positions lie in.
        recent: float keys and (unrotated) values ``(B, H, f, D)``, right-aligned with column
            ``newest``; row ``b`` reads its newest ``floats[b]`` positions from them (q4).
        reach: q8: ``(B, Lq)``, how many positions before its own each query reads from
            ``recent`` (its own it always does); None at q4.
        lengths: each row's length (its newest position is ``lengths[b] - 1``).
        newest: the column of every row's newest position.
        wrap: the columns are a ring (counted modulo ``L``).
        group: the keys' quantization group size (q4: the positions of a key group).
        value_group: the values' quantization group size (q8: ``group``).
        bits: 8 or 4.
        key_bits: the keys' bits (per channel: :data:`KEY_BITS`; else ``bits``).
        per_channel: keys quantized per channel in whole groups (q4), else per position.
        rotated: values held rotated by :func:`hadamard` (q4).
        rotated_keys: keys held rotated by :func:`hadamard` (q8; ``recent`` holds them
            unrotated).
        first_kv: (q4, a global layer) each row's first position's float keys and values
            ``(B, H, 1, D)`` (unrotated), read instead of its words where ``recent`` does not
            hold it (None: no row has them); ``first_held``: which rows have them.
    """

    keys: tuple[mx.array, mx.array]
    values: tuple[mx.array, mx.array]
    columns: int
    recent: tuple[mx.array, mx.array]
    floats: tuple[int, ...]
    reach: mx.array | None
    lengths: tuple[int, ...]
    newest: int
    wrap: bool
    group: int
    value_group: int
    bits: int
    key_bits: int
    per_channel: bool
    rotated: bool
    rotated_keys: bool
    first_kv: tuple[mx.array, mx.array] | None = None
    first_held: tuple[bool, ...] = ()

    @property
    def ages(self) -> mx.array:
        """``(L,)``: how many positions older than its row's newest each column holds (a
        ring's columns past ``newest`` hold the oldest)."""
        L = self.columns
        ages = self.newest - mx.arange(L)
        return ages % L if self.wrap else ages

    @property
    def positions(self) -> mx.array:
        """``(B, L)``: the position each column holds (negative: padding)."""
        return mx.array(self.lengths)[:, None] - 1 - self.ages[None]

    def shifts(self) -> list[int]:
        """Per row, how far its first column is into its key group (column 0 holds position
        ``lengths[b] - 1 - newest``; a ring of a multiple of ``group`` keeps that phase)."""
        return [(n - 1 - self.newest) % self.group for n in self.lengths]

    def float_columns(self) -> mx.array:
        """``(B, L)``: which columns each row reads from ``recent`` (q4: its newest
        ``floats[b]`` positions)."""
        f, ages = self.recent[0].shape[2], self.ages[None]  # (negative: past ``newest``)
        return (ages >= 0) & (ages < mx.array([min(n, f) for n in self.floats])[:, None])

    def first_column(self) -> tuple[mx.array, mx.array] | None:
        """``(B,)`` each row's column of its first position, and ``(B,)`` whether the row reads
        it from ``first_kv`` (it has them, and ``recent`` does not hold the position); None
        without ``first_kv``."""
        if self.first_kv is None:
            return None
        column = mx.clip(self.newest + 1 - mx.array(self.lengths), 0, self.columns - 1)
        return column, mx.array(self._first_reads())

    def _first_reads(self) -> list[bool]:
        """Per row, whether it reads its first position from ``first_kv``."""
        f = self.recent[0].shape[2]
        return [
            held and n > min(k, f)
            for held, n, k in zip(self.first_held, self.lengths, self.floats, strict=True)
        ]

    def stored(self, kind: str) -> tuple[mx.array, mx.array]:
        """The keys' (``kind`` "keys") or values' words, and the words of their scales and
        biases, over the ``columns`` held (views)."""
        words, extra = self.keys if kind == "keys" else self.values
        return words[..., : self.columns, :], extra[..., : self.columns, :]

    def expanded(self) -> tuple[mx.array, mx.array]:
        """Keys and values in the model's dtype, every column expanded (keys rotated back;
        values rotated if ``rotated``)."""
        (recent_keys, recent_values), group, bits = self.recent, self.group, self.bits
        wrap, dk, dv = self.wrap, recent_keys.shape[3], recent_values.shape[3]
        words, extra = self.stored("keys")
        if self.per_channel:
            keys = channel_keys_f32(words, extra, group, self.positions, wrap, self.key_bits)
        else:
            keys = dequantized(words, *scales_of(extra, dk // group), mx.float32, bits, group)
            keys = hadamard(keys) if self.rotated_keys else keys
        keys = _overlay(keys, recent_keys, self.floats, self.newest, wrap)
        words, extra = self.stored("values")
        values = dequantized(
            words, *scales_of(extra, dv // self.value_group), mx.float32, bits, self.value_group
        )
        recent_values = recent_values.astype(mx.float32)
        if self.rotated:
            recent_values = hadamard(recent_values)
        values = _overlay(values, recent_values, self.floats, self.newest, wrap)
        if self.first_kv is not None:  # (column by column: a full-size select costs 15%)
            first_keys, first_values = (x.astype(mx.float32) for x in self.first_kv)
            first_values = hadamard(first_values) if self.rotated else first_values
            for b, reads in enumerate(self._first_reads()):
                if reads:
                    c = self.newest + 1 - self.lengths[b]
                    keys[b : b + 1, :, c : c + 1, :] = first_keys[b : b + 1]
                    values[b : b + 1, :, c : c + 1, :] = first_values[b : b + 1]
        return keys.astype(recent_keys.dtype), values.astype(recent_keys.dtype)


class QuantizedLayer:
    """Keys and values quantized in a group buffer, and float copies of each row's newest
    positions (``recent``, right-aligned with the buffer), which attention reads instead of
    their words. Every batch operation of mlx-lm's caches (growth, rotation, padding, merging,
    extending, filtering, extracting, trimming) moves positions along one axis, so it runs
    unchanged on them, and ``recent`` moves along the rows; each row's length is kept on the
    host (``lengths``), which says which of its columns hold which positions. A step hands
    attention a :class:`HeldQuantized` (as both keys and values).

    The buffer holds ``mx.quantize``'s words in ``keys`` and ``values`` and the words of their
    float16 scales and biases apart, in ``halves``: a plain mlx-lm buffer whose every operation
    mirrors this one's. ``mx.quantized_matmul`` takes only row-contiguous operands, so words
    sliced out of :func:`packed` rows, and out of a buffer's spare positions, were copied whole
    at every step by both of MLX's backends (on a CPU about 40% of a q8 global layer's step
    over 4 rows of 8K positions); attention now reads the buffers whole, spare positions
    included. Rows still come in packed (:func:`split_buffer` merges their two parts apart)
    and go out packed (:meth:`extract`). mlx-lm's ``state`` covers the words alone: the batch
    never saves or restores a buffer by it.

    q8 (:class:`GroupQuantizedKVCache`) holds every position per position, as a q8 file stores
    it, and keeps float copies of each row's newest :data:`FLOAT_WINDOW` positions (``counts``:
    how many of them a row has since it joined). A query at position ``p`` reads its own
    position and those before it back to ``p - FLOAT_WINDOW`` in float, but none before its
    fence (the latest point at or before ``p`` a cache can start from: where the row joined,
    a multiple of the stored blocks, a shared head's end, ``fences``), so a position computes
    the same whether its prompt came in one chunk or many, or from a cache (a finished row
    leaves its float copies behind: ``engine.loop``). Reading the decoded tokens' copies raised
    the top-1 agreement of decoding at a 4K history from 98.05% to 99.61% on ``gemma3-270m``
    (``bench_fidelity``, groups of 32, keys unrotated); reading a prompt's too, that of a
    prompt teacher-forced through the batch from 98.93% to 99.12% (groups of 128, keys
    rotated).
    """

    bits: int
    group_size: int  # of the keys (q4: positions per key group)
    value_group_size: int
    lengths: list[int]
    counts: list[int]
    recent: tuple[mx.array, mx.array] | None
    per_channel = False  # keys quantized per channel as their groups complete (q4)
    rotated_values = False  # values held rotated by :func:`hadamard` (q4)
    rotated_keys = False  # keys held rotated by :func:`hadamard` (q8, set per buffer)
    # q4, a global layer: each row's first position's float keys and values (B, H, 1, D),
    # which rows have them (``first_held``); see :class:`_ChannelQuantized`
    first_kv: tuple[mx.array, mx.array] | None = None
    first_held: list[bool]
    halves: Any  # the words of the scales and biases, in a GroupKVCache / GroupRotatingKVCache

    def _wraps(self) -> bool:
        return bool(getattr(self, "rotated", False))

    @property
    def key_bits(self) -> int:
        """The keys' bits (q4's, per channel: :data:`KEY_BITS`)."""
        return self.bits

    def float_positions(self) -> int:
        """How many newest positions ``recent`` holds a row."""
        return FLOAT_WINDOW

    def step_floats(
        self, old: list[int], n: int, fences: FenceRows
    ) -> tuple[tuple[int, ...], mx.array | None]:
        """What each row reads in float in a step writing ``n`` positions a row (rows of
        ``old`` lengths before it): per query, how many positions before its own (``reach``,
        ``(B, n)``), and per row how many of its newest (the last query's, its own counted).
        ``fences``: per row, each query's fence (None: only where the row joined)."""
        rows = fences if fences is not None else [None] * len(old)
        reach = [
            [
                min(FLOAT_WINDOW, count + i, was + i - fence[i] if fence else FLOAT_WINDOW)
                for i in range(n)
            ]
            for was, count, fence in zip(old, self.counts, rows, strict=True)
        ]
        if any(r < 0 for row in reach for r in row):
            raise ValueError(f"a fence lies past its query's position: {fences}")
        self.counts = [min(FLOAT_WINDOW, count + n) for count in self.counts]
        return tuple(row[-1] + 1 for row in reach), mx.array(reach, mx.int32)

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[HeldQuantized, HeldQuantized]:
        """mlx-lm's call (no fences but where each row joined)."""
        return self.write(keys, values)

    def write(
        self, keys: mx.array, values: mx.array, fences: FenceRows = None
    ) -> tuple[HeldQuantized, HeldQuantized]:
        """Write a step's keys and values (``fences``: per row, each position's fence, see
        :class:`QuantizedLayer`); what attention reads for the step."""
        bits, group, n = self.bits, self.group_size, keys.shape[2]
        if fences is not None and (
            len(fences) != keys.shape[0] or any(len(f) != n for f in fences)
        ):
            raise ValueError(f"fences for {keys.shape[0]} rows of {n} positions: {fences}")
        if self.per_channel:  # (read from ``recent`` until their key group is settled)
            key_words = packed_per_position(keys, group, self.key_bits)
        else:
            key_words = packed(rotated_if(keys, self.rotated_keys), bits, group)
        value_words = packed(rotated_if(values, self.rotated_values), bits, self.value_group_size)
        columns = self._store(key_words, value_words)
        old, self.lengths = self.lengths, [length + n for length in self.lengths]
        f = self.float_positions()
        if self.recent is None:
            B, H, _, _ = keys.shape
            self.recent = tuple(mx.zeros((B, H, f, x.shape[3]), x.dtype) for x in (keys, values))
        joined = [
            mx.concatenate([r, x.astype(r.dtype)], axis=2)
            for r, x in zip(self.recent, (keys, values), strict=True)
        ]
        self._settle_groups(joined[0], old)
        # (copies: a slice would keep all of ``joined`` alive)
        self.recent = tuple(mx.contiguous(x[..., -f:, :]) for x in joined)
        held = HeldQuantized(
            (self.keys, self.halves.keys),  # type: ignore[attr-defined]
            (self.values, self.halves.values),  # type: ignore[attr-defined]
            columns,
            tuple(joined),
            *self.step_floats(old, n, fences),
            tuple(self.lengths),
            self._idx - 1,  # type: ignore[attr-defined]
            self._wraps(),
            group,
            self.value_group_size,
            bits,
            self.key_bits,
            self.per_channel,
            self.rotated_values,
            self.rotated_keys,
            self.first_kv,
            () if self.first_kv is None else tuple(self.first_held),
        )
        return held, held

    def _words(self, width: int, kind: str) -> int:
        """How many of a packed head's ``width`` words of ``kind`` are words."""
        if kind == "keys":
            return words_in(width, self.key_bits, self.group_size)
        return words_in(width, self.bits, self.value_group_size)

    def _store(self, key_words: mx.array, value_words: mx.array) -> int:
        """Write a step's packed keys and values: their words, and their scales' and biases'
        words into ``halves`` (mlx-lm's update, on both; contiguous, as a ring's first chunk
        is kept as given). Returns the columns the rows' positions now lie in."""
        k = self._words(key_words.shape[3], "keys")
        v = self._words(value_words.shape[3], "values")
        key_words, key_extra = (mx.contiguous(x) for x in (key_words[..., :k], key_words[..., k:]))
        value_words, value_extra = (
            mx.contiguous(x) for x in (value_words[..., :v], value_words[..., v:])
        )
        self.halves.update_and_fetch(key_extra, value_extra)
        held, _ = super().update_and_fetch(key_words, value_words)  # type: ignore[misc]
        return held.shape[2]

    def _put_keys(self, b: int, cols: Any, data: mx.array) -> None:
        """Overwrite row ``b``'s key columns ``cols`` with packed ``data``."""
        k = self._words(data.shape[3], "keys")
        self.keys[b : b + 1, :, cols, :] = data[..., :k]  # type: ignore[has-type]
        self.halves.keys[b : b + 1, :, cols, :] = data[..., k:]

    def packed_views(self) -> tuple[mx.array, mx.array]:
        """The keys and values of the positions mlx-lm's buffer gives (its
        ``keys_and_values``), :func:`packed` again (copies, made only when read)."""
        words = self.keys_and_values()  # type: ignore[attr-defined]
        halves = self.halves.keys_and_values()
        return tuple(  # type: ignore[return-value]
            mx.concatenate([w, h], axis=-1) for w, h in zip(words, halves, strict=True)
        )

    def trim(self, n: int) -> int:
        self.halves.trim(n)
        return super().trim(n)  # type: ignore[misc]

    def prepare(self, **kwargs: Any) -> None:
        super().prepare(**kwargs)  # type: ignore[misc]
        self.halves.prepare(**kwargs)

    def finalize(self) -> None:
        super().finalize()  # type: ignore[misc]
        self.halves.finalize()

    def _settle_groups(self, joined_keys: mx.array, old: list[int]) -> None:
        """Quantize what the step completed beyond writing it (q4's key groups)."""

    def filter(self, batch_indices: list[int]) -> None:
        super().filter(batch_indices)  # type: ignore[misc]
        self.halves.filter(batch_indices)
        for buffer in (self, self.halves):  # (a cut of left padding leaves strided views)
            if buffer.keys is not None:
                buffer.keys = mx.contiguous(buffer.keys)
                buffer.values = mx.contiguous(buffer.values)
        self.lengths = [self.lengths[i] for i in batch_indices]
        self.counts = [self.counts[i] for i in batch_indices]
        if self.recent is not None:
            index = mx.array(batch_indices)
            self.recent = tuple(r[index] for r in self.recent)
        if self.first_kv is not None:
            index = mx.array(batch_indices)
            self.first_kv = tuple(x[index] for x in self.first_kv)
            self.first_held = [self.first_held[i] for i in batch_indices]

    def extend(self, other: QuantizedLayer) -> None:
        mine, theirs = self._recent_for(other), other._recent_for(self)
        firsts = _stack_firsts(self._firsts() + other._firsts())
        super().extend(other)  # type: ignore[misc]
        self.halves.extend(other.halves)
        self.lengths = self.lengths + other.lengths
        self.counts = self.counts + other.counts
        if mine is not None:
            self.recent = tuple(mx.concatenate(p, axis=0) for p in zip(mine, theirs, strict=True))
        self.first_kv, self.first_held = firsts

    def _firsts(self) -> list[tuple[mx.array, mx.array] | None]:
        """Each row's ``first_kv`` (None: it has none)."""
        if self.first_kv is None:
            return [None] * len(self.lengths)
        return [
            tuple(x[b : b + 1] for x in self.first_kv) if held else None
            for b, held in enumerate(self.first_held)
        ]

    def _recent_for(self, other: QuantizedLayer) -> tuple[mx.array, mx.array] | None:
        """``recent``, or zeros shaped like ``other``'s (None when neither has any)."""
        if self.recent is not None or other.recent is None:
            return self.recent
        B = len(self.lengths)
        return tuple(mx.zeros((B, *r.shape[1:]), r.dtype) for r in other.recent)

    def extract(self, idx: int) -> Any:
        row = super().extract(idx)  # type: ignore[misc]
        halves = self.halves.extract(idx)
        if row.keys is not None:  # (packed again)
            row.keys = mx.concatenate([row.keys, halves.keys], axis=-1)
            row.values = mx.concatenate([row.values, halves.values], axis=-1)
        row.float_count = self.counts[idx]
        if self.recent is None:
            row.recent = None
        else:  # copies, as mlx-lm's extract copies the buffers (a view keeps the group's alive)
            row.recent = tuple(mx.contiguous(r[idx : idx + 1]) for r in self.recent)
        row.first_kv = None
        if self.first_kv is not None and self.first_held[idx]:
            row.first_kv = tuple(mx.contiguous(x[idx : idx + 1]) for x in self.first_kv)
        return row

    @property
    def nbytes(self) -> int:
        held = super().nbytes + self.halves.nbytes  # type: ignore[misc]
        held += 0 if self.recent is None else sum(r.nbytes for r in self.recent)
        return held + (0 if self.first_kv is None else sum(x.nbytes for x in self.first_kv))


def words_in(width: int, bits: int, group: int) -> int:
    """How many of a :func:`packed` head's ``width`` words are ``mx.quantize``'s words (the
    rest: its float16 scales and biases, a word a group)."""
    dim = 32 * width * group // (bits * group + 32)
    if packed_dim(dim, bits, group) != width:
        raise ValueError(f"{width} words are not a packed head at {bits} bits, groups of {group}")
    return dim * bits // 32


def split_buffer(
    rows: list[Any],
    cls: type,
    keys: tuple[int, int],
    values: tuple[int, int],
    merge: Callable[[list[Any]], Any],
) -> Any:
    """A :class:`QuantizedLayer` buffer of class ``cls`` of packed single-row caches, their words
    and their scales' and biases' words merged apart by ``merge`` (of rows, none included:
    one empty row), with no packed copy of the group; ``keys`` and ``values``: their (bits,
    group size)."""

    def part(row: Any, words: bool) -> Any:
        ring = isinstance(row, RotatingKVCache)
        out = RotatingKVCache(row.max_size) if ring else KVCache()
        out.offset = row.offset
        if ring:
            out._idx = row._idx
        if row.keys is not None:
            k = words_in(row.keys.shape[3], *keys)
            v = words_in(row.values.shape[3], *values)
            out.keys = row.keys[..., :k] if words else row.keys[..., k:]
            out.values = row.values[..., :v] if words else row.values[..., v:]
        return out

    buffer = merge([part(r, True) for r in rows])
    buffer.__class__ = cls
    buffer.halves = merge([part(r, False) for r in rows])
    # (a ring of q4 key groups leaves whole: ``GroupRotatingKVCache.extract``)
    buffer.halves.per_channel = cls.per_channel
    return buffer


def _merge_global(parts: list[Any]) -> GroupKVCache:
    """mlx-lm's merge of single-row caches (none: one empty row)."""
    return GroupKVCache.merge(parts) if parts else GroupKVCache([0])


def held_arrays(layer: Any) -> list[mx.array]:
    """The arrays a batch layer's buffer holds (a :class:`QuantizedLayer`'s halves too): what
    a step evaluates after writing it."""
    arrays = [layer.keys, layer.values]
    halves = getattr(layer, "halves", None)
    return arrays if halves is None else [*arrays, halves.keys, halves.values]


class GroupQuantizedKVCache(QuantizedLayer, GroupKVCache):
    """A group's buffer for one global-attention layer, its keys and values quantized."""


class GroupQuantizedRotatingKVCache(QuantizedLayer, GroupRotatingKVCache):
    """A group's buffer for one sliding-window layer, its keys and values quantized."""


def quantized_buffer(
    rows: list[Any], window: int | None, bits: int, group_size: int, rotated_keys: bool = False
) -> Any:
    """One group buffer of packed single-row caches (none: one empty row); ``rotated_keys``:
    they hold their keys rotated by :func:`hadamard`."""
    kinds = ((bits, group_size), (bits, group_size))
    if window is None:
        merged = split_buffer(rows, GroupQuantizedKVCache, *kinds, _merge_global)
    else:

        def merge(parts: list[Any]) -> GroupRotatingKVCache:
            return GroupRotatingKVCache.merge(parts) if parts else GroupRotatingKVCache(window, [0])

        merged = split_buffer(rows, GroupQuantizedRotatingKVCache, *kinds, merge)
    merged.bits = bits
    merged.rotated_keys = rotated_keys
    return _with_recent(merged, rows, group_size, group_size)


def _stack_firsts(
    firsts: list[tuple[mx.array, mx.array] | None],
) -> tuple[tuple[mx.array, mx.array] | None, list[bool]]:
    """Rows' ``first_kv`` (None: a row without) as one buffer's ``first_kv`` and
    ``first_held`` (zeros for the rows without; None when no row has them)."""
    some = next((x for x in firsts if x is not None), None)
    held = [x is not None for x in firsts]
    if some is None:
        return None, held
    return tuple(
        mx.concatenate([mx.zeros_like(some[k]) if x is None else x[k] for x in firsts], axis=0)
        for k in range(2)
    ), held


def _with_recent(
    merged: Any,
    rows: list[Any],
    key_group: int,
    value_group: int,
    first_kv: tuple[mx.array, mx.array] | None = None,
) -> Any:
    """``merged`` (a buffer of ``rows``) given its group sizes and the rows' lengths, float
    positions and first positions (``first_kv``: every row's, else each row's own if it
    carries them)."""
    merged.group_size, merged.value_group_size = key_group, value_group
    merged.lengths = [row.offset for row in rows] or [0]
    held = [getattr(row, "recent", None) for row in rows]
    # (a row without float copies reads every position before it joins through its words)
    merged.counts = [
        getattr(row, "float_count", 0) if r is not None else 0
        for row, r in zip(rows, held, strict=True)
    ] or [0]
    some = next((r for r in held if r is not None), None)
    merged.recent = None
    if some is not None:
        parts = [r if r is not None else tuple(mx.zeros_like(x) for x in some) for r in held]
        merged.recent = tuple(mx.concatenate([p[k] for p in parts], axis=0) for k in range(2))
    firsts = [first_kv or getattr(row, "first_kv", None) for row in rows] or [first_kv]
    merged.first_kv, merged.first_held = _stack_firsts(firsts)
    return merged


class _ChannelQuantized(QuantizedLayer):
    """Keys and values as a q4 cache file holds them: keys per channel over groups of
    ``group_size`` (:data:`KEY_GROUP_SIZE`) positions at :data:`KEY_BITS` bits (their float16
    scales spread over the group's slots), quantized once a group's last position is
    :data:`FLOAT_WINDOW` old (until then its positions are held per position, and read from
    ``recent``); values rotated by :func:`hadamard` and quantized to 4 bits per position in
    groups of ``value_group_size``. ``recent`` holds the :data:`FLOAT_WINDOW` newest positions
    and those of the key group not yet complete. ``engine.attention`` folds each key group's
    scales into the query instead of expanding the keys.

    A global layer also holds each row's first position in float (``first_kv``), which
    attention reads instead of its words: causal attention makes a sequence's first keys and
    values a function of its first token alone, so the engine computes them once a token
    (``engine.runner.ModelRunner.first_positions``) for every row, whatever it joined from; its
    words stay as quantized (a cache file's bytes do not change). That position (the BOS
    token) draws much of the attention and carries large channels: reading it in float cut
    q4's mean KL by a fifth at a 4K history (``bench_q4_schemes``).
    """

    bits = 4
    key_bits = KEY_BITS
    per_channel = True
    rotated_values = True

    def float_positions(self) -> int:
        return float_window(self.group_size)

    def floats_of(self, length: int) -> int:
        """Of a row of ``length`` positions, how many newest ones it holds in float."""
        return length - channel_boundary(length, self.group_size)

    def step_floats(
        self, old: list[int], n: int, fences: FenceRows
    ) -> tuple[tuple[int, ...], mx.array | None]:
        # What was float before the step and what it writes (a prompt's chunk sees itself
        # unquantized); the groups it completes are read quantized from the next step on.
        return tuple(self.floats_of(was) + n for was in old), None

    def _settle_groups(self, joined_keys: mx.array, old: list[int]) -> None:
        group = self.group_size
        for b, (was, now) in enumerate(zip(old, self.lengths, strict=True)):
            first, stop = channel_boundary(was, group), channel_boundary(now, group)
            if stop > first:
                self._settle(b, joined_keys, first, stop, now)

    def _settle(self, b: int, joined: mx.array, first: int, stop: int, length: int) -> None:
        """Quantize row ``b``'s keys of positions ``[first, stop)`` per channel (whole groups
        leaving the float part) into its columns."""
        oldest, youngest = length - 1 - first, length - stop  # their ages
        width = joined.shape[2]
        x = joined[b : b + 1, :, width - 1 - oldest : width - youngest, :]
        data = join_packed(*quantize_per_channel(as_float16(x), self.group_size, KEY_BITS))
        newest, L = self._idx - 1, self.keys.shape[2]
        if self._wraps():
            cols: Any = (newest - oldest + mx.arange(stop - first)) % L
        else:
            cols = slice(newest - oldest, newest - youngest + 1)
        self._put_keys(b, cols, data)

    def extract(self, idx: int) -> Any:
        row = super().extract(idx)
        if isinstance(row, RotatingKVCache):
            row.max_size = self.max_size - self.group_size  # the model's window
        return row


class ChannelQuantizedKVCache(_ChannelQuantized, GroupKVCache):
    """A group's buffer for one global-attention layer held as :class:`_ChannelQuantized`."""


class ChannelQuantizedRotatingKVCache(_ChannelQuantized, GroupRotatingKVCache):
    """A group's buffer for one sliding-window layer held as :class:`_ChannelQuantized`, in a
    ring of :func:`ring_size` positions (its masks keep the model's window)."""


def channel_buffer(
    rows: list[Any],
    window: int | None,
    group: int,
    first_kv: tuple[mx.array, mx.array] | None = None,
) -> Any:
    """One group buffer of channel-quantized single-row caches (:func:`channel_row`, values in
    groups of ``group``; none: one empty row); a global layer's rows read their first position
    from ``first_kv`` (:class:`_ChannelQuantized`; else from what each row carries)."""
    kinds = ((KEY_BITS, KEY_GROUP_SIZE), (4, group))
    if window is None:
        merged = split_buffer(rows, ChannelQuantizedKVCache, *kinds, _merge_global)
        return _with_recent(merged, rows, KEY_GROUP_SIZE, group, first_kv)
    size = ring_size(window, KEY_GROUP_SIZE)
    merged = split_buffer(
        rows, ChannelQuantizedRotatingKVCache, *kinds, lambda parts: _merge_ring(parts, size)
    )
    return _with_recent(merged, rows, KEY_GROUP_SIZE, group)


def _merge_ring(rows: list[Any], size: int) -> GroupRotatingKVCache:
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
    merged._idx = merged._offset = longest
    return merged


def channel_row(row: Any, value_group: int, stored: tuple[mx.array, mx.array] | None = None) -> Any:
    """A float single-row cache as a :class:`_ChannelQuantized` layer holds it: positions in
    whole key groups (:data:`KEY_GROUP_SIZE`) at least :data:`FLOAT_WINDOW` old quantized per
    channel, the rest per position (their float in ``recent``), values rotated and quantized
    in groups of ``value_group``; a window from the start of its first key group (positions
    before the window repeat its first, out of any query's reach).

    ``stored``: the row's packed keys and values as a q4 file of the same group sizes stores
    them (the same positions, keys per channel in their whole groups): kept as they are
    wherever the row holds them quantized, so a q4 file joins the batch without being
    quantized again."""
    group = KEY_GROUP_SIZE
    window = row.max_size if isinstance(row, RotatingKVCache) else None
    out = KVCache() if window is None else RotatingKVCache(window)
    out.offset, out.recent = row.offset, None
    keys, values = _held(row)
    if keys is None:
        return out
    n, held = row.offset, keys.shape[2]
    start = (n - held) // group * group
    if n - held > start:  # a window's first group: its earlier positions are gone
        pad = n - held - start
        keys, values = (
            mx.concatenate([mx.repeat(x[..., :1, :], pad, axis=2), x], axis=2)
            for x in (keys, values)
        )
    quantized = max(0, channel_boundary(n, group) - start)
    parts = [packed_per_position(keys[..., quantized:, :], group, KEY_BITS)]
    if quantized:
        head = quantize_per_channel(as_float16(keys[..., :quantized, :]), group, KEY_BITS)
        parts.insert(0, join_packed(*head))
    out.keys = mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
    out.values = packed(hadamard(values.astype(mx.float32)), 4, value_group)
    if stored is not None:  # (a window's file can hold more positions than the window)
        stored = tuple(x[..., x.shape[2] - held :, :] for x in stored)
        first = n - held  # the position of the first one held
        whole = -(-first // group) * group - start  # columns of the first whole stored group
        if quantized > whole:
            out.keys[..., whole:quantized, :] = stored[0][
                ..., whole - (first - start) : quantized - (first - start), :
            ]
        out.values[..., first - start :, :] = stored[1]
    f = float_window(group)
    out.recent = tuple(_last(x, f) for x in (keys, values))
    if window is not None:
        out._idx = out.keys.shape[2]
    return out


def _held(row: Any) -> tuple[mx.array | None, mx.array | None]:
    """A float row's keys and values in temporal order (a window: its last ``max_size``)."""
    if row.keys is None or row.offset == 0:
        return None, None
    if not isinstance(row, RotatingKVCache):
        return row.keys[..., : row.offset, :], row.values[..., : row.offset, :]
    keys, values = row._temporal_order(row.keys), row._temporal_order(row.values)
    n = min(row.offset, row.max_size, keys.shape[2])
    return keys[..., -n:, :], values[..., -n:, :]


def _last(x: mx.array, f: int) -> mx.array:
    """The last ``f`` positions of ``x`` (a copy), zeros before them when it holds fewer."""
    if x.shape[2] >= f:
        return mx.contiguous(x[..., -f:, :])
    return mx.concatenate(
        [mx.zeros((*x.shape[:2], f - x.shape[2], x.shape[3]), x.dtype), x], axis=2
    )


def expanded_channel_row(row: Any, value_group: int, dims: tuple[int, int], dtype: Any) -> Any:
    """A :func:`channel_row` (values in groups of ``value_group``, or a row extracted from a
    channel-quantized buffer) in ``dtype``: a window's last ``max_size`` positions."""
    group = KEY_GROUP_SIZE
    window = row.max_size if isinstance(row, RotatingKVCache) else None
    out = KVCache() if window is None else RotatingKVCache(window)
    out.offset = row.offset
    if row.keys is None or row.offset == 0:
        return out
    n = row.offset
    held_keys = row.keys if window is not None else row.keys[..., :n, :]
    held_values = row.values if window is not None else row.values[..., :n, :]
    L = held_keys.shape[2]
    pos = (n - L + mx.arange(L))[None]
    floats = [n - channel_boundary(n, group)]
    n_words = dims[0] * KEY_BITS // 32
    keys = _overlay(
        channel_keys_f32(
            held_keys[..., :n_words], held_keys[..., n_words:], group, pos, False, KEY_BITS
        ),
        row.recent[0],
        floats,
        L - 1,
        False,
    )
    values = hadamard(expand(held_values, dims[1], mx.float32, 4, value_group))
    values = _overlay(values, row.recent[1], floats, L - 1, False)
    if window is not None:
        keep = min(L, window)
        keys, values = keys[..., -keep:, :], values[..., -keep:, :]
        out._idx = keep
    out.keys, out.values = keys.astype(dtype), values.astype(dtype)
    return out


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
