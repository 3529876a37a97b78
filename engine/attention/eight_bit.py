"""q8 attention: a block of queries at a time (:data:`SCORES_BYTES` of scores), each
position's newest predecessors read in float up to its fence."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from agentkv.engine.attention.dense import masked_softmax
from agentkv.engine.attention.words import columns, expands, held_expanded, times_words
from agentkv.engine.batch.held import FLOAT_WINDOW, HeldQuantized
from agentkv.engine.codes import hadamard

# Bytes of float32 scores a q8 layer's attention holds for one block of a step's queries: a
# prompt's chunk over a long history goes in several (:func:`eight_bit_attention`).
SCORES_BYTES = 1 << 25


def eight_bit_attention(
    queries: mx.array, held: HeldQuantized, scale: float, mask: Any
) -> mx.array:
    """q8 attention of ``(B, Hq, Lq, D)`` queries, a block of at most :data:`SCORES_BYTES` of
    float32 scores at a time (a long prompt's chunk over a long history would otherwise hold
    several such arrays of all its queries at once), the words expanded once for all blocks
    where :func:`times_words` would expand them. Returns ``(B, Hq, Lq, Dv)`` float32."""
    B, n_q, Lq, dk = queries.shape
    n_kv, L = held.keys[0].shape[1], held.columns
    g = n_q // n_kv
    block = max(1, min(Lq, SCORES_BYTES // (4 * B * n_q * max(L, 1))))
    dv = held.recent[1].shape[3]
    expand = expands(g * Lq)
    keys_f = held_expanded(held, "keys", dk, held.bits, held.group) if expand else None
    values_f = held_expanded(held, "values", dv, held.bits, held.value_group) if expand else None
    outs = []
    for start in range(0, Lq, block):
        stop = min(Lq, start + block)
        q = queries[:, :, start:stop] if block < Lq else queries
        if outs:  # (one block at a time: its scores gone before the next block's are made)
            q = mx.depends(q, outs[-1])
        q = (q.astype(mx.float32) * scale).reshape(B, n_kv, g * (stop - start), dk)
        q_keys = hadamard(q) if held.rotated_keys else q  # (keys held rotated: so is the query)
        if keys_f is None:
            scores = times_words(q_keys, held, "keys", dk, held.bits, held.group)
        else:
            scores = q_keys @ keys_f.swapaxes(-1, -2)
        rows_masked = isinstance(mask, mx.array) and mask.ndim > 1 and mask.shape[-2] == Lq
        part = mask[..., start:stop, :] if rows_masked and block < Lq else mask
        outs.append(eight_bit_band(q, scores, held, part, start, stop, values_f))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def eight_bit_band(
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
    (``values_f``: the values' words expanded, :func:`times_words`), under ``mask``'s rows of
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
    scores = columns(scores, lo, hi, mx.where(in_float, picked, scores[..., lo:hi]))
    weights = masked_softmax(scores.reshape(B, n_kv, rows, L), mask, Lq)
    weights = weights.reshape(B, n_kv, g, Lq, L)
    zero = mx.array(0, mx.float32)
    weights_q = columns(weights, lo, hi, mx.where(in_float, zero, weights[..., lo:hi]))
    weights_q = weights_q.reshape(B, n_kv, rows, L)
    if values_f is None:
        out = times_words(weights_q, held, "values", dv, held.bits, held.value_group)
    else:
        out = weights_q @ values_f
    band_weights = mx.take_along_axis(weights, column[None, None, None], axis=-1)
    band_weights = band_weights * reads[:, None, None]  # (B, Hkv, g, Lq, W + 1)
    band_values = mx.take(recent_values, entry, axis=2).reshape(B, n_kv, 1, Lq, W + 1, dv)
    band_out = band_weights[..., None, :] @ band_values.astype(mx.float32)
    out = out.reshape(B, n_kv, g, Lq, dv) + band_out.squeeze(-2)
    return out.reshape(B, n_kv * g, Lq, dv)
