"""Ragged attention: one forward pass over many sequences of different lengths, no padding
between them.

mlx-lm's models take a ``(B, L)`` token array and hand every layer one cache object. agentkv
feeds each step as ``T`` rows of one token (``L = 1``): the decode tokens of every running
sequence and the prefill chunks of joining ones, a chunk laid out one token per row. Every
linear layer, norm and MLP works per token, so this changes nothing for them, and each row's
rotary position comes from the cache's per-row ``offset``.

Each layer gets a :class:`StepCache`: a view that routes row ranges (:class:`Span`) to the
group caches that own them (see ``agentkv.engine.batch``). A decode span is ``B`` rows of ``B``
sequences sharing one padded group buffer; a prefill span is ``c`` rows of one sequence, which
attend as a ``(1, H, c, D)`` block with a causal mask. Attention therefore runs once per span
over exactly that span's keys, and the model's own code does the rest.

The only hook is ``scaled_dot_product_attention``: every mlx-lm model imports it from
``mlx_lm.models.base`` by name, so :func:`install` points that name, in the model's own
modules, at :func:`ragged_attention`, which hands any other cache straight to mlx-lm's function.

On MLX's CPU backend, decode spans (one query per row) of float layers attend through
:func:`decode_attention`,
the same math as two matmuls over the key-value head groups, which MLX's CPU backend runs
faster than ``mx.fast.scaled_dot_product_attention`` over a long history (``bench_mixed``:
what a long agent costs the others)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from agentkv.engine.attention.dense import decode_attention
from agentkv.engine.attention.quantized import quantized_attention
from agentkv.engine.attention.words import DEVICE
from agentkv.engine.batch.held import HeldQuantized
from agentkv.engine.batch.quantized import QuantizedLayer
from agentkv.engine.mlxlm import SDPA as MLX_LM_SDPA
from agentkv.engine.mlxlm import route_attention


@dataclass(slots=True, frozen=True)
class Span:
    """Rows ``start .. start + rows`` of a step, held by one group's layer cache.

    ``prefill``: the rows are consecutive tokens of one sequence (a B=1 group), not one token
    of each of the group's ``rows`` sequences. ``padded``: the group's buffer may hold positions
    of no sequence (it has held more than one), so even a decode step needs a mask.
    ``fences``: per row, each of its positions' fence (a q8 layer reads no float copy before
    it: ``agentkv.engine.batch.quantized.QuantizedLayer``; None where the layers are not q8).
    ``blocks``: a prefill chunk's rows, each the number of the image it is a token of (-1:
    text), where an image's tokens attend to each other both ways (Gemma 4); None otherwise.
    """

    cache: Any
    start: int
    rows: int
    prefill: bool
    padded: bool = True
    fences: tuple[tuple[int, ...], ...] | None = None
    blocks: tuple[int, ...] | None = None

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
        if self.blocks is None or max(self.blocks) < 0:
            return self.cache.make_mask(self.rows if self.prefill else 1, window_size=window_size)
        # The chunk's keys are the last of the step's: its image rows see all of their image.
        mask = self.cache.make_mask(self.rows, window_size=window_size, return_array=True)
        blocks = mx.array(self.blocks)
        same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
        earlier = mx.zeros((self.rows, mask.shape[-1] - self.rows), dtype=mx.bool_)
        return mask | mx.concatenate([earlier, same], axis=1)


class SpanMasks(tuple):
    """One attention mask per span, as :meth:`StepCache.make_mask` makes them."""


class Fetched(tuple):
    """A layer's keys (or values) for one step, a piece per span, and the :class:`StepCache`
    that holds them: a layer that reads another layer's KV (Gemma 4's shared-KV layers) gets
    these with no cache of its own, and attends through that layer's spans."""

    step: StepCache

    def __new__(cls, pieces: list[Any], step: StepCache) -> Fetched:
        fetched = super().__new__(cls, pieces)
        fetched.step = step
        return fetched

    @property
    def dtype(self) -> mx.Dtype:
        """The pieces' type (models that cast their attention's output back to it)."""
        return self[0].dtype

    def astype(self, dtype: mx.Dtype) -> Fetched:
        """Every piece cast (models that attend in float32: Phi-2, StableLM)."""
        return Fetched([piece.astype(dtype) for piece in self], self.step)


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

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Fetched, Fetched]:
        fetched = [
            s.cache.write(s.as_block(keys), s.as_block(values), s.fences)
            if isinstance(s.cache, QuantizedLayer)
            else s.cache.update_and_fetch(s.as_block(keys), s.as_block(values))
            for s in self.spans
        ]
        return Fetched([k for k, _ in fetched], self), Fetched([v for _, v in fetched], self)

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
            elif DEVICE.cpu and not span.prefill and sinks is None:
                out = decode_attention(q, k, v, scale, mask)
            else:
                out = MLX_LM_SDPA(q, k, v, span.cache, scale=scale, mask=mask, sinks=sinks)
            outputs.append(out.transpose(2, 1, 0, 3) if span.prefill else out)
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)


def ragged_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, span by span for a :class:`StepCache` (the
    layer's own, or the one whose keys a shared-KV layer reads)."""
    if isinstance(cache, StepCache):
        return cache.attend(queries, keys, values, scale, mask, sinks)
    if cache is None and isinstance(keys, Fetched):
        return keys.step.attend(queries, keys, values, scale, mask, sinks)
    if isinstance(keys, HeldQuantized):
        return quantized_attention(queries, keys, scale, mask, sinks)
    return MLX_LM_SDPA(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install(model: nn.Module) -> int:
    """Route the attention of ``model``'s modules through :func:`ragged_attention`.

    Returns:
        How many modules use it (0: the model has its own attention, which a step cannot
        drive; the caller's probe then fails and says so).
    """
    DEVICE.cpu = mx.default_device().type == mx.DeviceType.cpu
    return route_attention(model, ragged_attention)
