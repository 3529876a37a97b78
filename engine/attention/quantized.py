"""Attention over a quantized layer (:class:`~engine.batch.held.HeldQuantized`): q8 and q4
keys read as their words, never expanded but on a CPU's chunk."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from agentkv.engine.attention.dense import decode_attention, masked_softmax
from agentkv.engine.attention.eight_bit import eight_bit_attention
from agentkv.engine.attention.words import (
    DEVICE,
    folded_scores,
    times_words,
)
from agentkv.engine.batch.held import HeldQuantized
from agentkv.engine.codes import hadamard
from agentkv.engine.mlxlm import SDPA as MLX_LM_SDPA


def quantized_attention(
    queries: mx.array, held: HeldQuantized, scale: float, mask: Any, sinks: mx.array | None
) -> mx.array:
    """Attention of ``(B, Hq, Lq, D)`` queries over a quantized layer.

    Keys held per position (q8) are scored through ``mx.quantized_matmul`` as they are (held
    rotated by :func:`~engine.codes.hadamard`: against the query rotated once; on a
    CPU, :data:`EXPANDED_ROWS` query rows a head or more through the words expanded once),
    a block of queries at a time (:func:`eight_bit_attention`). Keys
    held per channel (q4): a key group's codes ``c`` read as ``s * c + b`` with one scale ``s``
    and bias ``b`` per channel, so a query's score against them is ``(q * s) . c + q . b``:
    each key group meets the query scaled by its scales in a matmul over its raw codes
    (:func:`folded_scores`), and the keys are never expanded. Columns a row holds in float
    are scored and weighted from ``recent`` (q8: each query's own position and the
    ``reach`` before it, :func:`eight_bit_band`; q4 global layers: also the row's first
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
        if DEVICE.cpu and Lq == 1 and foldable and sinks is None:
            out = decode_attention(queries, keys, values, scale, mask)
        else:
            out = MLX_LM_SDPA(queries, keys, values, None, scale=scale, mask=mask, sinks=sinks)
        return hadamard(out) if held.rotated else out
    if not held.per_channel:
        return eight_bit_attention(queries, held, scale, mask).astype(queries.dtype)
    recent_keys, recent_values = held.recent
    dv, f = recent_values.shape[3], recent_keys.shape[2]
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, rows, dk)
    scores = folded_scores(q, held)

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
    weights = masked_softmax(scores, mask, Lq)

    # Values: the quantized columns through their words, the float ones from ``recent`` and
    # ``first_kv``.
    zero = mx.array(0, mx.float32)
    weights_q = mx.where(in_float, zero, weights) if blend else weights
    weights_q = mx.where(at_first, zero, weights_q) if first is not None else weights_q
    out = times_words(weights_q, held, "values", dv, bits, held.value_group)
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
