"""Length groups on real tiny models: what a group holds, exact round trips through it, where
a sequence goes, and the bytes a turn sets aside."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from agentkv.engine.attention.step import install
from agentkv.engine.batch.buffers import MIN_GROWTH, growth
from agentkv.engine.batch.groups import KVGroup, best_group
from agentkv.engine.batch.layout import PADDING_TOLERANCE, KVLayout
from agentkv.engine.batch.state import GroupStateCache, state_row
from agentkv.engine.mlxlm import temporal_order
from agentkv.engine.models.loading import load_model

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
            wk, wv = temporal_order(w, w.keys), temporal_order(w, w.values)
            gk, gv = temporal_order(g, g.keys), temporal_order(g, g.values)
            size = min(w.offset, w.max_size)
            assert mx.array_equal(gk[..., -size:, :], wk[..., -size:, :]).item()
            assert mx.array_equal(gv[..., -size:, :], wv[..., -size:, :]).item()
        else:
            assert mx.array_equal(g.keys[..., : w.offset, :], w.keys[..., : w.offset, :]).item()
            assert mx.array_equal(g.values[..., : w.offset, :], w.values[..., : w.offset, :]).item()
        if getattr(w, "recent", None) is not None:  # keys per channel: the newest in float
            assert all(mx.array_equal(x, y).item() for x, y in zip(g.recent, w.recent, strict=True))


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
    from agentkv.engine.errors import InvalidCacheError

    layout = KVLayout.of(model)
    wrong = [KVCache() for _ in layout.windows]
    if all(w is None for w in layout.windows):
        wrong = [RotatingKVCache(max_size=8) for _ in layout.windows]
    with pytest.raises(InvalidCacheError, match="do not match the model"):
        KVGroup.start(layout, Seq(0), wrong)


def test_a_group_refuses_a_cache_with_other_heads(model):
    from agentkv.engine.errors import InvalidCacheError

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


@pytest.mark.parametrize("bits", [None, 8])
def test_a_row_cut_right_after_a_chunk_leaves_with_its_window_only(model, bits):
    """A prompt's chunk leaves a sliding ring over its window until the next decode step
    writes in place; a row extracted then holds its window's newest positions (all any later
    step reads), and decodes on exactly as the uncut cache does."""
    layout = KVLayout.of(model, bits=bits)
    window = min((w for w in layout.windows if w), default=None)
    if window is None:
        pytest.skip("no sliding-window layers")
    n = 2 * window + 7
    install(model)  # (a quantized group hands attention what it holds)
    group = KVGroup.start(layout, Seq(n), None)
    tokens = mx.array([(5 * i) % 400 + 16 for i in range(n)])
    model(tokens[None], cache=group.layers)  # one chunk: the group's rings hold all n positions
    sliding = [c for c in group.layers if isinstance(c, BatchRotatingKVCache)]
    assert {c.keys.shape[2] for c in sliding} == {n}
    # (packed: a quantized ring holds its words and their scales apart)
    held = [c.packed_views() if bits else c.keys_and_values() for c in sliding]
    newest = [(k[..., -window:, :], v[..., -window:, :]) for k, v in held]
    row = group.extract(group.seqs[0])
    assert [c.keys.shape[2] for c in row] == [min(n, w or n) for w in layout.windows]
    kept = [c for c in row if isinstance(c, RotatingKVCache)]
    for c, (keys, values) in zip(kept, newest, strict=True):
        assert mx.array_equal(c.keys, keys).item() and mx.array_equal(c.values, values).item()
    assert layout.overhang(row, prompt=1, chunk=512) == 1
    # mlx-lm's own caches of the same chunk hold all n positions; they join cut to their
    # windows (its merge), so they reserve only the turn's chunk too.
    original = prefilled(model, n)
    assert {c.keys.shape[2] for c in original if isinstance(c, RotatingKVCache)} == {n}
    assert layout.overhang(original, prompt=4, chunk=512) == 4
    joined = KVGroup.start(layout, Seq(n), original)
    sliding = [c for c in joined.layers if isinstance(c, BatchRotatingKVCache)]
    assert {c.keys.shape[2] for c in sliding} == {window}
    if bits is None:  # the uncut caches decode the same
        token = mx.array([[21]])
        assert mx.array_equal(model(token, cache=row), model(token, cache=original)).item()


def test_a_q4_row_keeps_its_key_groups_whole_and_reserves_what_it_holds(model):
    """A q4 ring is not cut on its way out (its key groups' scales lie over their positions):
    the columns it holds beyond its ring (the window and one key group) count in what it
    reserves when it joins again."""
    layout = KVLayout.of(model, bits=4)
    window = min((w for w in layout.windows if w), default=None)
    if window is None:
        pytest.skip("no sliding-window layers")
    group = layout.packing.key_group(layout.windows.index(window))
    assert group == 32  # (positions of a key group, whatever the values' group size)
    n = 2 * window + group + 7
    install(model)
    buffers = KVGroup.start(layout, Seq(n), None)
    tokens = mx.array([(5 * i) % 400 + 16 for i in range(n)])
    model(tokens[None], cache=buffers.layers)
    row = buffers.extract(buffers.seqs[0])
    assert {c.keys.shape[2] for c in row if isinstance(c, RotatingKVCache)} == {n}
    assert layout.overhang(row, prompt=1, chunk=512) == n - (window + group)
    assert layout.overhang(row, prompt=512, chunk=512) == 512
    # Layers that do not match the model count nothing (joining refuses them), and raise
    # nothing here: another window, keys of another shape or kind, fewer or more layers.
    i = next(j for j, c in enumerate(row) if isinstance(c, RotatingKVCache))
    other = RotatingKVCache(window + 1)
    other.keys, other.values, other.offset = row[i].keys, row[i].values, row[i].offset
    flat = RotatingKVCache(window)
    flat.keys, flat.values = mx.zeros((3, 4), mx.uint32), mx.zeros((3, 4), mx.uint32)
    tupled = RotatingKVCache(window)
    tupled.keys = (row[i].keys, row[i].keys)
    for odd in (other, flat, tupled, KVCache()):
        layers = [odd if isinstance(c, RotatingKVCache) else c for c in row]
        assert layout.overhang(layers, prompt=3, chunk=512) == 3
    assert layout.overhang(row[:0], prompt=3, chunk=512) == 3
    assert layout.overhang([*row, *row], prompt=3, chunk=512) == n - (window + group)


def test_a_reservation_covers_history_growth_and_padding(model):
    layout = KVLayout.of(model)
    for tokens in (2, 300, 5000):
        held = layout.owned_bytes(tokens)
        assert layout.reservation(tokens, overhang=16) >= held * (1 + PADDING_TOLERANCE)


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
            gk, wk = temporal_order(got, got.keys), temporal_order(want, want.keys)
            n = min(want.offset, want.max_size)
            gk, wk = gk[..., -n:, :], wk[..., -n:, :]
        error = mx.abs(gk - wk).max().item()
        assert error <= 2 * mx.abs(wk).max().item() / (2**bits - 1)


def test_a_packed_row_joins_only_a_layer_held_quantized(model):
    from agentkv.engine.errors import InvalidCacheError

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
        assert group.layers[i].recent is None  # no float copies until a step writes
        held = group.layers[i].nbytes
        positions = 300 if w is None else min(300, w)
        assert q8.token_bytes[i] * positions <= held <= q8.token_bytes[i] * (300 + growth(300))


def test_a_packed_row_with_no_positions_expands_to_an_empty_row(model):
    layout = KVLayout.of(model, bits=8)
    rows = make_prompt_cache(model)
    for row in rows:  # packed arrays holding no position
        row.keys = row.values = mx.zeros((1, 1, 0, 8), mx.uint32)
    assert all(row.keys is None and row.offset == 0 for row in layout.packing.expand(rows))


@pytest.mark.parametrize(
    ("rotated", "window", "blocked"),
    [(True, None, False), (False, None, False), (True, 7, False), (True, None, True)],
)
def test_eight_bit_rows_attend_to_their_newest_positions_in_float(
    rotated, window, blocked, monkeypatch
):
    """q8 holds every position as its words (keys ``rotated``: of their Hadamard transform)
    and keeps float copies of each row's newest FLOAT_WINDOW positions: each query, of a
    prompt's chunk or a decode step alike, reads its own position and the FLOAT_WINDOW before
    it in float and the rest through the words, but none before where its row joined (a cache
    joins without float copies) or before its fence; a row leaves with its float copies and
    rejoins with them. A sliding window (``window``) shorter than the float copies reads
    only its own positions. ``blocked``: the rows' prompt chunk attends a query at a time."""
    from agentkv.engine.attention import eight_bit
    from agentkv.engine.attention.quantized import quantized_attention

    if blocked:
        monkeypatch.setattr(eight_bit, "SCORES_BYTES", 1)
    from agentkv.engine.batch.held import FLOAT_WINDOW
    from agentkv.engine.batch.packing import Packing
    from agentkv.engine.batch.quantized import quantized_buffer
    from agentkv.engine.codes import expand, hadamard, packed
    from agentkv.engine.scheme import LayerScheme

    H, D, group, prompt, steps = 2, 64, 32, 3, 24
    lengths = [5, 40]
    total = max(lengths) + prompt + steps
    keys = mx.random.normal((2, H, total, D), key=mx.random.key(11)) * 4
    values = mx.random.normal(keys.shape, key=mx.random.key(12))
    packing = Packing(8, (LayerScheme(8, group, rotated_keys=rotated),), ((D, D),), mx.float32)
    rows = [
        packing.pack(0, float_rows(keys[b : b + 1, :, :n], values[b : b + 1, :, :n], window))
        for b, n in enumerate(lengths)
    ]
    buffer = quantized_buffer(rows, window, 8, group, rotated)
    fence = lengths[1] + prompt + 10  # row 1's, from its 11th decoded token on

    def as_words(x: mx.array, rotate: bool = False) -> mx.array:
        if not rotate:
            return expand(packed(x, 8, group), D, mx.float32, 8, group)
        return hadamard(expand(packed(hadamard(x), 8, group), D, mx.float32, 8, group))

    def step(n: int, t: int) -> list[list[int]]:
        """Write ``n`` positions a row; check attention; return each query's reach."""
        mask = buffer.make_mask(n, window_size=window)
        at = [length + t for length in lengths]
        k = mx.stack([keys[b, :, a : a + n] for b, a in enumerate(at)])
        v = mx.stack([values[b, :, a : a + n] for b, a in enumerate(at)])
        fences = [[0] * n, [fence if at[1] + i >= fence else 0 for i in range(n)]]
        held, _ = buffer.write(k, v, fences)
        query = mx.random.normal((2, 2 * H, n, D), key=mx.random.key(50 + t))
        got = quantized_attention(query, held, 0.125, mask, None)
        for b, a in enumerate(at):
            for i in range(n):  # query i: position a + i, its newest ``own`` ones in float
                end, own = a + i + 1, held.reach[b, i].item() + 1
                wk = as_words(keys[b : b + 1, :, :end], rotated)
                wv = as_words(values[b : b + 1, :, :end])
                wk[..., end - own :, :] = keys[b : b + 1, :, end - own : end]
                wv[..., end - own :, :] = values[b : b + 1, :, end - own : end]
                first = max(0, end - window) if window else 0
                want = mx.fast.scaled_dot_product_attention(
                    query[b : b + 1, :, i : i + 1],
                    wk[..., first:, :],
                    wv[..., first:, :],
                    scale=0.125,
                )
                assert mx.allclose(got[b : b + 1, :, i : i + 1], want, atol=1e-4).item(), (t, b)
        return held.reach.tolist()

    # A prompt's chunk, right after the rows joined: each query reads the chunk's positions up
    # to its own in float, none of the cache's.
    assert step(prompt, 0) == [[0, 1, 2]] * 2
    for t in range(steps):
        since = min(prompt + t, FLOAT_WINDOW)  # float copies before the step
        cut = lengths[1] + prompt + t - fence  # row 1's positions since its fence
        assert step(1, prompt + t) == [[since], [since if cut < 0 else min(since, cut)]]
    if window is not None:
        return  # (a ring's row: tests/test_engine.py decodes and rejoins them)
    row = buffer.extract(1)
    assert row.float_count == FLOAT_WINDOW
    n = lengths[1] + prompt + steps
    assert mx.array_equal(row.recent[0][0], keys[1, :, n - FLOAT_WINDOW : n]).item()
    again = quantized_buffer([row], None, 8, group, rotated)
    assert again.counts == [FLOAT_WINDOW]
    assert mx.array_equal(again.packed_views()[0][..., :n, :], row.keys[..., :n, :]).item()
    # The row's keys expand to what their words hold (rotated back).
    expanded = packing.expand_layer(0, row).keys[..., :n, :]
    assert mx.allclose(expanded, as_words(keys[1:2, :, :n], rotated), atol=1e-5).item()


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("on_cpu", [False, True])
@pytest.mark.parametrize("window", [None, 16, 5])
@pytest.mark.parametrize("warm", [0, 24])
def test_eight_bit_positions_attend_alike_however_a_prompt_is_chunked(
    warm, window, on_cpu, blocked, monkeypatch
):
    """A q8 row resumed from a cache (a sliding window's ring already wrapped), after ``warm``
    decode steps (24: its float copies full, each position reading the 16 before it in float),
    is fed the same eight positions in chunks of every shape: each position's attention output
    is the same (bit for bit in a global layer), as each reads its own position and those
    before it since the row joined in float and the rest through the words whatever the
    chunk. On a CPU a
    chunk of ``EXPANDED_ROWS`` query rows a head or more (here the whole eight) expands the
    words for one float matmul: the same values, summed in another order. ``blocked``: a
    chunk's queries attend a few at a time (``SCORES_BYTES``), each as it would alone."""
    from agentkv.engine.attention import eight_bit, words
    from agentkv.engine.attention.quantized import quantized_attention
    from agentkv.engine.batch.held import FLOAT_WINDOW
    from agentkv.engine.batch.packing import Packing
    from agentkv.engine.batch.quantized import quantized_buffer
    from agentkv.engine.scheme import LayerScheme

    monkeypatch.setattr(words.DEVICE, "cpu", on_cpu)
    monkeypatch.setattr(words, "EXPANDED_ROWS", 16)  # query rows a head: 2 a position
    expanded = []  # one entry a call: the words each expanded read took
    real = words.expanded
    monkeypatch.setattr(words, "expanded", lambda *a: expanded.append(a[0].shape) or real(*a))
    H, D, group, cached, fed = 2, 64, 32, 20, 8
    total = cached + warm + fed
    # (blocked: 3 queries a block, 4 query heads over at most ``total`` columns, 4 bytes a score)
    monkeypatch.setattr(eight_bit, "SCORES_BYTES", 3 * 4 * 4 * total + 3 if blocked else 1 << 26)
    bands = []  # the queries each band took
    band = eight_bit.eight_bit_band
    monkeypatch.setattr(
        eight_bit, "eight_bit_band", lambda *a: bands.append(a[-2] - a[-3]) or band(*a)
    )

    keys = mx.random.normal((1, H, total, D), key=mx.random.key(21)) * 4
    values = mx.random.normal(keys.shape, key=mx.random.key(22))
    queries = mx.random.normal((1, 2 * H, warm + fed, D), key=mx.random.key(23))
    packing = Packing(8, (LayerScheme(8, group, rotated_keys=True),), ((D, D),), mx.float32)

    def outputs(chunks: list[int], named: bool = False) -> list:
        row = packing.pack(0, float_rows(keys[..., :cached, :], values[..., :cached, :], window))
        buffer = quantized_buffer([row], window, 8, group, True)
        got, at = [], 0
        for n in [1] * warm + chunks:
            k, v = (x[..., cached + at : cached + at + n, :] for x in (keys, values))
            mask = "causal" if named else buffer.make_mask(n, window_size=window)
            held, _ = buffer.write(k, v)
            out = quantized_attention(queries[..., at : at + n, :], held, 0.125, mask, None)
            got += [out[..., i, :] for i in range(n)] if at >= warm else []
            at += n
        assert window or held.reach[0, -1].item() == min(warm + fed - 1, FLOAT_WINDOW)
        mx.eval(got)
        return got

    whole = outputs([fed])
    if window is None:  # mlx-lm's named mask, made an array over the positions held
        named = outputs([fed], named=True)
        assert all(mx.array_equal(a, b).item() for a, b in zip(whole, named, strict=True))
    eights = 1 if window else 2  # chunks of 8 so far: keys and values expanded for each
    assert len(expanded) == (2 * eights if on_cpu else 0)
    steps = outputs([1] * 8)
    for chunks in [[7, 1], [3, 5], [8]]:
        again = outputs(chunks)
        for a, b in zip(steps, again, strict=True):
            # a ring written in place orders its columns otherwise, and an expanded chunk's
            # float matmul sums in another order
            if window is None and not (on_cpu and chunks == [8]):
                assert mx.array_equal(a, b).item(), chunks
            else:
                assert mx.allclose(a, b, rtol=0, atol=1e-5).item(), chunks
    assert len(expanded) == (2 * eights + 2 if on_cpu else 0)
    if window is None:  # (3 queries a block when blocked)
        fed_in = [[1] * warm + c for c in [[8]] * eights + [[1] * 8, [7, 1], [3, 5], [8]]]
        size = 3 if blocked else 8
        want = [min(size, n - at) for c in fed_in for n in c for at in range(0, n, size)]
        assert bands == want


@pytest.mark.parametrize("bits", [8, 4])
def test_a_chunk_on_a_cpu_multiplies_its_words_expanded_as_the_quantized_matmul_reads_them(
    bits, monkeypatch
):
    """On a CPU a prompt's chunk (``EXPANDED_ROWS`` query rows a head or more) multiplies the
    positions it reads expanded in float, where ``mx.quantized_matmul`` expands them once a
    row: the same attention to float32 rounding (q4: a chunk its folded key groups still
    score, values through the words); a decode step still takes the matmul. q8's expansion
    (its codes are the words' bytes) is exactly ``mx.dequantize``'s."""
    from agentkv.engine.attention import words
    from agentkv.engine.attention.quantized import quantized_attention
    from agentkv.engine.batch.channel import channel_buffer
    from agentkv.engine.batch.packing import Packing
    from agentkv.engine.batch.quantized import quantized_buffer
    from agentkv.engine.batch.rows import channel_row
    from agentkv.engine.codes import scales_of
    from agentkv.engine.scheme import LayerScheme

    H, D, group, cached, n = 2, 64, 32, 70, 8  # 2 query heads a KV head: 16 rows a chunk
    keys = mx.random.normal((1, H, cached + n, D), key=mx.random.key(31)) * 4
    values = mx.random.normal(keys.shape, key=mx.random.key(32))
    queries = mx.random.normal((1, 2 * H, n, D), key=mx.random.key(33))
    packing = Packing(8, (LayerScheme(8, group, rotated_keys=True),), ((D, D),), mx.float32)
    expanded = []
    real = words.expanded
    monkeypatch.setattr(words, "expanded", lambda *a: expanded.append(a[-2]) or real(*a))
    monkeypatch.setattr(words, "EXPANDED_ROWS", 16)

    def attend(on_cpu: bool, chunk: int = n) -> tuple:
        monkeypatch.setattr(words.DEVICE, "cpu", on_cpu)
        row = float_rows(keys[..., :cached, :], values[..., :cached, :], None)
        if bits == 8:
            buffer = quantized_buffer([packing.pack(0, row)], None, 8, group, True)
        else:
            buffer = channel_buffer([channel_row(row, group)], None, group)
        out = []
        for at in range(0, n, chunk):
            new = (x[..., cached + at : cached + at + chunk, :] for x in (keys, values))
            mask = buffer.make_mask(chunk)
            held, _ = buffer.write(*new)
            q = queries[..., at : at + chunk, :]
            out.append(quantized_attention(q, held, 0.125, mask, None))
        return mx.concatenate(out, axis=2), held

    matmul, _ = attend(False)
    assert expanded == []
    on_cpu, held = attend(True)
    assert expanded == ([8, 8] if bits == 8 else [4])  # q8: keys and values; q4: its values
    assert mx.allclose(on_cpu, matmul, rtol=0, atol=1e-5).item()
    steps, _ = attend(True, chunk=1)  # decode steps: 2 rows a head, the matmul's
    assert len(expanded) == (2 if bits == 8 else 1)
    assert mx.allclose(steps, matmul, rtol=0, atol=1e-5).item()
    if bits == 8:
        key_words, extra = held.keys
        scales, biases = scales_of(extra, D // group)
        want = mx.dequantize(
            key_words,
            scales.astype(mx.float32),
            biases.astype(mx.float32),
            group_size=group,
            bits=8,
        )
        assert mx.array_equal(words.expanded(key_words, scales, biases, 8, group), want).item()


def test_a_q8_chunk_attends_a_block_of_queries_at_a_time(monkeypatch):
    """A q8 chunk over a long history attends ``SCORES_BYTES`` of scores at a time: the same
    outputs as all its queries at once, in a fraction of the working set (MLX's peak memory
    above what the buffer holds)."""
    from agentkv.engine.attention import eight_bit, words
    from agentkv.engine.attention.quantized import quantized_attention
    from agentkv.engine.batch.packing import Packing
    from agentkv.engine.batch.quantized import quantized_buffer
    from agentkv.engine.scheme import LayerScheme

    H, D, group, cached, n = 2, 64, 32, 4096, 256
    keys = mx.random.normal((1, H, cached + n, D), key=mx.random.key(41))
    values = mx.random.normal(keys.shape, key=mx.random.key(42))
    queries = mx.random.normal((1, 2 * H, n, D), key=mx.random.key(43))
    packing = Packing(8, (LayerScheme(8, group, rotated_keys=True),), ((D, D),), mx.float32)
    row = packing.pack(0, float_rows(keys[..., :cached, :], values[..., :cached, :], None))
    buffer = quantized_buffer([row], None, 8, group, True)
    mask = buffer.make_mask(n)
    held, _ = buffer.write(keys[..., cached:, :], values[..., cached:, :])
    mx.eval(mask, held.keys, held.values, held.recent, queries)
    monkeypatch.setattr(words.DEVICE, "cpu", True)

    def attend(scores_bytes: int) -> tuple[mx.array, int]:
        monkeypatch.setattr(eight_bit, "SCORES_BYTES", scores_bytes)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        out = quantized_attention(queries, held, 0.125, mask, None)
        mx.eval(out)
        return out, mx.get_peak_memory() - before

    whole, at_once = attend(1 << 30)  # 4 query heads x 256 x 4,352 columns: 17.8 MB a score
    blocked, in_blocks = attend(1 << 20)  # 15 queries a block
    assert mx.allclose(whole, blocked, rtol=0, atol=1e-5).item()
    assert in_blocks < at_once / 4, (in_blocks, at_once)


# ---- four bits: keys per channel, values rotated, the newest positions in float -------------


def float_rows(keys: mx.array, values: mx.array, window: int | None) -> KVCache:
    """A float single-row cache of ``keys`` / ``values`` (1, H, n, D), as mlx-lm fills one."""
    row = KVCache() if window is None else RotatingKVCache(window)
    row.update_and_fetch(keys, values)
    return row


@pytest.mark.parametrize(("bits", "window"), [(8, None), (4, None), (8, 80), (4, 48)])
def test_a_quantized_layer_holds_its_words_apart_and_attends_over_them_whole(bits, window):
    """A quantized layer holds its words apart from the words of their scales and biases, and
    attention hands ``mx.quantized_matmul`` the buffers themselves, spare positions included:
    it attends as over the positions expanded, through growth, a filter (a global layer's cuts
    left padding), an extend and a ring's wrapping; a row leaves packed, with exactly the bytes
    packing its positions gives (a q4 ring's: ``test_four_bit_rows_decoded_in_a_group_...``)."""
    from agentkv.engine.attention.quantized import quantized_attention
    from agentkv.engine.batch.buffers import GroupKVCache, GroupRotatingKVCache
    from agentkv.engine.batch.channel import channel_buffer
    from agentkv.engine.batch.packing import Packing
    from agentkv.engine.batch.quantized import QuantizedLayer, quantized_buffer
    from agentkv.engine.batch.rows import channel_row
    from agentkv.engine.codes import hadamard, packed, packed_dim
    from agentkv.engine.config import KEY_BITS
    from agentkv.engine.scheme import LayerScheme

    H, D, group, steps = 2, 64, 32, 40
    lengths = [5, 40, 70]
    total = max(lengths) + 2 * steps
    keys = mx.random.normal((4, H, total, D), key=mx.random.key(21)) * 4
    values = mx.random.normal(keys.shape, key=mx.random.key(22))
    packing = Packing(8, (LayerScheme(8, group, rotated_keys=True),), ((D, D),), mx.float32)

    def history(b: int, first: int, n: int, ring: int | None) -> KVCache:
        return float_rows(keys[b : b + 1, :, first:n], values[b : b + 1, :, first:n], ring)

    def buffer_of(rows: list[int]) -> QuantizedLayer:
        made = [history(b, 0, lengths[b], window) for b in rows]
        if bits == 8:
            return quantized_buffer([packing.pack(0, r) for r in made], window, 8, group, True)
        return channel_buffer([channel_row(r, group) for r in made], window, group)

    def packed_buffer(rows: list[int]) -> Any:
        """q8: mlx-lm's own buffer of the same packed rows, the reference moved alike."""
        made = [packing.pack(0, history(b, 0, lengths[b], window)) for b in rows]
        if window is None:
            return GroupKVCache.merge(made)
        return GroupRotatingKVCache.merge(made)

    buffer, ids = buffer_of([0, 1, 2]), [0, 1, 2]
    reference = packed_buffer([0, 1, 2]) if bits == 8 else None
    key_bits = 8 if bits == 8 else KEY_BITS
    assert buffer.keys.shape[3] == D * key_bits // 32 and buffer.values.shape[3] == D * bits // 32
    at = list(lengths)
    spare = 0
    for t in range(steps):
        if t == 12:  # the longest row leaves (a global layer: the padding before the rest is cut)
            buffer.filter([0, 1])
            ids, at = ids[:2], at[:2]
            if reference is not None:
                reference.filter([0, 1])
        if t == 20:  # a row joins
            buffer.extend(buffer_of([2]))
            ids, at = [*ids, 2], [*at, lengths[2]]
            if reference is not None:
                reference.extend(packed_buffer([2]))
        mask = buffer.make_mask(1, window_size=window)
        k = mx.stack([keys[b, :, a : a + 1] for b, a in zip(ids, at, strict=True)])
        v = mx.stack([values[b, :, a : a + 1] for b, a in zip(ids, at, strict=True)])
        held, _ = buffer.update_and_fetch(k, v)
        at = [a + 1 for a in at]
        if reference is not None:  # the same bytes where mlx-lm's buffer has them, every step
            want = reference.update_and_fetch(packed(hadamard(k), 8, group), packed(v, 8, group))
            got_packed = buffer.packed_views()
            for x, y in zip(got_packed, want, strict=True):
                assert mx.array_equal(x, y).item(), t
        assert held.keys[0] is buffer.keys and held.values[1] is buffer.halves.values
        spare = max(spare, buffer.keys.shape[2] - held.columns)
        query = mx.random.normal((len(ids), 2 * H, 1, D), key=mx.random.key(60 + t))
        got = quantized_attention(query, held, 0.125, mask, None)
        keys_f, values_f = held.expanded()
        want = mx.fast.scaled_dot_product_attention(query, keys_f, values_f, scale=0.125, mask=mask)
        want = hadamard(want) if held.rotated else want
        assert mx.allclose(got, want, atol=1e-4).item(), (t, mx.abs(got - want).max().item())
    assert spare > 0  # the buffer grew ahead of its rows, and attention read past them
    assert not window or buffer.rotated  # (and a ring of 80 positions wrapped: q4's is 48 + 32)
    widths = (packed_dim(D, key_bits, group), packed_dim(D, bits, group))
    for i, (b, n) in enumerate(zip(ids, at, strict=True)):
        row = buffer.extract(i)
        m = row.keys.shape[2]
        assert row.keys.shape == (1, H, m, widths[0]) and row.offset == n
        assert row.values.shape == (1, H, m, widths[1])
        if bits == 4 and window:
            continue
        # The row's bytes are what packing its positions gives, whatever the buffer did.
        want = history(b, n - m, n, None)
        want = packing.pack(0, want) if bits == 8 else channel_row(want, group)
        assert mx.array_equal(row.keys, want.keys).item(), b
        assert mx.array_equal(row.values, want.values).item(), b
    halves = buffer.halves.keys.nbytes + buffer.halves.values.nbytes
    floats = sum(r.nbytes for r in buffer.recent)
    floats += 0 if buffer.first_kv is None else sum(x.nbytes for x in buffer.first_kv)
    assert buffer.nbytes == buffer.keys.nbytes + buffer.values.nbytes + halves + floats
    empty = buffer_of([])  # (mlx-lm's padding of an empty buffer reaches both parts once)
    empty.prepare(left_padding=[3])
    assert empty.left_padding.tolist() == empty.halves.left_padding.tolist() == [3]


@pytest.mark.parametrize("window", [None, 32])
def test_four_bit_rows_decoded_in_a_group_hold_what_a_whole_cache_quantizes(window):
    """Two rows of different lengths decode 90 positions in one group (a 32-position window
    wraps its ring several times): every key group the group quantized as it completed holds
    the bytes quantizing the whole history at once gives, the float copies are the newest
    positions exactly, and attention through the group equals attention over those positions
    expanded (one key channel is 100x the others, which per-position scales would blur)."""
    from agentkv.engine.attention.quantized import quantized_attention
    from agentkv.engine.batch.channel import channel_buffer
    from agentkv.engine.batch.held import float_window
    from agentkv.engine.batch.rows import channel_row, expanded_channel_row
    from agentkv.engine.codes import hadamard
    from agentkv.engine.config import KEY_GROUP_SIZE as K

    group, H, D, steps = 32, 2, 64, 90  # (values in groups of 32, keys of K positions)
    lengths = [7, 96]  # the window starts a key group: no position of one is lost
    keys = mx.random.normal((2, H, max(lengths) + steps, D), key=mx.random.key(1))
    keys = keys * mx.where(mx.arange(D) == 5, 100.0, 1.0)
    values = mx.random.normal(keys.shape, key=mx.random.key(2))
    rows = [
        float_rows(keys[b : b + 1, :, :n], values[b : b + 1, :, :n], window)
        for b, n in enumerate(lengths)
    ]
    buffer = channel_buffer([channel_row(r, group) for r in rows], window, group)
    # What the whole history quantized at once gives (a window's first group whole too).
    whole_rows = [
        float_rows(keys[b : b + 1, :, :n], values[b : b + 1, :, :n], None)
        for b, n in enumerate(lengths)
    ]
    query = mx.random.normal((2, H, 1, D), key=mx.random.key(3))
    for t in range(steps):
        mask = buffer.make_mask(1, window_size=window)
        k = mx.stack([keys[b, :, n + t] for b, n in enumerate(lengths)])[:, :, None]
        v = mx.stack([values[b, :, n + t] for b, n in enumerate(lengths)])[:, :, None]
        held, _ = buffer.update_and_fetch(k, v)
        # This step attends to what the history before it holds, and to the new position in
        # float (the group it completes is read quantized from the next step on).
        before = [
            expanded_channel_row(channel_row(row, group), group, (D, D), mx.float32)
            for row in whole_rows
        ]
        for b, row in enumerate(whole_rows):
            row.update_and_fetch(k[b : b + 1], v[b : b + 1])
        # Attention over the quantized keys as they are, and over them expanded.
        out = quantized_attention(query, held, 0.125, mask, None)
        keys_f, values_f = held.expanded()
        expanded = mx.fast.scaled_dot_product_attention(
            query, keys_f, values_f, scale=0.125, mask=mask
        )
        assert mx.allclose(out, hadamard(expanded), atol=1e-4).item(), (window, t)
        for b, want in enumerate(before):
            wk = mx.concatenate([want.keys, k[b : b + 1]], axis=2)
            wv = mx.concatenate([want.values, v[b : b + 1]], axis=2)
            n = min(wk.shape[2], window or wk.shape[2])
            wk, wv = wk[..., -n:, :], wv[..., -n:, :]
            ref = mx.fast.scaled_dot_product_attention(query[b : b + 1], wk, wv, scale=0.125)
            assert mx.allclose(out[b : b + 1], ref, atol=1e-4).item(), (window, t, b)
    for b, row in enumerate(whole_rows):
        got, want = buffer.extract(b), channel_row(row, group)
        n, f = row.offset, float_window(K)
        assert got.offset == want.offset == n
        assert isinstance(got, KVCache if window is None else RotatingKVCache)
        assert all(
            mx.array_equal(x, y).item() for x, y in zip(got.recent, want.recent, strict=True)
        )
        assert mx.array_equal(got.recent[0][0, :, -1], keys[b, :, n - 1]).item()
        assert got.recent[0].shape[2] == f
        # The groups the window reaches (older ones are overwritten in its ring).
        whole = -(-(n - min(n, window or n)) // K) * K
        cols = want.keys.shape[2] - (n - whole)
        assert mx.array_equal(got.keys[..., -(n - whole) :, :], want.keys[..., cols:, :]).item()
        assert mx.array_equal(got.values[..., -(n - whole) :, :], want.values[..., cols:, :]).item()


@pytest.mark.parametrize("chunk", [1, 40])
def test_four_bit_global_rows_read_their_first_position_in_float(chunk):
    """A q4 global layer's rows read their first position from ``first_kv`` instead of its
    words (decode steps through the folded scores; a 40-token chunk's expanded keys), where
    ``recent`` does not hold it; a row without them reads its words. Rows keep theirs through
    ``extend``, ``filter`` and ``extract``."""
    from agentkv.engine.attention.quantized import quantized_attention
    from agentkv.engine.batch.channel import channel_buffer
    from agentkv.engine.batch.rows import channel_row
    from agentkv.engine.codes import hadamard

    group, H, D = 32, 2, 64
    lengths = [3, 70, 161] if chunk == 1 else [161]
    keys = mx.random.normal((3, H, 161, D), key=mx.random.key(8))
    values = mx.random.normal(keys.shape, key=mx.random.key(9))
    # A first position unlike what its words hold: a large key, and a value of its own.
    firsts = [
        (keys[b : b + 1, :, :1] * 8, mx.random.normal((1, H, 1, D), key=mx.random.key(10 + b)))
        for b in range(3)
    ]
    held_first = [True, False, True] if chunk == 1 else [True]
    buffers = [
        channel_buffer(
            [
                channel_row(
                    float_rows(keys[b : b + 1, :, :n], values[b : b + 1, :, :n], None), group
                )
            ],
            None,
            group,
            firsts[b] if held_first[b] else None,
        )
        for b, n in enumerate(lengths)
    ]
    buffer = buffers[0]
    for other in buffers[1:]:
        buffer.extend(other)
    assert buffer.first_held == held_first
    B = len(lengths)
    k, v = (mx.random.normal((B, H, chunk, D), key=mx.random.key(30 + i)) for i in (0, 1))
    mask = buffer.make_mask(chunk)
    held, _ = buffer.update_and_fetch(k, v)
    query = mx.random.normal((B, 4, chunk, D), key=mx.random.key(40))
    got = quantized_attention(query, held, 0.125, mask, None)
    keys_f, values_f = held.expanded()
    want = hadamard(
        mx.fast.scaled_dot_product_attention(query, keys_f, values_f, scale=0.125, mask=mask)
    )
    assert mx.allclose(got, want, atol=1e-4).item(), mx.abs(got - want).max().item()
    L = keys_f.shape[2]
    for b, n in enumerate(lengths):
        column = L - (n + chunk)  # the row's first position (left-padded)
        in_recent = n + chunk <= held.floats[b]
        reads = held_first[b] and not in_recent
        first_key = keys_f[b, :, column]
        assert mx.allclose(first_key, firsts[b][0][0, :, 0], atol=1e-5).item() == reads, b
        assert (
            mx.allclose(values_f[b, :, column], hadamard(firsts[b][1])[0, :, 0], atol=1e-5).item()
            == reads
        )
    # Without them the same step attends otherwise (the test can tell).
    plain = dataclasses.replace(held, first_kv=None, first_held=())
    assert not mx.allclose(
        quantized_attention(query, plain, 0.125, mask, None), got, atol=1e-3
    ).item()
    if chunk == 1:
        buffer.filter([2, 1])
        assert buffer.first_held == [True, False]
        assert mx.array_equal(buffer.first_kv[0][0], firsts[2][0][0]).item()
        row = buffer.extract(0)
        assert all(
            mx.array_equal(x, y).item() for x, y in zip(row.first_kv, firsts[2], strict=True)
        )
        assert buffer.extract(1).first_kv is None


def test_four_bit_keys_in_the_batch_are_what_a_q4_file_stores():
    from agentkv.engine.batch.held import channel_boundary
    from agentkv.engine.batch.rows import channel_row
    from agentkv.engine.codes import join_packed, packed, packed_per_position
    from agentkv.engine.kv.quant import hadamard, quantize_channel_keys

    keys = mx.random.normal((1, 2, 150, 64), key=mx.random.key(4)) * 3
    values = mx.random.normal((1, 2, 150, 64), key=mx.random.key(5))
    row = channel_row(float_rows(keys, values, None), 32)  # values in groups of 32
    q = channel_boundary(150, 32)
    assert q == 128  # whole key groups (32 positions) at least FLOAT_WINDOW old
    stored = join_packed(*quantize_channel_keys(keys[..., :q, :], 0, 32, 5))
    assert mx.array_equal(row.keys[..., :q, :], stored).item()
    tail = packed_per_position(keys[..., q:, :], 32, 5)
    assert mx.array_equal(row.keys[..., q:, :], tail).item()
    assert mx.array_equal(row.values, packed(hadamard(values), 4, 32)).item()


@pytest.mark.parametrize("window", [None, 40, 64])
@pytest.mark.parametrize(("query_heads", "chunk"), [(2, 1), (8, 1), (4, 3), (4, 5), (4, 40)])
def test_four_bit_attention_reads_the_quantized_keys_as_attention_over_them_expanded(
    window, query_heads, chunk, monkeypatch
):
    """Attention over a four-bit layer scores each key group against the query scaled by the
    group's scales instead of expanding the keys (decode steps, grouped query heads, small
    chunks with their causal mask, a ring of a whole number of groups); more query rows than
    a key group has positions (a 5- or 40-token chunk of 4 heads) or a ring that splits a
    group (a 40-position window's) expand them. Either way it gives what attention over the
    expanded keys gives, rows of different lengths padded."""
    from agentkv.engine.attention import quantized
    from agentkv.engine.attention.quantized import quantized_attention
    from agentkv.engine.batch.channel import channel_buffer
    from agentkv.engine.batch.rows import channel_row
    from agentkv.engine.codes import hadamard

    folded, steps = [], []  # calls scoring the quantized keys as they are; per step, whether
    fold = quantized.folded_scores
    monkeypatch.setattr(quantized, "folded_scores", lambda *a: folded.append(1) or fold(*a))
    from agentkv.engine.config import KEY_GROUP_SIZE as K

    group, H, D = 32, 2, 64  # (values in groups of 32; keys per channel over K positions)
    lengths = [3, 70, 161]
    keys = mx.random.normal((3, H, 161, D), key=mx.random.key(6)) * mx.where(
        mx.arange(D) == 9, 50.0, 1.0
    )
    values = mx.random.normal(keys.shape, key=mx.random.key(7))
    rows = [
        channel_row(float_rows(keys[b : b + 1, :, :n], values[b : b + 1, :, :n], window), group)
        for b, n in enumerate(lengths)
    ]
    if chunk > 1:  # a prompt's chunk: one sequence's group
        rows = rows[2:]
    buffer = channel_buffer(rows, window, group)
    B = len(rows)
    for t in range(3):
        mask = buffer.make_mask(chunk, window_size=window)
        k, v = (
            mx.random.normal((B, H, chunk, D), key=mx.random.key(20 + 2 * t + i)) for i in (0, 1)
        )
        held, _ = buffer.update_and_fetch(k, v)
        query = mx.random.normal((B, query_heads, chunk, D), key=mx.random.key(40 + t))
        before = len(folded)
        got = quantized_attention(query, held, 0.125, mask, None)
        # Folded where a key-value head has at most a key group's K query rows and the
        # buffer's columns are whole key groups (a wrapped ring of 40 + K is not).
        splits = held.wrap and held.columns % K
        steps.append(len(folded) > before)
        assert steps[-1] == (query_heads // H * chunk <= K and not splits), (t, splits)
        keys_f, values_f = held.expanded()
        want = hadamard(
            mx.fast.scaled_dot_product_attention(query, keys_f, values_f, scale=0.125, mask=mask)
        )
        assert got.shape == (B, query_heads, chunk, D)
        assert mx.allclose(got, want, atol=1e-4).item(), (t, mx.abs(got - want).max().item())
    if window == 40 and chunk == 1:  # its ring wraps within the steps: some expand
        assert 0 < sum(steps) < len(steps)
    elif window != 40 and query_heads // H * chunk <= K:
        assert all(steps)


def rows(n: int, seed: int) -> list[ArraysCache]:
    mx.random.seed(seed)
    return [
        state_row([mx.random.normal((1, 3, 8)), mx.random.normal((1, 2, 4, 4))]) for _ in range(n)
    ]


def test_state_rows_move_between_groups_bit_for_bit():
    a, b = rows(3, 0), rows(2, 1)
    group = GroupStateCache.merge(a)
    other = GroupStateCache.merge(b)
    group.extend(other)
    assert group.batch_size == 5 and group[0].shape == (5, 3, 8)
    everyone = a + b
    for i, row in enumerate(everyone):
        got = group.extract(i)
        assert all(mx.array_equal(x, y).item() for x, y in zip(got.cache, row.cache, strict=True))
    group.filter([4, 1])
    assert group.batch_size == 2
    for i, row in zip(range(2), (everyone[4], everyone[1]), strict=True):
        assert mx.array_equal(group.extract(i)[1], row[1]).item()
    # A row that has no state yet (before its first chunk) joins as zeros, as mlx-lm starts it.
    empty = GroupStateCache.empty(2)
    assert empty[0] is None and empty.batch_size == 1
    group.extend(empty)
    assert group.batch_size == 3 and not mx.any(group[0][2]).item()
