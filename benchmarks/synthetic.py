"""Caches of a model's exact shape holding random keys and values, for benchmarks.

Decoding over a cache costs the same whatever its values, so a benchmark of the batch can give
an agent a 32K-token history in milliseconds instead of prefilling one for minutes. Build them
on the generation thread (``Engine.run``): MLX arrays belong to the thread that uses them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from agentkv.engine.mlxlm import set_write_index
from agentkv.engine.request import PromptCache


def synthetic_cache(model, tokens: int, seed: int, vocab: int) -> PromptCache:
    """A ``tokens``-position cache for ``model`` with random keys, values and token ids."""
    shapes = make_prompt_cache(model)
    model(mx.array([[1]]), cache=shapes)  # one token: every layer's head count and size
    key = mx.random.key(seed)
    layers = []
    for probe in shapes:
        window = probe.max_size if isinstance(probe, RotatingKVCache) else None
        held = tokens if window is None else min(tokens, window)
        _, heads, _, k_dim = probe.keys.shape
        v_dim = probe.values.shape[3]
        key, k_key, v_key = mx.random.split(key, 3)
        keys = 0.5 * mx.random.normal((1, heads, held, k_dim), key=k_key)
        values = 0.5 * mx.random.normal((1, heads, held, v_dim), key=v_key)
        layer = KVCache() if window is None else RotatingKVCache(max_size=window)
        layer.keys, layer.values = keys.astype(probe.keys.dtype), values.astype(probe.keys.dtype)
        layer.offset = tokens
        if window is not None:
            set_write_index(layer, held)  # temporal order, as a rebuilt ring keeps it
        layers.append(layer)
    mx.eval([(c.keys, c.values) for c in layers])
    ids = mx.random.randint(16, vocab, (tokens,), key=key).tolist()
    return PromptCache(layers, ids)
