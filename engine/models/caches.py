"""What kinds of cache a model's layers keep: mlx-lm's ``make_prompt_cache``, flat.

A ``CacheList`` (a layer holding two caches: attention and recurrent state, or multi-head latent
attention beside a sparse-attention index) counts as the caches it holds. Creating caches
allocates no arrays: it is the model's own answer to which layers slide, which hold state."""

from __future__ import annotations

from typing import Any


def flat_caches(caches: list[Any]) -> tuple[list[Any], tuple[int, ...]]:
    """``caches`` with each ``CacheList`` replaced by the caches it holds, and per model layer
    how many it held (0: a cache of its own)."""
    from mlx_lm.models.cache import CacheList

    flat, nested = [], []
    for cache in caches:
        inner = cache.caches if isinstance(cache, CacheList) else None
        flat.extend(inner if inner is not None else (cache,))
        nested.append(0 if inner is None else len(inner))
    return flat, tuple(nested)


def model_caches(model: Any) -> list[Any]:
    """The model's fresh caches, flat (:func:`flat_caches`)."""
    from mlx_lm.models.cache import make_prompt_cache

    return flat_caches(make_prompt_cache(model))[0]


def is_state(layer: Any) -> bool:
    """Whether a cache layer is recurrent state (an ``ArraysCache``: conv / SSM / gated-delta
    state, or a group's rows of it)."""
    from mlx_lm.models.cache import ArraysCache

    return isinstance(layer, ArraysCache)
