"""The four-bit schemes harness's own tests (run by hand: ``python -m pytest
benchmarks/research``; not part of ``make test``)."""

import pytest

from tests.test_benchmarks import run_quick


def test_q4_schemes_quick(tmp_path):
    report = run_quick("research.bench_q4_schemes", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    rows = {row["scheme"]: row for row in report["rows"]}
    assert len(rows) == 5
    control = rows["exact (control: the harness alone)"]
    # Holding nothing quantized, the harness reproduces the exact model.
    assert control["agreement"] == 1.0 and control["mean_kl"] < 1e-6
    assert control["bits"] == 16 and control["vs_float16_8k"] == 1.0
    today = rows["q4 per token (batch today)"]
    kivi = rows["q4 per-channel keys, Hadamard values, window 32"]
    assert today["bits"] == kivi["bits"] == 5.0
    assert 1e-5 < kivi["mean_kl"] < today["mean_kl"] / 4  # (quantized, far less harmed)
    assert today["vs_float16_8k"] == 5 / 16 < kivi["vs_float16_8k"] < 0.35
    assert report["targets_met"] == {"four_bit_agreement": None}  # (a 4K history only)


def test_q4_schemes_round_trip_in_groups_of_16_at_5_bits_and_clipped():
    import mlx.core as mx

    from benchmarks.research.bench_q4_schemes import round_trip

    x = mx.random.normal((3, 64, 128), key=mx.random.key(0)) * mx.arange(1, 129) / 32
    held = round_trip(x, 4, 16, min_max=True)
    groups = x.reshape(3, 64, 8, 16)
    step = (groups.max(axis=-1) - groups.min(axis=-1)) / 15
    error = mx.abs(held - x).reshape(3, 64, 8, 16).max(axis=-1)
    # Each group of 16 keeps its own range: at most half its 4-bit step off (float16 rounding
    # of the scale and bias aside), and its extremes held almost exactly.
    assert mx.all(error <= step * 0.5 + 2e-3).item()
    assert mx.all(mx.abs(held.reshape(groups.shape).max(axis=-1) - groups.max(axis=-1)) < 2e-2)
    assert mx.abs(held - x).max().item() > 0  # (quantized)
    # Groups of 32 by the same rule (per-channel keys'), not mx.quantize's.
    by_rule = round_trip(x, 4, 32, min_max=True)
    wide = x.reshape(3, 64, 4, 32)
    wide_step = (wide.max(axis=-1) - wide.min(axis=-1)) / 15
    assert mx.all(mx.abs(by_rule - x).reshape(wide.shape).max(axis=-1) <= wide_step * 0.5 + 2e-3)
    assert mx.any(by_rule != round_trip(x, 4, 32)).item()
    # Five-bit codes by the same rule (q4's keys over 32 positions): half the step and more.
    five = round_trip(x, 5, 32, min_max=True)
    fine_step = (wide.max(axis=-1) - wide.min(axis=-1)) / 31
    assert mx.all(mx.abs(five - x).reshape(wide.shape).max(axis=-1) <= fine_step * 0.5 + 2e-3)
    assert 0 < mx.abs(five - x).max().item() < 0.6 * mx.abs(by_rule - x).max().item()
    clipped = round_trip(x, 4, 32, clip=True)
    plain = round_trip(x, 4, 32)

    def squared(y):
        return mx.sum((y - x).reshape(3, 64, 4, 32) ** 2, axis=-1)

    # Each group keeps whichever narrowed range errs least, its own range among them.
    assert mx.all(squared(clipped) <= squared(plain) * (1 + 1e-3) + 1e-6).item()
    # A normal sample's tails are often worth narrowing: some groups err less.
    assert mx.mean(squared(clipped) < squared(plain) * (1 - 1e-3)).item() > 0.1
    assert mx.sum(squared(clipped)).item() < 0.99 * mx.sum(squared(plain)).item()


def test_q4_schemes_batch_q4_reads_the_first_position_in_float_over_its_words():
    """The harness's batch q4: a global layer's first position read exactly, its key group
    quantized with it (the others as the scheme without it holds them)."""
    import dataclasses

    import mlx.core as mx

    from benchmarks.research.bench_q4_schemes import BATCH_Q4, Held, HeldLayer

    keys = mx.random.normal((1, 1, 200, 128), key=mx.random.key(1))
    keys[..., 0, :] *= 20  # a BOS-like outlier
    values = mx.random.normal(keys.shape, key=mx.random.key(2))
    new = [mx.random.normal((1, 1, 1, 128), key=mx.random.key(3 + i)) for i in (0, 1)]
    plain = dataclasses.replace(BATCH_Q4, sink=0, sink_in_group=False)
    got, words = (
        HeldLayer(keys, values, 200, None, Held(s, 128, None), 0).update_and_fetch(*new)
        for s in (BATCH_Q4, plain)
    )
    for x, mine, theirs, kind in zip((keys, values), got, words, ("keys", "values"), strict=True):
        assert mx.array_equal(mine[..., :1, :], x[..., :1, :]).item(), kind
        assert not mx.allclose(theirs[..., :1, :], x[..., :1, :], atol=1e-3).item(), kind
        assert mx.array_equal(mine[..., 1:, :], theirs[..., 1:, :]).item(), kind


def test_q4_schemes_global_key_bits_and_first_position_count_on_global_layers_only():
    """``global_key_bits`` holds a global layer's keys at its bits and a sliding layer's at
    ``key_bits``; ``× float16`` counts a first position on global layers only."""
    import dataclasses

    import mlx.core as mx

    from benchmarks.research.bench_q4_schemes import BATCH_Q4, Held

    mixed = dataclasses.replace(BATCH_Q4, global_key_bits=4)
    keys = mx.random.normal((1, 1, 32, 128), key=mx.random.key(5))
    held = Held(mixed, 128, None, frozenset({1}))
    five, four = (dataclasses.replace(BATCH_Q4, key_bits=b) for b in (5, 4))
    for layer, alike in ((0, five), (1, four)):
        want = Held(alike, 128, None).hold(keys, "keys", layer)
        assert mx.array_equal(held.hold(keys, "keys", layer), want).item(), layer
    assert mixed.bits == 4.625 and mixed.layer_bits(False) == BATCH_Q4.bits == 5.125

    sliding, global_ = [(512, False)], [(8192, True)]
    plain = dataclasses.replace(BATCH_Q4, sink=0, sink_in_group=False)
    assert BATCH_Q4.held_fraction(sliding) == plain.held_fraction(sliding)
    # one position more in float on a global layer, its words still held
    extra = BATCH_Q4.held_fraction(global_) - plain.held_fraction(global_)
    assert extra == pytest.approx(1 / 8192)


def test_q4_schemes_sliding_layers_take_their_own_scheme():
    """``sliding``: a sliding-window layer holds and counts by its own scheme, a global one by
    the scheme itself, as the harness builds its layers (:func:`held_layers`)."""
    import dataclasses

    import mlx.core as mx

    from benchmarks.research.bench_q4_schemes import BATCH_Q4, PER_TOKEN_SLIDING, held_layers

    bare = dataclasses.replace(PER_TOKEN_SLIDING, window=0)
    mixed = dataclasses.replace(BATCH_Q4, sliding=bare)
    assert mixed.of_layer(True) is mixed and mixed.of_layer(False) is bare
    assert mixed.layer_bits(False) == bare.layer_bits(False) == 4.25
    assert mixed.layer_bits(True) == BATCH_Q4.bits
    sliding, global_ = [(512, False)], [(8192, True)]
    assert mixed.held_fraction(sliding) == bare.held_fraction(sliding) == 4.25 / 16
    assert mixed.held_fraction(global_) == BATCH_Q4.held_fraction(global_)

    keys, values = (mx.random.normal((1, 1, 100, 128), key=mx.random.key(i)) for i in (7, 8))
    prefix = [(keys, values, None), (keys[..., -64:, :], values[..., -64:, :], 64)]
    layers = held_layers(mixed, prefix, [100, 100], 128, None, None)
    assert [layer.held.scheme for layer in layers] == [mixed, bare]
    # the global layer: 2 key groups held, the newest 16 and its open key group (20) in
    # float; the sliding one: every position quantized per token
    assert [layer.floats[0].shape[2] for layer in layers] == [36, 0]
    assert [layer.quantized[0].shape[2] for layer in layers] == [64, 64]
    want = layers[1].held.hold(keys[..., -64:, :], "keys", 1)
    assert mx.array_equal(layers[1].quantized[0], want).item()


def test_q4_schemes_pre_rope_keys_are_quantized_at_their_own_positions():
    """``pre_rope``: a key is quantized with its rotary embedding undone at its position and
    done again. Keys whose channels are constant before the embedding come back almost
    exactly (quantized after it they do not), and each batch of positions leaving the float
    part is quantized from the position it starts at: through a sliding layer's window, a
    ring so small that its float positions are cut too, and a global layer's first
    position kept apart or read in float."""
    import dataclasses
    import types

    import mlx.core as mx

    from benchmarks.research.bench_q4_schemes import SCHEMES, Held, HeldLayer

    scheme = SCHEMES["pre-RoPE 4-bit per-channel keys in groups of 32, the rest as the batch's q4"]
    rope = types.SimpleNamespace(dims=128, traditional=False, base=10000.0, scale=1.0)

    def embedded(x, at):
        return mx.fast.rope(x, 128, traditional=False, base=1e4, scale=1.0, offset=at)

    constant = mx.random.normal((1, 1, 1, 128), key=mx.random.key(8)) * 3
    pre = mx.broadcast_to(constant, (1, 1, 240, 128))
    values = mx.random.normal((1, 1, 240, 128), key=mx.random.key(9))

    def run(s, n, offset, window, steps):  # ``steps``: positions written at each
        held = Held(s, 128, None, frozenset(), [rope])
        starts = []
        hold = held.hold
        held.hold = lambda x, kind, layer, start=0: (
            starts.append(start),
            hold(x, kind, layer, start),
        )[1]
        layer = HeldLayer(
            embedded(pre[..., :n, :], offset - n), values[..., :n, :], offset, window, held, 0
        )
        keys, at = None, offset
        for c in steps:
            keys, _ = layer.update_and_fetch(embedded(pre[..., :c, :], at), values[..., :c, :])
            at += c
        return layer, keys, starts[::2]  # (keys, then values, from each start)

    errors = {}
    for s in (scheme, dataclasses.replace(scheme, pre_rope=False)):
        # a sliding layer of window 200 holding positions 200 to 399 (offset 400): 5 key groups
        # held at once, then one each time 48 positions are in float
        layer, keys, starts = run(s, 200, 400, 200, [1] * 40)
        assert starts == [200, 360, 392] and layer.start == 424 and keys.shape[2] == 200
        errors[s.pre_rope] = mx.abs(keys - embedded(pre[..., :200, :], 240)).max().item()
    assert errors[True] < 0.01 < 0.1 < errors[False], errors

    # a ring of 40 positions, under the 16 newest and an open key group: its oldest float
    # positions are cut (3 decode steps), until a chunk of 10 leaves 50 in float, whose key
    # group from position 3 is held (then cut down to the ring, 10 positions more)
    layer, keys, starts = run(scheme, 40, 40, 40, [1, 1, 1, 10])
    assert starts == [3] and layer.start == 35 and keys.shape[2] == 40
    assert mx.abs(keys - embedded(pre[..., :40, :], 13)).max().item() < 0.01

    # a global layer: its first position kept apart (held from position 1) or read in float
    # over its words (held from 0)
    apart = dataclasses.replace(scheme, sink_in_group=False)
    for s, first in ((apart, 1), (scheme, 0)):
        layer, _, starts = run(s, 100, 100, None, [])
        assert starts == [first] and layer.start == first + 64, s.sink_in_group
