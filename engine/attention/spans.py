"""Layers run span by span: the model's own code once per span of a step's rows, each span
with the group cache that holds it.

A step feeds ``T`` rows of one token (``agentkv.engine.attention.step``). Attention reads each
span's keys through mlx-lm's ``scaled_dot_product_attention``; two kinds of layer cannot work that
way, and run span by span instead, a prefill chunk as a ``(1, c, D)`` block of consecutive
tokens and a decode group as ``(B, 1, D)``:

- recurrent layers (``agentkv.engine.batch.state``), which must see a chunk's tokens in order. Their
  step view is a :class:`StepState`;
- attention that reads its cache outside ``scaled_dot_product_attention`` (multi-head latent
  attention scores its cached rotary keys itself; some models write attention out). When the
  ragged step does not reproduce such a model's logits, the runner runs its layers span by
  span (:func:`install_spans` with ``attention``), each against its group's mlx-lm batch cache
  (``BatchKVCache`` / ``BatchRotatingKVCache``) with that span's mask.

Every decoder layer gets :class:`SpanLayer`'s call (its class swapped for a subclass); a call
whose cache is not a step view goes straight through. Layers mix no tokens across sequences
outside attention, so span by span is the model's own computation; it costs one call of the
layer (its MLP included) per span instead of one per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList

from agentkv.engine.attention.step import SpanMasks, StepCache
from agentkv.engine.mlxlm import decoder_layers, recast


class StepState:
    """What a recurrent layer sees as its cache during one step: the spans
    (:class:`~engine.attention.step.Span`) whose rows it holds, each with its group's
    ``GroupStateCache``."""

    __slots__ = ("spans",)

    def __init__(self, spans: list[Any]):
        self.spans = spans

    def make_mask(self, N: int, *args: Any, **kwargs: Any) -> None:
        """No mask: a span's rows are one sequence's consecutive tokens or one token of each
        of its group's sequences, none of them padding."""
        return None


class StepList:
    """What a layer holding a ``CacheList`` (attention and state, or MLA beside a sparse
    attention index) sees during a step: its caches' views, indexed as the ``CacheList``."""

    __slots__ = ("views",)

    def __init__(self, views: list[Any]):
        self.views = views

    def __getitem__(self, i: int) -> Any:
        return self.views[i]

    @property
    def spans(self) -> list[Any]:
        """Its caches' spans together: each a span of the same rows whose cache is a
        ``CacheList`` of theirs."""
        return [
            dataclasses.replace(span, cache=CacheList(*(v.spans[j].cache for v in self.views)))
            for j, span in enumerate(self.views[0].spans)
        ]


def step_views(
    windows: tuple[int | None, ...],
    nested: tuple[int, ...],
    spans: list[list[Any]],
    positions: mx.array,
) -> list[Any]:
    """Each model layer's view of a step: per cache (``windows``: a layout's, 0 for recurrent
    state) its spans, with the rows' ``positions`` for attention; a ``CacheList`` layer's caches
    (``nested``: how many each model layer holds, 0 for a cache of its own) together."""
    views = [
        StepState(s) if windows[i] == 0 else StepCache(s, positions) for i, s in enumerate(spans)
    ]
    if not any(nested):
        return views
    together, at = [], 0
    for n in nested:
        together.append(views[at] if n == 0 else StepList(views[at : at + n]))
        at += max(n, 1)
    return together


def run_spans(call: Any, x: mx.array, step: Any, args: tuple, kwargs: dict) -> mx.array:
    """``call`` (a layer's own) on ``x``'s rows span by span: ``step`` (a :class:`StepState`,
    :class:`StepList` or :class:`~engine.attention.step.StepCache`) replaced by the span's
    cache, a :class:`~engine.attention.step.SpanMasks` by the span's mask, and an array of one
    value per row that the model computed for the step's ``(T, ., 1, .)`` layout (Mistral 4's
    attention scale per position) by the span's rows, laid out as its queries are."""
    outputs, total = [], x.shape[0]
    for j, span in enumerate(step.spans):
        rows = x[span.start : span.stop] if span.start or x.shape[0] != span.rows else x
        if span.prefill:
            rows = rows.transpose(1, 0, 2)  # (1, c, D): the chunk's tokens in order

        def given(v: Any, span: Any = span, j: int = j) -> Any:
            if v is step:
                return span.cache
            if isinstance(v, SpanMasks):
                return v[j]
            if isinstance(v, mx.array) and v.ndim == 4 and v.shape[0] == total and v.shape[2] == 1:
                return span.as_block(v)  # per row, laid out as the step's (T, ., 1, .) rows
            return v

        out = call(rows, *map(given, args), **{k: given(v) for k, v in kwargs.items()})
        if not isinstance(out, mx.array) or out.shape[:2] != rows.shape[:2]:
            raise TypeError(
                f"a layer run span by span returned {type(out).__name__} "
                f"{getattr(out, 'shape', '')}, not its rows' hidden states"
            )
        outputs.append(out.transpose(1, 0, 2) if span.prefill else out)
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)


class SpanLayer:
    """A decoder layer that runs span by span when its cache is a :class:`StepState` or a
    :class:`StepList` (and, with ``agentkv_spans_attention``, a
    :class:`~engine.attention.step.StepCache`)."""

    # (A name no model's module uses: a class attribute would hide a submodule of that name.)
    agentkv_spans_attention = False

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        kinds = (StepState, StepList)  # (a layer holding state always runs span by span)
        if self.agentkv_spans_attention:
            kinds = (*kinds, StepCache)
        step = next((v for v in (*args, *kwargs.values()) if isinstance(v, kinds)), None)
        call = super().__call__  # type: ignore[misc]
        if step is None:
            return call(x, *args, **kwargs)
        return run_spans(call, x, step, args, kwargs)


_WRAPPED: dict[tuple[type, bool], type] = {}


def install_spans(model: nn.Module, attention: bool = False) -> None:
    """Give each of ``model``'s decoder layers :class:`SpanLayer`'s call; ``attention``: its
    attention layers too run span by span."""
    for layer in decoder_layers(model):
        cls = type(layer)
        base = cls.__mro__[2] if issubclass(cls, SpanLayer) else cls  # (Wrapped, SpanLayer, base)
        key = (base, attention)
        if key not in _WRAPPED:
            fields = {"__module__": base.__module__, "agentkv_spans_attention": attention}
            _WRAPPED[key] = type(base.__name__, (SpanLayer, base), fields)
        recast(layer, _WRAPPED[key])
