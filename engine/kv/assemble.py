"""A tail and its blocks checked against each other and joined into a whole (format-1)
EncodedCache, in numpy: any thread."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from agentkv.engine.errors import CacheFormatError
from agentkv.engine.kv.encoded import (
    FORMAT_VERSION,
    PAGED_FORMAT_VERSIONS,
    EncodedCache,
    is_paged_format,
    tensor,
)
from agentkv.engine.kv.layouts import STORED, parse_paged_layouts, part_bits, part_group, part_names
from agentkv.engine.kv.paged import POINT
from agentkv.engine.kv.quant import quantized_parts
from agentkv.engine.kv.state import STATE_TYPE


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
    if not is_paged_format(meta, "tail"):
        raise CacheFormatError(
            f"not a format-{'/'.join(map(str, PAGED_FORMAT_VERSIONS))} tail (format_version "
            f"{meta.get('format_version')!r}, kind {meta.get('kind')!r})"
        )
    kv_bits, group_size = tail.kv_bits, tail.group_size
    block_tokens = tail.block_tokens
    layouts = parse_paged_layouts(meta)
    globals_ = [i for i, layout in enumerate(layouts) if layout["type"] == "KVCache"]
    start = len(blocks) * block_tokens
    tail = _unstack(tail, globals_, "globals.")
    blocks = [_unstack(block, globals_, "") for block in blocks]
    for j, block in enumerate(blocks):
        _check_block(block, j, kv_bits, group_size, block_tokens, {i: layouts[i] for i in globals_})
    tail_tokens = tensor(tail, "tokens", None, np.int32)
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
            parts = part_names(i, layout.get("group_size") if kv_bits else None)
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
        if layout["type"] == STATE_TYPE:
            whole.append({k: v for k, v in layout.items() if k != "start"})
            continue
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
        if name == "tokens" or name.startswith(("layers.", POINT)):  # (a checkpoint's: windows)
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


def _check_block(
    block: EncodedCache,
    j: int,
    kv_bits: int | None,
    group_size: int | None,
    block_tokens: int,
    globals_: dict[int, dict[str, Any]],
) -> None:
    meta = block.metadata
    if not is_paged_format(meta, "block"):
        raise CacheFormatError(
            f"block {j} is not a format-{'/'.join(map(str, PAGED_FORMAT_VERSIONS))} block"
        )
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
    tokens = tensor(block, "tokens", (block_tokens,), np.int32)
    del tokens
    expected = {"tokens"}
    for i, layout in globals_.items():
        entry = entries[i]
        layer_group = layout.get("group_size") if kv_bits else None
        fields = (
            "dtype",
            "group_size",
            "channel_keys",
            "key_group_size",
            "key_bits",
            "rotated_values",
            "rotated_keys",
        )
        if any(entry.get(f) != layout.get(f) for f in fields):
            raise CacheFormatError(
                f"block {j} layer {i}: dtype, group size or quantization scheme differs from "
                "the tail"
            )
        for kv in ("keys", "values"):
            s = layout[f"{kv}_shape"]
            shape = (s[0], s[1], block_tokens, s[3])
            name = f"layers.{i}.{kv}"
            if layer_group is None:
                tensor(block, name, shape, STORED[layout["dtype"]])
                expected.add(name)
            else:
                group = part_group(layout, kv, layer_group)
                quantized_parts(block, name, shape, group, part_bits(layout, kv, kv_bits))
                expected |= {f"{name}.q", f"{name}.scales", f"{name}.biases"}
    if extra := sorted(set(block.tensors) - expected):
        raise CacheFormatError(f"block {j} has unexpected tensors {extra}")
