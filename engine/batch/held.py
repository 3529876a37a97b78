"""What one step's attention reads of a quantized layer (:class:`HeldQuantized`), and the
geometry of the positions it holds in float (its newest, and q4's open key group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from agentkv.engine.codes import SCALE_DTYPE, codes_of, dequantized, hadamard, scales_of

FLOAT_WINDOW = 16  # newest positions a quantized layer holds in float (q4: beyond its open group)


def float_window(group: int) -> int:
    """Positions a channel-quantized layer's float buffer holds: the :data:`FLOAT_WINDOW`
    newest, and the positions of the key group not yet quantized."""
    return FLOAT_WINDOW + group


def channel_boundary(length: int, group: int) -> int:
    """Of a sequence of ``length`` positions, how many a channel-quantized layer holds
    quantized (whole key groups at least :data:`FLOAT_WINDOW` positions old); the rest are in
    float."""
    return max(0, (length - FLOAT_WINDOW) // group * group)


def ring_size(window: int, group: int) -> int:
    """Positions a channel-quantized sliding-window layer's ring holds: its window and one key
    group more, so a position is overwritten only once its whole group has left the window
    (the group's scales are spread over its positions' slots)."""
    return window + group


def channel_keys_f32(
    words: mx.array, extra: mx.array, group: int, pos: mx.array, wrap: bool, bits: int
) -> mx.array:
    """Keys ``(B, H, L, ·)`` held per channel at ``bits`` (their ``words``, and the ``extra``
    words of their scales and biases), in float32: column ``c`` of row ``b`` holds position
    ``pos[b, c]``, its group's scales in the slots of the group's columns (``wrap``: a ring,
    the columns counted modulo ``L``). Columns of no quantized group give finite values the
    caller replaces or masks."""
    dim = words.shape[3] * 32 // bits
    B, H, L, E = extra.shape
    first = mx.arange(L)[None] - pos % group  # the column of each one's group's first position
    cols = first[..., None] + mx.arange(group)
    cols = cols % L if wrap else mx.clip(cols, 0, L - 1)
    slots = mx.take_along_axis(extra, cols.reshape(B, 1, L * group, 1), axis=2)
    slots = slots.view(SCALE_DTYPE).reshape(B, H, L, group, 2, E)
    scales = slots[..., 0, :].reshape(B, H, L, dim).astype(mx.float32)
    biases = slots[..., 1, :].reshape(B, H, L, dim).astype(mx.float32)
    return codes_of(words, bits) * scales + biases


def overlay(x: mx.array, recent: mx.array, floats: list[int], newest: int, wrap: bool) -> mx.array:
    """``x`` with the positions each row holds in float (its newest ``floats[b]``, at columns
    up to ``newest``) taken from ``recent`` (right-aligned: its last column is ``newest``)."""
    L, f = x.shape[2], recent.shape[2]
    m = min(f, L if wrap else newest + 1)
    if m <= 0:
        return x
    ages = mx.arange(m - 1, -1, -1)
    keep = (ages[None] < mx.array(floats)[:, None])[:, None, :, None]
    if wrap:
        cols: Any = (newest - m + 1 + mx.arange(m)) % L
    else:
        cols = slice(newest - m + 1, newest + 1)
    x[:, :, cols, :] = mx.where(keep, recent[..., f - m :, :].astype(x.dtype), x[:, :, cols, :])
    return x


@dataclass(frozen=True, slots=True)
class HeldQuantized:
    """A quantized layer as one step's attention reads it (``agentkv.engine.attention`` attends over
    it without expanding the quantized keys; :meth:`expanded` expands them).

    Attributes:
        keys, values: the buffer's words ``(B, H, L', words)`` and the words of their float16
            scales and biases, each whole and row contiguous (what attention hands
            ``mx.quantized_matmul`` without copying them; q4's keys it gathers into whole key
            groups, a copy, at each step): keys per position, or (q4) per
            channel in whole groups (other columns per position); values per position,
            ``rotated`` by :func:`hadamard` (q4). The first ``columns`` positions are held;
            the rest are spare (zeros, or positions trimmed off).
        columns: ``L``, the columns the rows' positions lie in.
        recent: float keys and (unrotated) values ``(B, H, f, D)``, right-aligned with column
            ``newest``; row ``b`` reads its newest ``floats[b]`` positions from them (q4).
        reach: q8: ``(B, Lq)``, how many positions before its own each query reads from
            ``recent`` (its own it always does); None at q4.
        lengths: each row's length (its newest position is ``lengths[b] - 1``).
        newest: the column of every row's newest position.
        wrap: the columns are a ring (counted modulo ``L``).
        group: the keys' quantization group size (q4: the positions of a key group).
        value_group: the values' quantization group size (q8: ``group``).
        bits: 8 or 4.
        key_bits: the keys' bits (per channel: :data:`KEY_BITS`; else ``bits``).
        per_channel: keys quantized per channel in whole groups (q4), else per position.
        rotated: values held rotated by :func:`hadamard` (q4).
        rotated_keys: keys held rotated by :func:`hadamard` (q8; ``recent`` holds them
            unrotated).
        first_kv: (q4, a global layer) each row's first position's float keys and values
            ``(B, H, 1, D)`` (unrotated), read instead of its words where ``recent`` does not
            hold it (None: no row has them); ``first_held``: which rows have them.
    """

    keys: tuple[mx.array, mx.array]
    values: tuple[mx.array, mx.array]
    columns: int
    recent: tuple[mx.array, mx.array]
    floats: tuple[int, ...]
    reach: mx.array | None
    lengths: tuple[int, ...]
    newest: int
    wrap: bool
    group: int
    value_group: int
    bits: int
    key_bits: int
    per_channel: bool
    rotated: bool
    rotated_keys: bool
    first_kv: tuple[mx.array, mx.array] | None = None
    first_held: tuple[bool, ...] = ()

    @property
    def ages(self) -> mx.array:
        """``(L,)``: how many positions older than its row's newest each column holds (a
        ring's columns past ``newest`` hold the oldest)."""
        L = self.columns
        ages = self.newest - mx.arange(L)
        return ages % L if self.wrap else ages

    @property
    def positions(self) -> mx.array:
        """``(B, L)``: the position each column holds (negative: padding)."""
        return mx.array(self.lengths)[:, None] - 1 - self.ages[None]

    def shifts(self) -> list[int]:
        """Per row, how far its first column is into its key group (column 0 holds position
        ``lengths[b] - 1 - newest``; a ring of a multiple of ``group`` keeps that phase)."""
        return [(n - 1 - self.newest) % self.group for n in self.lengths]

    def float_columns(self) -> mx.array:
        """``(B, L)``: which columns each row reads from ``recent`` (q4: its newest
        ``floats[b]`` positions)."""
        f, ages = self.recent[0].shape[2], self.ages[None]  # (negative: past ``newest``)
        return (ages >= 0) & (ages < mx.array([min(n, f) for n in self.floats])[:, None])

    def first_column(self) -> tuple[mx.array, mx.array] | None:
        """``(B,)`` each row's column of its first position, and ``(B,)`` whether the row reads
        it from ``first_kv`` (it has them, and ``recent`` does not hold the position); None
        without ``first_kv``."""
        if self.first_kv is None:
            return None
        column = mx.clip(self.newest + 1 - mx.array(self.lengths), 0, self.columns - 1)
        return column, mx.array(self._first_reads())

    def _first_reads(self) -> list[bool]:
        """Per row, whether it reads its first position from ``first_kv``."""
        f = self.recent[0].shape[2]
        return [
            held and n > min(k, f)
            for held, n, k in zip(self.first_held, self.lengths, self.floats, strict=True)
        ]

    def stored(self, kind: str) -> tuple[mx.array, mx.array]:
        """The keys' (``kind`` "keys") or values' words, and the words of their scales and
        biases, over the ``columns`` held (views)."""
        words, extra = self.keys if kind == "keys" else self.values
        return words[..., : self.columns, :], extra[..., : self.columns, :]

    def expanded(self) -> tuple[mx.array, mx.array]:
        """Keys and values in the model's dtype, every column expanded (keys rotated back;
        values rotated if ``rotated``)."""
        (recent_keys, recent_values), group, bits = self.recent, self.group, self.bits
        wrap, dk, dv = self.wrap, recent_keys.shape[3], recent_values.shape[3]
        words, extra = self.stored("keys")
        if self.per_channel:
            keys = channel_keys_f32(words, extra, group, self.positions, wrap, self.key_bits)
        else:
            keys = dequantized(words, *scales_of(extra, dk // group), mx.float32, bits, group)
            keys = hadamard(keys) if self.rotated_keys else keys
        keys = overlay(keys, recent_keys, self.floats, self.newest, wrap)
        words, extra = self.stored("values")
        values = dequantized(
            words, *scales_of(extra, dv // self.value_group), mx.float32, bits, self.value_group
        )
        recent_values = recent_values.astype(mx.float32)
        if self.rotated:
            recent_values = hadamard(recent_values)
        values = overlay(values, recent_values, self.floats, self.newest, wrap)
        if self.first_kv is not None:  # (column by column: a full-size select costs 15%)
            first_keys, first_values = (x.astype(mx.float32) for x in self.first_kv)
            first_values = hadamard(first_values) if self.rotated else first_values
            for b, reads in enumerate(self._first_reads()):
                if reads:
                    c = self.newest + 1 - self.lengths[b]
                    keys[b : b + 1, :, c : c + 1, :] = first_keys[b : b + 1]
                    values[b : b + 1, :, c : c + 1, :] = first_values[b : b + 1]
        return keys.astype(recent_keys.dtype), values.astype(recent_keys.dtype)
