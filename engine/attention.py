"""Ragged attention: one forward pass over many sequences of different lengths, no padding
between them.

mlx-lm's models take a ``(B, L)`` token array and hand every layer one cache object. agentkv
feeds each step as ``T`` rows of one token (``L = 1``): the decode tokens of every running
sequence and the prefill chunks of joining ones, a chunk laid out one token per row. Every
linear layer, norm and MLP works per token, so this changes nothing for them, and each row's
rotary position comes from the cache's per-row ``offset``.

Each layer gets a :class:`StepCache`: a view that routes row ranges (:class:`Span`) to the
group caches that own them (see ``engine.kv_batch``). A decode span is ``B`` rows of ``B``
sequences sharing one padded group buffer; a prefill span is ``c`` rows of one sequence, which
attend as a ``(1, H, c, D)`` block with a causal mask. Attention therefore runs once per span
over exactly that span's keys, and the model's own code does the rest.

The only hook is ``scaled_dot_product_attention``: every mlx-lm model imports it from
``mlx_lm.models.base`` by name, so :func:`install` points that name, in the model's own
modules, at :func:`ragged_attention`, which hands any other cache straight to mlx-lm's function.

On MLX's CPU backend, decode spans (one query per row) of float layers attend through
:func:`decode_attention`,
the same math as two matmuls over the key-value head groups: 1.6x faster than
``mx.fast.scaled_dot_product_attention`` there at a 16K-token history and 2.5x at 32K (its
kernel reads the keys at about 1.6 GB/s), which is what a long agent costs the others.

A quantized layer (``engine.batch_caches``: q8 per position, q4 keys per channel and values
rotated, each with its newest positions in float) hands attention a
:class:`~engine.batch_caches.HeldQuantized`, which :func:`quantized_attention` reads without
expanding the quantized keys (``bench_batch_kv`` measures its working set and time against
expanding them). On a CPU, where MLX's quantized matmul runs one scalar loop per output, a
prompt's chunk (:data:`EXPANDED_ROWS` query rows a key-value head or more) expands the words
it reads for one float matmul instead (``bench_batch_kv`` times a chunk both ways). On every
backend a q8 chunk attends :data:`SCORES_BYTES` of scores at a time, a block of its queries
after another, so its working set does not grow with chunk size times history.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from agentkv.engine.batch_caches import (
    FLOAT_WINDOW,
    HeldQuantized,
    QuantizedLayer,
    dequantized,
    hadamard,
    scales_of,
)

_MLX_LM_SDPA = base.scaled_dot_product_attention
_ON_CPU = [False]  # set by install(): decode spans take decode_attention
# On a CPU, query rows a key-value head from which a quantized layer's words are expanded for
# one float matmul (a prompt's chunk) rather than read by ``mx.quantized_matmul``
# (:func:`_eight_bit_attention`, :func:`_times_words`).
EXPANDED_ROWS = 16
# Bytes of float32 scores a q8 layer's attention holds for one block of a step's queries: a
# prompt's chunk over a long history goes in several (:func:`_eight_bit_attention`).
SCORES_BYTES = 1 << 25


@dataclass(slots=True, frozen=True)
class Span:
    """Rows ``start .. start + rows`` of a step, held by one group's layer cache.

    ``prefill``: the rows are consecutive tokens of one sequence (a B=1 group), not one token
    of each of the group's ``rows`` sequences. ``padded``: the group's buffer may hold positions
    of no sequence (it has held more than one), so even a decode step needs a mask.
    ``fences``: per row, each of its positions' fence (a q8 layer reads no float copy before
    it: ``engine.batch_caches.QuantizedLayer``; None where the layers are not q8).
    """

    cache: Any
    start: int
    rows: int
    prefill: bool
    padded: bool = True
    fences: tuple[tuple[int, ...], ...] | None = None

    @property
    def stop(self) -> int:
        return self.start + self.rows

    def as_block(self, x: mx.array) -> mx.array:
        """This span's rows of a ``(T, H, 1, D)`` array, shaped as its cache expects."""
        if self.start or x.shape[0] != self.rows:
            x = x[self.start : self.stop]
        return x.transpose(2, 1, 0, 3) if self.prefill else x  # (1, H, c, D) for a chunk

    def mask(self, window_size: int | None) -> Any:
        window = window_size is None or window_size == getattr(self.cache, "max_size", None)
        if window and not (self.prefill or self.padded):
            return None  # one sequence's own positions, all of them in its window
        return self.cache.make_mask(self.rows if self.prefill else 1, window_size=window_size)


class SpanMasks(tuple):
    """One attention mask per span, as :meth:`StepCache.make_mask` makes them."""


class StepCache:
    """What one layer of the model sees as its cache during one step."""

    __slots__ = ("offset", "spans")

    def __init__(self, spans: list[Span], offset: mx.array):
        self.spans = spans
        self.offset = offset  # (T,) rotary position of every row

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> SpanMasks:
        if N != 1:
            raise ValueError(f"a step feeds one token per row, got {N}")
        return SpanMasks(s.mask(window_size) for s in self.spans)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        fetched = [
            s.cache.write(s.as_block(keys), s.as_block(values), s.fences)
            if isinstance(s.cache, QuantizedLayer)
            else s.cache.update_and_fetch(s.as_block(keys), s.as_block(values))
            for s in self.spans
        ]
        return tuple(k for k, _ in fetched), tuple(v for _, v in fetched)

    def attend(
        self,
        queries: mx.array,
        keys: tuple,
        values: tuple,
        scale: float,
        masks: SpanMasks,
        sinks: mx.array | None,
    ) -> mx.array:
        outputs = []
        for span, k, v, mask in zip(self.spans, keys, values, masks, strict=True):
            q = span.as_block(queries)
            if isinstance(k, HeldQuantized):
                out = quantized_attention(q, k, scale, mask, sinks)
            elif _ON_CPU[0] and not span.prefill and sinks is None:
                out = decode_attention(q, k, v, scale, mask)
            else:
                out = _MLX_LM_SDPA(q, k, v, span.cache, scale=scale, mask=mask, sinks=sinks)
            outputs.append(out.transpose(2, 1, 0, 3) if span.prefill else out)
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)


def decode_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | None
) -> mx.array:
    """Attention of one query per row, ``(B, Hq, 1, D)`` over ``(B, Hkv, L, D)`` keys: each
    key-value head's query heads as the rows of one matmul, a boolean or additive mask."""
    B, n_q, _, _ = queries.shape
    n_kv = keys.shape[1]
    q = (queries * scale).reshape(B, n_kv, n_q // n_kv, -1)
    scores = q @ keys.swapaxes(-1, -2)  # (B, Hkv, Hq / Hkv, L)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], 1, 1, -1)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values).reshape(B, n_q, 1, -1)


def ragged_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, span by span for a :class:`StepCache`."""
    if isinstance(cache, StepCache):
        return cache.attend(queries, keys, values, scale, mask, sinks)
    if isinstance(keys, HeldQuantized):
        return quantized_attention(queries, keys, scale, mask, sinks)
    return _MLX_LM_SDPA(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def quantized_attention(
    queries: mx.array, held: HeldQuantized, scale: float, mask: Any, sinks: mx.array | None
) -> mx.array:
    """Attention of ``(B, Hq, Lq, D)`` queries over a quantized layer.

    Keys held per position (q8) are scored through ``mx.quantized_matmul`` as they are (held
    rotated by :func:`~engine.batch_caches.hadamard`: against the query rotated once; on a
    CPU, :data:`EXPANDED_ROWS` query rows a head or more through the words expanded once),
    a block of queries at a time (:func:`_eight_bit_attention`). Keys
    held per channel (q4): a key group's codes ``c`` read as ``s * c + b`` with one scale ``s``
    and bias ``b`` per channel, so a query's score against them is ``(q * s) . c + q . b``:
    each key group meets the query scaled by its scales in a matmul over its raw codes
    (:func:`_folded_scores`), and the keys are never expanded. Columns a row holds in float
    are scored and weighted from ``recent`` (q8: each query's own position and the
    ``reach`` before it, :func:`_eight_bit_band`; q4 global layers: also the row's first
    position, from ``first_kv``). Values
    are quantized per position, as ``mx.quantized_matmul`` reads them. Scores and weights are
    float32; the output is rotated back where the values are held rotated, and given in the
    queries' dtype (the fallback below: in the keys', the same in practice).

    Where scaling the queries per group would hold more than the keys expanded (more than
    ``group`` query rows a key-value head, as in a prompt's chunk), or the groups do not line
    up (a ring whose size no group divides), q4's keys and values are expanded and attended in
    float instead, and so are they for attention sinks; q8 refuses sinks (the load probe then
    keeps the batch in the model's precision) and always reads its words (a ``"causal"`` mask,
    which none of the batch's buffers makes, is made an array for it).
    """
    B, n_q, Lq, dk = queries.shape
    n_kv, L, group, bits = held.keys[0].shape[1], held.columns, held.group, held.bits
    rows = n_q // n_kv * Lq  # query rows a key-value head
    foldable = mask is None or isinstance(mask, mx.array)
    if not held.per_channel:
        if sinks is not None:
            raise ValueError("q8 KV in the batch does not support attention sinks")
        if isinstance(mask, str):  # causal over the positions the columns hold
            at = mx.array(held.lengths)[:, None] - Lq + mx.arange(Lq)  # (B, Lq) query positions
            held_at = held.positions[:, None, :]  # (B, 1, L)
            mask = ((held_at >= 0) & (held_at <= at[..., None]))[:, None]
            foldable = True
    unfolded = held.per_channel and (rows > group or (held.wrap and L % group))
    if unfolded or not foldable or sinks is not None:
        keys, values = held.expanded()
        if _ON_CPU[0] and Lq == 1 and foldable and sinks is None:
            out = decode_attention(queries, keys, values, scale, mask)
        else:
            out = _MLX_LM_SDPA(queries, keys, values, None, scale=scale, mask=mask, sinks=sinks)
        return hadamard(out) if held.rotated else out
    if not held.per_channel:
        return _eight_bit_attention(queries, held, scale, mask).astype(queries.dtype)
    recent_keys, recent_values = held.recent
    dv, f = recent_values.shape[3], recent_keys.shape[2]
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, rows, dk)
    scores = _folded_scores(q, held)

    # Columns held in float (q4: the row's newest positions): scored against ``recent``
    # (column c: its entry of age c's).
    blend = any(n > 0 for n in held.floats)
    if blend:
        in_float = held.float_columns()[:, None, None, :]  # (B, 1, 1, L)
        recent_col = mx.clip(f - 1 - held.ages, 0, f - 1)
        recent_scores = q @ recent_keys.astype(mx.float32).swapaxes(-1, -2)  # (B, Hkv, rows, f)
        scores = mx.where(in_float, mx.take(recent_scores, recent_col, axis=-1), scores)
    # A global layer's first position: its column scored against ``first_kv``.
    first = held.first_column()
    if first is not None:
        column, reads = first
        at_first = ((mx.arange(L)[None] == column[:, None]) & reads[:, None])[:, None, None]
        first_keys, first_values = (x.astype(mx.float32) for x in held.first_kv)
        scores = mx.where(at_first, q @ first_keys.swapaxes(-1, -2), scores)
    weights = _masked_softmax(scores, mask, Lq)

    # Values: the quantized columns through their words, the float ones from ``recent`` and
    # ``first_kv``.
    zero = mx.array(0, mx.float32)
    weights_q = mx.where(in_float, zero, weights) if blend else weights
    weights_q = mx.where(at_first, zero, weights_q) if first is not None else weights_q
    out = _times_words(weights_q, held, "values", dv, bits, held.value_group)
    if first is not None:
        first_weights = mx.take_along_axis(weights, column[:, None, None, None], axis=-1)
        first_weights = first_weights * reads[:, None, None, None]  # (B, Hkv, rows, 1)
        out = out + first_weights @ (hadamard(first_values) if held.rotated else first_values)
    if blend:
        age = f - 1 - mx.arange(f)  # of each recent entry
        column = held.newest - age
        # (``age >= 0`` holds always, but without it MLX orders this step's graph otherwise:
        # 153 MB at peak instead of 125 on bench_batch_kv's layer)
        reads = (age[None] >= 0) & (age[None] < mx.array(held.floats)[:, None])
        reads &= age[None] < (L if held.wrap else held.newest + 1)
        column = column % L if held.wrap else mx.clip(column, 0, L - 1)
        recent_weights = mx.take(weights, column, axis=-1) * reads[:, None, None, :]
        recent_values = recent_values.astype(mx.float32)
        out = out + recent_weights @ (hadamard(recent_values) if held.rotated else recent_values)
    out = hadamard(out) if held.rotated else out
    return out.reshape(B, n_q, Lq, dv).astype(queries.dtype)


def _masked_softmax(scores: mx.array, mask: Any, Lq: int) -> mx.array:
    """Float32 attention weights of ``(B, Hkv, rows, L)`` scores under ``mask``."""
    if mask is not None:
        B, n_kv, rows, L = scores.shape
        scores = scores.reshape(B, n_kv, rows // Lq, Lq, L)
        mask = mask.reshape(-1, 1, 1, *mask.shape[-2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, mx.float32))
        else:
            scores = scores + mask.astype(mx.float32)
        scores = scores.reshape(B, n_kv, rows, L)
    return mx.softmax(scores, axis=-1, precise=True)


def _eight_bit_attention(
    queries: mx.array, held: HeldQuantized, scale: float, mask: Any
) -> mx.array:
    """q8 attention of ``(B, Hq, Lq, D)`` queries, a block of at most :data:`SCORES_BYTES` of
    float32 scores at a time (a long prompt's chunk over a long history would otherwise hold
    several such arrays of all its queries at once), the words expanded once for all blocks
    where :func:`_times_words` would expand them. Returns ``(B, Hq, Lq, Dv)`` float32."""
    B, n_q, Lq, dk = queries.shape
    n_kv, L = held.keys[0].shape[1], held.columns
    g = n_q // n_kv
    block = max(1, min(Lq, SCORES_BYTES // (4 * B * n_q * max(L, 1))))
    dv = held.recent[1].shape[3]
    expand = _expands(g * Lq)
    keys_f = _held_expanded(held, "keys", dk, held.bits, held.group) if expand else None
    values_f = _held_expanded(held, "values", dv, held.bits, held.value_group) if expand else None
    outs = []
    for start in range(0, Lq, block):
        stop = min(Lq, start + block)
        q = queries[:, :, start:stop] if block < Lq else queries
        if outs:  # (one block at a time: its scores gone before the next block's are made)
            q = mx.depends(q, outs[-1])
        q = (q.astype(mx.float32) * scale).reshape(B, n_kv, g * (stop - start), dk)
        q_keys = hadamard(q) if held.rotated_keys else q  # (keys held rotated: so is the query)
        if keys_f is None:
            scores = _times_words(q_keys, held, "keys", dk, held.bits, held.group)
        else:
            scores = q_keys @ keys_f.swapaxes(-1, -2)
        rows_masked = isinstance(mask, mx.array) and mask.ndim > 1 and mask.shape[-2] == Lq
        part = mask[..., start:stop, :] if rows_masked and block < Lq else mask
        outs.append(_eight_bit_band(q, scores, held, part, start, stop, values_f))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _eight_bit_band(
    q: mx.array,
    scores: mx.array,
    held: HeldQuantized,
    mask: Any,
    start: int,
    stop: int,
    values_f: mx.array | None = None,
) -> mx.array:
    """q8 attention of the step's queries ``start`` to ``stop`` (``q``: scaled,
    ``(B, Hkv, g * (stop - start), D)``) given their scores against the words: query ``i`` of
    row ``b`` reads its own position and the ``held.reach[b, i]`` before it in float
    (``recent``, whose last entries are the step's queries'), the rest through the words
    (``values_f``: the values' words expanded, :func:`_times_words`), under ``mask``'s rows of
    these queries. The float band is
    ``FLOAT_WINDOW + 1`` positions a query, scored and weighted by one small matmul each, the
    same whatever the step's shape, so a position reads the same in a chunk of any size or a
    decode step (bit for bit where both read the words through ``mx.quantized_matmul``; a
    CPU's expanded chunk sums in another order). Returns ``(B, Hq, stop - start, Dv)``
    float32."""
    B, n_kv, rows, dk = q.shape
    recent_keys, recent_values = held.recent
    F, dv, L = recent_keys.shape[2], recent_values.shape[3], scores.shape[-1]
    Lq_all, W = held.reach.shape[1], FLOAT_WINDOW
    Lq = stop - start
    g = rows // Lq
    i = mx.arange(start, stop)  # the queries, of the step's
    d = mx.arange(W + 1)  # how far before a query's own position
    # The float entry and the buffer column of query i's position minus d (a chunk is written
    # in order, a ring put back in order first).
    entry = (F - Lq_all + i[:, None] - d[None]).reshape(-1)
    age = (Lq_all - 1 - i)[:, None] + d[None]  # (Lq, W + 1)
    column = held.newest - age
    column = column % L if held.wrap else mx.clip(column, 0, L - 1)
    reach = held.reach[:, start:stop] if Lq < Lq_all else held.reach  # (B, Lq)
    reads = d[None, None] <= reach[..., None]  # (B, Lq, W + 1)
    reads &= (age < L if held.wrap else column == held.newest - age)[None]
    band_keys = mx.take(recent_keys, entry, axis=2).reshape(B, n_kv, 1, Lq, W + 1, dk)
    q5 = q.reshape(B, n_kv, g, Lq, 1, dk)
    band = (q5 @ band_keys.astype(mx.float32).swapaxes(-1, -2)).squeeze(-2)  # (.., g, Lq, W+1)
    # Each column read in float takes its band score (position p - d at offset d). Only the
    # queries' own Lq columns and the W before them can be (a ring's: all of them).
    last = held.newest - (Lq_all - stop)  # the column of the queries' last position
    lo, hi = (0, L) if held.wrap else (max(0, last + 1 - Lq - W), last + 1)
    at = mx.array(held.lengths)[:, None] - Lq_all + i  # (B, Lq) query positions
    offset = at[..., None] - held.positions[:, None, lo:hi]  # (B, Lq, hi - lo)
    in_float = ((offset >= 0) & (offset <= reach[..., None]))[:, None, None]
    picked = mx.take_along_axis(band, mx.clip(offset, 0, W)[:, None, None], axis=-1)
    scores = scores.reshape(B, n_kv, g, Lq, L)
    scores = _columns(scores, lo, hi, mx.where(in_float, picked, scores[..., lo:hi]))
    weights = _masked_softmax(scores.reshape(B, n_kv, rows, L), mask, Lq)
    weights = weights.reshape(B, n_kv, g, Lq, L)
    zero = mx.array(0, mx.float32)
    weights_q = _columns(weights, lo, hi, mx.where(in_float, zero, weights[..., lo:hi]))
    weights_q = weights_q.reshape(B, n_kv, rows, L)
    if values_f is None:
        out = _times_words(weights_q, held, "values", dv, held.bits, held.value_group)
    else:
        out = weights_q @ values_f
    band_weights = mx.take_along_axis(weights, column[None, None, None], axis=-1)
    band_weights = band_weights * reads[:, None, None]  # (B, Hkv, g, Lq, W + 1)
    band_values = mx.take(recent_values, entry, axis=2).reshape(B, n_kv, 1, Lq, W + 1, dv)
    band_out = band_weights[..., None, :] @ band_values.astype(mx.float32)
    out = out.reshape(B, n_kv, g, Lq, dv) + band_out.squeeze(-2)
    return out.reshape(B, n_kv * g, Lq, dv)


def _columns(x: mx.array, lo: int, hi: int, part: mx.array) -> mx.array:
    """``x`` with its last axis' columns ``lo:hi`` replaced by ``part``."""
    if lo == 0 and hi == x.shape[-1]:
        return part
    return mx.concatenate([x[..., :lo], part, x[..., hi:]], axis=-1)


def _folded_scores(q: mx.array, held: HeldQuantized) -> mx.array:
    """``(B, Hkv, rows, L)`` scores of queries ``q`` (scaled, ``(B, Hkv, rows, D)``) against
    the buffer's quantized key groups, each group's scales folded into the queries (columns
    of no quantized group give finite values the caller replaces or masks)."""
    B, n_kv, rows, dk = q.shape
    L, group = held.columns, held.group
    # Key groups laid out whole: row b's columns shifted so each group starts at a multiple of
    # ``group`` (columns past the buffer repeat its edge; their scores are never read back).
    shift = mx.array(held.shifts())[:, None]  # (B, 1)
    n_groups = -(-(L + group - 1) // group)
    cols = mx.arange(n_groups * group)[None] - shift
    cols = cols % L if held.wrap else mx.clip(cols, 0, L - 1)
    n_words, bits, index = dk * held.key_bits // 32, held.key_bits, cols[:, None, :, None]
    words, halves = (mx.take_along_axis(x, index, axis=2) for x in held.keys)
    words = mx.contiguous(words.reshape(B, n_kv, n_groups, group, n_words))
    halves = halves.view(mx.float16)
    halves = halves.reshape(B, n_kv, n_groups, group, 2, dk // group)
    scales = halves[..., 0, :].reshape(B, n_kv, n_groups, 1, dk).astype(mx.float32)
    biases = halves[..., 1, :].reshape(B, n_kv, n_groups, dk).astype(mx.float32)
    ones, zeros, size = _unit_scales(B, n_kv, n_groups, group, dk)
    scores = mx.quantized_matmul(
        q[:, :, None] * scales, words, ones, zeros, transpose=True, group_size=size, bits=bits
    )  # (B, Hkv, groups, rows, group)
    scores = scores + (q @ biases.swapaxes(-1, -2)).swapaxes(-1, -2)[..., None]
    scores = scores.transpose(0, 1, 3, 2, 4).reshape(B, n_kv, rows, n_groups * group)
    return mx.take_along_axis(scores, (mx.arange(L)[None] + shift)[:, None, None, :], axis=-1)


def _times_words(
    x: mx.array, held: HeldQuantized, kind: str, dim: int, bits: int, group: int
) -> mx.array:
    """``x`` times the held ``kind`` ("keys": scores, ``x`` times their transpose; "values":
    ``x`` weights over their ``L`` columns), heads of ``dim`` per position in groups of
    ``group``, read through their words by ``mx.quantized_matmul``, in float32 (on a CPU, for
    :data:`EXPANDED_ROWS` rows of ``x`` a head or more, the ``L`` positions expanded once and
    multiplied in float: the same values, summed in another order).

    The quantized matmul's operands must be row contiguous (MLX's CUDA backend has no
    quantized matmul for strided ones, its CPU backend copies them): the buffer's words are
    passed whole, spare
    positions included (their scores are cut off, their weights zero), and only their scales
    and biases, a word a group, are copied (cast to float32)."""
    L, keys = held.columns, kind == "keys"
    if _expands(x.shape[-2]):
        w = _held_expanded(held, kind, dim, bits, group)
        return x @ w.swapaxes(-1, -2) if keys else x @ w
    words, extra = held.keys if keys else held.values
    scales, biases = scales_of(extra, dim // group)
    spare = words.shape[2] - L
    if spare and not keys:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, spare)])
    out = mx.quantized_matmul(
        x,
        words,
        mx.contiguous(scales.astype(mx.float32)),
        mx.contiguous(biases.astype(mx.float32)),
        transpose=keys,
        group_size=group,
        bits=bits,
    )
    return out[..., :L] if spare and keys else out


def _expands(rows: int) -> bool:
    """Whether ``rows`` query rows a key-value head read the words expanded (on a CPU, from
    :data:`EXPANDED_ROWS` on) rather than through ``mx.quantized_matmul``."""
    return _ON_CPU[0] and rows >= EXPANDED_ROWS


def _held_expanded(held: HeldQuantized, kind: str, dim: int, bits: int, group: int) -> mx.array:
    """The held ``kind``'s ``held.columns`` positions, heads of ``dim`` in ``bits`` codes in
    groups of ``group``, expanded to float32 from their words."""
    L = held.columns
    words, extra = held.keys if kind == "keys" else held.values
    scales, biases = scales_of(extra, dim // group)
    return _expanded(*(a[..., :L, :] for a in (words, scales, biases)), bits, group)


def _expanded(words: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int):
    """Words with their float16 scales and biases as float32 values, as ``mx.dequantize``
    gives them (8 bits: a word's bytes are its codes, the first the lowest on a little-endian
    CPU, expanded by elementwise ops, which MLX's CPU backend runs faster than
    ``mx.dequantize``)."""
    if bits != 8:
        return dequantized(words, scales, biases, mx.float32, bits, group)
    *lead, n = words.shape
    codes = words.view(mx.uint8).astype(mx.float32).reshape(*lead, -1, group)
    scales, biases = (x.astype(mx.float32)[..., None] for x in (scales, biases))
    return (codes * scales + biases).reshape(*lead, n * 4)


def _unit_scales(B: int, heads: int, groups: int, group: int, dim: int) -> tuple:
    """Scales of one and biases of zero for ``mx.quantized_matmul`` to read codes as they
    are, in its largest group that divides ``dim``, and that group size."""
    size = next(g for g in (128, 64, 32) if dim % g == 0)
    ones = mx.ones((B, heads, groups, group, dim // size), mx.float32)
    return ones, mx.zeros_like(ones), size


def install(model: nn.Module) -> int:
    """Route the attention of ``model``'s modules through :func:`ragged_attention`.

    Returns:
        How many modules use it (0: the model has its own attention, which a step cannot
        drive; the caller's probe then fails and says so).
    """
    _ON_CPU[0] = mx.default_device().type == mx.DeviceType.cpu
    names = {type(m).__module__ for _, m in model.named_modules()}
    installed = 0
    for name in names:
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is _MLX_LM_SDPA:
            module.scaled_dot_product_attention = ragged_attention
        if current in (_MLX_LM_SDPA, ragged_attention):
            installed += 1
    return installed
