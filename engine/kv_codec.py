"""Per-agent KV caches to host-memory numpy arrays plus string metadata, and back.

Both directions run on the generation thread (every MLX op lives there). An :class:`EncodedCache`
holds only C-contiguous numpy arrays that own their memory, and strings, so a writer thread can
hand it to ``safetensors.numpy.save_file`` without touching MLX.

Format (``format_version`` 1). Tensors: ``tokens`` (int32, 1-D) and, per layer ``i``, either
``layers.{i}.keys`` / ``layers.{i}.values`` (unquantized: the original dtype, bfloat16 as a
uint16 view) or ``layers.{i}.keys.q|.scales|.biases`` and the same for ``values`` (``mx.quantize``
of the float16 cast: uint32 words, float16 scales and biases). Metadata: ``format_version``,
``kv_bits`` ("none", "8", "4"), ``group_size`` ("none" or the preferred group size) and
``layers``, a JSON list with each layer's ``type``, ``offset``, ``max_size``, ``keep``, ``dtype``,
``keys_shape``, ``values_shape`` and ``group_size``. Keys and values are stored in temporal order,
only the positions in use.

Each layer is quantized with the first group size that divides its head dimension, trying the
preferred one, then 64, 32, 128 (what ``mx.quantize`` accepts). A layer that none divides (head
dim 72, say) is stored unquantized, with a logged warning: saving never fails on a head size.
Its layout says ``"group_size": null``; a layout without the field (older files) uses the file's.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engine.errors import CacheFormatError
from engine.request import PromptCache

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts
# 32 rather than mlx-lm's 64: on a trained model (gemma3-270m, 4K history) q8 keeps 99.2% of
# teacher-forced top-1 tokens against 98.4% at 64, for 6% more bytes (q8 0.5625x of float16).
DEFAULT_GROUP_SIZE = 32
FALLBACK_GROUP_SIZES = (64, 32, 128)  # tried in this order after the preferred one
_warned_head_dims: set[int] = set()
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # numpy has no bf16
_LAYER_TYPES = {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache}


@dataclass(slots=True, frozen=True)
class EncodedCache:
    """A prompt cache as plain arrays and strings, ready for a safetensors file.

    Attributes:
        tensors: Host-memory, C-contiguous arrays by name, including ``tokens`` (int32, 1-D).
        metadata: Everything else needed to rebuild the cache (see the module docstring).
    """

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]

    @property
    def num_tokens(self) -> int:
        return int(self.tensors["tokens"].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def kv_bits(self) -> int | None:
        return _parse_int(self.metadata, "kv_bits", (4, 8))

    @property
    def group_size(self) -> int | None:
        return _parse_int(self.metadata, "group_size", GROUP_SIZES)


def check_group_size(head_dim: int, group_size: int) -> None:
    """Raise ValueError (naming both) unless ``mx.quantize`` can quantize rows of ``head_dim``.

    Pure arithmetic, so any thread may call it; tests pin it to what ``mx.quantize`` accepts.
    """
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size {group_size} is not supported; use one of {GROUP_SIZES}")
    if head_dim % group_size:
        raise ValueError(
            f"head_dim {head_dim} is not divisible by group_size {group_size}; "
            f"pick a group size from {GROUP_SIZES} that divides {head_dim}"
        )


def choose_group_size(head_dim: int, preferred: int = 64) -> int | None:
    """The quantization group size for rows of ``head_dim``: ``preferred`` if it divides them,
    else the first of 64, 32, 128 that does; None when none does (store the layer unquantized).
    """
    for group_size in (preferred, *FALLBACK_GROUP_SIZES):
        if group_size in GROUP_SIZES and head_dim % group_size == 0:
            return group_size
    return None


def encode_cache(
    cache: PromptCache, kv_bits: int | None, group_size: int = DEFAULT_GROUP_SIZE
) -> EncodedCache:
    """Copy a prompt cache into host memory, quantizing keys and values if asked.

    Args:
        cache: Per-layer ``KVCache`` / ``RotatingKVCache`` and the tokens they hold.
        kv_bits: None to store keys and values bit-exactly, or 8 / 4 to quantize them.
        group_size: Preferred quantization group size along the head dimension (ignored when
            unquantized); a layer it does not divide uses :func:`choose_group_size`'s choice.

    Returns:
        The encoded cache.

    Raises:
        ValueError: Empty cache, unsupported layer type or dtype, offsets that disagree with
            the token count, kv_bits other than None / 8 / 4, or a group size mx.quantize
            does not know.
    """
    if kv_bits not in (None, 4, 8):
        raise ValueError(f"kv_bits must be None, 8 or 4, got {kv_bits!r}")
    if kv_bits is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"group_size {group_size} is not supported; use one of {GROUP_SIZES}")
    if cache.num_tokens == 0 or not cache.layers:
        raise ValueError("cannot encode an empty cache (no tokens or no layers)")
    pending: dict[str, mx.array] = {}
    layouts = []
    for i, layer in enumerate(cache.layers):
        keys, values, layout = _temporal_layer(layer, i, cache.num_tokens)
        layer_group = None if kv_bits is None else _layer_group_size(keys, values, group_size)
        layouts.append(layout | {"group_size": layer_group})
        pending |= _stored_kv(i, keys, values, kv_bits, layer_group)
    mx.eval(*pending.values())
    # np.array copies (C order): the result owns its memory, so no MLX buffer is freed elsewhere.
    tensors = {name: np.array(x, order="C") for name, x in pending.items()}
    tensors["tokens"] = np.array(cache.tokens, dtype=np.int32)
    metadata = {
        "format_version": str(FORMAT_VERSION),
        "kv_bits": "none" if kv_bits is None else str(kv_bits),
        "group_size": "none" if kv_bits is None else str(group_size),
        "layers": json.dumps(layouts, separators=(",", ":")),
    }
    return EncodedCache(tensors, metadata)


def _stored_kv(
    i: int, keys: mx.array, values: mx.array, kv_bits: int | None, group_size: int | None
) -> dict[str, mx.array]:
    """Layer ``i``'s keys and values as stored: as they are (bfloat16 as its uint16 bits), or
    ``mx.quantize``d words, scales and biases (lazy)."""
    out = {}
    for kind, x in (("keys", keys), ("values", values)):
        name = f"layers.{i}.{kind}"
        if group_size is None:
            out[name] = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
            continue
        q, scales, biases = mx.quantize(x.astype(mx.float16), group_size=group_size, bits=kv_bits)
        out |= {f"{name}.q": q, f"{name}.scales": scales, f"{name}.biases": biases}
    return out


def _layer_group_size(keys: mx.array, values: mx.array, preferred: int) -> int | None:
    """One group size for a layer's keys and values, or None (logged once per head size)."""
    # A group size divides both head sizes exactly when it divides their gcd.
    group_size = choose_group_size(math.gcd(keys.shape[-1], values.shape[-1]), preferred)
    dims = {keys.shape[-1], values.shape[-1]}
    if group_size is None and not dims <= _warned_head_dims:
        _warned_head_dims.update(dims)
        log.warning(
            "KV head size %s is not divisible by any quantization group size %s; "
            "such layers are saved unquantized",
            "/".join(map(str, sorted(dims))),
            GROUP_SIZES,
        )
    return group_size


def decode_cache(encoded: EncodedCache) -> PromptCache:
    """Rebuild the prompt cache (fresh ``KVCache`` / ``RotatingKVCache`` layers, evaluated).

    Quantized keys and values are dequantized and cast back to their original dtype, so the
    result merges into a running batch like any other cache.

    Raises:
        CacheFormatError: Unsupported format_version, bad metadata, a missing, unexpected or
            misshapen tensor, an unknown layer type, or a token count that is not the offset.
    """
    meta = encoded.metadata
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise CacheFormatError(
            f"unsupported format_version {version!r}; this agentkv reads version "
            f"{FORMAT_VERSION} (drop the cache file and let it be rebuilt)"
        )
    kv_bits, group_size = encoded.kv_bits, encoded.group_size
    if (kv_bits is None) != (group_size is None):
        raise CacheFormatError(f"kv_bits {kv_bits} and group_size {group_size} must both be set")
    tokens = _tensor(encoded, "tokens", None, np.int32)
    if tokens.ndim != 1:
        raise CacheFormatError(f"tensor 'tokens' must be 1-D, got shape {tokens.shape}")
    layouts = _parse_layouts(meta)
    expected = {"tokens"}
    for i, layout in enumerate(layouts):
        parts = [""] if _group_of(encoded, layout) is None else [".q", ".scales", ".biases"]
        expected |= {f"layers.{i}.{kv}{part}" for kv in ("keys", "values") for part in parts}
    if extra := sorted(set(encoded.tensors) - expected):
        raise CacheFormatError(f"unexpected tensors {extra} for this layout")
    layers = []
    for i, layout in enumerate(layouts):
        if layout["offset"] != tokens.shape[0]:
            raise CacheFormatError(
                f"layer {i} holds {layout['offset']} positions but tensor 'tokens' has "
                f"{tokens.shape[0]}"
            )
        if layout["type"] == "KVCache":
            layer = KVCache()
        else:
            layer = RotatingKVCache(max_size=layout["max_size"], keep=layout["keep"])
            layer._idx = layout["keys_shape"][2]  # temporal order: next write after the newest
        group_size = _group_of(encoded, layout)
        layer.keys, layer.values = (
            _read_kv(
                encoded, f"layers.{i}.{kv}", layout[f"{kv}_shape"], layout["dtype"], group_size
            )
            for kv in ("keys", "values")
        )
        layer.offset = layout["offset"]
        layers.append(layer)
    mx.eval(*(x for layer in layers for x in (layer.keys, layer.values)))
    return PromptCache(layers, tokens.tolist())


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
    tensors = {"tokens": _tensor(encoded, "tokens", None, np.int32)}
    for i, layout in enumerate(_parse_layouts(encoded.metadata)):
        group_size = _group_of(encoded, layout)
        for kv in ("keys", "values"):
            name, shape = f"layers.{i}.{kv}", tuple(layout[f"{kv}_shape"])
            if group_size is None:  # stored unquantized
                tensors[name] = _tensor(encoded, name, shape, _STORED[layout["dtype"]])
                continue
            rows, head_dim = shape[:-1], shape[-1]
            words, scales, biases = _quantized(encoded, name, shape, group_size)
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
        return np.ascontiguousarray(x.astype(_STORED[dtype], copy=False))
    bits = x.astype(np.float32, copy=False).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)  # round to nearest even, as a cast would
    return np.ascontiguousarray((rounded >> 16).astype(np.uint16))


def _temporal_layer(layer: Any, i: int, num_tokens: int) -> tuple[mx.array, mx.array, dict]:
    """Keys and values of one layer in temporal order (used positions only), and its layout."""
    if type(layer) not in _LAYER_TYPES.values():
        raise ValueError(f"layer {i} is a {type(layer).__name__}; only {list(_LAYER_TYPES)}")
    if layer.offset != num_tokens or layer.keys is None:
        raise ValueError(
            f"layer {i} holds {layer.offset} positions but the cache lists {num_tokens} tokens"
        )
    if type(layer) is KVCache:
        keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
        extra = {"max_size": None, "keep": None}
    else:
        # Unrolls a wrapped ring (keep prefix first) and drops unfilled slots of a larger buffer.
        keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
        extra = {"max_size": layer.max_size, "keep": layer.keep}
    dtype = next((n for n, d in _DTYPES.items() if d == keys.dtype), None)
    if dtype is None or values.dtype != keys.dtype:
        raise ValueError(f"layer {i} has dtype {keys.dtype}/{values.dtype}; need {list(_DTYPES)}")
    layout = {"type": type(layer).__name__, "offset": int(layer.offset), **extra, "dtype": dtype}
    return keys, values, layout | {"keys_shape": keys.shape, "values_shape": values.shape}


def _group_of(encoded: EncodedCache, layout: dict[str, Any]) -> int | None:
    """A layer's quantization group size; None when the file or the layer is unquantized."""
    if encoded.kv_bits is None:
        return None
    return layout.get("group_size", encoded.group_size)


def _read_kv(
    encoded: EncodedCache, name: str, shape: tuple[int, ...], dtype: str, group_size: int | None
) -> mx.array:
    if group_size is None:
        x = mx.array(_tensor(encoded, name, shape, _STORED[dtype]))
        return x.view(mx.bfloat16) if dtype == "bfloat16" else x
    q, scales, biases = _quantized(encoded, name, shape, group_size)
    x = mx.dequantize(
        mx.array(q), mx.array(scales), mx.array(biases), group_size=group_size, bits=encoded.kv_bits
    )
    return x.astype(_DTYPES[dtype])


def _quantized(
    encoded: EncodedCache, name: str, shape: tuple[int, ...], group_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (packed words, scales, biases) of a quantized tensor, shapes checked."""
    kv_bits = encoded.kv_bits
    rows, head_dim = shape[:-1], shape[-1]
    if head_dim % group_size:
        raise CacheFormatError(f"{name}: head_dim {head_dim} not divisible by {group_size}")
    words = _tensor(encoded, f"{name}.q", (*rows, head_dim * kv_bits // 32), np.uint32)
    scales, biases = (
        _tensor(encoded, f"{name}.{p}", (*rows, head_dim // group_size), np.float16)
        for p in ("scales", "biases")
    )
    return words, scales, biases


def _tensor(encoded: EncodedCache, name: str, shape: tuple | None, dtype: type) -> np.ndarray:
    x = encoded.tensors.get(name)
    if x is None:
        raise CacheFormatError(f"tensor {name!r} is missing")
    if x.dtype != dtype or (shape is not None and x.shape != tuple(shape)):
        raise CacheFormatError(
            f"tensor {name!r} is {x.dtype}{list(x.shape)}, expected "
            f"{np.dtype(dtype)}{'' if shape is None else list(shape)}"
        )
    return x


def _parse_int(metadata: dict[str, str], key: str, allowed: tuple[int, ...]) -> int | None:
    raw = metadata.get(key)
    if raw == "none":
        return None
    if raw not in {str(a) for a in allowed}:
        raise CacheFormatError(f"metadata {key!r} is {raw!r}; expected 'none' or one of {allowed}")
    return int(raw)


def _layers_json(metadata: dict[str, str]) -> list[Any]:
    """Metadata ``layers``: a non-empty JSON list (its entries unchecked)."""
    try:
        layouts = json.loads(metadata["layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFormatError(f"metadata 'layers' is missing or not JSON: {exc}") from exc
    if not isinstance(layouts, list) or not layouts:
        raise CacheFormatError("metadata 'layers' must be a non-empty JSON list")
    return layouts


def _parse_layouts(metadata: dict[str, str]) -> list[dict[str, Any]]:
    layouts = _layers_json(metadata)
    for i, layout in enumerate(layouts):
        if problem := _layout_problem(layout):
            raise CacheFormatError(f"layer {i} layout {str(layout)[:200]}: {problem}")
        layout["keys_shape"], layout["values_shape"] = map(
            tuple, (layout["keys_shape"], layout["values_shape"])
        )
    return layouts


def _layout_problem(layout: Any) -> str | None:
    def ints(*values: Any, low: int) -> bool:
        return all(type(v) is int and v >= low for v in values)

    fields = ("type", "offset", "max_size", "keep", "dtype", "keys_shape", "values_shape")
    if not isinstance(layout, dict) or not set(fields) <= layout.keys():
        return f"needs the fields {list(fields)}"
    if layout["type"] not in _LAYER_TYPES:
        return f"unknown layer type {layout['type']!r}; expected one of {list(_LAYER_TYPES)}"
    if layout["dtype"] not in _DTYPES:
        return f"unknown dtype {layout['dtype']!r}; expected one of {list(_DTYPES)}"
    if layout.get("group_size") not in (None, *GROUP_SIZES):
        return f"group_size must be null or one of {GROUP_SIZES}"
    if not ints(layout["offset"], low=1):
        return "offset must be a positive integer"
    if layout["type"] == "RotatingKVCache" and not (
        ints(layout["max_size"], low=1) and ints(layout["keep"], low=0)
    ):
        return "a RotatingKVCache needs an integer max_size >= 1 and keep >= 0"
    k, v = layout["keys_shape"], layout["values_shape"]
    if not all(isinstance(s, list) and len(s) == 4 and ints(*s, low=1) for s in (k, v)):
        return "keys_shape and values_shape must be 4 positive integers (B, heads, length, dim)"
    if k[:3] != v[:3]:
        return "keys and values disagree on batch, heads or length"
    length, offset, max_size = k[2], layout["offset"], layout["max_size"]
    if layout["type"] == "KVCache" and length != offset:
        return f"a KVCache at offset {offset} stores {offset} positions, not {length}"
    # A rotating layer holds at least the last min(offset, max_size) positions, at most all.
    if layout["type"] == "RotatingKVCache" and not (
        min(offset, max_size) <= length <= offset and layout["keep"] < max_size
    ):
        return f"a RotatingKVCache at offset {offset} cannot store {length} positions"
    return None


# ---- paged caches (format 2) ---------------------------------------------------------------
#
# A cache is stored as fixed-size blocks of its global-attention (``KVCache``) layers plus a
# small per-save "tail". Block ``j`` holds positions ``[j*B, (j+1)*B)`` of every global layer
# and those tokens; the tail holds the tokens after the last full block, the global layers'
# positions there, and each sliding-window layer's whole state (at most its window). Blocks are
# keyed by the caller (a hash chain of the tokens) and shared between caches; a turn writes
# only the blocks that are new plus a tail. The new blocks of a save are consecutive, and are
# encoded together as one *segment* (one file): ``n*B`` positions, which
# :func:`split_blocks` cuts back into blocks. ``assemble_paged`` turns a tail and its blocks
# back into a format-1 :class:`EncodedCache` that ``decode_cache`` / ``dequantize_on_host`` read.
#
# Segment (block) tensors: ``tokens`` (int32, n*B) and ``layers.{i}.keys|values`` (or
# ``.q|.scales|.biases``) of shape (1, heads, n*B, dim) for each global layer i, or, when the
# global layers are alike, one tensor per part stacking them on the first axis. Metadata:
# ``format_version`` "2", ``kind`` "block", ``kv_bits``, ``group_size`` and ``layers`` (JSON
# list of ``index``, ``dtype``, ``group_size``). Tail tensors: the same names for every layer
# (global layers only when the tail holds some of their positions); its ``layers`` layout adds
# ``start``, the first position the tail holds of that layer. A *window* is the tail of a cache
# that ends exactly at a block boundary: what a new cache needs, with the blocks before it, to
# start there.

PAGED_FORMAT_VERSION = 2
DEFAULT_BLOCK_TOKENS = 256


@dataclass(slots=True, frozen=True)
class PagedCache:
    """A cache encoded for paged storage: the new blocks as segments (runs of consecutive
    blocks) by the index of their first block, and the tail."""

    segments: dict[int, EncodedCache]
    tail: EncodedCache
    block_tokens: int

    @property
    def nbytes(self) -> int:
        return self.tail.nbytes + sum(b.nbytes for b in self.segments.values())

    def blocks_in(self, first: int) -> range:
        """The indexes of the blocks the segment starting at block ``first`` holds."""
        return range(first, first + self.segments[first].num_tokens // self.block_tokens)


def is_global(layer: Any) -> bool:
    """Whether a layer keeps every position (paged into blocks) rather than a window."""
    return type(layer) is KVCache


def encode_paged(
    cache: PromptCache,
    kv_bits: int | None,
    group_size: int,
    block_tokens: int,
    blocks: set[int] | None = None,
) -> PagedCache:
    """Encode the blocks ``blocks`` (indexes of full blocks; None: all), one segment per run of
    consecutive ones, and the tail.

    Runs on the generation thread; only the positions of the requested blocks and of the tail
    are quantized and copied to host memory.

    Raises:
        ValueError: as :func:`encode_cache`, or a block size below 1.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if kv_bits not in (None, 4, 8):
        raise ValueError(f"kv_bits must be None, 8 or 4, got {kv_bits!r}")
    if cache.num_tokens == 0 or not cache.layers:
        raise ValueError("cannot encode an empty cache (no tokens or no layers)")
    total = cache.num_tokens
    full = total // block_tokens
    wanted = sorted(range(full) if blocks is None else (j for j in blocks if 0 <= j < full))
    # One quantize per layer over [first wanted block, end): rows quantize independently, so
    # slicing afterwards gives exactly what quantizing each block would.
    low = wanted[0] * block_tokens if wanted else full * block_tokens
    pending: dict[str, mx.array] = {}
    layouts, block_layers = [], []
    for i, layer in enumerate(cache.layers):
        keys, values, layout = _temporal_layer(layer, i, total)
        layer_group = None if kv_bits is None else _layer_group_size(keys, values, group_size)
        if is_global(layer):
            keys, values = keys[..., low:, :], values[..., low:, :]
            block_layers.append({"index": i, "dtype": layout["dtype"], "group_size": layer_group})
            start = full * block_tokens
        else:
            start = total - keys.shape[2]
        layouts.append(layout | {"group_size": layer_group, "start": start})
        pending |= _stored_kv(i, keys, values, kv_bits, layer_group)
    mx.eval(*pending.values())
    # Views of MLX memory, read here on the generation thread only: every array handed out
    # below is a numpy copy that owns its memory.
    host = {name: np.asarray(x) for name, x in pending.items()}
    tokens = np.array(cache.tokens, dtype=np.int32)
    common = {
        "format_version": str(PAGED_FORMAT_VERSION),
        "kv_bits": "none" if kv_bits is None else str(kv_bits),
        "group_size": "none" if kv_bits is None else str(group_size),
    }
    globals_ = [entry["index"] for entry in block_layers]
    global_set = set(globals_)
    # Global layers alike (dtype, group size, heads, head sizes) are stacked into one tensor per
    # part, so a block holds a handful of tensors however many layers the model has.
    stacked = bool(globals_) and len({_signature(host, i) for i in globals_}) == 1
    parts = sorted({n.split(".", 2)[2] for n in host if int(n.split(".")[1]) in global_set})

    def positions(name: str, begin: int, end: int) -> np.ndarray:
        layer = int(name.split(".")[1])
        if layer in global_set:  # global arrays start at ``low``
            begin, end = begin - low, end - low
        return np.array(host[name][:, :, begin:end], order="C")

    def global_tensors(begin: int, end: int, prefix: str) -> dict[str, np.ndarray]:
        if not stacked:
            return {n: positions(n, begin, end) for n in host if int(n.split(".")[1]) in global_set}
        return {
            f"{prefix}{part}": np.concatenate(
                [host[f"layers.{i}.{part}"][:, :, begin - low : end - low] for i in globals_],
                axis=0,
            )
            for part in parts
        }

    segments = {}
    block_meta = common | {
        "kind": "block",
        "stacked": "true" if stacked else "false",
        "layers": json.dumps(block_layers, separators=(",", ":")),
    }
    runs: list[list[int]] = []  # [first, end) of each run of consecutive wanted blocks
    for j in wanted:
        if runs and runs[-1][1] == j:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1])
    for first, end in runs:
        begin, end = first * block_tokens, end * block_tokens
        tensors = global_tensors(begin, end, "")
        tensors["tokens"] = tokens[begin:end].copy()
        segments[first] = EncodedCache(tensors, dict(block_meta))
    tail_tensors = {"tokens": tokens[full * block_tokens :].copy()}
    if total > full * block_tokens:
        tail_tensors |= global_tensors(full * block_tokens, total, "globals.")
    for name, array in host.items():
        if int(name.split(".")[1]) not in global_set:
            tail_tensors[name] = np.array(array, order="C")
    for layout in layouts:
        if layout["type"] == "KVCache":
            length = total - full * block_tokens
            for kv in ("keys_shape", "values_shape"):
                shape = layout[kv]
                layout[kv] = (shape[0], shape[1], length, shape[3])
    tail_meta = common | {
        "kind": "tail",
        "stacked": "true" if stacked else "false",
        "block_tokens": str(block_tokens),
        "layers": json.dumps(layouts, separators=(",", ":")),
    }
    return PagedCache(segments, EncodedCache(tail_tensors, tail_meta), block_tokens)


def _signature(host: dict[str, np.ndarray], i: int) -> tuple:
    """What must agree for global layers to be stacked: each part's dtype and shape but the
    number of positions."""
    return tuple(
        (name.split(".", 2)[2], x.dtype.str, x.shape[:2], x.shape[3:])
        for name, x in sorted(host.items())
        if name.startswith(f"layers.{i}.")
    )


def split_blocks(segment: EncodedCache, block_tokens: int) -> list[EncodedCache]:
    """The blocks a segment holds, in order: views of its arrays, each with the segment's
    metadata. Numpy only, any thread.

    Raises:
        CacheFormatError: its tokens are not a whole number of blocks, or a tensor is not
            4-D with that many positions on its third axis.
    """
    if block_tokens < 1:
        raise CacheFormatError(f"block_tokens must be >= 1, got {block_tokens}")
    tokens = _tensor(segment, "tokens", None, np.int32)
    if tokens.ndim != 1:
        raise CacheFormatError(f"segment tokens have shape {list(tokens.shape)}, not 1-D")
    count, rest = divmod(tokens.shape[0], block_tokens)
    if rest or not count:
        raise CacheFormatError(
            f"a segment of {tokens.shape[0]} tokens is not whole {block_tokens}-token blocks"
        )
    for name, x in segment.tensors.items():
        if name != "tokens" and (x.ndim != 4 or x.shape[2] != tokens.shape[0]):
            raise CacheFormatError(
                f"segment tensor {name!r} has shape {list(x.shape)}, not 4-D with "
                f"{tokens.shape[0]} positions"
            )
    if count == 1:
        return [segment]
    return [token_slice(segment, b * block_tokens, (b + 1) * block_tokens) for b in range(count)]


def token_slice(segment: EncodedCache, begin: int, end: int) -> EncodedCache:
    """Positions ``[begin, end)`` of a segment (or tail): views of its arrays on the token axis
    (``tokens``: the first; keys and values: the third), with its metadata."""
    return EncodedCache(
        {
            name: x[begin:end] if name == "tokens" else x[:, :, begin:end]
            for name, x in segment.tensors.items()
        },
        segment.metadata,
    )


def assemble_paged(
    tail: EncodedCache, blocks: list[EncodedCache], *, join: bool = True
) -> EncodedCache | None:
    """The format-1 cache a tail and its blocks (in order) make up: numpy only, any thread.
    ``join=False`` only checks them (as :func:`decode_paged` will read them) and returns None.

    Raises:
        CacheFormatError: a malformed or mismatched tail or block (format, kind, storage
            settings, layer set, shapes, token counts).
    """
    meta = tail.metadata
    if meta.get("format_version") != str(PAGED_FORMAT_VERSION) or meta.get("kind") != "tail":
        raise CacheFormatError(
            f"not a format-{PAGED_FORMAT_VERSION} tail (format_version "
            f"{meta.get('format_version')!r}, kind {meta.get('kind')!r})"
        )
    kv_bits, group_size = tail.kv_bits, tail.group_size
    try:
        block_tokens = int(meta["block_tokens"])
    except (KeyError, ValueError) as exc:
        raise CacheFormatError(f"tail metadata 'block_tokens': {exc}") from exc
    layouts = _parse_paged_layouts(meta)
    globals_ = [i for i, layout in enumerate(layouts) if layout["type"] == "KVCache"]
    start = len(blocks) * block_tokens
    tail = _unstack(tail, globals_, "globals.")
    blocks = [_unstack(block, globals_, "") for block in blocks]
    for j, block in enumerate(blocks):
        _check_block(block, j, kv_bits, group_size, block_tokens, {i: layouts[i] for i in globals_})
    tail_tokens = _tensor(tail, "tokens", None, np.int32)
    total = start + tail_tokens.shape[0]
    concatenate = np.concatenate if join else lambda pieces, axis=0: None
    tensors = {"tokens": concatenate([*(b.tensors["tokens"] for b in blocks), tail_tokens])}
    whole = []
    for i, layout in enumerate(layouts):
        if layout["offset"] != total:
            raise CacheFormatError(
                f"layer {i} holds {layout['offset']} positions, blocks and tail {total}"
            )
        names = [n for n in tail.tensors if n.startswith(f"layers.{i}.")]
        if layout["type"] == "KVCache":
            if layout["start"] != start:
                raise CacheFormatError(
                    f"layer {i}: the tail starts at {layout['start']}, its blocks end at {start}"
                )
            parts = _part_names(i, layout.get("group_size") if kv_bits else None)
            for name in parts:
                pieces = [b.tensors[name] for b in blocks]
                if total > start:
                    if name not in tail.tensors:
                        raise CacheFormatError(f"tensor {name!r} is missing from the tail")
                    pieces.append(tail.tensors[name])
                if pieces:
                    tensors[name] = concatenate(pieces, axis=2)
        else:
            for name in names:
                tensors[name] = tail.tensors[name]
        shapes = {kv: layout[kv] for kv in ("keys_shape", "values_shape")}
        if layout["type"] == "KVCache":
            shapes = {kv: (s[0], s[1], total, s[3]) for kv, s in shapes.items()}
        whole.append({k: v for k, v in layout.items() if k != "start"} | shapes)
    if total == 0:
        raise CacheFormatError("the tail and its blocks hold no tokens")
    if not join:
        return None
    metadata = {
        "format_version": str(FORMAT_VERSION),
        "kv_bits": meta["kv_bits"],
        "group_size": meta["group_size"],
        "layers": json.dumps(whole, separators=(",", ":")),
    }
    return EncodedCache(tensors, metadata)


def _unstack(encoded: EncodedCache, globals_: list[int], prefix: str) -> EncodedCache:
    """A block or tail whose global layers are stacked (metadata ``stacked``), as per-layer
    views ``layers.{i}.*``; any other as it is."""
    if encoded.metadata.get("stacked") != "true":
        return encoded
    tensors = {}
    for name, x in encoded.tensors.items():
        if name == "tokens" or name.startswith("layers."):
            tensors[name] = x
            continue
        if not name.startswith(prefix) or x.ndim != 4 or x.shape[0] != len(globals_):
            raise CacheFormatError(
                f"stacked tensor {name!r} has shape {list(x.shape)}; expected "
                f"{len(globals_)} global layers first"
            )
        for g, i in enumerate(globals_):
            tensors[f"layers.{i}.{name[len(prefix) :]}"] = x[g : g + 1]
    return EncodedCache(tensors, encoded.metadata)


def _part_names(i: int, group_size: int | None) -> list[str]:
    parts = [""] if group_size is None else [".q", ".scales", ".biases"]
    return [f"layers.{i}.{kv}{p}" for kv in ("keys", "values") for p in parts]


def _check_block(
    block: EncodedCache,
    j: int,
    kv_bits: int | None,
    group_size: int | None,
    block_tokens: int,
    globals_: dict[int, dict[str, Any]],
) -> None:
    meta = block.metadata
    if meta.get("format_version") != str(PAGED_FORMAT_VERSION) or meta.get("kind") != "block":
        raise CacheFormatError(f"block {j} is not a format-{PAGED_FORMAT_VERSION} block")
    if block.kv_bits != kv_bits or block.group_size != group_size:
        raise CacheFormatError(
            f"block {j} is stored as kv_bits {block.kv_bits}/group {block.group_size}, "
            f"the tail as {kv_bits}/{group_size}"
        )
    try:
        entries = {e["index"]: e for e in json.loads(meta["layers"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFormatError(f"block {j} metadata 'layers': {exc}") from exc
    if set(entries) != set(globals_):
        raise CacheFormatError(f"block {j} holds layers {sorted(entries)}, not {sorted(globals_)}")
    tokens = _tensor(block, "tokens", (block_tokens,), np.int32)
    del tokens
    expected = {"tokens"}
    for i, layout in globals_.items():
        entry = entries[i]
        layer_group = layout.get("group_size") if kv_bits else None
        if entry.get("dtype") != layout["dtype"] or entry.get("group_size") != layout.get(
            "group_size"
        ):
            raise CacheFormatError(f"block {j} layer {i}: dtype or group size differs from tail")
        for kv in ("keys", "values"):
            s = layout[f"{kv}_shape"]
            shape = (s[0], s[1], block_tokens, s[3])
            name = f"layers.{i}.{kv}"
            if layer_group is None:
                _tensor(block, name, shape, _STORED[layout["dtype"]])
                expected.add(name)
            else:
                _quantized(block, name, shape, layer_group)
                expected |= {f"{name}.q", f"{name}.scales", f"{name}.biases"}
    if extra := sorted(set(block.tensors) - expected):
        raise CacheFormatError(f"block {j} has unexpected tensors {extra}")


def _parse_paged_layouts(metadata: dict[str, str]) -> list[dict[str, Any]]:
    """Tail layouts: format-1 layouts plus ``start``; a global layer may hold 0 positions."""
    layouts = _layers_json(metadata)
    for i, layout in enumerate(layouts):
        if not isinstance(layout, dict) or type(layout.get("start")) is not int:
            raise CacheFormatError(f"layer {i} layout needs an integer 'start'")
        # Validate as the whole layer it stands for (global: all positions).
        probe = dict(layout)
        if probe.get("type") == "KVCache" and isinstance(probe.get("keys_shape"), list):
            offset = probe.get("offset")
            probe["keys_shape"] = [*probe["keys_shape"][:2], offset, probe["keys_shape"][3]]
            probe["values_shape"] = [*probe["values_shape"][:2], offset, *probe["values_shape"][3:]]
        if problem := _layout_problem(probe):
            raise CacheFormatError(f"layer {i} layout {str(layout)[:200]}: {problem}")
        layout["keys_shape"], layout["values_shape"] = map(
            tuple, (layout["keys_shape"], layout["values_shape"])
        )
    return layouts


LoadedFile = tuple[str, dict[str, np.ndarray], dict[str, str]]
"""A file ``decode_paged`` read: its path, its tensors (views of MLX memory) and metadata."""


class BlockRun(NamedTuple):
    """Blocks ``first`` to ``first + count - 1`` of a segment (block) file; ``count`` None: to
    its end."""

    path: str
    first: int = 0
    count: int | None = None


def decode_paged(
    tail_path: str,
    blocks: Sequence[str | BlockRun],
    on_gpu: bool,
    check: Callable[[list[LoadedFile]], None] | None = None,
) -> PromptCache:
    """Load a tail and its blocks (runs of segment files, in order; a path: the whole file)
    straight into MLX and rebuild the prompt cache, on the generation thread: ``mx.load``
    reads each file once into MLX memory (as mlx-lm's own ``load_prompt_cache`` does); the
    runs are joined per layer and quantized layers are dequantized, and while MLX computes
    that, ``check`` sees every file's tensors (zero-copy numpy views of host memory) and
    metadata, the tail last, and raises to refuse them. Dequantization is in float32:
    ``mx.dequantize`` with float32 scales on a GPU, ``q * scale + bias`` as plain array math
    on a CPU (~15x faster than ``mx.dequantize`` there, and exactly what
    :func:`dequantize_on_host` computes). The cache is returned only if ``check`` passes.

    ``check`` is pure numpy (it may hash): nothing in it touches MLX.

    Raises:
        CacheFormatError: malformed tail metadata, or a run past its file's end. Whatever
            ``check`` raises. ValueError / RuntimeError from MLX for a file it cannot read.
    """
    runs = [BlockRun(r) if isinstance(r, str) else r for r in blocks]
    paths = [*dict.fromkeys(run.path for run in runs), tail_path]
    # Read on the CPU stream: host memory, which ``check`` reads without moving it off a GPU.
    loaded = [mx.load(path, return_metadata=True, stream=mx.cpu) for path in paths]
    mx.eval([x for arrays, _ in loaded for x in arrays.values()])
    files = [
        (path, {k: np.asarray(x) for k, x in arrays_.items()}, dict(meta_))
        for path, (arrays_, meta_) in zip(paths, loaded, strict=True)
    ]
    try:
        tail, meta = loaded[-1]
        if meta.get("format_version") != str(PAGED_FORMAT_VERSION) or meta.get("kind") != "tail":
            raise CacheFormatError(f"{tail_path} is not a format-{PAGED_FORMAT_VERSION} tail")
        kv_bits = _parse_int(meta, "kv_bits", (4, 8))
        layouts = _parse_paged_layouts(meta)
        block_tokens = int(meta["block_tokens"])
        segments = {path: arrays for path, (arrays, _) in zip(paths, loaded, strict=True)}
        blocks = [_run_of(segments[run.path], run, block_tokens) for run in runs]
        tokens = [*(b["tokens"] for b in blocks), tail["tokens"]]

        def joined(name: str, tail_name: str) -> mx.array:
            pieces = [b[name] for b in blocks] + ([tail[tail_name]] if tail_name in tail else [])
            return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)

        def expand(got: dict[str, mx.array], group: int | None, dtype: str) -> mx.array:
            if group is None:
                return got[""].view(mx.bfloat16) if dtype == "bfloat16" else got[""]
            x = _dequantize_f32(got[".q"], got[".scales"], got[".biases"], group, kv_bits, on_gpu)
            return x.astype(_DTYPES[dtype])

        globals_ = [i for i, layout in enumerate(layouts) if layout["type"] == "KVCache"]
        stacked = {}  # kv -> every global layer's keys or values, joined and expanded at once
        if meta.get("stacked") == "true" and globals_:
            first = layouts[globals_[0]]
            group = first.get("group_size") if kv_bits else None
            parts = [""] if group is None else [".q", ".scales", ".biases"]
            for kv in ("keys", "values"):
                got = {part: joined(f"{kv}{part}", f"globals.{kv}{part}") for part in parts}
                stacked[kv] = expand(got, group, first["dtype"])
        layers = []
        for i, layout in enumerate(layouts):
            group = layout.get("group_size") if kv_bits else None
            parts = [""] if group is None else [".q", ".scales", ".biases"]
            arrays = []
            for kv in ("keys", "values"):
                if stacked and layout["type"] == "KVCache":
                    g = globals_.index(i)
                    arrays.append(stacked[kv][g : g + 1])
                    continue
                got = {}
                for part in parts:
                    name = f"layers.{i}.{kv}{part}"
                    got[part] = joined(name, name) if layout["type"] == "KVCache" else tail[name]
                arrays.append(expand(got, group, layout["dtype"]))
            if layout["type"] == "KVCache":
                layer = KVCache()
            else:
                layer = RotatingKVCache(max_size=layout["max_size"], keep=layout["keep"])
                layer._idx = layout["keys_shape"][2]  # temporal order: next write after the newest
            layer.keys, layer.values = arrays
            layer.offset = layout["offset"]
            layers.append(layer)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        # A missing or misshapen tensor: a damaged file says which here, else the files do
        # not fit together.
        if check is not None:
            check(files)
        if isinstance(exc, CacheFormatError):
            raise
        raise CacheFormatError(f"{tail_path} and its blocks do not fit together: {exc!r}") from exc
    # The joins and dequantization run (on the device, or MLX's CPU thread) while ``check``
    # hashes the files' memory here; nothing is returned unless it passes.
    arrays = [x for layer in layers for x in (layer.keys, layer.values)]
    mx.async_eval(*arrays)
    if check is not None:
        check(files)
    token_list = (mx.concatenate(tokens) if len(tokens) > 1 else tokens[0]).tolist()
    mx.eval(*arrays)
    return PromptCache(layers, token_list)


def _run_of(arrays: dict[str, mx.array], run: BlockRun, block_tokens: int) -> dict[str, mx.array]:
    """The arrays of a run of blocks of a loaded segment (lazy slices on the token axis)."""
    if run.first == 0 and run.count is None:
        return arrays
    size = arrays["tokens"].shape[0]
    begin = run.first * block_tokens
    end = size if run.count is None else begin + run.count * block_tokens
    if not 0 <= begin < end <= size:
        raise CacheFormatError(
            f"blocks {run.first}+{run.count} of {run.path}: it holds {size // block_tokens}"
        )
    return {n: x[begin:end] if n == "tokens" else x[:, :, begin:end] for n, x in arrays.items()}


def _dequantize_f32(
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
