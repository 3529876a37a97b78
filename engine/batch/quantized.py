"""q8 in the batch (:class:`QuantizedLayer`): see the package's docstring."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
)

from agentkv.engine.batch.buffers import (
    FenceRows,
    GroupKVCache,
    GroupRotatingKVCache,
    merge_global,
)
from agentkv.engine.batch.held import FLOAT_WINDOW, HeldQuantized
from agentkv.engine.codes import packed, packed_per_position, rotated_if, words_in
from agentkv.engine.mlxlm import recast, set_write_index, write_index


class QuantizedLayer:
    """Keys and values quantized in a group buffer, and float copies of each row's newest
    positions (``recent``, right-aligned with the buffer), which attention reads instead of
    their words. Every batch operation of mlx-lm's caches (growth, rotation, padding, merging,
    extending, filtering, extracting, trimming) moves positions along one axis, so it runs
    unchanged on them, and ``recent`` moves along the rows; each row's length is kept on the
    host (``lengths``), which says which of its columns hold which positions. A step hands
    attention a :class:`HeldQuantized` (as both keys and values).

    The buffer holds ``mx.quantize``'s words in ``keys`` and ``values`` and the words of their
    float16 scales and biases apart, in ``halves``: a plain mlx-lm buffer whose every operation
    mirrors this one's. ``mx.quantized_matmul`` takes only row-contiguous operands, so words
    sliced out of :func:`packed` rows, and out of a buffer's spare positions, were copied whole
    at every step by both of MLX's backends (on a CPU about 40% of a q8 global layer's step
    over 4 rows of 8K positions); attention now reads the buffers whole, spare positions
    included. Rows still come in packed (:func:`split_buffer` merges their two parts apart)
    and go out packed (:meth:`extract`). mlx-lm's ``state`` covers the words alone: the batch
    never saves or restores a buffer by it.

    q8 (:class:`GroupQuantizedKVCache`) holds every position per position, as a q8 file stores
    it, and keeps float copies of each row's newest :data:`FLOAT_WINDOW` positions (``counts``:
    how many of them a row has since it joined). A query at position ``p`` reads its own
    position and those before it back to ``p - FLOAT_WINDOW`` in float, but none before its
    fence (the latest point at or before ``p`` a cache can start from: where the row joined,
    a multiple of the stored blocks, a shared head's end, ``fences``), so a position computes
    the same whether its prompt came in one chunk or many, or from a cache (a finished row
    leaves its float copies behind: ``agentkv.engine.loop``). Reading the decoded tokens' copies
    raised the top-1 agreement of decoding at a 4K history from 98.05% to 99.61% on ``gemma3-270m``
    (``bench_fidelity``, groups of 32, keys unrotated); reading a prompt's too, that of a
    prompt teacher-forced through the batch from 98.93% to 99.12% (groups of 128, keys
    rotated).
    """

    bits: int
    group_size: int  # of the keys (q4: positions per key group)
    value_group_size: int
    lengths: list[int]
    counts: list[int]
    recent: tuple[mx.array, mx.array] | None
    per_channel = False  # keys quantized per channel as their groups complete (q4)
    rotated_values = False  # values held rotated by :func:`hadamard` (q4)
    rotated_keys = False  # keys held rotated by :func:`hadamard` (q8, set per buffer)
    # q4, a global layer: each row's first position's float keys and values (B, H, 1, D),
    # which rows have them (``first_held``); see :class:`_ChannelQuantized`
    first_kv: tuple[mx.array, mx.array] | None = None
    first_held: list[bool]
    halves: Any  # the words of the scales and biases, in a GroupKVCache / GroupRotatingKVCache

    def _wraps(self) -> bool:
        return bool(getattr(self, "rotated", False))

    @property
    def key_bits(self) -> int:
        """The keys' bits (q4's, per channel: :data:`KEY_BITS`)."""
        return self.bits

    def float_positions(self) -> int:
        """How many newest positions ``recent`` holds a row."""
        return FLOAT_WINDOW

    def step_floats(
        self, old: list[int], n: int, fences: FenceRows
    ) -> tuple[tuple[int, ...], mx.array | None]:
        """What each row reads in float in a step writing ``n`` positions a row (rows of
        ``old`` lengths before it): per query, how many positions before its own (``reach``,
        ``(B, n)``), and per row how many of its newest (the last query's, its own counted).
        ``fences``: per row, each query's fence (None: only where the row joined)."""
        rows = fences if fences is not None else [None] * len(old)
        reach = [
            [
                min(FLOAT_WINDOW, count + i, was + i - fence[i] if fence else FLOAT_WINDOW)
                for i in range(n)
            ]
            for was, count, fence in zip(old, self.counts, rows, strict=True)
        ]
        if any(r < 0 for row in reach for r in row):
            raise ValueError(f"a fence lies past its query's position: {fences}")
        self.counts = [min(FLOAT_WINDOW, count + n) for count in self.counts]
        return tuple(row[-1] + 1 for row in reach), mx.array(reach, mx.int32)

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[HeldQuantized, HeldQuantized]:
        """mlx-lm's call (no fences but where each row joined)."""
        return self.write(keys, values)

    def write(
        self, keys: mx.array, values: mx.array, fences: FenceRows = None
    ) -> tuple[HeldQuantized, HeldQuantized]:
        """Write a step's keys and values (``fences``: per row, each position's fence, see
        :class:`QuantizedLayer`); what attention reads for the step."""
        bits, group, n = self.bits, self.group_size, keys.shape[2]
        if fences is not None and (
            len(fences) != keys.shape[0] or any(len(f) != n for f in fences)
        ):
            raise ValueError(f"fences for {keys.shape[0]} rows of {n} positions: {fences}")
        if self.per_channel:  # (read from ``recent`` until their key group is settled)
            key_words = packed_per_position(keys, group, self.key_bits)
        else:
            key_words = packed(rotated_if(keys, self.rotated_keys), bits, group)
        value_words = packed(rotated_if(values, self.rotated_values), bits, self.value_group_size)
        columns = self._store(key_words, value_words)
        old, self.lengths = self.lengths, [length + n for length in self.lengths]
        f = self.float_positions()
        if self.recent is None:
            B, H, _, _ = keys.shape
            self.recent = tuple(mx.zeros((B, H, f, x.shape[3]), x.dtype) for x in (keys, values))
        joined = [
            mx.concatenate([r, x.astype(r.dtype)], axis=2)
            for r, x in zip(self.recent, (keys, values), strict=True)
        ]
        self._settle_groups(joined[0], old)
        # (copies: a slice would keep all of ``joined`` alive)
        self.recent = tuple(mx.contiguous(x[..., -f:, :]) for x in joined)
        held = HeldQuantized(
            (self.keys, self.halves.keys),  # type: ignore[attr-defined]
            (self.values, self.halves.values),  # type: ignore[attr-defined]
            columns,
            tuple(joined),
            *self.step_floats(old, n, fences),
            tuple(self.lengths),
            write_index(self) - 1,
            self._wraps(),
            group,
            self.value_group_size,
            bits,
            self.key_bits,
            self.per_channel,
            self.rotated_values,
            self.rotated_keys,
            self.first_kv,
            () if self.first_kv is None else tuple(self.first_held),
        )
        return held, held

    def _words(self, width: int, kind: str) -> int:
        """How many of a packed head's ``width`` words of ``kind`` are words."""
        if kind == "keys":
            return words_in(width, self.key_bits, self.group_size)
        return words_in(width, self.bits, self.value_group_size)

    def _store(self, key_words: mx.array, value_words: mx.array) -> int:
        """Write a step's packed keys and values: their words, and their scales' and biases'
        words into ``halves`` (mlx-lm's update, on both; contiguous, as a ring's first chunk
        is kept as given). Returns the columns the rows' positions now lie in."""
        k = self._words(key_words.shape[3], "keys")
        v = self._words(value_words.shape[3], "values")
        key_words, key_extra = (mx.contiguous(x) for x in (key_words[..., :k], key_words[..., k:]))
        value_words, value_extra = (
            mx.contiguous(x) for x in (value_words[..., :v], value_words[..., v:])
        )
        self.halves.update_and_fetch(key_extra, value_extra)
        held, _ = super().update_and_fetch(key_words, value_words)  # type: ignore[misc]
        return held.shape[2]

    def _put_keys(self, b: int, cols: Any, data: mx.array) -> None:
        """Overwrite row ``b``'s key columns ``cols`` with packed ``data``."""
        k = self._words(data.shape[3], "keys")
        self.keys[b : b + 1, :, cols, :] = data[..., :k]  # type: ignore[has-type]
        self.halves.keys[b : b + 1, :, cols, :] = data[..., k:]

    def packed_views(self) -> tuple[mx.array, mx.array]:
        """The keys and values of the positions mlx-lm's buffer gives (its
        ``keys_and_values``), :func:`packed` again (copies, made only when read)."""
        words = self.keys_and_values()  # type: ignore[attr-defined]
        halves = self.halves.keys_and_values()
        return tuple(  # type: ignore[return-value]
            mx.concatenate([w, h], axis=-1) for w, h in zip(words, halves, strict=True)
        )

    def trim(self, n: int) -> int:
        self.halves.trim(n)
        return super().trim(n)  # type: ignore[misc]

    def prepare(self, **kwargs: Any) -> None:
        super().prepare(**kwargs)  # type: ignore[misc]
        self.halves.prepare(**kwargs)

    def finalize(self) -> None:
        super().finalize()  # type: ignore[misc]
        self.halves.finalize()

    def _settle_groups(self, joined_keys: mx.array, old: list[int]) -> None:
        """Quantize what the step completed beyond writing it (q4's key groups)."""

    def filter(self, batch_indices: list[int]) -> None:
        super().filter(batch_indices)  # type: ignore[misc]
        self.halves.filter(batch_indices)
        for buffer in (self, self.halves):  # (a cut of left padding leaves strided views)
            if buffer.keys is not None:
                buffer.keys = mx.contiguous(buffer.keys)
                buffer.values = mx.contiguous(buffer.values)
        self.lengths = [self.lengths[i] for i in batch_indices]
        self.counts = [self.counts[i] for i in batch_indices]
        if self.recent is not None:
            index = mx.array(batch_indices)
            self.recent = tuple(r[index] for r in self.recent)
        if self.first_kv is not None:
            index = mx.array(batch_indices)
            self.first_kv = tuple(x[index] for x in self.first_kv)
            self.first_held = [self.first_held[i] for i in batch_indices]

    def extend(self, other: QuantizedLayer) -> None:
        mine, theirs = self._recent_for(other), other._recent_for(self)
        firsts = _stack_firsts(self._firsts() + other._firsts())
        super().extend(other)  # type: ignore[misc]
        self.halves.extend(other.halves)
        self.lengths = self.lengths + other.lengths
        self.counts = self.counts + other.counts
        if mine is not None:
            self.recent = tuple(mx.concatenate(p, axis=0) for p in zip(mine, theirs, strict=True))
        self.first_kv, self.first_held = firsts

    def _firsts(self) -> list[tuple[mx.array, mx.array] | None]:
        """Each row's ``first_kv`` (None: it has none)."""
        if self.first_kv is None:
            return [None] * len(self.lengths)
        return [
            tuple(x[b : b + 1] for x in self.first_kv) if held else None
            for b, held in enumerate(self.first_held)
        ]

    def _recent_for(self, other: QuantizedLayer) -> tuple[mx.array, mx.array] | None:
        """``recent``, or zeros shaped like ``other``'s (None when neither has any)."""
        if self.recent is not None or other.recent is None:
            return self.recent
        B = len(self.lengths)
        return tuple(mx.zeros((B, *r.shape[1:]), r.dtype) for r in other.recent)

    def extract(self, idx: int) -> Any:
        row = super().extract(idx)  # type: ignore[misc]
        halves = self.halves.extract(idx)
        if row.keys is not None:  # (packed again)
            row.keys = mx.concatenate([row.keys, halves.keys], axis=-1)
            row.values = mx.concatenate([row.values, halves.values], axis=-1)
        row.float_count = self.counts[idx]
        if self.recent is None:
            row.recent = None
        else:  # copies, as mlx-lm's extract copies the buffers (a view keeps the group's alive)
            row.recent = tuple(mx.contiguous(r[idx : idx + 1]) for r in self.recent)
        row.first_kv = None
        if self.first_kv is not None and self.first_held[idx]:
            row.first_kv = tuple(mx.contiguous(x[idx : idx + 1]) for x in self.first_kv)
        return row

    @property
    def nbytes(self) -> int:
        held = super().nbytes + self.halves.nbytes  # type: ignore[misc]
        held += 0 if self.recent is None else sum(r.nbytes for r in self.recent)
        return held + (0 if self.first_kv is None else sum(x.nbytes for x in self.first_kv))


def split_buffer(
    rows: list[Any],
    cls: type,
    keys: tuple[int, int],
    values: tuple[int, int],
    merge: Callable[[list[Any]], Any],
) -> Any:
    """A :class:`QuantizedLayer` buffer of class ``cls`` of packed single-row caches, their words
    and their scales' and biases' words merged apart by ``merge`` (of rows, none included:
    one empty row), with no packed copy of the group; ``keys`` and ``values``: their (bits,
    group size)."""

    def part(row: Any, words: bool) -> Any:
        ring = isinstance(row, RotatingKVCache)
        out = RotatingKVCache(row.max_size) if ring else KVCache()
        out.offset = row.offset
        if ring:
            set_write_index(out, write_index(row))
        if row.keys is not None:
            k = words_in(row.keys.shape[3], *keys)
            v = words_in(row.values.shape[3], *values)
            out.keys = row.keys[..., :k] if words else row.keys[..., k:]
            out.values = row.values[..., :v] if words else row.values[..., v:]
        return out

    buffer = recast(merge([part(r, True) for r in rows]), cls)
    buffer.halves = merge([part(r, False) for r in rows])
    # (a ring of q4 key groups leaves whole: ``GroupRotatingKVCache.extract``)
    buffer.halves.per_channel = cls.per_channel
    return buffer


class GroupQuantizedKVCache(QuantizedLayer, GroupKVCache):
    """A group's buffer for one global-attention layer, its keys and values quantized."""


class GroupQuantizedRotatingKVCache(QuantizedLayer, GroupRotatingKVCache):
    """A group's buffer for one sliding-window layer, its keys and values quantized."""


def quantized_buffer(
    rows: list[Any], window: int | None, bits: int, group_size: int, rotated_keys: bool = False
) -> Any:
    """One group buffer of packed single-row caches (none: one empty row); ``rotated_keys``:
    they hold their keys rotated by :func:`hadamard`."""
    kinds = ((bits, group_size), (bits, group_size))
    if window is None:
        merged = split_buffer(rows, GroupQuantizedKVCache, *kinds, merge_global)
    else:

        def merge(parts: list[Any]) -> GroupRotatingKVCache:
            return GroupRotatingKVCache.merge(parts) if parts else GroupRotatingKVCache(window, [0])

        merged = split_buffer(rows, GroupQuantizedRotatingKVCache, *kinds, merge)
    merged.bits = bits
    merged.rotated_keys = rotated_keys
    return with_recent(merged, rows, group_size, group_size)


def _stack_firsts(
    firsts: list[tuple[mx.array, mx.array] | None],
) -> tuple[tuple[mx.array, mx.array] | None, list[bool]]:
    """Rows' ``first_kv`` (None: a row without) as one buffer's ``first_kv`` and
    ``first_held`` (zeros for the rows without; None when no row has them)."""
    some = next((x for x in firsts if x is not None), None)
    held = [x is not None for x in firsts]
    if some is None:
        return None, held
    return tuple(
        mx.concatenate([mx.zeros_like(some[k]) if x is None else x[k] for x in firsts], axis=0)
        for k in range(2)
    ), held


def with_recent(
    merged: Any,
    rows: list[Any],
    key_group: int,
    value_group: int,
    first_kv: tuple[mx.array, mx.array] | None = None,
) -> Any:
    """``merged`` (a buffer of ``rows``) given its group sizes and the rows' lengths, float
    positions and first positions (``first_kv``: every row's, else each row's own if it
    carries them)."""
    merged.group_size, merged.value_group_size = key_group, value_group
    merged.lengths = [row.offset for row in rows] or [0]
    held = [getattr(row, "recent", None) for row in rows]
    # (a row without float copies reads every position before it joins through its words)
    merged.counts = [
        getattr(row, "float_count", 0) if r is not None else 0
        for row, r in zip(rows, held, strict=True)
    ] or [0]
    some = next((r for r in held if r is not None), None)
    merged.recent = None
    if some is not None:
        parts = [r if r is not None else tuple(mx.zeros_like(x) for x in some) for r in held]
        merged.recent = tuple(mx.concatenate([p[k] for p in parts], axis=0) for k in range(2))
    firsts = [first_kv or getattr(row, "first_kv", None) for row in rows] or [first_kv]
    merged.first_kv, merged.first_held = _stack_firsts(firsts)
    return merged
