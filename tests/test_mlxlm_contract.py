"""What agentkv relies on in mlx-lm beyond its public API (``agentkv.engine.mlxlm``), checked
against the installed mlx-lm. A release that changes one of these fails here, with a message
naming what changed, before anything in the batch does."""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from agentkv.engine import mlxlm
from agentkv.engine.models.loading import load_model


def positions(*values: int) -> mx.array:
    """Keys (or values) of one head whose only feature is the position: (1, 1, n, 1)."""
    return mx.array(values, dtype=mx.float32).reshape(1, 1, -1, 1)


def feed(cache, *values: int):
    for v in values:
        cache.update_and_fetch(positions(v), positions(v))
    return cache


def flat(x: mx.array) -> list[int]:
    return [int(v) for v in x.reshape(-1).tolist()]


def test_a_ring_gives_its_positions_oldest_first_and_a_rebuilt_ring_continues_alike():
    ring = feed(RotatingKVCache(max_size=4), 0, 1, 2, 3, 4, 5)  # wrapped: 4, 5 over 0, 1
    assert flat(mlxlm.temporal_order(ring, ring.keys)) == [2, 3, 4, 5], (
        "RotatingKVCache._temporal_order no longer gives a wrapped ring's positions oldest "
        "first: saving rings (engine.kv) relies on it"
    )
    assert mlxlm.write_index(ring) == 2, (
        "RotatingKVCache._idx is no longer the slot its next position is written to"
    )
    # Rebuilt from its positions in temporal order, writing after the newest (engine.kv.load).
    rebuilt = RotatingKVCache(max_size=4)
    rebuilt.keys = rebuilt.values = positions(2, 3, 4, 5)
    rebuilt.offset = 6
    mlxlm.set_write_index(rebuilt, 4)
    feed(ring, 6)
    feed(rebuilt, 6)
    assert flat(mlxlm.temporal_order(rebuilt, rebuilt.keys)) == [3, 4, 5, 6], (
        "a RotatingKVCache given its positions in temporal order and _idx after the newest no "
        "longer continues as the ring it was saved from"
    )
    assert flat(mlxlm.temporal_order(ring, ring.keys)) == [3, 4, 5, 6]
    assert (ring.offset, rebuilt.offset) == (7, 7)


def test_a_batch_buffer_writes_every_row_at_its_shared_index():
    rows = [feed(KVCache(), 1, 2, 3), feed(KVCache(), 1, 2, 3, 4, 5)]
    merged = BatchKVCache.merge(rows)
    assert mlxlm.write_index(merged) == 5, (
        "BatchKVCache._idx is no longer the columns its rows use after a merge (the longest "
        "row, the others left-padded): engine.batch's buffers grow from it"
    )
    nine = mx.full((2, 1, 1, 1), 9.0)
    merged.update_and_fetch(nine, nine)
    assert mlxlm.write_index(merged) == 6
    assert flat(merged.extract(0).keys) == [1, 2, 3, 9]
    # An empty merge is mlx-lm's own class: recast to a subclass that only adds behaviour.

    class Growing(BatchKVCache):
        @property
        def step(self) -> int:
            return 8

    grown = mlxlm.recast(BatchKVCache.merge([KVCache()]), Growing)
    grown.update_and_fetch(positions(7), positions(7))
    assert isinstance(grown, Growing) and grown.keys.shape[2] == 8, (
        "a BatchKVCache recast to a subclass no longer grows its buffer by the subclass's step"
    )


def test_a_batch_ring_built_from_padded_rows_reads_them_back_and_writes_after_them():
    ring = BatchRotatingKVCache(4, [1, 0])  # a row of 2 positions beside one of 3
    ring.keys = ring.values = mx.array([[0, 5, 6], [1, 2, 3]], dtype=mx.float32).reshape(2, 1, 3, 1)
    ring.offset = mx.array([2, 3])
    mlxlm.set_batch_extent(ring, 3)
    assert (mlxlm.write_index(ring), mlxlm.ring_offset(ring)) == (3, 3), (
        "BatchRotatingKVCache._idx / _offset no longer hold the columns written so far"
    )
    assert flat(ring.extract(0).keys)[-2:] == [5, 6] and flat(ring.extract(1).keys) == [1, 2, 3]
    ring.update_and_fetch(
        mx.array([7, 4], dtype=mx.float32).reshape(2, 1, 1, 1),
        mx.array([7, 4], dtype=mx.float32).reshape(2, 1, 1, 1),
    )
    assert mlxlm.ring_offset(ring) == 4
    assert flat(ring.extract(1).keys)[-4:] == [1, 2, 3, 4]


def test_models_import_mlx_lms_attention_by_name():
    """The hook: a model module's ``scaled_dot_product_attention`` is ``mlx_lm.models.base``'s,
    a global name :func:`route_attention` can point elsewhere."""
    from agentkv.engine.attention.step import ragged_attention

    families = ["llama", "gemma3_text", "qwen3", "qwen3_next", "gpt_oss"]
    routed = (base.scaled_dot_product_attention, ragged_attention)  # (once an engine ran)
    hooked = {
        name: getattr(
            importlib.import_module(f"mlx_lm.models.{name}"), "scaled_dot_product_attention", None
        )
        in routed
        for name in families
    }
    assert all(hooked.values()), (
        f"mlx-lm models no longer import scaled_dot_product_attention from mlx_lm.models.base "
        f"by name: {[n for n, ok in hooked.items() if not ok]}; agentkv's step attention "
        "hooks that name"
    )
    assert mlxlm.SDPA is base.scaled_dot_product_attention


@pytest.mark.parametrize("spec", ["tiny:llama", "tiny:gemma3", "tiny:hybrid"])
def test_a_models_decoder_layers_are_its_layers_and_take_a_subclass(spec):
    model = load_model(spec).model
    layers = mlxlm.decoder_layers(model)
    assert len(layers) == model.args.num_hidden_layers, (
        "mlx-lm models no longer list their decoder layers as model.layers"
    )
    # What engine.attention.spans does: a subclass adding a call, the layer's state as it was.
    cls = type(layers[0])
    wrapped = type(
        cls.__name__, (cls,), {"__call__": lambda self, *a, **k: cls.__call__(self, *a, **k)}
    )
    before = {k for k, _ in layers[0].parameters().items()}
    mlxlm.recast(layers[0], wrapped)
    assert type(layers[0]) is wrapped and set(layers[0].parameters()) == before


def test_a_one_row_buffer_drops_the_newest_positions_of_a_span_and_continues():
    """What a drafted step's rejected drafts rely on (``mlxlm.drop_newest``): after an update
    of several positions, a ``BatchKVCache`` / ``BatchRotatingKVCache`` of one row cut back
    by ``trim`` (and a ring's buffer to ``_idx``) holds what it held before them and writes
    the next position after it, as if they had never been written."""

    def grown(cache, values):
        x = mx.array(values, dtype=mx.float32).reshape(1, 1, -1, 1)
        return cache.update_and_fetch(x, x)

    for make in (lambda: BatchKVCache([0]), lambda: BatchRotatingKVCache(4, [0])):
        cut, whole = make(), make()
        for value in range(6):  # past the ring's window: it wrapped
            grown(cut, [value])
            grown(whole, [value])
        grown(cut, [6, 70, 80])  # a span of three; the last two rejected
        mlxlm.drop_newest(cut, 2)
        grown(cut, [7])
        grown(whole, [6])
        grown(whole, [7])
        got = flat(cut.extract(0).keys)
        want = flat(whole.extract(0).keys)
        assert got[-len(want) :] == want and got[-2:] == [6, 7], (
            f"{type(cut).__name__}.trim no longer cuts a span's newest positions back "
            f"({got} against {want})"
        )
        assert int(cut.offset[0].item()) == int(whole.offset[0].item()) == 8
