"""Attention over float keys and values, one query per row (decode spans on a CPU)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


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


def masked_softmax(scores: mx.array, mask: Any, Lq: int) -> mx.array:
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
