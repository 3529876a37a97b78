"""Reading quantized words for attention: scores against the keys' words with each group's
scales folded into the query, weights times the values' words, and, on a CPU, the words of
:data:`EXPANDED_ROWS` query rows a head or more expanded for one float matmul instead
(MLX's quantized matmul runs one scalar loop per output there)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from agentkv.engine.batch.held import HeldQuantized
from agentkv.engine.codes import dequantized, scales_of


@dataclass(slots=True)
class Device:
    """Where the model's attention runs: ``install`` sets it for the model's device (tests and
    benchmarks set it to take the other path on one machine)."""

    cpu: bool = False  # decode spans take decode_attention; chunks expand their words


DEVICE = Device()


# On a CPU, query rows a key-value head from which a quantized layer's words are expanded for
# one float matmul (a prompt's chunk) rather than read by ``mx.quantized_matmul``
# (:func:`eight_bit_attention`, :func:`times_words`).
EXPANDED_ROWS = 16


def columns(x: mx.array, lo: int, hi: int, part: mx.array) -> mx.array:
    """``x`` with its last axis' columns ``lo:hi`` replaced by ``part``."""
    if lo == 0 and hi == x.shape[-1]:
        return part
    return mx.concatenate([x[..., :lo], part, x[..., hi:]], axis=-1)


def folded_scores(q: mx.array, held: HeldQuantized) -> mx.array:
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
    ones, zeros, size = unit_scales(B, n_kv, n_groups, group, dk)
    scores = mx.quantized_matmul(
        q[:, :, None] * scales, words, ones, zeros, transpose=True, group_size=size, bits=bits
    )  # (B, Hkv, groups, rows, group)
    scores = scores + (q @ biases.swapaxes(-1, -2)).swapaxes(-1, -2)[..., None]
    scores = scores.transpose(0, 1, 3, 2, 4).reshape(B, n_kv, rows, n_groups * group)
    return mx.take_along_axis(scores, (mx.arange(L)[None] + shift)[:, None, None, :], axis=-1)


def times_words(
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
    if expands(x.shape[-2]):
        w = held_expanded(held, kind, dim, bits, group)
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


def expands(rows: int) -> bool:
    """Whether ``rows`` query rows a key-value head read the words expanded (on a CPU, from
    :data:`EXPANDED_ROWS` on) rather than through ``mx.quantized_matmul``."""
    return DEVICE.cpu and rows >= EXPANDED_ROWS


def held_expanded(held: HeldQuantized, kind: str, dim: int, bits: int, group: int) -> mx.array:
    """The held ``kind``'s ``held.columns`` positions, heads of ``dim`` in ``bits`` codes in
    groups of ``group``, expanded to float32 from their words."""
    L = held.columns
    words, extra = held.keys if kind == "keys" else held.values
    scales, biases = scales_of(extra, dim // group)
    return expanded(*(a[..., :L, :] for a in (words, scales, biases)), bits, group)


def expanded(words: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int):
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


def unit_scales(B: int, heads: int, groups: int, group: int, dim: int) -> tuple:
    """Scales of one and biases of zero for ``mx.quantized_matmul`` to read codes as they
    are, in its largest group that divides ``dim``, and that group size."""
    size = next(g for g in (128, 64, 32) if dim % g == 0)
    ones = mx.ones((B, heads, groups, group, dim // size), mx.float32)
    return ones, mx.zeros_like(ones), size
