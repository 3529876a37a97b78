"""Deepstack (Qwen3-VL) in agentkv's batch: an image's features from the vision tower's early
layers are added to the hidden states of its tokens after the language model's first layers.

mlx-vlm's Qwen3-VL adds level ``i`` of each image's deepstack features to its tokens' hidden
states after decoder layer ``i``. mlx-lm's class of its language model (Qwen3's) reads no such
input, so :func:`install_deepstack` gives each of those layers a call that adds what the step
staged for it (:class:`agentkv.engine.models.vision.Staged`: the vision half stages the rows of
the step's image tokens and each level's features for them when it embeds them), each level
taken once. A step without image rows stages nothing: its layers run as mlx-lm's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv.engine.errors import UnsupportedModelError
from agentkv.engine.mlxlm import decoder_layers, recast

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

    from agentkv.engine.models.vision import Staged, Vision


class DeepstackLayer:
    """A decoder layer's call (mixed in before its class) whose output takes its level's
    staged deepstack features on the step's image rows (the step feeds one token a row:
    hidden states are ``(rows, 1, hidden)``)."""

    # (Class attributes of each installed layer's own class: names no model's module uses.)
    agentkv_deepstack: Staged
    agentkv_deepstack_level: int

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(x, *args, **kwargs)  # type: ignore[misc]
        staged = self.agentkv_deepstack.take(self.agentkv_deepstack_level)
        if staged is None:
            return out
        rows, features = staged
        return out.at[rows].add(features[:, None, :].astype(out.dtype))


def install_deepstack(model: nn.Module, vision: Vision | None) -> int:
    """Give the first of ``model``'s decoder layers, one a deepstack level of ``vision``
    (none for most families), :class:`DeepstackLayer`'s call; returns how many. Installed
    after the batch's own layer calls (``agentkv.engine.attention.spans``), so that it adds
    to the whole step's rows."""
    levels = vision.levels if vision is not None else 0
    layers = decoder_layers(model)[:levels]
    if len(layers) != levels:
        raise UnsupportedModelError(
            f"{vision.path.name}: {levels} deepstack levels, {len(layers)} decoder layers"
        )
    for level, layer in enumerate(layers):
        fields = {"__module__": type(layer).__module__}
        fields |= {"agentkv_deepstack": vision.staged, "agentkv_deepstack_level": level}
        recast(layer, type(type(layer).__name__, (DeepstackLayer, type(layer)), fields))
    return levels
