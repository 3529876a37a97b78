"""What two computation paths may differ by, and no more (see DESIGN.md, "Floats across
computation paths").

Paths that multiply matrices of other shapes (a prompt prefilled whole, or a head and then a
chunk; a row decoded in a batch, or alone) may round differently: a BLAS picks its kernels and
summation order by shape and by CPU (AVX2, AVX-512), so one path's float can be the other's
plus an ulp. Quantized, such a value may land one code step away where it sits on a rounding
boundary. Anything more is a real difference: reading other positions, in float instead of
quantized, a token forgotten.
"""

from __future__ import annotations

import numpy as np

CODES_DIFFERING = 0.005
"""Share of the codes two paths may hold one step apart."""
STEPS = 1.5
"""How far apart, in steps of its group's scale, a value two paths quantized may be: one code,
and the float16 scale and bias themselves an ulp apart (up to 255 codes times that ulp)."""


def q8_steps(a: np.ndarray, b: np.ndarray, dim: int) -> tuple[float, float]:
    """How far apart two arrays of q8 heads are, as ``agentkv.engine.codes.packed`` holds them
    (uint32: ``dim`` codes in words of four, then a word per group: its float16 scale and bias):
    (the largest difference of a position's values as stored, codes times scale plus bias, in
    steps of that group's scale; the share of codes that differ)."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint32, (a.shape, b.shape)
    words = dim // 4
    groups = a.shape[-1] - words
    group = dim // groups
    codes = [x[..., :words].view(np.uint8).astype(np.float64) for x in (a, b)]
    halves = [x[..., words:].view(np.float16).astype(np.float64) for x in (a, b)]
    values = []
    for c, h in zip(codes, halves, strict=True):
        grouped = c.reshape(*c.shape[:-1], groups, group)
        scale, bias = h[..., :groups, None], h[..., groups:, None]
        values.append(grouped * scale + bias)
    scale = np.maximum(np.abs(halves[0][..., :groups, None]), np.finfo(np.float16).tiny)
    steps = float(np.max(np.abs(values[0] - values[1]) / scale)) if a.size else 0.0
    differing = float(np.mean(codes[0] != codes[1])) if a.size else 0.0
    return steps, differing


def q8_alike(a: np.ndarray, b: np.ndarray, dim: int) -> bool:
    """Whether two q8 arrays hold the same values up to float rounding on two paths: every
    value within :data:`STEPS`, few codes apart."""
    steps, differing = q8_steps(a, b, dim)
    return steps <= STEPS and differing <= CODES_DIFFERING


def assert_q8_alike(a: np.ndarray, b: np.ndarray, dim: int) -> None:
    steps, differing = q8_steps(a, b, dim)
    assert steps <= STEPS and differing <= CODES_DIFFERING, (
        f"q8 arrays apart by {steps:.2f} steps, {differing:.2%} of their codes differ"
    )
