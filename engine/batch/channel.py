"""q4 in the batch (keys per channel, values rotated): see the package's docstring."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    RotatingKVCache,
)

from agentkv.engine.batch.buffers import (
    FenceRows,
    GroupKVCache,
    GroupRotatingKVCache,
    merge_global,
    merge_ring,
)
from agentkv.engine.batch.held import channel_boundary, float_window, ring_size
from agentkv.engine.batch.quantized import QuantizedLayer, split_buffer, with_recent
from agentkv.engine.codes import as_float16, join_packed, quantize_per_channel
from agentkv.engine.config import KEY_BITS, KEY_GROUP_SIZE
from agentkv.engine.mlxlm import write_index


class _ChannelQuantized(QuantizedLayer):
    """Keys and values as a q4 cache file holds them: keys per channel over groups of
    ``group_size`` (:data:`KEY_GROUP_SIZE`) positions at :data:`KEY_BITS` bits (their float16
    scales spread over the group's slots), quantized once a group's last position is
    :data:`FLOAT_WINDOW` old (until then its positions are held per position, and read from
    ``recent``); values rotated by :func:`hadamard` and quantized to 4 bits per position in
    groups of ``value_group_size``. ``recent`` holds the :data:`FLOAT_WINDOW` newest positions
    and those of the key group not yet complete. ``agentkv.engine.attention`` folds each key group's
    scales into the query instead of expanding the keys.

    A global layer also holds each row's first position in float (``first_kv``), which
    attention reads instead of its words: causal attention makes a sequence's first keys and
    values a function of its first token alone, so the engine computes them once a token
    (``agentkv.engine.runner.ModelRunner.first_positions``) for every row, whatever it joined from;
    its words stay as quantized (a cache file's bytes do not change). That position (the BOS
    token) draws much of the attention and carries large channels: reading it in float cut
    q4's mean KL by a fifth at a 4K history (``benchmarks.research.bench_q4_schemes``).
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
        newest, L = write_index(self) - 1, self.keys.shape[2]
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
        merged = split_buffer(rows, ChannelQuantizedKVCache, *kinds, merge_global)
        return with_recent(merged, rows, KEY_GROUP_SIZE, group, first_kv)
    size = ring_size(window, KEY_GROUP_SIZE)
    merged = split_buffer(
        rows, ChannelQuantizedRotatingKVCache, *kinds, lambda parts: merge_ring(parts, size)
    )
    return with_recent(merged, rows, KEY_GROUP_SIZE, group)
