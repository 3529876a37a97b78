"""Quantizing keys and values for storage and expanding them again: in numpy on a reader thread, or
in MLX on the generation thread, both in float32.

q8 quantizes every position's keys and values along the head dimension (``mx.quantize``, a
float16 scale and bias per group of ``group_size`` values), keys rotated first by an orthonormal
Walsh-Hadamard transform of the head dimension (:func:`hadamard`; a power-of-two head size): a
key's few large channels otherwise set its groups' scales, and the rest lose their precision
(``bench_fidelity`` and ``benchmarks.research.bench_q4_schemes`` measure it). q4 quantizes
values rotated the same way (a few large channels spread over all of them), in groups of the
layer's ``group_size``, and quantizes keys per channel instead: each channel over
``key_group_size`` (:data:`~engine.config.KEY_GROUP_SIZE`, 32) consecutive positions (KIVI), to
``key_bits`` (:data:`~engine.config.KEY_BITS`, 5: the bytes of four-bit codes over 16 positions,
half their step). Keys have outlier channels that one per-token scale cannot serve; along the
positions, a channel's values are alike (``docs/research/kv-fidelity.md`` compares the
schemes).

A per-channel key group is positions ``[k * group, (k + 1) * group)`` of the sequence, whole
inside the stored ones; its ``head_dim`` scales (and biases) are spread over its positions'
scale slots, ``head_dim / group`` to a position, in channel order. So the scales and biases have
the shapes of per-token quantization in groups of ``group`` (the words ``head_dim * key_bits /
32`` a position) and every tensor is cut into blocks along the positions like it; positions of a
group that is not whole (a sliding window's first, a cache's last) are quantized per token, at
the same bits, in groups of ``group`` channels (by the same min/max rule,
``agentkv.engine.codes.quantize_per_position``), and all of a window's keys are per token in the
layer's
``group_size`` when it keeps its first positions (mlx-lm's ``keep``). A layer's layout says
which scheme it uses (``channel_keys`` with its ``key_group_size`` and ``key_bits``,
``rotated_values``, q8's ``rotated_keys``); a layout without them (unquantized, or a file
written before) is per token and unrotated; one with ``channel_keys`` but no ``key_group_size``
(written before key groups of their own) has key groups of its ``group_size``, and one without
``key_bits`` (written before five-bit keys) four-bit keys.
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import numpy as np

from agentkv.engine.batch.packing import Packing
from agentkv.engine.codes import (
    as_float16,
    codes_of,
    hadamard,
    quantize_per_channel,
    quantize_per_position,
)
from agentkv.engine.errors import CacheFormatError
from agentkv.engine.kv.encoded import GROUP_SIZES, EncodedCache, tensor
from agentkv.engine.kv.layouts import STORED, group_of, parse_layouts, part_bits, part_group
from agentkv.engine.scheme import LayerScheme

log = logging.getLogger(__name__)
ROTATED = {"keys": "rotated_keys", "values": "rotated_values"}  # a layout's flag for each


def quant_scheme(scheme: LayerScheme | None) -> dict[str, bool | int]:
    """The layout fields a cache file stores a layer of ``scheme`` under (none for a layer in
    the model's precision): ``agentkv.engine.scheme.layer_scheme`` decides them, for the batch
    too."""
    return {} if scheme is None else scheme.flags()


def stored_kv(
    i: int,
    keys: mx.array,
    values: mx.array,
    kv_bits: int | None,
    group_size: int | None,
    packing: Packing | None = None,
    start: int = 0,
    scheme: dict[str, bool | int] | None = None,
) -> dict[str, mx.array]:
    """Layer ``i``'s keys and values as stored: as they are (bfloat16 as its uint16 bits), or
    quantized words, scales and biases (lazy); ``start``: the position of the first one;
    ``scheme``: :func:`quant_scheme`'s fields (rotated keys; per-channel keys, rotated values).

    Keys and values packed by the batch (``packing``, ``agentkv.engine.batch``) are the words,
    scales and biases ``mx.quantize`` made of their float16 cast: stored as they are when the
    file's bits, group size and scheme are the batch's, per token (no dequantize, no drift
    across resumes), else dequantized first."""
    scheme = scheme or {}
    out = {}
    for kind, x in (("keys", keys), ("values", values)):
        name = f"layers.{i}.{kind}"
        if x.dtype == mx.uint32:  # packed by the batch
            if packing.stores_as(i, kv_bits, group_size, scheme):
                q, scales, biases = packing.parts(i, x, kind)
                out |= {f"{name}.q": q, f"{name}.scales": scales, f"{name}.biases": biases}
                continue
            x = packing.values(i, x, kind)
        if group_size is None:
            out[name] = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
            continue
        if kind == "keys" and scheme.get("channel_keys"):
            key_group = scheme.get("key_group_size", group_size)
            key_bits = scheme.get("key_bits", kv_bits)
            q, scales, biases = quantize_channel_keys(x, start, key_group, key_bits)
        else:
            if scheme.get(ROTATED[kind]) and x.size:
                x = hadamard(x.astype(mx.float32))
            q, scales, biases = mx.quantize(as_float16(x), group_size=group_size, bits=kv_bits)
        out |= {f"{name}.q": q, f"{name}.scales": scales, f"{name}.biases": biases}
    return out


def channel_span(start: int, length: int, group: int) -> tuple[int, int]:
    """Of ``length`` stored positions, the first at ``start``: the indexes ``[a, b)`` of those
    in whole key groups of ``group`` positions (``a == b``: none)."""
    a = -start % group
    b = (start + length) // group * group - start
    return (a, b) if b > a else (0, 0)


def quantize_channel_keys(
    keys: mx.array, start: int, group: int, bits: int
) -> tuple[mx.array, mx.array, mx.array]:
    """Keys ``(..., L, D)`` from position ``start`` as words of ``bits`` (along the head
    dimension, as ``mx.quantize`` packs them) and float16 scales and biases ``(..., L, D /
    group)``: per channel over each whole group of ``group`` positions (its scales spread over
    its positions' slots), per token in groups of ``group`` channels elsewhere."""
    x = as_float16(keys)
    a, b = channel_span(start, x.shape[-2], group)
    if a == b:
        return quantize_per_position(x, group, bits)
    pieces = []
    if a:
        pieces.append(quantize_per_position(x[..., :a, :], group, bits))
    pieces.append(quantize_per_channel(x[..., a:b, :], group, bits))
    if b < x.shape[-2]:
        pieces.append(quantize_per_position(x[..., b:, :], group, bits))
    return tuple(mx.concatenate([p[k] for p in pieces], axis=-2) for k in range(3))


def hadamard_on_host(x: np.ndarray) -> np.ndarray:
    """:func:`hadamard` in numpy (a float32 array)."""
    shape, dim = x.shape, x.shape[-1]
    # The head dimension first, so each butterfly adds whole contiguous rows.
    y = np.ascontiguousarray(x.reshape(-1, dim).T, dtype=np.float32)
    out = np.empty_like(y)
    h = 1
    while h < dim:
        pairs, into = (a.reshape(dim // (2 * h), 2, h, -1) for a in (y, out))
        np.add(pairs[:, 0], pairs[:, 1], out=into[:, 0])
        np.subtract(pairs[:, 0], pairs[:, 1], out=into[:, 1])
        y, out = out, y
        h *= 2
    y *= np.float32(1 / math.sqrt(dim))
    return np.ascontiguousarray(y.T).reshape(shape)


def quantized_parts(
    encoded: EncodedCache, name: str, shape: tuple[int, ...], group_size: int, kv_bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (packed words, scales, biases) of a tensor quantized to ``kv_bits``, shapes
    checked."""
    rows, head_dim = shape[:-1], shape[-1]
    if head_dim % group_size:
        raise CacheFormatError(f"{name}: head_dim {head_dim} not divisible by {group_size}")
    words = tensor(encoded, f"{name}.q", (*rows, head_dim * kv_bits // 32), np.uint32)
    scales, biases = (
        tensor(encoded, f"{name}.{p}", (*rows, head_dim // group_size), np.float16)
        for p in ("scales", "biases")
    )
    return words, scales, biases


def dequantize_on_host(encoded: EncodedCache) -> EncodedCache:
    """The same cache with quantized keys/values expanded in numpy (no MLX: any thread).

    Loading runs this in the reader thread so that :func:`decode_cache` on the generation
    thread only copies arrays in, instead of stalling the batch on dequantization.

    ``q * scale + bias`` is computed in float32 and rounded once, to the cache's dtype: exact
    for a float32 cache. ``mx.dequantize`` rounds to float16 after each operation instead,
    which costs numpy ~15x more (float16 conversions are not vectorized) and is less exact;
    the two differ by at most one float16 step.

    Raises:
        CacheFormatError: as :func:`decode_cache`.
    """
    kv_bits = encoded.kv_bits
    if kv_bits is None:
        return encoded
    tensors = {"tokens": tensor(encoded, "tokens", None, np.int32)}
    for i, layout in enumerate(parse_layouts(encoded.metadata)):
        group_size = group_of(encoded, layout)
        for kv in ("keys", "values"):
            name, shape = f"layers.{i}.{kv}", tuple(layout[f"{kv}_shape"])
            if group_size is None:  # stored unquantized
                tensors[name] = tensor(encoded, name, shape, STORED[layout["dtype"]])
                continue
            group, bits = part_group(layout, kv, group_size), part_bits(layout, kv, kv_bits)
            parts = quantized_parts(encoded, name, shape, group, bits)
            channels = kv == "keys" and layout.get("channel_keys", False)
            start = layout["offset"] - shape[2] if channels else None
            x = expand_on_host(*parts, bits, group, start)
            if layout.get(ROTATED[kv], False) and x.size:
                x = hadamard_on_host(x)
            tensors[name] = _to_stored(x, layout["dtype"])
    metadata = encoded.metadata | {"kv_bits": "none", "group_size": "none"}
    return EncodedCache(tensors, metadata)


def expand_on_host(
    words: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    group: int,
    channel_start: int | None = None,
) -> np.ndarray:
    """Quantized ``(..., L, D)`` values in float32, ``q * scale + bias``: per token, or with
    ``channel_start`` (the first position's), keys per channel in their whole groups
    (:func:`quantize_channel_keys`)."""
    # mx.quantize packs one little-endian bit stream: 8-bit values are the words' bytes in
    # order, 4-bit values each byte's low nibble, then its high nibble, and 5-bit values fill
    # five bytes eight at a time, each one's low bit first.
    *rows, n_words = words.shape
    dim = n_words * 32 // bits
    packed = np.ascontiguousarray(words).view(np.uint8)
    if bits == 8:
        q = packed
    elif bits == 4:
        q = np.stack([packed & 0xF, packed >> 4], axis=-1)
    else:
        eight = packed.reshape(*rows, dim // 8, bits).astype(np.uint64)
        stream = (eight << (8 * np.arange(bits, dtype=np.uint64))).sum(axis=-1, keepdims=True)
        q = (stream >> (bits * np.arange(8, dtype=np.uint64))) & np.uint64(2**bits - 1)
        q = q.astype(np.uint8)
    q = q.reshape(*rows, dim // group, group)
    x = np.multiply(q, scales[..., None].astype(np.float32), dtype=np.float32)
    x += biases[..., None].astype(np.float32)
    x = x.reshape(*rows, dim)
    if channel_start is not None:
        a, b = channel_span(channel_start, rows[-1], group)
        if b > a:
            *lead, _ = rows
            shape = (*lead, (b - a) // group, group, dim)
            whole = q.reshape(*rows, dim)[..., a:b, :].reshape(shape)
            per = [
                p[..., a:b, :].reshape(*lead, (b - a) // group, 1, dim) for p in (scales, biases)
            ]
            channel = np.multiply(whole, per[0].astype(np.float32), dtype=np.float32)
            channel += per[1].astype(np.float32)
            x[..., a:b, :] = channel.reshape(*lead, b - a, dim)
    return x


def _to_stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in the stored form of ``dtype`` (bfloat16 as its uint16 bit pattern)."""
    if dtype != "bfloat16":
        return np.ascontiguousarray(x.astype(STORED[dtype], copy=False))
    bits = x.astype(np.float32, copy=False).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)  # round to nearest even, as a cast would
    return np.ascontiguousarray((rounded >> 16).astype(np.uint16))


def dequantize_f32(
    words: mx.array,
    scales: mx.array,
    biases: mx.array,
    group: int,
    bits: int,
    fused: bool,
    channel_start: int | None = None,
) -> mx.array:
    """Quantized values in float32: ``mx.dequantize`` (``fused``), else ``q * scale + bias``
    as :func:`expand_on_host` computes it; ``channel_start``: keys per channel
    (:func:`quantize_channel_keys`), and a group ``mx.dequantize`` does not take, always the
    latter."""
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    if fused and channel_start is None and group in GROUP_SIZES:
        return mx.dequantize(words, scales, biases, group_size=group, bits=bits)
    *rows, n_words = words.shape
    dim = n_words * 32 // bits
    codes = words.view(mx.uint8) if bits == 8 else codes_of(words, bits)
    q = codes.reshape(*rows, dim // group, group).astype(mx.float32)
    x = (q * scales[..., None] + biases[..., None]).reshape(*rows, dim)
    if channel_start is None:
        return x
    a, b = channel_span(channel_start, rows[-1], group)
    if a == b:
        return x
    *lead, _ = rows
    shape = (*lead, (b - a) // group, 1, dim)
    whole = q.reshape(*rows, dim)[..., a:b, :].reshape(*lead, (b - a) // group, group, dim)
    channel = whole * scales[..., a:b, :].reshape(shape) + biases[..., a:b, :].reshape(shape)
    pieces = [x[..., :a, :], channel.reshape(*lead, b - a, dim), x[..., b:, :]]
    return mx.concatenate([p for p in pieces if p.shape[-2]], axis=-2)


def expand_layer_part(
    got: dict[str, mx.array], layout: dict, kind: str, bits: int, group: int, fused: bool
) -> mx.array:
    """A quantized layer's keys (``kind``) or values, as stored in ``got`` (``.q``,
    ``.scales``, ``.biases``) under ``layout`` (the layer's ``group``; keys per channel: in
    their own), in float32 (the keys' positions end at its ``offset``)."""
    start = None
    group, bits = part_group(layout, kind, group), part_bits(layout, kind, bits)
    if kind == "keys" and layout.get("channel_keys", False):
        start = layout["offset"] - got[".q"].shape[-2]
    x = dequantize_f32(got[".q"], got[".scales"], got[".biases"], group, bits, fused, start)
    if layout.get(ROTATED[kind], False) and x.size:
        x = hadamard(x)
    return x
