"""Multimodal rotary positions (Qwen 3.5, Qwen3-VL) in agentkv's batch.

Such a model gives an image's tokens positions of their own: the token at row ``r``, column
``c`` of an image that starts at position ``S`` sits at ``(S, S + r, S + c)`` (time, height,
width; the frequencies of each rotary pair read one of the three, interleaved), and the text
after the image continues from ``S`` plus the image's longer side, not its token count. Text
takes the same position three times, which is plain rotary embedding at that position.

So the batch feeds every row of such a sequence its position shifted by what the images before
it took less than their tokens (:func:`scan`, from the token list and each image's grid), and
the rows of an image's tokens their three positions: a step that has some passes a
:class:`MultimodalPositions` as the rotary offset, which :class:`MultimodalRope` (installed on
the model's attention layers) reads. Steps without image rows are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from agentkv.engine.models.image_rules import ImageRule, Size
from agentkv.engine.models.vision import IMAGE_BASE


@dataclass(slots=True)
class MultimodalPositions:
    """A step's rotary offsets where some rows are image tokens: ``text`` (T,) every row's
    position (an image row's first), ``rows`` the image rows and ``thw`` their three
    positions, ``(3, R, 1)``."""

    text: mx.array
    rows: mx.array
    thw: mx.array


@dataclass(slots=True)
class Scanned:
    """Where a scan of a token list stopped: ``shift`` applies to text after ``tokens[:at]``;
    ``at`` is the token list's end or the start of an image run still open there."""

    at: int = 0
    shift: int = 0


def scan(tokens: list[int], grid: Callable[[int], Size], since: Scanned) -> Scanned:
    """The shift of text after ``tokens`` (each image ``token`` of ``grid(token)`` rows and
    columns shifts what follows by its longer side less its count), from ``since`` on."""
    at, shift, n = since.at, since.shift, len(tokens)
    i = at
    while i < n:
        token = tokens[i]
        if token < IMAGE_BASE:
            i += 1
            continue
        j = i
        while j < n and tokens[j] == token:
            j += 1
        rows, columns = grid(token)
        whole, rest = divmod(j - i, rows * columns)  # (the same image twice: two runs)
        shift += whole * (max(rows, columns) - rows * columns)
        if rest and j == n:
            return Scanned(j - rest, shift)
        i = j
    return Scanned(n, shift)


def chunk_positions(
    history: list[int], chunk: list[int], grid: Callable[[int], Size], since: Scanned
) -> tuple[list[int], list[tuple[int, int, int, int]], Scanned]:
    """The rotary positions of a prefill ``chunk`` after ``history`` (scanned up to
    ``since``): each row's position, the image rows as ``(row, t, h, w)``, and the scan of
    ``history + chunk``."""
    before = scan(history, grid, since)
    shift = before.shift
    run: tuple[int, int] | None = None  # (token, start) of the image run being fed
    if before.at < len(history):
        run = (history[before.at], before.at)
    positions, images = [], []
    for j, token in enumerate(chunk):
        p = len(history) + j
        if token < IMAGE_BASE:
            run = None
            positions.append(p + shift)
            continue
        if run is None or run[0] != token:
            run = (token, p)
        rows, columns = grid(token)
        k, first = p - run[1], run[1] + shift
        positions.append(first)
        images.append((j, first, first + k // columns, first + k % columns))
        if k == rows * columns - 1:
            shift += max(rows, columns) - rows * columns
            run = None
    at = len(history) + len(chunk) if run is None else run[1]
    return positions, images, Scanned(at, shift)


class MultimodalRope(nn.Module):
    """An attention layer's rotary embedding that also takes :class:`MultimodalPositions`:
    rows of plain positions go through the layer's own embedding, image rows through
    mlx-vlm's multimodal one (its interleaved frequency layout)."""

    def __init__(self, rope: nn.Module, rule: ImageRule):
        from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

        super().__init__()
        # Underscored: neither counts as the model's parameters.
        self._rope = rope
        self._multimodal = MRoPERotaryEmbedding(
            rule.rotary_dims,
            base=rule.theta,
            mrope_section=list(rule.mrope_section),
            style=rule.style,
        )
        self._style = rule.style

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if not isinstance(offset, MultimodalPositions):
            return self._rope(x, offset=offset)
        from mlx_vlm.models.rope_utils import apply_multimodal_rotary_pos_emb

        out = self._rope(x, offset=offset.text)
        rows = x[offset.rows]
        cos, sin = self._multimodal(rows, offset.thw)
        rotated, _ = apply_multimodal_rotary_pos_emb(rows, rows, cos, sin, style=self._style)
        out[offset.rows] = rotated
        return out


def install_multimodal_rope(model: nn.Module, rule: ImageRule) -> int:
    """Wrap the rotary embedding of every attention layer of ``model`` that has one; returns
    how many."""
    count = 0
    for _, module in model.named_modules():
        rope = getattr(module, "rope", None)
        if isinstance(rope, nn.Module) and not isinstance(rope, MultimodalRope):
            module.rope = MultimodalRope(rope, rule)
            count += 1
    return count


def decode_positions(group: Any) -> mx.array:
    """The rotary positions of a length group's decode rows: each row's next position, plus
    what its sequence's images shift it by."""
    if not any(seq.rope_shift for seq in group.seqs):
        return group.positions
    shifts = mx.array([seq.rope_shift for seq in group.seqs], dtype=group.positions.dtype)
    return group.positions + shifts


def prefill_positions(
    seq: Any, n: int, first_row: int, vision: Any, images: list[tuple[int, int, int, int]]
) -> mx.array:
    """The rotary positions of the next ``n`` prompt tokens of ``seq`` (fed from step row
    ``first_row``); where they hold image tokens of a model that positions them, their
    ``(row, t, h, w)`` are added to ``images``."""
    if vision is None or vision.rule is None or not vision.rule.positioned:
        return seq.group.positions + mx.arange(n)
    if not seq.request.image_sizes:
        return seq.group.positions + mx.arange(n) + seq.rope_shift
    sizes = seq.request.image_sizes
    since = seq.rope_scan if seq.rope_scan and seq.rope_scan.at <= len(seq.tokens) else Scanned()
    positions, rows, seq.rope_scan = chunk_positions(
        seq.tokens, seq.prompt[:n], lambda token: vision.grid(sizes[token]), since
    )
    seq.rope_shift = seq.rope_scan.shift
    images += [(first_row + j, t, h, w) for j, t, h, w in rows]
    return mx.array(positions, dtype=mx.int32)


def step_offsets(
    positions: list[mx.array], images: list[tuple[int, int, int, int]]
) -> mx.array | MultimodalPositions:
    """A step's rotary offsets: its rows' positions, and its image rows' three where it has
    some."""
    text = mx.concatenate(positions)
    if not images:
        return text
    rows, t, h, w = zip(*images, strict=True)
    return MultimodalPositions(text, mx.array(rows), mx.array([t, h, w])[:, :, None])
