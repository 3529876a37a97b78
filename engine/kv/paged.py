"""Paged caches (format 2; format 3 where q8 keys are rotated), encoding: blocks, segments
and the tail.

A cache is stored as fixed-size blocks of its global-attention (``KVCache``) layers plus a
small per-save "tail". Block ``j`` holds positions ``[j*B, (j+1)*B)`` of every global layer
and those tokens; the tail holds the tokens after the last full block, the global layers'
positions there, and each sliding-window layer's whole state (at most its window). Blocks are
keyed by the caller (a hash chain of the tokens) and shared between caches; a turn writes
only the blocks that are new plus a tail. The new blocks of a save are consecutive, and are
encoded together as one *segment* (one file): ``n*B`` positions, which
:func:`split_blocks` cuts back into blocks. ``assemble_paged`` turns a tail and its blocks
back into a format-1 :class:`EncodedCache` that ``decode_cache`` / ``dequantize_on_host`` read.

q4 keys are quantized per channel in groups of ``key_group_size`` positions, to ``key_bits``
(``agentkv.engine.config.KEY_GROUP_SIZE``, ``KEY_BITS``, ``agentkv.engine.kv.quant``) only when a
block is a whole number of such groups; else (and for q8, keys rotated) per token.

Segment (block) tensors: ``tokens`` (int32, n*B) and ``layers.{i}.keys|values`` (or
``.q|.scales|.biases``) of shape (1, heads, n*B, dim) for each global layer i, or, when the
global layers are alike, one tensor per part stacking them on the first axis. Metadata:
``format_version`` "2" ("3" with q8's rotated keys), ``kind`` "block", ``kv_bits``,
``group_size`` and ``layers`` (JSON list of ``index``, ``dtype``, ``group_size``, q8's
``rotated_keys`` and q4's ``channel_keys`` / ``key_group_size`` / ``key_bits`` /
``rotated_values``).
Tail tensors: the same names for every layer (global layers only when the tail holds some of
their positions); its ``layers`` layout adds
``start``, the first position the tail holds of that layer. A *window* is the tail of a cache
that ends exactly at a block boundary: what a new cache needs, with the blocks before it, to
start there.
A tail may also keep one *checkpoint* (``encode_paged(points=True)``): the sliding-window and
state layers as they were where the cache's last prompt ended, as tensors ``point.layers.{i}.*``
and metadata ``point`` (JSON: ``num_tokens`` and the ``layers`` layouts, each with its
``index``). With the global layers cut there, that is the cache of its first ``num_tokens``
tokens, exactly: a client that resends the reply otherwise than it was generated resumes
from there after a restart too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from agentkv.engine.errors import CacheFormatError
from agentkv.engine.kv.encoded import EncodedCache, consecutive_runs, paged_format_of, tensor
from agentkv.engine.kv.layouts import temporal_layer
from agentkv.engine.kv.quant import quant_scheme, stored_kv
from agentkv.engine.kv.state import encode_state
from agentkv.engine.models.caches import is_state
from agentkv.engine.request import Checkpoint, PromptCache
from agentkv.engine.scheme import layer_scheme

POINT = "point."
"""Prefix of a tail's tensors for the checkpoint it keeps (metadata ``point``)."""


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
    points: bool = False,
) -> PagedCache:
    """Encode the blocks ``blocks`` (indexes of full blocks; None: all), one segment per run of
    consecutive ones, and the tail; with ``points``, the tail also keeps the cache's
    checkpoint where its last prompt ended (:func:`kept_point`).

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
        if not is_global(layer):  # whole, in the tail
            tensors, layout = _window(layer, i, total, kv_bits, group_size, block_tokens, cache)
            layouts.append(layout)
            pending |= tensors
            continue
        keys, values, layout = temporal_layer(layer, i, total, cache.packing)
        dims = layout["keys_shape"][3], layout["values_shape"][3]
        decided = layer_scheme(kv_bits, group_size, dims, block_tokens, layout["keep"])
        layer_group = None if decided is None else decided.group_size
        scheme = quant_scheme(decided)
        keys, values = keys[..., low:, :], values[..., low:, :]
        entry = {"index": i, "dtype": layout["dtype"], "group_size": layer_group}
        block_layers.append(entry | scheme)
        layouts.append(layout | {"group_size": layer_group, "start": full * block_tokens} | scheme)
        pending |= stored_kv(i, keys, values, kv_bits, layer_group, cache.packing, low, scheme)
    # The checkpoint kept where the last prompt ended: its windows (see the module docstring).
    point = kept_point(cache) if points else None
    point_layouts, point_pending = [], {}
    if point is not None:
        for i, layer in sorted(point.windows.items()):
            tensors, layout = _window(
                layer, i, point.num_tokens, kv_bits, group_size, block_tokens, cache
            )
            point_layouts.append(layout | {"index": i})
            point_pending |= {f"{POINT}{name}": x for name, x in tensors.items()}
    mx.eval(*pending.values(), *point_pending.values())
    # Views of MLX memory, read here on the generation thread only: every array handed out
    # below is a numpy copy that owns its memory.
    host = {name: np.asarray(x) for name, x in pending.items()}
    tokens = np.array(cache.tokens, dtype=np.int32)
    common = {
        "format_version": str(paged_format_of(layouts)),
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
    for run in consecutive_runs(wanted):  # each run of consecutive wanted blocks: one segment
        first = run.start
        begin, end = first * block_tokens, run.stop * block_tokens
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
    if point is not None:
        tail_tensors |= {name: np.array(x, order="C") for name, x in point_pending.items()}
        entry = {"num_tokens": point.num_tokens, "layers": point_layouts}
        tail_meta["point"] = json.dumps(entry, separators=(",", ":"))
    return PagedCache(segments, EncodedCache(tail_tensors, tail_meta), block_tokens)


def kept_point(cache: PromptCache) -> Checkpoint | None:
    """The checkpoint a saved cache keeps: the latest where a prompt ended and the reply
    began (``GenerationRequest.checkpoint_prompt``), before its end; None when it has none."""
    points = [c for c in cache.checkpoints if c.prompt_end and 0 < c.num_tokens < cache.num_tokens]
    return max(points, key=lambda c: c.num_tokens, default=None)


def _window(
    layer: Any,
    i: int,
    total: int,
    kv_bits: int | None,
    group_size: int,
    block_tokens: int,
    cache: PromptCache,
) -> tuple[dict[str, mx.array], dict]:
    """A sliding-window or state layer's tensors (lazy) and layout: all it holds, after
    ``total`` tokens."""
    if is_state(layer):
        state, layout = encode_state(layer, i, total)
        return state, layout | {"start": total}
    keys, values, layout = temporal_layer(layer, i, total, cache.packing)
    dims = layout["keys_shape"][3], layout["values_shape"][3]
    decided = layer_scheme(kv_bits, group_size, dims, block_tokens, layout["keep"])
    layer_group = None if decided is None else decided.group_size
    scheme = quant_scheme(decided)
    start = total - keys.shape[2]
    layout |= {"group_size": layer_group, "start": start} | scheme
    return stored_kv(i, keys, values, kv_bits, layer_group, cache.packing, start, scheme), layout


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
    tokens = tensor(segment, "tokens", None, np.int32)
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
