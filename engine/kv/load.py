"""Loading a paged cache straight into MLX: its files read once, blocks joined per layer,
quantized layers expanded (or packed as stored, for a batch holding them so), checked while
MLX computes."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from agentkv.engine.batch.packing import Packing
from agentkv.engine.batch.rows import channel_row, is_packed
from agentkv.engine.batch.state import row_arrays
from agentkv.engine.codes import join_packed
from agentkv.engine.errors import CacheFormatError
from agentkv.engine.kv.encoded import (
    PAGED_FORMAT_VERSIONS,
    block_tokens_of,
    is_paged_format,
    parse_int,
)
from agentkv.engine.kv.layouts import (
    DTYPES,
    layout_problem,
    parse_paged_layouts,
    part_bits,
    part_group,
)
from agentkv.engine.kv.paged import POINT
from agentkv.engine.kv.quant import expand_layer_part
from agentkv.engine.kv.state import STATE_TYPE, decode_state
from agentkv.engine.mlxlm import set_write_index
from agentkv.engine.request import Checkpoint, PromptCache, layer_nbytes
from agentkv.engine.scheme import FLAGS

log = logging.getLogger(__name__)

LoadedFile = tuple[str, dict[str, np.ndarray], dict[str, str]]
"""A file ``decode_paged`` read: its path, its tensors (views of MLX memory) and metadata."""


class BlockRun(NamedTuple):
    """Blocks ``first`` to ``first + count - 1`` of a segment (block) file; ``count`` None: to
    its end."""

    path: str
    first: int = 0
    count: int | None = None


def decode_paged(
    read: Callable[[list[str]], list[tuple[dict[str, mx.array], dict[str, str]]]],
    tail_path: str,
    blocks: Sequence[str | BlockRun],
    on_gpu: bool,
    check: Callable[[list[LoadedFile]], None] | None = None,
    packing: Packing | None = None,
    first_positions: Callable[[int], list[tuple[mx.array, mx.array]]] | None = None,
) -> PromptCache:
    """Load a tail and its blocks (runs of segment files, in order; a path: the whole file)
    straight into MLX and rebuild the prompt cache, on the generation thread: ``read`` (the
    file format's reader, ``agentkv.store.cache_files.load_into_mlx``) reads each file once into MLX
    memory (as mlx-lm's own ``load_prompt_cache`` does); the
    runs are joined per layer and quantized layers are dequantized, and while MLX computes
    that, ``check`` sees every file's tensors (zero-copy numpy views of host memory) and
    metadata, the tail last, and raises to refuse them. Dequantization is in float32:
    ``mx.dequantize`` with float32 scales on a GPU (q4 keys per channel: the CPU's math),
    ``q * scale + bias`` as plain array math on a CPU (~15x faster than ``mx.dequantize``
    there, and exactly what :func:`dequantize_on_host` computes). The cache is returned only
    if ``check`` passes.

    ``packing``: how the batch holds KV quantized (``Engine.packing``). A layer stored with its
    bits, group size and scheme, per token (q8, keys rotated), is not dequantized: its words,
    scales and biases are packed as the batch holds them (``agentkv.engine.batch``), bit for
    bit what the file stores.
    A q4 layer (keys per channel, values rotated) joins a batch holding q4 with its stored
    words too, its newest positions expanded into the float copies the batch keeps of them.

    ``first_positions``: per layer, the keys and values a sequence starting with a token holds
    at its first position (``Engine.first_positions``: the runner's, kept per token; None
    for a token outside the vocabulary). A layer dequantized here that still holds its first
    position (global layers; sliding ones within their window) takes them in place of what
    its words give: causal attention makes them its first token's alone, and that position
    (BOS) is the one many heads attend to most, so its quantization error weighs most. They
    are had for the first token the files name before ``check`` has verified them (so that
    the dequantized buffers are written in place, not copied); a cache ``check`` refuses is
    not returned. Where they cannot be had (logged), the words' are kept.

    ``check`` is pure numpy (it may hash): nothing in it touches MLX.

    Raises:
        CacheFormatError: malformed tail metadata, or a run past its file's end. Whatever
            ``check`` raises. ValueError / RuntimeError from MLX for a file it cannot read.
    """
    runs = [BlockRun(r) if isinstance(r, str) else r for r in blocks]
    paths = [*dict.fromkeys(run.path for run in runs), tail_path]
    loaded = read(paths)
    files = [
        (path, {k: np.asarray(x) for k, x in arrays_.items()}, dict(meta_))
        for path, (arrays_, meta_) in zip(paths, loaded, strict=True)
    ]
    try:
        tail, meta = loaded[-1]
        if not is_paged_format(meta, "tail"):
            raise CacheFormatError(
                f"{tail_path} is not a tail of format {'/'.join(map(str, PAGED_FORMAT_VERSIONS))}"
            )
        kv_bits = parse_int(meta, "kv_bits", (4, 8))
        layouts = parse_paged_layouts(meta)
        block_tokens = block_tokens_of(meta)
        segments = {path: arrays for path, (arrays, _) in zip(paths, loaded, strict=True)}
        blocks = [_run_of(segments[run.path], run, block_tokens) for run in runs]
        tokens = [*(b["tokens"] for b in blocks), tail["tokens"]]
        firsts: list = []  # the first token's first positions, once a layer asks (or [None])

        def exact(i: int) -> tuple[mx.array, mx.array] | None:
            """Layer ``i``'s exact first position (had before ``check``: see above)."""
            if not firsts:
                token = int(tokens[0][0].item())
                firsts.append(_first_positions_of(token, first_positions))
            return None if firsts[0] is None else firsts[0][i]

        def joined(name: str, tail_name: str) -> mx.array:
            pieces = [b[name] for b in blocks] + ([tail[tail_name]] if tail_name in tail else [])
            return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)

        def packs(i: int, group: int | None) -> bool:
            return (
                group is not None
                and packing is not None
                and packing.stores_as(i, kv_bits, group, scheme_of(layouts[i]))
            )

        def keeps_channels(i: int, group: int | None) -> bool:
            """Whether a batch holding keys per channel takes layer ``i``'s stored words."""
            layout = layouts[i]
            return (
                group is not None
                and packing is not None
                and packing.channel_keys(i)
                and (kv_bits, group) == (packing.bits, packing.group_sizes[i])
                and bool(layout.get("channel_keys") and layout.get("rotated_values"))
                and part_group(layout, "keys", group) == packing.key_group(i)
                and part_bits(layout, "keys", kv_bits) == packing.bits_of(i, "keys")
            )

        def materialize(
            got: dict[str, mx.array], layout: dict, kind: str, group: int | None, pack: bool
        ) -> mx.array:
            if pack:
                return join_packed(got[".q"], got[".scales"], got[".biases"])
            dtype = layout["dtype"]
            if group is None:
                return got[""].view(mx.bfloat16) if dtype == "bfloat16" else got[""]
            x = expand_layer_part(got, layout, kind, kv_bits, group, on_gpu)
            return x.astype(DTYPES[dtype])

        def takes_exact(
            i: int, group: int | None, packed: bool, layout: dict | None = None
        ) -> bool:
            """Whether layer ``i``, expanded from its words, holds its first position at index
            0 (a global layer, or a sliding one whose window has not wrapped), to be written
            there exactly (written lazily: the dequantized buffer is written in place)."""
            layout = layouts[i] if layout is None else layout
            return (
                first_positions is not None
                and group is not None
                and not packed
                and not keeps_channels(i, group)
                and layout["offset"] >= 1
                and (layout["type"] == "KVCache" or layout["offset"] == layout["keys_shape"][2])
                and exact(i) is not None
            )

        globals_ = [i for i, layout in enumerate(layouts) if layout["type"] == "KVCache"]
        stacked = {}  # kv -> every global layer's keys or values, joined and materialized at once
        stacked_words = {}  # kv -> the same, as stored (for a batch holding keys per channel)
        if meta.get("stacked") == "true" and globals_:
            first = layouts[globals_[0]]
            group = first.get("group_size") if kv_bits else None
            parts = [""] if group is None else [".q", ".scales", ".biases"]
            pack = all(packs(i, group) for i in globals_)
            for k, kv in enumerate(("keys", "values")):
                got = {part: joined(f"{kv}{part}", f"globals.{kv}{part}") for part in parts}
                x = stacked[kv] = materialize(got, first, kv, group, pack)
                if any(takes_exact(i, group, pack) for i in globals_):
                    x[:, :, :1, :] = mx.concatenate(
                        [
                            exact(i)[k].astype(x.dtype)
                            if takes_exact(i, group, pack)
                            else x[g : g + 1, :, :1, :]
                            for g, i in enumerate(globals_)
                        ]
                    )
                if any(keeps_channels(i, group) for i in globals_):
                    stacked_words[kv] = join_packed(got[".q"], got[".scales"], got[".biases"])

        def layer_of(i: int, layout: dict, prefix: str = "") -> Any:
            """Layer ``i`` as ``layout`` says, from the tail's tensors named ``prefix`` +
            ``layers.{i}.*`` (a global layer: joined with its blocks')."""
            if layout["type"] == STATE_TYPE:  # whole, in the tail
                return decode_state(lambda name: tail[prefix + name], i, layout)
            group = layout.get("group_size") if kv_bits else None
            parts = [""] if group is None else [".q", ".scales", ".biases"]
            arrays, words = [], []
            for k, kv in enumerate(("keys", "values")):
                if stacked and layout["type"] == "KVCache":
                    g = globals_.index(i)
                    arrays.append(stacked[kv][g : g + 1])
                    if keeps_channels(i, group):
                        words.append(stacked_words[kv][g : g + 1])
                    continue
                got = {}
                for part in parts:
                    name = f"layers.{i}.{kv}{part}"
                    if layout["type"] == "KVCache":
                        got[part] = joined(name, name)
                    else:
                        got[part] = tail[prefix + name]
                x = materialize(got, layout, kv, group, packs(i, group))
                if takes_exact(i, group, packs(i, group), layout):
                    x[..., :1, :] = exact(i)[k].astype(x.dtype)
                arrays.append(x)
                if keeps_channels(i, group):
                    words.append(join_packed(got[".q"], got[".scales"], got[".biases"]))
            if layout["type"] == "KVCache":
                layer = KVCache()
            else:
                layer = RotatingKVCache(max_size=layout["max_size"], keep=layout["keep"])
                set_write_index(layer, layout["keys_shape"][2])  # temporal order: after newest
            layer.keys, layer.values = arrays
            layer.offset = layout["offset"]
            if words:  # held as the file holds it; only the newest positions from the floats
                layer = channel_row(layer, group, stored=tuple(words))
            return layer

        layers = [layer_of(i, layout) for i, layout in enumerate(layouts)]
        # The checkpoint the tail keeps (``agentkv.engine.kv.paged``): its windows, as they were
        # then.
        point = read_point(meta, layouts)
        windows = {}
        if point is not None:
            for layout in point["layers"]:
                i = layout["index"]
                windows[i] = layer_of(i, {k: v for k, v in layout.items() if k != "index"}, POINT)
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
    every = [*layers, *windows.values()]
    arrays = [x for layer in every for x in (*row_arrays(layer), *layer_recent(layer))]
    mx.async_eval(*arrays)
    if check is not None:
        check(files)
    token_list = (mx.concatenate(tokens) if len(tokens) > 1 else tokens[0]).tolist()
    mx.eval(*arrays)
    packed = packing is not None and any(is_packed(layer) for layer in layers)
    points = ()
    if point is not None:
        nbytes = sum(layer_nbytes(x) for x in windows.values())
        points = (Checkpoint(point["num_tokens"], windows, nbytes, prompt_end=True),)
    return PromptCache(layers, token_list, packing=packing if packed else None, checkpoints=points)


def read_point(meta: dict[str, str], layouts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The checkpoint a tail's metadata ``point`` describes (``agentkv.engine.kv.paged``), checked
    against the tail's own layers; None when it keeps none.

    Raises:
        CacheFormatError: it is malformed, or names layers the tail does not hold as windows.
    """
    if "point" not in meta:
        return None
    try:
        point = json.loads(meta["point"])
        n, entries = point["num_tokens"], point["layers"]
        if type(n) is not int or not 0 < n < layouts[0]["offset"] or not entries:
            raise ValueError(f"num_tokens {n!r} is not within the cache")
        for layout in entries:
            i = layout["index"]
            if type(i) is not int or not 0 <= i < len(layouts):
                raise ValueError(f"layer {i!r} is not one of the tail's")
            own = layouts[i]
            if own["type"] == "KVCache" or layout["type"] != own["type"]:
                raise ValueError(f"layer {i} is a {own['type']}, not a window of its own")
            if layout["offset"] != n or (problem := layout_problem(layout)):
                raise ValueError(f"layer {i}: {problem or 'offset is not num_tokens'}")
    except (TypeError, ValueError, KeyError) as exc:
        raise CacheFormatError(f"metadata 'point': {exc}") from exc
    return point


def _first_positions_of(
    token: int, first_positions: Callable[[int], list | None]
) -> list[tuple[mx.array, mx.array]] | None:
    """``first_positions(token)``, or None where it has none (a token outside the model's
    vocabulary: a damaged file, which ``check`` then refuses) or fails (logged: the cache
    reads its first position from its words)."""
    try:
        return first_positions(token)
    except Exception as exc:  # the cache is still good: only its first position is less so
        log.warning("the first position of token %d could not be computed: %r", token, exc)
        return None


def scheme_of(layout: dict) -> dict[str, bool]:
    """A layer's quantization flags (``agentkv.engine.scheme.FLAGS``) as its layout sets them."""
    return {flag: True for flag in FLAGS if layout.get(flag, False)}


def layer_recent(layer: Any) -> tuple[mx.array, ...]:
    """A channel-packed row's float copies of its newest positions (none for other rows)."""
    recent = getattr(layer, "recent", None)
    return () if recent is None else recent


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
