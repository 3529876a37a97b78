"""Length groups on real tiny models: what a group holds, exact round trips through it, where
a sequence goes, and the bytes a turn sets aside."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from engine.kv_batch import (
    MIN_GROWTH,
    PADDING_TOLERANCE,
    KVGroup,
    KVLayout,
    best_group,
    growth,
)
from engine.models.loading import load_model

SPECS = ["tiny:gemma3", "tiny:llama"]


class Seq:
    """The part of an engine Sequence a group looks at."""

    def __init__(self, n: int):
        self.tokens = list(range(n))
        self.group = None


@pytest.fixture(scope="module", params=SPECS)
def model(request):
    return load_model(request.param).model


def prefilled(model, n: int, salt: int = 0) -> list:
    """mlx-lm caches of an n-token prompt, as a request would bring them."""
    caches = make_prompt_cache(model)
    tokens = mx.array([(5 * i + 3 * salt) % 400 + 16 for i in range(n)])
    model(tokens[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def assert_same_cache(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        assert g.offset == w.offset
        if isinstance(w, RotatingKVCache):  # compare in temporal order, as it is attended
            wk, wv = w._temporal_order(w.keys), w._temporal_order(w.values)
            gk, gv = g._temporal_order(g.keys), g._temporal_order(g.values)
            size = min(w.offset, w.max_size)
            assert mx.array_equal(gk[..., -size:, :], wk[..., -size:, :]).item()
            assert mx.array_equal(gv[..., -size:, :], wv[..., -size:, :]).item()
        else:
            assert mx.array_equal(g.keys[..., : w.offset, :], w.keys[..., : w.offset, :]).item()
            assert mx.array_equal(g.values[..., : w.offset, :], w.values[..., : w.offset, :]).item()


def test_growth_is_small_for_short_buffers_and_proportional_for_long_ones():
    assert growth(0) == growth(100) == MIN_GROWTH
    assert growth(16_384) == 1024
    assert growth(16_384 + 16 * 20) == 1056  # 1044, rounded up to whole MIN_GROWTH steps


def test_layout_reads_each_layers_window_and_bytes(model):
    layout = KVLayout.of(model)
    caches = make_prompt_cache(model)
    assert layout.windows == tuple(
        c.max_size if isinstance(c, RotatingKVCache) else None for c in caches
    )
    args = model.args
    per_layer = 2 * args.num_key_value_heads * args.head_dim * 4  # K and V, float32
    assert layout.token_bytes == (per_layer,) * len(caches)
    n_global = sum(w is None for w in layout.windows)
    window = max((w for w in layout.windows if w), default=0)
    n_sliding = len(caches) - n_global
    assert layout.owned_bytes(10) == 10 * per_layer * len(caches)
    assert layout.owned_bytes(1000) == per_layer * (
        1000 * n_global + min(1000, window or 0) * n_sliding
    )


def test_a_group_gives_back_exactly_the_caches_it_was_given(model):
    layout = KVLayout.of(model)
    lengths = [5, 40, 37]
    originals = [prefilled(model, n, salt=n) for n in lengths]
    seqs = [Seq(n) for n in lengths]
    groups = [KVGroup.start(layout, s, c) for s, c in zip(seqs, originals, strict=True)]
    first = groups[0]
    first.absorb(groups[1])
    first.absorb(groups[2])
    assert first.seqs == seqs and all(s.group is first for s in seqs)
    for seq, original in zip(seqs, originals, strict=True):
        assert_same_cache(first.extract(seq), original)
    first.remove([seqs[1]])
    assert seqs[1].group is None and first.seqs == [seqs[0], seqs[2]]
    assert_same_cache(first.extract(seqs[0]), originals[0])
    assert_same_cache(first.extract(seqs[2]), originals[2])


def test_a_group_refuses_caches_of_another_shape(model):
    from engine.errors import InvalidCacheError

    layout = KVLayout.of(model)
    wrong = [KVCache() for _ in layout.windows]
    if all(w is None for w in layout.windows):
        wrong = [RotatingKVCache(max_size=8) for _ in layout.windows]
    with pytest.raises(InvalidCacheError, match="do not match the model"):
        KVGroup.start(layout, Seq(0), wrong)


def test_a_group_refuses_a_cache_with_other_heads(model):
    from engine.errors import InvalidCacheError

    layout = KVLayout.of(model)
    caches = prefilled(model, 6)
    layer = caches[-1]
    b, h, n, d = layer.keys.shape
    layer.keys = mx.zeros((b, h + 1, n, d), layer.keys.dtype)  # another model's KV heads
    layer.values = mx.zeros((b, h + 1, n, layer.values.shape[3]), layer.values.dtype)
    with pytest.raises(InvalidCacheError, match=f"cache layer {len(caches) - 1} holds"):
        KVGroup.start(layout, Seq(6), caches)


def test_an_empty_cache_starts_a_group_that_grows_in_small_steps(model):
    layout = KVLayout.of(model)
    group = KVGroup.start(layout, Seq(0), make_prompt_cache(model))
    assert [type(a) for a in group.layers] == [type(b) for b in layout.empty_layers()]


def test_a_sequence_joins_the_group_it_pads_least_or_none_past_the_tolerance(model):
    layout = KVLayout.of(model)
    groups = []
    for lengths in ([100, 104], [400, 410]):
        seqs = [Seq(n) for n in lengths]
        group = KVGroup.start(layout, seqs[0], prefilled(model, lengths[0]))
        group.absorb(KVGroup.start(layout, seqs[1], prefilled(model, lengths[1])))
        groups.append(group)
    assert best_group(layout, groups, [102]) is groups[0]
    assert best_group(layout, groups, [405]) is groups[1]
    assert best_group(layout, groups, [250]) is None  # pads either group by far too much
    assert best_group(layout, groups, [3]) is None


def test_padding_tolerance_bounds_what_a_group_holds(model):
    layout = KVLayout.of(model)
    lengths = [300, 300, 300 + int(300 * PADDING_TOLERANCE / 2)]
    assert layout.fits_one_group(lengths)
    assert not layout.fits_one_group([300, 300, 2000])


def test_a_group_compacts_after_its_longest_sequence_leaves(model):
    layout = KVLayout.of(model)
    long_seq, short_seq = Seq(600), Seq(20)
    group = KVGroup.start(layout, long_seq, prefilled(model, 600))
    group.absorb(KVGroup.start(layout, short_seq, prefilled(model, 20, salt=1)))
    short_cache = group.extract(short_seq)
    group.remove([long_seq])
    group.compact(layout)
    assert group.held_bytes <= 1.2 * layout.owned_bytes(20) + layout.owned_bytes(MIN_GROWTH)
    assert_same_cache(group.extract(short_seq), short_cache)


def test_a_reservation_covers_history_growth_and_padding(model):
    layout = KVLayout.of(model)
    for tokens in (2, 300, 5000):
        held = layout.owned_bytes(tokens)
        assert layout.reservation(tokens, chunk=16) >= held * (1 + PADDING_TOLERANCE)


# ---- quantized in the batch (batch_kv_bits) -------------------------------------------------


def packed_like(layout: KVLayout, caches: list) -> list:
    """What a quantized group should give back for ``caches``: each quantized layer's keys
    and values through mx.quantize, packed."""
    return [layout.packing.pack(i, c) if layout.quantized(i) else c for i, c in enumerate(caches)]


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_group_gives_back_exactly_the_quantized_rows(model, bits):
    layout = KVLayout.of(model, bits=bits)
    assert all(layout.quantized(i) for i in range(len(layout.windows)))  # sliding ones too
    window = min((w for w in layout.windows if w), default=32)
    lengths = [5, 40, window + 7, 2 * window + 3]  # past a window: rotated buffers
    originals = [prefilled(model, n, salt=n) for n in lengths]
    seqs = [Seq(n) for n in lengths]
    groups = [KVGroup.start(layout, s, c) for s, c in zip(seqs, originals, strict=True)]
    first = groups[0]
    for other in groups[1:]:
        first.absorb(other)
    for seq, original in zip(seqs, originals, strict=True):
        assert_same_cache(first.extract(seq), packed_like(layout, original))
    # A row that left and rejoins (a paused sequence) comes back exactly as it left.
    paused = first.extract(seqs[1])
    first.remove([seqs[1]])
    first.absorb(KVGroup.start(layout, Seq(40), paused))
    assert_same_cache(first.extract(first.seqs[-1]), packed_like(layout, originals[1]))
    first.remove([seqs[3]])  # the longest: compacting copies the rest, still exact
    first.compact(layout)
    assert_same_cache(first.extract(seqs[2]), packed_like(layout, originals[2]))
    # Expanded to the model's precision, within a quantization step of the original.
    for got, want in zip(layout.packing.expand(first.extract(seqs[2])), originals[2], strict=True):
        assert type(got) is type(want) and got.keys.dtype == want.keys.dtype
        gk, wk = got.keys[..., : got.offset, :], want.keys[..., : want.offset, :]
        if isinstance(want, RotatingKVCache):  # the window's positions, in temporal order
            gk, wk = got._temporal_order(got.keys), want._temporal_order(want.keys)
            n = min(want.offset, want.max_size)
            gk, wk = gk[..., -n:, :], wk[..., -n:, :]
        error = mx.abs(gk - wk).max().item()
        assert error <= 2 * mx.abs(wk).max().item() / (2**bits - 1)


def test_a_packed_row_joins_only_a_layer_held_quantized(model):
    from engine.errors import InvalidCacheError

    quantized, exact = KVLayout.of(model, bits=8), KVLayout.of(model)
    group = KVGroup.start(quantized, Seq(12), prefilled(model, 12))
    row = group.extract(group.seqs[0])
    with pytest.raises(InvalidCacheError, match="packed"):
        KVGroup.start(exact, Seq(12), row)


def test_a_quantized_layer_holds_fewer_bytes_a_token(model):
    exact, q8, q4 = (KVLayout.of(model, bits=b) for b in (None, 8, 4))
    group = KVGroup.start(q8, Seq(300), prefilled(model, 300))
    for i, w in enumerate(exact.windows):
        assert q4.token_bytes[i] < q8.token_bytes[i] < exact.token_bytes[i]
        held = group.layers[i].nbytes
        positions = 300 if w is None else min(300, w)
        assert q8.token_bytes[i] * positions <= held <= q8.token_bytes[i] * (300 + growth(300))


def test_a_packed_row_with_no_positions_expands_to_an_empty_row(model):
    layout = KVLayout.of(model, bits=8)
    rows = make_prompt_cache(model)
    for row in rows:  # packed arrays holding no position
        row.keys = row.values = mx.zeros((1, 1, 0, 8), mx.uint32)
    assert all(row.keys is None and row.offset == 0 for row in layout.packing.expand(rows))
