"""Quantizing keys and values for storage (``mx.quantize``) and expanding them again: in numpy
on a reader thread, or in MLX on the generation thread, both in float32."""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import numpy as np

from engine.batch_caches import Packing, as_float16
from engine.errors import CacheFormatError
from engine.kv.encoded import GROUP_SIZES, EncodedCache, choose_group_size, tensor
from engine.kv.layouts import STORED, group_of, parse_layouts

log = logging.getLogger(__name__)
_warned_head_dims: set[int] = set()


def stored_kv(
    i: int,
    keys: mx.array,
    values: mx.array,
    kv_bits: int | None,
    group_size: int | None,
    packing: Packing | None = None,
) -> dict[str, mx.array]:
    """Layer ``i``'s keys and values as stored: as they are (bfloat16 as its uint16 bits), or
    ``mx.quantize``d words, scales and biases (lazy).

    Keys and values packed by the batch (``packing``, ``engine.batch_caches``) are the words,
    scales and biases ``mx.quantize`` made of their float16 cast: stored as they are when the
    file's bits and group size are the batch's (no dequantize, no drift across resumes),
    else dequantized first."""
    out = {}
    for kind, x in (("keys", keys), ("values", values)):
        name = f"layers.{i}.{kind}"
        if x.dtype == mx.uint32:  # packed by the batch
            if packing.stores_as(i, kv_bits, group_size):
                q, scales, biases = packing.parts(i, x, kind)
                out |= {f"{name}.q": q, f"{name}.scales": scales, f"{name}.biases": biases}
                continue
            x = packing.values(i, x, kind)
        if group_size is None:
            out[name] = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
            continue
        q, scales, biases = mx.quantize(as_float16(x), group_size=group_size, bits=kv_bits)
        out |= {f"{name}.q": q, f"{name}.scales": scales, f"{name}.biases": biases}
    return out


def layer_group_size(key_dim: int, value_dim: int, preferred: int) -> int | None:
    """One group size for a layer's keys and values, or None (logged once per head size)."""
    # A group size divides both head sizes exactly when it divides their gcd.
    group_size = choose_group_size(math.gcd(key_dim, value_dim), preferred)
    dims = {key_dim, value_dim}
    if group_size is None and not dims <= _warned_head_dims:
        _warned_head_dims.update(dims)
        log.warning(
            "KV head size %s is not divisible by any quantization group size %s; "
            "such layers are saved unquantized",
            "/".join(map(str, sorted(dims))),
            GROUP_SIZES,
        )
    return group_size


def quantized_parts(
    encoded: EncodedCache, name: str, shape: tuple[int, ...], group_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (packed words, scales, biases) of a quantized tensor, shapes checked."""
    kv_bits = encoded.kv_bits
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
            rows, head_dim = shape[:-1], shape[-1]
            words, scales, biases = quantized_parts(encoded, name, shape, group_size)
            # mx.quantize packs little-endian: 8-bit values are the words' bytes in order,
            # 4-bit values are each byte's low nibble, then its high nibble.
            packed = np.ascontiguousarray(words).view(np.uint8)
            q = packed if kv_bits == 8 else np.stack([packed & 0xF, packed >> 4], axis=-1)
            q = q.reshape(*rows, head_dim // group_size, group_size)
            x = np.multiply(q, scales[..., None].astype(np.float32), dtype=np.float32)
            x += biases[..., None].astype(np.float32)
            tensors[name] = _to_stored(x.reshape(shape), layout["dtype"])
    metadata = encoded.metadata | {"kv_bits": "none", "group_size": "none"}
    return EncodedCache(tensors, metadata)


def _to_stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in the stored form of ``dtype`` (bfloat16 as its uint16 bit pattern)."""
    if dtype != "bfloat16":
        return np.ascontiguousarray(x.astype(STORED[dtype], copy=False))
    bits = x.astype(np.float32, copy=False).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)  # round to nearest even, as a cast would
    return np.ascontiguousarray((rounded >> 16).astype(np.uint16))


def dequantize_f32(
    words: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int, fused: bool
) -> mx.array:
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    if fused:
        return mx.dequantize(words, scales, biases, group_size=group, bits=bits)
    packed = words.view(mx.uint8)
    if bits == 4:  # each byte: low nibble first
        packed = mx.stack([packed & 0xF, packed >> 4], axis=-1)
    rows = words.shape[:-1]
    q = packed.reshape(*rows, scales.shape[-1], group).astype(mx.float32)
    return (q * scales[..., None] + biases[..., None]).reshape(*rows, -1)
