"""Per-layer layouts: how a cache layer is described in a file's ``layers`` metadata (type,
offset, window, dtype, shapes, group size), read off mlx-lm cache layers and checked when read
back."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from agentkv.engine.batch.packing import Packing
from agentkv.engine.batch.rows import is_packed
from agentkv.engine.errors import CacheFormatError
from agentkv.engine.kv.encoded import GROUP_SIZES, EncodedCache
from agentkv.engine.kv.state import STATE_TYPE, state_layout_problem
from agentkv.engine.mlxlm import temporal_order

KEY_GROUP_SIZES = (16, *GROUP_SIZES)  # of keys per channel: positions a scale covers
FILE_KEY_BITS = (4, 5)  # of keys per channel (5 bits: a key head size that packs into words)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # numpy has no bf16
LAYER_TYPES = {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache}


def temporal_layer(
    layer: Any, i: int, num_tokens: int, packing: Packing | None = None
) -> tuple[mx.array, mx.array, dict]:
    """Keys and values of one layer in temporal order (used positions only), and its layout.

    A layer held packed (uint32 words, see ``agentkv.engine.batch``) is described by
    ``packing``: its layout names the model's dtype and head sizes, its arrays stay packed
    (a layer held with keys per channel is expanded: the batch's float positions are the
    newest, which a file quantizes on its own terms)."""
    if type(layer) not in LAYER_TYPES.values():
        raise ValueError(f"layer {i} is a {type(layer).__name__}; only {list(LAYER_TYPES)}")
    if packing is not None and packing.channel_keys(i) and is_packed(layer):
        layer = packing.expand_layer(i, layer)
    if layer.offset != num_tokens or layer.keys is None:
        raise ValueError(
            f"layer {i} holds {layer.offset} positions but the cache lists {num_tokens} tokens"
        )
    if type(layer) is KVCache:
        keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
        extra = {"max_size": None, "keep": None}
    else:
        # Unrolls a wrapped ring (keep prefix first) and drops unfilled slots of a larger buffer.
        keys, values = temporal_order(layer, layer.keys), temporal_order(layer, layer.values)
        extra = {"max_size": layer.max_size, "keep": layer.keep}
    keys_shape, values_shape, dtype = keys.shape, values.shape, keys.dtype
    if dtype == mx.uint32 and packing is not None and packing.quantized(i):
        dk, dv = packing.dims[i]
        keys_shape, values_shape = (*keys_shape[:3], dk), (*values_shape[:3], dv)
        dtype = packing.dtype
    name = next((n for n, d in DTYPES.items() if d == dtype), None)
    if name is None or values.dtype != keys.dtype:
        raise ValueError(f"layer {i} has dtype {keys.dtype}/{values.dtype}; need {list(DTYPES)}")
    layout = {"type": type(layer).__name__, "offset": int(layer.offset), **extra, "dtype": name}
    return keys, values, layout | {"keys_shape": keys_shape, "values_shape": values_shape}


def group_of(encoded: EncodedCache, layout: dict[str, Any]) -> int | None:
    """A layer's quantization group size; None when the file or the layer is unquantized."""
    if encoded.kv_bits is None:
        return None
    return layout.get("group_size", encoded.group_size)


def part_group(layout: dict[str, Any], kind: str, group: int) -> int:
    """The group size of a quantized layer's ``kind`` ("keys" or "values") given the layer's
    ``group``: keys per channel in their ``key_group_size`` (a layout written before key groups
    had their own: the layer's)."""
    if kind == "keys" and layout.get("channel_keys", False):
        return layout.get("key_group_size", group)
    return group


def part_bits(layout: dict[str, Any], kind: str, bits: int) -> int:
    """The bits of a quantized layer's ``kind`` ("keys" or "values") in a file of ``bits``:
    keys per channel at their ``key_bits`` (a layout written before keys had bits of their
    own: the file's)."""
    if kind == "keys" and layout.get("channel_keys", False):
        return layout.get("key_bits", bits)
    return bits


def part_names(i: int, group_size: int | None) -> list[str]:
    parts = [""] if group_size is None else [".q", ".scales", ".biases"]
    return [f"layers.{i}.{kv}{p}" for kv in ("keys", "values") for p in parts]


def layers_json(metadata: dict[str, str]) -> list[Any]:
    """Metadata ``layers``: a non-empty JSON list (its entries unchecked)."""
    try:
        layouts = json.loads(metadata["layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFormatError(f"metadata 'layers' is missing or not JSON: {exc}") from exc
    if not isinstance(layouts, list) or not layouts:
        raise CacheFormatError("metadata 'layers' must be a non-empty JSON list")
    return layouts


def parse_layouts(metadata: dict[str, str]) -> list[dict[str, Any]]:
    layouts = layers_json(metadata)
    for i, layout in enumerate(layouts):
        if problem := layout_problem(layout):
            raise CacheFormatError(f"layer {i} layout {str(layout)[:200]}: {problem}")
        if layout["type"] == STATE_TYPE:
            continue
        layout["keys_shape"], layout["values_shape"] = map(
            tuple, (layout["keys_shape"], layout["values_shape"])
        )
    return layouts


def parse_paged_layouts(metadata: dict[str, str]) -> list[dict[str, Any]]:
    """Tail layouts: format-1 layouts plus ``start``; a global layer may hold 0 positions."""
    layouts = layers_json(metadata)
    for i, layout in enumerate(layouts):
        if not isinstance(layout, dict) or type(layout.get("start")) is not int:
            raise CacheFormatError(f"layer {i} layout needs an integer 'start'")
        if layout.get("type") == STATE_TYPE:
            if (problem := layout_problem(layout)) or layout["start"] != layout["offset"]:
                problem = problem or "a state layer's tail starts where it ends (its offset)"
                raise CacheFormatError(f"layer {i} layout {str(layout)[:200]}: {problem}")
            continue
        # Validate as the whole layer it stands for (global: all positions).
        probe = dict(layout)
        if probe.get("type") == "KVCache" and isinstance(probe.get("keys_shape"), list):
            offset = probe.get("offset")
            probe["keys_shape"] = [*probe["keys_shape"][:2], offset, probe["keys_shape"][3]]
            probe["values_shape"] = [*probe["values_shape"][:2], offset, *probe["values_shape"][3:]]
        if problem := layout_problem(probe):
            raise CacheFormatError(f"layer {i} layout {str(layout)[:200]}: {problem}")
        layout["keys_shape"], layout["values_shape"] = map(
            tuple, (layout["keys_shape"], layout["values_shape"])
        )
    return layouts


def layout_problem(layout: Any) -> str | None:
    def ints(*values: Any, low: int) -> bool:
        return all(type(v) is int and v >= low for v in values)

    if isinstance(layout, dict) and layout.get("type") == STATE_TYPE:
        return state_layout_problem(layout)
    fields = ("type", "offset", "max_size", "keep", "dtype", "keys_shape", "values_shape")
    if not isinstance(layout, dict) or not set(fields) <= layout.keys():
        return f"needs the fields {list(fields)}"
    if layout["type"] not in LAYER_TYPES:
        return (
            f"unknown layer type {layout['type']!r}; expected one of {[*LAYER_TYPES, STATE_TYPE]}"
        )
    if layout["dtype"] not in DTYPES:
        return f"unknown dtype {layout['dtype']!r}; expected one of {list(DTYPES)}"
    if layout.get("group_size") not in (None, *GROUP_SIZES):
        return f"group_size must be null or one of {GROUP_SIZES}"
    for flag in ("channel_keys", "rotated_values", "rotated_keys"):
        if layout.get(flag, False) is not False and (
            layout[flag] is not True or layout.get("group_size") is None
        ):
            return f"{flag} must be true or false, and true only for a quantized layer"
    key_group = layout.get("key_group_size")
    if "key_group_size" in layout and (
        type(key_group) is not int
        or key_group not in KEY_GROUP_SIZES
        or not layout.get("channel_keys")
    ):
        return f"key_group_size must be one of {KEY_GROUP_SIZES}, and only with channel_keys"
    key_bits = layout.get("key_bits")
    if "key_bits" in layout and (
        type(key_bits) is not int or key_bits not in FILE_KEY_BITS or not layout.get("channel_keys")
    ):
        return f"key_bits must be one of {FILE_KEY_BITS}, and only with channel_keys"
    if not ints(layout["offset"], low=1):
        return "offset must be a positive integer"
    if layout["type"] == "RotatingKVCache" and not (
        ints(layout["max_size"], low=1) and ints(layout["keep"], low=0)
    ):
        return "a RotatingKVCache needs an integer max_size >= 1 and keep >= 0"
    k, v = layout["keys_shape"], layout["values_shape"]
    if not all(isinstance(s, list) and len(s) == 4 and ints(*s, low=1) for s in (k, v)):
        return "keys_shape and values_shape must be 4 positive integers (B, heads, length, dim)"
    if k[3] % layout.get("key_group_size", 1):
        return f"key_group_size {layout['key_group_size']} does not divide the key head size {k[3]}"
    if "key_bits" in layout and k[3] * layout["key_bits"] % 32:
        return f"key_bits {layout['key_bits']} do not pack a key head size of {k[3]} into words"
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
    if layout.get("rotated_values") and v[3] & (v[3] - 1):
        return f"rotated_values needs a power-of-two value head size, not {v[3]}"
    if layout.get("rotated_keys") and (k[3] & (k[3] - 1) or layout.get("channel_keys")):
        return f"rotated_keys needs per-token keys of a power-of-two head size, not {k[3]}"
    return None
