"""A single row's cache packed and expanded: the conversions between what a finished row
leaves and the model's precision."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
)

from agentkv.engine.batch.held import (
    channel_boundary,
    channel_keys_f32,
    float_window,
    overlay,
)
from agentkv.engine.codes import (
    as_float16,
    expand,
    hadamard,
    join_packed,
    packed,
    packed_per_position,
    quantize_per_channel,
)
from agentkv.engine.config import KEY_BITS, KEY_GROUP_SIZE
from agentkv.engine.mlxlm import set_write_index, temporal_order, write_index


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
    keys, values = held_of(row)
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
        set_write_index(out, out.keys.shape[2])
    return out


def held_of(row: Any) -> tuple[mx.array | None, mx.array | None]:
    """A float row's keys and values in temporal order (a window: its last ``max_size``)."""
    if row.keys is None or row.offset == 0:
        return None, None
    if not isinstance(row, RotatingKVCache):
        return row.keys[..., : row.offset, :], row.values[..., : row.offset, :]
    keys, values = temporal_order(row, row.keys), temporal_order(row, row.values)
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
    keys = overlay(
        channel_keys_f32(
            held_keys[..., :n_words], held_keys[..., n_words:], group, pos, False, KEY_BITS
        ),
        row.recent[0],
        floats,
        L - 1,
        False,
    )
    values = hadamard(expand(held_values, dims[1], mx.float32, 4, value_group))
    values = overlay(values, row.recent[1], floats, L - 1, False)
    if window is not None:
        keep = min(L, window)
        keys, values = keys[..., -keep:, :], values[..., -keep:, :]
        set_write_index(out, keep)
    out.keys, out.values = keys.astype(dtype), values.astype(dtype)
    return out


def is_packed(row: Any) -> bool:
    """Whether a single-row cache holds :func:`packed` keys and values."""
    keys = getattr(row, "keys", None)  # (recurrent state has none)
    return keys is not None and keys.dtype == mx.uint32


def with_kv(row: Any, fn: Any, *kinds: str) -> Any:
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
        set_write_index(out, write_index(row))
    return out
