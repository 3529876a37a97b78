"""Quantized codes: what q8 and q4 hold of keys and values, in the batch and in cache files
alike (words, float16 scales and biases, 4- and 5-bit packing per channel or per position, the
Hadamard rotation)."""

from __future__ import annotations

import math

import mlx.core as mx

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
    its positions' slots, ``D / group`` to a position, in channel order
    (``agentkv.engine.kv.quant``)."""
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
    subtracts, then one scaling, the float32 bits ``agentkv.engine.kv.quant.hadamard_on_host``
    computes on a CPU."""
    return mx.hadamard_transform(x, scale=1 / math.sqrt(x.shape[-1]))


def rotates_keys(bits: int | None, key_dim: int) -> bool:
    """Whether keys of ``key_dim`` are held rotated by :func:`hadamard` at ``bits``: q8's, of
    a power-of-two head size (the batch and the cache files alike)."""
    return bits == 8 and key_dim & (key_dim - 1) == 0


def rotated_if(x: mx.array, rotate: bool) -> mx.array:
    """``x`` rotated by :func:`hadamard` in float32 when ``rotate``, else as it is."""
    return hadamard(x.astype(mx.float32)) if rotate and x.size else x


def words_in(width: int, bits: int, group: int) -> int:
    """How many of a :func:`packed` head's ``width`` words are ``mx.quantize``'s words (the
    rest: its float16 scales and biases, a word a group)."""
    dim = 32 * width * group // (bits * group + 32)
    if packed_dim(dim, bits, group) != width:
        raise ValueError(f"{width} words are not a packed head at {bits} bits, groups of {group}")
    return dim * bits // 32
