"""KV codec on real tiny-model caches: exact round trips that resume token for token (alone and
in one batch), quantized fidelity and size, rotating-buffer edge cases, corrupt inputs."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from agentkv.engine.batch.state import row_arrays, state_row
from agentkv.engine.codes import codes_of
from agentkv.engine.config import GROUP_SIZE_BY_BITS
from agentkv.engine.engine import Engine
from agentkv.engine.errors import CacheFormatError, InvalidCacheError
from agentkv.engine.kv.assemble import assemble_paged
from agentkv.engine.kv.encoded import (
    FORMAT_VERSION,
    GROUP_SIZES,
    EncodedCache,
    choose_group_size,
)
from agentkv.engine.kv.layouts import group_of, part_group
from agentkv.engine.kv.load import BlockRun, decode_paged
from agentkv.engine.kv.paged import PagedCache, encode_paged, split_blocks
from agentkv.engine.kv.quant import (
    channel_span,
    dequantize_on_host,
    hadamard,
    hadamard_on_host,
)
from agentkv.engine.kv.state import decode_state, encode_state
from agentkv.engine.kv.whole import decode_cache, encode_cache
from agentkv.engine.mlxlm import temporal_order
from agentkv.engine.models.caches import is_state
from agentkv.engine.request import FinishReason, GenerationRequest, PromptCache
from agentkv.store.cache_files import load_into_mlx

SPECS = ["tiny:gemma3", "tiny:llama"]
WINDOW = 32  # tiny:gemma3's sliding window
HISTORIES = [10, WINDOW, WINDOW + 1, 130]  # shorter than, equal to, just past, well past


@pytest.fixture(scope="module", params=SPECS)
def engine(request):
    eng = asyncio.run(Engine.open(request.param))
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def gemma():
    eng = asyncio.run(Engine.open("tiny:gemma3"))
    assert eng.model.sliding_window == WINDOW
    yield eng
    asyncio.run(eng.close())


def tokens(eng: Engine, n: int, salt: int = 0) -> list[int]:
    """n deterministic non-special token ids."""
    return [(7 * i + 11 * salt) % (eng.model.vocab_size - 16) + 16 for i in range(n)]


async def history(eng: Engine, n: int) -> PromptCache:
    """A real cache of exactly n tokens: a prompt plus 4 generated tokens."""
    res = await eng.generate(GenerationRequest(tokens(eng, n - 4, salt=n), 4, ignore_eos=True))
    assert res.cache.num_tokens == n
    return res.cache


async def roundtrip(eng: Engine, cache: PromptCache, kv_bits: int | None) -> PromptCache:
    encoded = await eng.run(encode_cache, cache, kv_bits)
    return await eng.run(decode_cache, encoded)


def temporal(layer) -> tuple[np.ndarray, np.ndarray]:
    """A layer's keys and values in temporal order, used positions only, as float32 numpy."""
    if isinstance(layer, RotatingKVCache):
        k, v = temporal_order(layer, layer.keys), temporal_order(layer, layer.values)
    else:
        k, v = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
    return np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))


def layout(layer) -> tuple:
    return (type(layer), layer.offset, getattr(layer, "max_size", None), getattr(layer, "keep", 0))


async def temporal_pairs(eng: Engine, a: PromptCache, b: PromptCache) -> list[tuple]:
    """Per layer, ``(temporal(a_layer), temporal(b_layer))``, read on the generation thread."""
    pairs = zip(a.layers, b.layers, strict=True)
    return await eng.run(lambda: [(temporal(x), temporal(y)) for x, y in pairs])


def argmax_agreement(eng: Engine, feed: list[int], a: PromptCache, b: PromptCache) -> int:
    """How many positions of ``feed`` get the same argmax after cache ``a`` as after ``b``."""
    model, x = eng.model.model, mx.array([feed])
    return int(mx.sum(model(x, cache=a.layers).argmax(-1) == model(x, cache=b.layers).argmax(-1)))


async def resume(eng: Engine, cache: PromptCache, salt: int = 1) -> list[int]:
    req = GenerationRequest(tokens(eng, 6, salt=salt), max_tokens=16, cache=cache)
    return (await eng.generate(req)).token_ids


@pytest.mark.parametrize("n", HISTORIES)
async def test_exact_roundtrip_resumes_token_for_token(engine, n):
    original = await history(engine, n)
    decoded = await roundtrip(engine, original, None)
    assert decoded.tokens == original.tokens
    assert [layout(d) for d in decoded.layers] == [layout(o) for o in original.layers]
    pairs = await temporal_pairs(engine, original, decoded)
    for (ok, ov), (dk, dv) in pairs:
        assert np.array_equal(ok, dk) and np.array_equal(ov, dv)
    if engine.model.sliding_window and n > WINDOW:
        assert pairs[0][1][0].shape[2] == WINDOW  # a sliding layer keeps just the window
    assert await resume(engine, decoded) == await resume(engine, original)


async def test_decoded_caches_resume_in_one_batch_as_alone(engine):
    caches = [await roundtrip(engine, await history(engine, n), None) for n in HISTORIES]
    alone = [await resume(engine, c, salt=i) for i, c in enumerate(caches)]
    batched = await asyncio.gather(*(resume(engine, c, salt=i) for i, c in enumerate(caches)))
    assert batched == alone


async def test_decoded_cache_survives_a_safetensors_file(gemma, tmp_path):
    original = await history(gemma, 100)
    for kv_bits in (None, 8):
        encoded = await gemma.run(encode_cache, original, kv_bits)
        assert all(t.flags.c_contiguous and t.flags.owndata for t in encoded.tensors.values())
        save_file(encoded.tensors, tmp_path / "c.safetensors", metadata=encoded.metadata)
        with safe_open(tmp_path / "c.safetensors", "np") as f:
            metadata = f.metadata()
        loaded = EncodedCache(load_file(tmp_path / "c.safetensors"), metadata)
        via_file = await gemma.run(decode_cache, loaded)
        direct = await gemma.run(decode_cache, encoded)
        assert await resume(gemma, via_file) == await resume(gemma, direct)


async def test_quantized_keys_are_close_and_q8_is_much_closer_than_q4(engine):
    original = await history(engine, 130)
    worst = {}
    for kv_bits in (8, 4):
        encoded = await engine.run(encode_cache, original, kv_bits)
        # No group size given: the precision's own (q8 128, keys rotated; q4 32).
        assert (encoded.kv_bits, encoded.group_size) == (kv_bits, GROUP_SIZE_BY_BITS[kv_bits])
        decoded = await engine.run(decode_cache, encoded)
        assert [layout(d) for d in decoded.layers] == [layout(o) for o in original.layers]
        assert all(d.keys.dtype == mx.float32 for d in decoded.layers)
        pairs = await temporal_pairs(engine, original, decoded)
        worst[kv_bits] = 0.0
        layouts = json.loads(encoded.metadata["layers"])
        for i, ((ok, ov), (dk, dv)) in enumerate(pairs):
            for name, exact, approx in (("keys", ok, dk), ("values", ov, dv)):
                scales = encoded.tensors[f"layers.{i}.{name}.scales"].astype(np.float32)
                group = part_group(layouts[i], name, group_of(encoded, layouts[i]))
                step = element_steps(scales, layouts[i], name, group)
                if layouts[i].get(f"rotated_{name}"):  # bounded where quantized
                    exact, approx = hadamard_on_host(exact), hadamard_on_host(approx)
                err = np.abs(exact - approx)
                # Affine rounding plus MLX's zero-point nudge, plus float16 casts in and out.
                assert np.all(err <= 1.25 * step + 2**-10 * np.abs(exact))
                worst[kv_bits] = max(worst[kv_bits], float(err.max()))
    assert 0 < worst[8] * 8 < worst[4]


def element_steps(scales: np.ndarray, layout: dict, kind: str, group: int) -> np.ndarray:
    """Each stored value's quantization step: its group's scale along the head dimension, or
    for q4 keys in whole groups of positions, its channel's scale over them."""
    *rows, _ = scales.shape
    step = np.repeat(np.abs(scales), group, axis=-1)
    if kind == "keys" and layout.get("channel_keys"):
        a, b = channel_span(layout["offset"] - rows[-1], rows[-1], group)
        if a == b:
            return step
        per = np.abs(scales[..., a:b, :]).reshape(*rows[:-1], (b - a) // group, 1, -1)
        step[..., a:b, :] = np.broadcast_to(
            per, (*rows[:-1], (b - a) // group, group, per.shape[-1])
        ).reshape(*rows[:-1], b - a, -1)
    return step


@pytest.mark.parametrize("n", [150, 137])  # 137: the last key group not whole
def test_q4_files_of_earlier_key_schemes_read_as_written(monkeypatch, n):
    """q4 files written before keys had groups of their own (``channel_keys`` without
    ``key_group_size``: 4-bit keys per channel over the layer's group size), and before keys
    had bits of their own (``key_group_size`` 16 without ``key_bits``: 4-bit keys over 16
    positions), read as written, in MLX and on the host, as does today's (5-bit keys over 32
    positions); a newer file read as if it were an older one is refused on its key scales' or
    words' shape (as a reader from before refuses it), not misread."""
    import agentkv.engine.kv.whole

    mx.random.seed(7)
    keys = mx.random.normal((1, 2, n, 64)) * mx.array([30.0] + [1.0] * 63)
    layer = KVCache()
    layer.update_and_fetch(keys, mx.random.normal((1, 2, n, 64)))
    cache = PromptCache([layer], list(range(n)))
    flags = {"channel_keys": True, "rotated_values": True}
    encoded = {}
    for key_group, extra in ((32, {}), (16, {"key_group_size": 16})):  # the earlier schemes
        monkeypatch.setattr(
            agentkv.engine.kv.whole, "quant_scheme", lambda *a, x=extra, **k: flags | x
        )
        encoded[key_group, 4] = encode_cache(cache, 4, 32)
        monkeypatch.undo()
    encoded[32, 5] = new = encode_cache(cache, 4, 32)
    exact = np.array(keys.astype(mx.float16).astype(mx.float32))
    widest = {}
    for (key_group, bits), file in encoded.items():
        (layout,) = json.loads(file.metadata["layers"])
        assert (layout.get("key_group_size"), layout.get("key_bits")) == {
            (32, 4): (None, None),
            (16, 4): (16, None),
            (32, 5): (32, 5),
        }[key_group, bits]
        assert file.tensors["layers.0.keys.q"].shape == (1, 2, n, 64 * bits // 32)
        scales = file.tensors["layers.0.keys.scales"]
        assert scales.shape == (1, 2, n, 64 // key_group)
        step = element_steps(scales.astype(np.float32), layout, "keys", key_group)
        for decoded in (decode_cache(file), decode_cache(dequantize_on_host(file))):
            err = np.abs(np.array(decoded.layers[0].keys) - exact)
            assert np.all(err <= 0.5 * step + 2**-10 * np.abs(exact))
        # (The small channels' largest step, in whole key groups: 5 bits over 32 positions
        # halve 4 bits' over 16 here, where a channel's range is alike over both.)
        a, b = channel_span(0, n, key_group)
        widest[key_group, bits] = float(step[..., a:b, 1:].max())
    assert widest[32, 5] < 0.7 * widest[16, 4] < 0.7 * widest[32, 4]
    for drop in (("key_bits",), ("key_group_size", "key_bits")):
        (layout,) = json.loads(new.metadata["layers"])
        layout = {k: v for k, v in layout.items() if k not in drop}
        relabelled = EncodedCache(new.tensors, new.metadata | {"layers": json.dumps([layout])})
        with pytest.raises(CacheFormatError, match=r"layers\.0\.keys\.q"):
            decode_cache(relabelled)


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_a_head_size_no_group_divides_is_stored_as_it_is_and_reads_back(kv_bits):
    """A layer of head size 12 (no group size divides it, no word holds its codes) is stored
    unquantized whatever the file's bits, and reads back bit for bit."""
    keys, values = (mx.random.normal((1, 2, 40, 12), key=mx.random.key(k)) for k in (1, 2))
    layer = KVCache()
    layer.update_and_fetch(keys, values)
    encoded = encode_cache(PromptCache([layer], list(range(40))), kv_bits)
    (layout,) = json.loads(encoded.metadata["layers"])
    assert layout.get("group_size") is None and "key_bits" not in layout
    for decoded in (decode_cache(encoded), decode_cache(dequantize_on_host(encoded))):
        assert mx.array_equal(decoded.layers[0].keys[..., :40, :], keys).item()
        assert mx.array_equal(decoded.layers[0].values[..., :40, :], values).item()


def test_q4_keys_are_quantized_per_channel_in_whole_groups_of_positions():
    # One key channel 100x the others: per token, its range would set every channel's step.
    mx.random.seed(5)
    n, window = 150, 64  # the sliding layer holds 86..149: whole groups 96..127
    keys = mx.random.normal((1, 2, n, 64)) * mx.array([100.0] + [1.0] * 63)
    values = mx.random.normal((1, 2, n, 64))
    whole_layer, sliding = KVCache(), RotatingKVCache(max_size=window)
    whole_layer.update_and_fetch(keys, values)
    for t in range(n):
        sliding.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    cache = PromptCache([whole_layer, sliding], list(range(n)))
    encoded = encode_cache(cache, 4, 32)
    layouts = json.loads(encoded.metadata["layers"])
    assert [(x["channel_keys"], x["rotated_values"]) for x in layouts] == [(True, True)] * 2
    assert [(x["key_group_size"], x["key_bits"]) for x in layouts] == [(32, 5)] * 2
    x16 = np.array(keys.astype(mx.float16).astype(mx.float32))
    for i, first in ((0, 0), (1, n - window)):
        stored = x16[:, :, first:]
        a, b = channel_span(first, n - first, 32)
        assert (a, b) == ((0, 128) if i == 0 else (10, 42))
        scales = encoded.tensors[f"layers.{i}.keys.scales"]
        biases = encoded.tensors[f"layers.{i}.keys.biases"]
        words = encoded.tensors[f"layers.{i}.keys.q"]
        assert words.shape == (1, 2, n - first, 10)  # 64 five-bit codes a position
        codes = np.array(codes_of(mx.array(words), 5))
        # Whole groups: each channel's float16 (max - min) / 31 and min over its 32 positions,
        # laid out 2 channels to a position's slots (64 / 32), and each key's code against them.
        groups = stored[:, :, a:b].reshape(1, 2, (b - a) // 32, 32, 64)
        low, high = groups.min(axis=3), groups.max(axis=3)
        want = ((high - low) / 31).astype(np.float16).reshape(1, 2, b - a, 2)
        np.testing.assert_array_equal(scales[:, :, a:b], want)
        np.testing.assert_array_equal(biases[:, :, a:b], low.astype(np.float16).reshape(want.shape))
        step = want.astype(np.float32).reshape(1, 2, (b - a) // 32, 1, 64)
        base = low.astype(np.float16).astype(np.float32)[:, :, :, None]
        q = np.clip(np.round((groups - base) / np.where(step > 0, step, 1)), 0, 31)
        np.testing.assert_array_equal(codes[:, :, a:b], q.reshape(1, 2, b - a, 64))
        # Elsewhere, per token by the same rule, in groups of 32 channels.
        for lo, hi in ((0, a), (b, n - first)):
            if hi > lo:
                part = stored[:, :, lo:hi].reshape(1, 2, hi - lo, 2, 32)
                low, high = part.min(axis=4), part.max(axis=4)
                np.testing.assert_array_equal(
                    scales[:, :, lo:hi], ((high - low) / 31).astype(np.float16)
                )
                np.testing.assert_array_equal(biases[:, :, lo:hi], low.astype(np.float16))
        # The small channels keep a small step where whole groups hold them.
        decoded = decode_cache(encoded).layers[i]
        got = np.array(decoded.keys if i == 0 else temporal_order(decoded, decoded.keys))
        err = np.abs(got[:, :, : n - first] - np.array(keys[:, :, first:]))
        assert err[:, :, a:b, 1:].max() < 0.5 < err[:, :, b:, 1:].max()
    # Values: rotated by the orthonormal Walsh-Hadamard transform, then quantized per token.
    rotated = hadamard(values.astype(mx.float32))
    q, _, _ = mx.quantize(rotated.astype(mx.float16), group_size=32, bits=4)
    np.testing.assert_array_equal(encoded.tensors["layers.0.values.q"], np.array(q))
    assert mx.allclose(hadamard(rotated), values, atol=1e-5).item()


async def test_q8_cache_resumes_with_nearly_the_same_predictions(engine):
    hits = total = 0
    for n in HISTORIES:
        original = await history(engine, n)
        q8 = await roundtrip(engine, original, 8)
        solo, from_q8 = await resume(engine, original), await resume(engine, q8)
        assert from_q8[0] == solo[0]
        # Teacher-forced: feed both caches the same 48 tokens, compare each position's argmax.
        exact, q8 = await roundtrip(engine, original, None), await roundtrip(engine, original, 8)
        feed = tokens(engine, 48, salt=n + 1)
        hits += await engine.run(argmax_agreement, engine, feed, exact, q8)
        total += len(feed)
    assert hits / total >= 0.9


async def test_q4_cache_resumes(gemma):
    original = await history(gemma, 130)
    res = await gemma.generate(
        GenerationRequest([20, 21], 8, cache=await roundtrip(gemma, original, 4), ignore_eos=True)
    )
    assert len(res.token_ids) == 8 and res.stats.cached_tokens == 130
    assert res.cache.tokens == [*original.tokens, 20, 21, *res.token_ids]


async def test_quantized_sizes_against_float16(engine):
    cache = await history(engine, 130)
    encoded = {b: await engine.run(encode_cache, cache, b, 32) for b in (8, 4)}
    encoded[None] = await engine.run(encode_cache, cache, None)
    token_bytes = encoded[None].tensors["tokens"].nbytes
    assert token_bytes == 130 * 4
    fp16_kv = (encoded[None].nbytes - token_bytes) // 2  # the tiny models are float32
    ratios = {b: (encoded[b].nbytes - token_bytes) / fp16_kv for b in (8, 4)}
    # Groups of 32: (d + 4d/32) / 2d; q4 keys per channel in 5-bit codes over 32 positions,
    # (5d/8 + 4d/32) / 2d, and values (d/2 + 4d/32) / 2d.
    assert ratios == {8: 0.5625, 4: (0.375 + 0.3125) / 2}
    assert encoded[8].nbytes / (fp16_kv + token_bytes) <= 0.57
    assert encoded[4].nbytes / (fp16_kv + token_bytes) <= 0.35
    at_64 = {b: await engine.run(encode_cache, cache, b, 64) for b in (8, 4)}
    assert {b: (at_64[b].nbytes - token_bytes) / fp16_kv for b in (8, 4)} == {
        8: 0.53125,
        4: (0.375 + 0.28125) / 2,
    }
    # No group size: each precision's own, 128 (64 here: 128 does not divide the heads of 64).
    default = {b: await engine.run(encode_cache, cache, b) for b in (8, 4)}
    assert {b: (default[b].nbytes - token_bytes) / fp16_kv for b in (8, 4)} == {
        8: 0.53125,
        4: (0.375 + 0.28125) / 2,
    }


async def test_tensor_names_and_metadata(gemma):
    encoded = await gemma.run(encode_cache, await history(gemma, 130), 4, 32)
    assert encoded.num_tokens == 130 and (encoded.kv_bits, encoded.group_size) == (4, 32)
    assert set(encoded.tensors) == {"tokens"} | {
        f"layers.{i}.{kv}.{part}"
        for i in range(5)
        for kv in ("keys", "values")
        for part in ("q", "scales", "biases")
    }
    # (q4 keys: 5-bit codes, per channel over 32 positions; values: 4-bit, groups of 32.)
    assert encoded.tensors["layers.0.keys.q"].shape == (1, 2, WINDOW, 64 * 5 // 32)
    assert encoded.tensors["layers.0.values.q"].shape == (1, 2, WINDOW, 64 * 4 // 32)
    assert encoded.tensors["layers.1.values.scales"].shape == (1, 2, 130, 64 // 32)
    assert encoded.tensors["layers.1.keys.scales"].shape == (1, 2, 130, 64 // 32)
    assert encoded.nbytes == sum(t.nbytes for t in encoded.tensors.values())
    metadata = encoded.metadata
    assert (metadata["format_version"], metadata["kv_bits"], metadata["group_size"]) == (
        str(FORMAT_VERSION),
        "4",
        "32",
    )
    rotating, full = json.loads(metadata["layers"])[:2]
    assert rotating == {
        "type": "RotatingKVCache",
        "offset": 130,
        "max_size": WINDOW,
        "keep": 0,
        "dtype": "float32",
        "keys_shape": [1, 2, WINDOW, 64],
        "values_shape": [1, 2, WINDOW, 64],
        "group_size": 32,
        "channel_keys": True,
        "key_group_size": 32,
        "key_bits": 5,
        "rotated_values": True,
    }
    assert full == rotating | {"type": "KVCache", "max_size": None, "keep": None} | {
        "keys_shape": [1, 2, 130, 64],
        "values_shape": [1, 2, 130, 64],
    }


def _rotating(max_size: int, keep: int, steps: list[int], dtype=mx.float32) -> RotatingKVCache:
    """A RotatingKVCache fed chunks of the given lengths (1 = in place, >1 = concatenate)."""
    cache, pos = RotatingKVCache(max_size=max_size, keep=keep), 0
    for s in steps:
        kv = mx.arange(pos, pos + s, dtype=mx.float32)[None, None, :, None] + mx.zeros(
            (1, 2, s, 64)
        )
        cache.update_and_fetch(kv.astype(dtype), -kv.astype(dtype))
        pos += s
    return cache


@pytest.mark.parametrize(
    ("keep", "steps", "stored"),
    [
        (0, [1] * 5, 5),  # buffer allocated for 8, 5 filled
        (0, [1] * 8, 8),  # exactly full
        (0, [1] * 13, 8),  # wrapped: _idx < offset
        (2, [1] * 13, 8),  # wrapped with a kept prefix
        (0, [12], 12),  # a long prefill keeps max_size + S - 1 positions
        (2, [12, 1, 1, 1], 8),  # prefill then in-place writes that trim
    ],
)
def test_rotating_layer_keeps_temporal_order_and_continues(keep, steps, stored):
    original = _rotating(8, keep, steps)
    decoded = decode_cache(encode_cache(PromptCache([original], list(range(sum(steps)))), None))
    (layer,) = decoded.layers
    assert layout(layer) == layout(original) and layer.keys.shape[2] == stored
    assert np.array_equal(temporal(layer)[0], temporal(original)[0])
    first = temporal(original)[0][0, 0, :, 0].tolist()
    assert first[:keep] == list(range(keep)) and first[-1] == sum(steps) - 1
    for s in (1, 1, 5, 1):  # both caches see the same future and stay equal
        kv = mx.full((1, 2, s, 64), float(100 + s))
        for c in (original, layer):
            c.update_and_fetch(kv, -kv)
        assert np.array_equal(temporal(layer)[0], temporal(original)[0])
        merged = [BatchRotatingKVCache.merge([c]) for c in (original, layer)]
        assert mx.array_equal(merged[0].keys, merged[1].keys).item()


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_bfloat16_cache_roundtrips(kv_bits):
    x = mx.random.normal((1, 2, 11, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    kv = KVCache()
    kv.update_and_fetch(x[..., :5, :], 2 * x[..., :5, :])
    kv.update_and_fetch(x[..., 5:, :], 2 * x[..., 5:, :])  # 11 positions in a 256-slot buffer
    rot = _rotating(8, 0, [1] * 11, mx.bfloat16)
    encoded = encode_cache(PromptCache([kv, rot], list(range(11))), kv_bits)
    decoded = decode_cache(encoded)
    for original, layer in zip([kv, rot], decoded.layers, strict=True):
        assert layer.keys.dtype == layer.values.dtype == mx.bfloat16
        assert layout(layer) == layout(original)
        for exact, back in zip(temporal(original), temporal(layer), strict=True):
            if kv_bits is None:  # bfloat16 -> float32 is exact, so this compares bits
                assert np.array_equal(exact, back)
            else:
                assert np.abs(exact - back).max() < 0.05 * np.abs(exact).max()
    if kv_bits is None:
        assert encoded.tensors["layers.0.keys"].dtype == np.uint16
    for c in (kv, decoded.layers[0]):
        c.update_and_fetch(x[..., :1, :], x[..., :1, :])
    assert decoded.layers[0].offset == kv.offset == 12
    if kv_bits is None:
        assert np.array_equal(temporal(decoded.layers[0])[0], temporal(kv)[0])


def _corrupt(encoded: EncodedCache, tensors=None, drop=(), **metadata) -> EncodedCache:
    t = {k: v for k, v in encoded.tensors.items() if k not in drop} | (tensors or {})
    return EncodedCache(t, encoded.metadata | metadata)


def _relayer(encoded: EncodedCache, layer: int = 1, **changes) -> str:
    layers = json.loads(encoded.metadata["layers"])
    layers[layer].update(changes)
    return json.dumps(layers)


@pytest.fixture(scope="module")
def small(gemma):
    async def encode():
        cache = await history(gemma, 40)
        return await gemma.run(encode_cache, cache, None), await gemma.run(encode_cache, cache, 8)

    return asyncio.run(encode())


KEY_GROUP_REFUSED = "key_group_size must be one of (16, 32, 64, 128), and only with channel_keys"
KEY_BITS_REFUSED = "key_bits must be one of (4, 5), and only with channel_keys"
CORRUPTIONS = {
    "missing tensor": (
        lambda e, q: _corrupt(e, drop=["layers.1.keys"]),
        "'layers.1.keys' is missing",
    ),
    "missing scales": (
        lambda e, q: _corrupt(q, drop=["layers.2.values.scales"]),
        "'layers.2.values.scales' is missing",
    ),
    "wrong shape": (
        lambda e, q: _corrupt(e, {"layers.0.keys": e.tensors["layers.0.keys"][:, :1]}),
        "'layers.0.keys' is float32[1, 1, 32, 64], expected float32[1, 2, 32, 64]",
    ),
    "wrong dtype": (
        lambda e, q: _corrupt(q, {"layers.3.keys.q": q.tensors["layers.3.keys.q"].view(np.int32)}),
        "'layers.3.keys.q' is int32",
    ),
    "unknown layer type": (
        lambda e, q: _corrupt(e, layers=_relayer(e, type="QuantizedKVCache")),
        "unknown layer type 'QuantizedKVCache'",
    ),
    "bad format version": (
        lambda e, q: _corrupt(e, format_version="2"),
        "unsupported format_version '2'",
    ),
    "no format version": (
        lambda e, q: EncodedCache(e.tensors, {}),
        "unsupported format_version None",
    ),
    "tokens mismatch": (
        lambda e, q: _corrupt(e, {"tokens": e.tensors["tokens"][:-1]}),
        "layer 0 holds 40 positions but tensor 'tokens' has 39",
    ),
    "offset mismatch": (
        lambda e, q: _corrupt(e, layers=_relayer(e, offset=41)),
        "a KVCache at offset 41 stores 41 positions, not 40",
    ),
    "rotating length": (
        lambda e, q: _corrupt(
            e,
            {"layers.0.keys": e.tensors["layers.0.keys"][:, :, :20]},
            layers=_relayer(e, 0, keys_shape=[1, 2, 20, 64], values_shape=[1, 2, 20, 64]),
        ),
        "a RotatingKVCache at offset 40 cannot store 20 positions",
    ),
    "one layer's offset off": (
        lambda e, q: _corrupt(
            e, layers=_relayer(e, offset=41, keys_shape=[1, 2, 41, 64], values_shape=[1, 2, 41, 64])
        ),
        "layer 1 holds 41 positions but tensor 'tokens' has 40",
    ),
    "extra tensor": (
        lambda e, q: _corrupt(e, {"layers.9.keys": e.tensors["tokens"]}),
        "unexpected tensors",
    ),
    "bad kv_bits": (lambda e, q: _corrupt(q, kv_bits="3"), "'kv_bits' is '3'"),
    "layers not json": (lambda e, q: _corrupt(e, layers="[{"), "'layers' is missing or not JSON"),
    "bad shape field": (
        lambda e, q: _corrupt(e, layers=_relayer(e, keys_shape=[1, 2])),
        "4 positive integers",
    ),
    "key groups without channel keys": (
        lambda e, q: _corrupt(q, layers=_relayer(q, key_group_size=16)),
        KEY_GROUP_REFUSED,
    ),
    "key groups not an integer": (
        lambda e, q: _corrupt(q, layers=_relayer(q, channel_keys=True, key_group_size=16.0)),
        KEY_GROUP_REFUSED,
    ),
    "key bits without channel keys": (
        lambda e, q: _corrupt(e, layers=_relayer(e, key_bits=5)),
        KEY_BITS_REFUSED,
    ),
    "key bits not 4 or 5": (
        lambda e, q: _corrupt(q, layers=_relayer(q, channel_keys=True, key_bits=6)),
        KEY_BITS_REFUSED,
    ),
    "key bits that do not pack the key head": (
        lambda e, q: _corrupt(
            q,
            layers=_relayer(
                q,
                channel_keys=True,
                key_group_size=16,
                key_bits=5,
                keys_shape=[*json.loads(q.metadata["layers"])[1]["keys_shape"][:3], 48],
            ),
        ),
        "key_bits 5 do not pack a key head size of 48 into words",
    ),
    "key bits not an integer": (
        lambda e, q: _corrupt(q, layers=_relayer(q, channel_keys=True, key_bits=True)),
        KEY_BITS_REFUSED,
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
async def test_corrupt_inputs_raise_cache_format_error(gemma, small, case):
    mutate, message = CORRUPTIONS[case]
    with pytest.raises(CacheFormatError, match=re.escape(message)):
        await gemma.run(decode_cache, mutate(*small))


async def test_bad_encode_requests_raise_value_error(gemma):
    cache = await history(gemma, 12)
    with pytest.raises(ValueError, match="empty cache"):
        await gemma.run(encode_cache, PromptCache(cache.layers, []), None)
    with pytest.raises(ValueError, match="kv_bits must be None, 8 or 4"):
        await gemma.run(encode_cache, cache, 3)
    with pytest.raises(ValueError, match="group_size 48 is not supported"):
        await gemma.run(encode_cache, cache, 8, 48)
    with pytest.raises(ValueError, match="layer 0 holds 12 positions but the cache lists 11"):
        await gemma.run(encode_cache, PromptCache(cache.layers, cache.tokens[:-1]), None)

    def quantized_cache() -> PromptCache:
        layer = QuantizedKVCache()
        layer.update_and_fetch(mx.zeros((1, 1, 12, 64)), mx.zeros((1, 1, 12, 64)))
        return PromptCache([layer] * 5, cache.tokens)

    quantized = await gemma.run(quantized_cache)
    with pytest.raises(ValueError, match="layer 0 is a QuantizedKVCache"):
        await gemma.run(encode_cache, quantized, None)


@pytest.mark.parametrize("head_dim", [32, 48, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("preferred", [32, 64, 128])
def test_choose_group_size_picks_what_mx_quantize_accepts(head_dim, preferred):
    def accepted(group_size: int) -> bool:
        try:
            mx.eval(mx.quantize(mx.zeros((2, head_dim)), group_size=group_size, bits=4))
        except ValueError:
            return False
        return True

    chosen = choose_group_size(head_dim, preferred)
    if chosen is None:  # the layer is stored unquantized
        assert not any(accepted(g) for g in GROUP_SIZES)
    else:
        assert accepted(chosen)
        assert chosen == preferred or not accepted(preferred)


@pytest.mark.parametrize("kv_bits", [8, 4])
async def test_host_dequantization_is_exact_in_float32_and_near_mlx(engine, kv_bits):
    for n in (10, 130):
        encoded = await engine.run(encode_cache, await history(engine, n), kv_bits)
        on_mlx = await engine.run(decode_cache, encoded)
        host = dequantize_on_host(encoded)
        assert host.kv_bits is None and host.group_size is None
        on_host = await engine.run(decode_cache, host)
        layouts = json.loads(encoded.metadata["layers"])
        for i, (a, b) in enumerate(zip(on_mlx.layers, on_host.layers, strict=True)):
            assert (type(a), a.offset) == (type(b), b.offset)
            group, rotated = layouts[i]["group_size"], layouts[i].get("rotated_keys", False)
            assert rotated == (kv_bits == 8)  # head size 64
            # Keys per channel or rotated: the same float32 arithmetic on MLX as on the host.
            assert mx.array_equal(a.keys, b.keys).item()
            assert mx.array_equal(a.values, b.values).item()
            if kv_bits == 4:  # keys per channel, values rotated
                assert layouts[i]["channel_keys"] and layouts[i]["rotated_values"]
                continue
            for kv, got, theirs in (("keys", b.keys, a.keys), ("values", b.values, a.values)):
                # Exactly q * scale + bias in float32 (the cache's dtype here; keys rotated
                # back) ...
                words, scales, biases = (
                    mx.array(encoded.tensors[f"layers.{i}.{kv}.{p}"])
                    for p in ("q", "scales", "biases")
                )
                exact = mx.dequantize(
                    words,
                    scales.astype(mx.float32),
                    biases.astype(mx.float32),
                    group_size=group,
                    bits=kv_bits,
                )
                if kv == "keys":
                    exact = mx.array(hadamard_on_host(np.array(exact)))
                    assert mx.array_equal(got, exact).item()
                    continue
                assert mx.array_equal(got, exact).item()
                # ... and within mx.dequantize's float16 rounding of q * scale, then of the sum.
                scaled = got - mx.repeat(biases.astype(mx.float32), group, axis=-1)
                rounding = (mx.abs(scaled) + mx.abs(got)) * 2.0**-11 + 2.0**-24
                assert mx.all(mx.abs(got - theirs) <= rounding).item()
        assert on_host.tokens == on_mlx.tokens


async def test_a_preferred_group_size_that_does_not_divide_falls_back(gemma):
    cache = await history(gemma, 12)  # head_dim 64
    encoded = await gemma.run(encode_cache, cache, 8, 128)
    assert encoded.group_size == 128  # the preference, recorded for the file
    assert {layer["group_size"] for layer in json.loads(encoded.metadata["layers"])} == {64}
    assert encoded.tensors["layers.0.keys.scales"].shape[-1] == 1  # 64 / 64
    decoded = await gemma.run(decode_cache, encoded)
    assert decoded.tokens == cache.tokens


@pytest.mark.parametrize(
    ("head_dim", "preferred", "chosen"),
    [
        (64, 64, 64),
        (128, 128, 128),
        (96, 64, 32),
        (160, 64, 32),
        (256, 128, 128),
        (80, 64, None),
        (72, 32, None),
        (48, 64, None),
        (32, 64, 32),
    ],
)
def test_choose_group_size_divides_the_head_dim_or_gives_none(head_dim, preferred, chosen):
    assert choose_group_size(head_dim, preferred) == chosen


def small_llama(head_dim: int):
    """A random-weight mlx-lm llama with the given head size (2 layers, 2 KV heads)."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=2 * head_dim, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
        vocab_size=128, rope_theta=10_000.0, tie_word_embeddings=True,
    )  # fmt: skip
    mx.random.seed(head_dim)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_head_dim_96_quantizes_with_group_32_and_resumes_like_the_original():
    model = small_llama(96)
    prompt = [(5 * i) % 120 + 3 for i in range(40)]
    layers = [KVCache() for _ in model.layers]
    model(mx.array([prompt]), cache=layers)
    cache = PromptCache(layers, prompt)
    encoded = encode_cache(cache, 8, 64)  # preferred 64 does not divide 96
    assert [layer["group_size"] for layer in json.loads(encoded.metadata["layers"])] == [32, 32]
    assert encoded.tensors["layers.0.keys.scales"].shape == (1, 2, 40, 3)
    decoded = decode_cache(encoded)
    for a, b in zip(cache.layers, decoded.layers, strict=True):
        assert a.keys[..., :40, :].shape == b.keys.shape
        assert mx.allclose(a.keys[..., :40, :], b.keys, atol=0.05).item()
    feed = mx.array([[7, 9, 11, 13]])
    expected = model(feed, cache=cache.layers).argmax(-1)
    assert mx.array_equal(model(feed, cache=decoded.layers).argmax(-1), expected).item()


def test_a_head_dim_no_group_size_divides_is_stored_unquantized_with_a_warning(caplog):
    mx.random.seed(3)
    layers = []
    for head_dim in (64, 72):  # 72: neither 32, 64 nor 128 divides it
        layer = KVCache()
        keys, values = (mx.random.normal((1, 2, 10, head_dim)) for _ in range(2))
        layer.update_and_fetch(keys, values)
        layers.append(layer)
    cache = PromptCache(layers, list(range(10)))
    with caplog.at_level(logging.WARNING, logger="agentkv.engine.scheme"):
        encoded = encode_cache(cache, 4, 64)
    assert "KV head size 72/72 is not divisible by any quantization group size" in caplog.text
    assert [layer["group_size"] for layer in json.loads(encoded.metadata["layers"])] == [64, None]
    assert {"layers.0.keys.q", "layers.1.keys", "layers.1.values"} <= set(encoded.tensors)
    assert "layers.1.keys.q" not in encoded.tensors
    used = [(layer.keys[..., :10, :], layer.values[..., :10, :]) for layer in layers]
    for decoded in (decode_cache(encoded), decode_cache(dequantize_on_host(encoded))):
        assert mx.array_equal(decoded.layers[1].keys, used[1][0]).item()
        assert mx.array_equal(decoded.layers[1].values, used[1][1]).item()
        assert not mx.array_equal(decoded.layers[0].keys, used[0][0]).item()  # 4-bit
        assert mx.allclose(decoded.layers[0].keys, used[0][0], atol=0.5).item()


# ---- paged storage (format 2) ------------------------------------------------------------

BLOCK = 16


def write_paged(tmp_path, paged) -> tuple[str, list[str]]:
    """The tail and segments of a PagedCache as files (safetensors with a checksum)."""
    from agentkv.store.cache_files import write_cache_file

    blocks = [
        str(write_cache_file(tmp_path / f"b{j}.safetensors", b.tensors, b.metadata).path)
        for j, b in sorted(paged.segments.items())
    ]
    tail = write_cache_file(tmp_path / "tail.safetensors", paged.tail.tensors, paged.tail.metadata)
    return str(tail.path), blocks


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
@pytest.mark.parametrize("n", [10, 2 * BLOCK, 130])
async def test_paged_round_trip_equals_the_whole_cache(engine, tmp_path, kv_bits, n):
    cache = await history(engine, n)
    block = 2 * BLOCK if kv_bits == 4 else BLOCK  # q4: whole groups of 32 positions a block
    paged = await engine.run(encode_paged, cache, kv_bits, 32, block)
    assert sorted(paged.segments) == ([0] if n >= block else [])  # one run: one segment
    assert [j for first in paged.segments for j in paged.blocks_in(first)] == list(
        range(n // block)
    )
    assert paged.tail.num_tokens == n % block
    whole = await engine.run(encode_cache, cache, kv_bits, 32)
    expected = await engine.run(decode_cache, dequantize_on_host(whole))
    # The numpy path (format 1 from tail and blocks) and the MLX path, CPU and GPU arithmetic.
    blocks = [b for segment in paged.segments.values() for b in split_blocks(segment, block)]
    assert len(blocks) == n // block
    assembled = await engine.run(
        decode_cache, dequantize_on_host(assemble_paged(paged.tail, blocks))
    )
    tail, block_paths = write_paged(tmp_path, paged)
    seen = []
    for on_gpu in (False, True):
        decoded = await engine.run(
            decode_paged, load_into_mlx, tail, block_paths, on_gpu, seen.append
        )
        for got in (assembled, decoded):
            assert got.tokens == cache.tokens
            assert [layout(x) for x in got.layers] == [layout(x) for x in cache.layers]
            for (a, b), (c, d) in await temporal_pairs(engine, expected, got):
                np.testing.assert_array_equal(a, c)
                np.testing.assert_array_equal(b, d)
    assert [path for path, _, _ in seen[0]] == [*block_paths, tail]  # check saw every file
    if len(blocks) > 2:  # runs of one file, read once and joined as the whole
        runs = [BlockRun(block_paths[0], 0, 2), BlockRun(block_paths[0], 2)]
        seen.clear()
        decoded = await engine.run(decode_paged, load_into_mlx, tail, runs, False, seen.append)
        assert [path for path, _, _ in seen[0]] == [block_paths[0], tail]
        for (a, b), (c, d) in await temporal_pairs(engine, expected, decoded):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, d)
    if kv_bits is None:  # exact: resumes token for token like the original
        assert await resume(engine, decoded) == await resume(engine, cache)


@pytest.mark.parametrize("n", [130, 150])  # 150: its window starts inside a key group
async def test_a_q4_file_joins_a_q4_batch_as_it_is_stored(gemma, tmp_path, n):
    """A batch holding q4 (keys per channel, values rotated) takes a q4 file's words as they
    are: the positions it holds quantized are exactly what quantizing the original cache gives
    (not the file's dequantized values quantized again); the newest are float."""
    from agentkv.engine.batch.held import channel_boundary, float_window
    from agentkv.engine.batch.layout import KVLayout
    from agentkv.engine.batch.rows import is_packed
    from agentkv.engine.config import KEY_GROUP_SIZE as K

    cache = await history(gemma, n)
    paged = await gemma.run(encode_paged, cache, 4, 32, 2 * BLOCK)
    tail, block_paths = write_paged(tmp_path, paged)
    packing = (await gemma.run(KVLayout.of, gemma.model.model, 4, 32)).packing
    got = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False, None, packing)
    assert got.packing == packing and all(is_packed(x) for x in got.layers)
    floats = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False)
    quantized = channel_boundary(n, K)
    for i, (row, original) in enumerate(zip(got.layers, cache.layers, strict=True)):
        want = packing.pack(i, original)  # the batch's row of the original, float cache
        assert row.keys.shape == want.keys.shape and row.offset == want.offset == n
        first = n - min(n, original.max_size if isinstance(original, RotatingKVCache) else n)
        whole = -(-first // K) * K - first // K * K  # columns before the first whole key group
        stop = quantized - first // K * K
        # (A 32-position window is all float: its positions are newer than FLOAT_WINDOW + K.)
        assert stop > whole or isinstance(original, RotatingKVCache)
        assert mx.array_equal(row.keys[..., whole:stop, :], want.keys[..., whole:stop, :]).item()
        assert mx.array_equal(
            row.values[..., first % K :, :], want.values[..., first % K :, :]
        ).item()
        # The newest positions in float: what the file holds for them, expanded.
        expanded = floats.layers[i]
        held = min(float_window(K), expanded.keys.shape[2])
        assert mx.array_equal(row.recent[0][..., -held:, :], expanded.keys[..., -held:, :]).item()
        assert mx.array_equal(row.recent[1][..., -held:, :], expanded.values[..., -held:, :]).item()


@pytest.mark.parametrize("key_group", [16, None])  # None: the layer's group size, 32 here
async def test_a_q4_file_of_four_bit_keys_joins_a_q4_batch_expanded(
    gemma, tmp_path, monkeypatch, key_group
):
    """A q4 file written before five-bit keys (4-bit keys over 16 positions, or before that
    over the layer's group size: 32 positions, as the batch's five-bit keys) does not join a
    batch holding q4 with its words: it loads expanded as stored (the batch packs it anew)."""
    import agentkv.engine.kv.paged
    from agentkv.engine.batch.layout import KVLayout
    from agentkv.engine.batch.rows import is_packed
    from agentkv.engine.kv.quant import quant_scheme

    def four_bit_keys(*args, **kwargs):
        fields = quant_scheme(*args, **kwargs)
        if fields.get("channel_keys"):
            fields = {k: v for k, v in fields.items() if k not in ("key_bits", "key_group_size")}
            fields |= {"key_group_size": key_group} if key_group else {}
        return fields

    cache = await history(gemma, 130)
    packing = (await gemma.run(KVLayout.of, gemma.model.model, 4, 32)).packing
    monkeypatch.setattr(agentkv.engine.kv.paged, "quant_scheme", four_bit_keys)
    paged = await gemma.run(encode_paged, cache, 4, 32, 2 * BLOCK)
    monkeypatch.undo()
    layouts = json.loads(paged.tail.metadata["layers"])
    assert all(x.get("key_group_size") == key_group and "key_bits" not in x for x in layouts)
    assert paged.tail.tensors["layers.0.keys.q"].shape[-1] == 64 * 4 // 32
    tail, block_paths = write_paged(tmp_path, paged)
    floats = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False)
    got = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False, None, packing)
    assert got.packing is None and not any(is_packed(x) for x in got.layers)
    for row, expanded, original in zip(got.layers, floats.layers, cache.layers, strict=True):
        exact, approx = temporal(original)[0], temporal(expanded)[0]
        np.testing.assert_array_equal(temporal(row)[0], approx)
        assert np.abs(exact - approx).max() < 0.2 * np.abs(exact).max()


async def test_a_q8_file_joins_a_q8_batch_as_stored_and_an_unrotated_one_is_read_unrotated(
    gemma, tmp_path, monkeypatch
):
    """q8 files store keys rotated, as a q8 batch holds them: a file joins such a batch with
    its words as stored (saved again, the same bytes). A q8 file written before keys were
    rotated (its layouts without ``rotated_keys``) still loads: expanded as stored, unrotated
    (the batch packs such a row, rotated, when it joins)."""
    import agentkv.engine.kv.paged
    from agentkv.engine.batch.layout import KVLayout
    from agentkv.engine.batch.rows import is_packed

    cache = await history(gemma, 130)
    packing = (await gemma.run(KVLayout.of, gemma.model.model, 8, 64)).packing
    assert all(map(packing.keys_rotated, range(len(packing.schemes))))  # head size 64
    paged = await gemma.run(encode_paged, cache, 8, 64, BLOCK)
    tail, block_paths = write_paged(tmp_path, paged)
    assert all(x["rotated_keys"] for x in json.loads(paged.tail.metadata["layers"]))
    got = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False, None, packing)
    assert got.packing == packing and all(is_packed(x) for x in got.layers)
    again = await gemma.run(encode_paged, got, 8, 64, BLOCK)
    for old, new in [(paged.tail, again.tail), (paged.segments[0], again.segments[0])]:
        assert old.tensors.keys() == new.tensors.keys()
        for name, x in old.tensors.items():
            np.testing.assert_array_equal(x, new.tensors[name], err_msg=name)

    # As agentkv wrote q8 files before (format 2): no flags, keys quantized as they are.
    monkeypatch.setattr(agentkv.engine.kv.paged, "quant_scheme", lambda *args, **kwargs: {})
    legacy = await gemma.run(encode_paged, cache, 8, 64, BLOCK)
    monkeypatch.undo()
    # Rotated keys make format 3 (which an agentkv reading only format 2 refuses); files
    # without them stay format 2.
    assert paged.tail.metadata["format_version"] == "3"
    assert {s.metadata["format_version"] for s in paged.segments.values()} == {"3"}
    for bits, block in ((None, BLOCK), (4, 2 * BLOCK)):
        other = await gemma.run(encode_paged, cache, bits, 32, block)
        assert other.tail.metadata["format_version"] == "2"
    legacy = PagedCache(
        {
            j: EncodedCache(b.tensors, b.metadata | {"format_version": "2"})
            for j, b in legacy.segments.items()
        },
        EncodedCache(legacy.tail.tensors, legacy.tail.metadata | {"format_version": "2"}),
        BLOCK,
    )
    assert not any("rotated_keys" in x for x in json.loads(legacy.tail.metadata["layers"]))
    (tmp_path / "legacy").mkdir()
    tail, block_paths = write_paged(tmp_path / "legacy", legacy)
    floats = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False)
    got = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False, None, packing)
    assert got.packing is None and not any(is_packed(x) for x in got.layers)
    for row, expanded, original in zip(got.layers, floats.layers, cache.layers, strict=True):
        exact, approx = temporal(original)[0], temporal(expanded)[0]
        np.testing.assert_array_equal(temporal(row)[0], approx)
        assert np.abs(exact - approx).max() < 0.02 * np.abs(exact).max()  # read unrotated


async def test_q4_blocks_not_whole_key_groups_keep_keys_per_token(gemma, tmp_path):
    odd = 48  # a key group and a half
    cache = await history(gemma, 3 * odd + 5)
    paged = await gemma.run(encode_paged, cache, 4, 32, odd)
    layouts = json.loads(paged.tail.metadata["layers"])
    assert all("channel_keys" not in x and x["rotated_values"] for x in layouts)
    entries = json.loads(paged.segments[0].metadata["layers"])
    assert all("channel_keys" not in e and e["rotated_values"] for e in entries)
    tail, block_paths = write_paged(tmp_path, paged)
    decoded = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False)
    blocks = split_blocks(paged.segments[0], odd)
    on_host = await gemma.run(decode_cache, dequantize_on_host(assemble_paged(paged.tail, blocks)))
    for (a, b), (c, d) in await temporal_pairs(gemma, on_host, decoded):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    # Blocks of another scheme than their tail's are refused.
    # (Blocks of keys per token, or of 4-bit keys per channel as written before 5-bit ones, are
    # such.)
    whole_groups = await gemma.run(encode_paged, cache, 4, 32, 2 * BLOCK)
    block = split_blocks(whole_groups.segments[0], 2 * BLOCK)[0]
    own = json.loads(block.metadata["layers"])
    assert all(e["channel_keys"] and (e["key_group_size"], e["key_bits"]) == (32, 5) for e in own)
    for drop in ("channel_keys", "key_bits"):
        other = [{k: v for k, v in e.items() if k != drop} for e in own]
        relabelled = EncodedCache(block.tensors, block.metadata | {"layers": json.dumps(other)})
        with pytest.raises(CacheFormatError, match="quantization scheme differs from the tail"):
            assemble_paged(whole_groups.tail, [relabelled], join=False)


async def test_a_q4_tail_at_a_block_boundary_with_no_new_blocks_saves(gemma, tmp_path):
    # A turn ending on a block boundary whose blocks are all stored: the tail holds no
    # position of the global layers (nothing to rotate), only the sliding windows.
    cache = await history(gemma, 4 * BLOCK)
    paged = await gemma.run(encode_paged, cache, 4, 32, 2 * BLOCK, set())
    assert paged.segments == {} and paged.tail.num_tokens == 0
    every = await gemma.run(encode_paged, cache, 4, 32, 2 * BLOCK)
    tail, block_paths = write_paged(tmp_path, PagedCache(every.segments, paged.tail, 2 * BLOCK))
    decoded = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False)
    whole = await gemma.run(decode_cache, await gemma.run(encode_cache, cache, 4, 32))
    for (a, b), (c, d) in await temporal_pairs(gemma, whole, decoded):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


@pytest.mark.parametrize(("kv_bits", "group"), [(None, 32), (4, 32), (8, 32), (8, 64)])
async def test_a_q8_batch_row_at_a_block_boundary_with_no_new_blocks_saves(
    gemma, tmp_path, kv_bits, group
):
    """A q8 batch's row (keys rotated) ending on a block boundary, all its blocks stored: its
    global layers' tail is empty, whether the file keeps the batch's words or expands them."""
    from agentkv.engine.batch.layout import KVLayout

    cache = await history(gemma, 4 * BLOCK)
    packing = (await gemma.run(KVLayout.of, gemma.model.model, 8, 64)).packing

    def pack() -> list:
        rows = [packing.pack(i, layer) for i, layer in enumerate(cache.layers)]
        mx.eval(*(x for row in rows for x in (row.keys, row.values)))
        return rows

    rows = await gemma.run(pack)
    packed = PromptCache(rows, cache.tokens, packing=packing)
    block = 2 * BLOCK if kv_bits == 4 else BLOCK
    paged = await gemma.run(encode_paged, packed, kv_bits, group, block, set())
    assert paged.segments == {} and paged.tail.num_tokens == 0
    every = await gemma.run(encode_paged, packed, kv_bits, group, block)
    tail, block_paths = write_paged(tmp_path, PagedCache(every.segments, paged.tail, block))
    decoded = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False)
    whole = await gemma.run(decode_cache, await gemma.run(encode_cache, packed, kv_bits, group))
    for (a, b), (c, d) in await temporal_pairs(gemma, whole, decoded):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


def test_a_window_that_keeps_its_first_positions_stores_q4_keys_per_token():
    layer = RotatingKVCache(max_size=64, keep=4)
    for t in range(100):
        layer.update_and_fetch(mx.full((1, 2, 1, 64), float(t)), mx.zeros((1, 2, 1, 64)))
    encoded = encode_cache(PromptCache([layer], list(range(100))), 4, 32)
    (stored,) = json.loads(encoded.metadata["layers"])
    assert "channel_keys" not in stored and stored["rotated_values"] is True


async def test_encode_paged_writes_only_the_blocks_asked_for(gemma):
    cache = await history(gemma, 5 * BLOCK + 3)
    every = await gemma.run(encode_paged, cache, 8, 32, BLOCK)
    some = await gemma.run(encode_paged, cache, 8, 32, BLOCK, {1, 2, 4})
    # One segment per run of consecutive blocks asked for.
    assert {first: list(some.blocks_in(first)) for first in some.segments} == {1: [1, 2], 4: [4]}
    assert list(every.segments) == [0] and list(every.blocks_in(0)) == [0, 1, 2, 3, 4]
    all_blocks = split_blocks(every.segments[0], BLOCK)
    some_blocks = {
        1: split_blocks(some.segments[1], BLOCK)[0],
        2: split_blocks(some.segments[1], BLOCK)[1],
    }
    some_blocks[4] = some.segments[4]
    for j in (1, 2, 4):
        assert some_blocks[j].metadata == all_blocks[j].metadata
        for name, x in all_blocks[j].tensors.items():
            np.testing.assert_array_equal(some_blocks[j].tensors[name], x)
    assert some.tail.metadata == every.tail.metadata
    # Global layers alike are stacked: a handful of tensors per segment, whatever the depth.
    assert every.segments[0].metadata["stacked"] == "true"
    assert sorted(every.segments[0].tensors) == [
        "keys.biases",
        "keys.q",
        "keys.scales",
        "tokens",
        "values.biases",
        "values.q",
        "values.scales",
    ]


def test_global_layers_that_differ_are_stored_per_layer(tmp_path):
    layers = []
    for head_dim in (64, 128):  # two global layers with different head sizes
        layer = KVCache()
        x = mx.random.normal((1, 2, 40, head_dim))
        layer.update_and_fetch(x, x + 1)
        layers.append(layer)
    cache = PromptCache(layers, list(range(40)))
    paged = encode_paged(cache, None, 32, BLOCK)
    assert paged.segments[0].metadata["stacked"] == "false"
    assert "layers.1.keys" in paged.segments[0].tensors
    tail, block_paths = write_paged(tmp_path, paged)
    decoded = decode_paged(load_into_mlx, tail, block_paths, False)
    for a, b in zip(cache.layers, decoded.layers, strict=True):
        assert mx.array_equal(a.keys[..., :40, :], b.keys).item()
        assert mx.array_equal(a.values[..., :40, :], b.values).item()


async def test_tails_and_blocks_that_do_not_fit_together_are_refused(gemma, tmp_path):
    cache = await history(gemma, 3 * BLOCK + 5)
    exact = await gemma.run(encode_paged, cache, None, 32, BLOCK)
    q8 = await gemma.run(encode_paged, cache, 8, 32, BLOCK)
    blocks = split_blocks(exact.segments[0], BLOCK)
    assert len(blocks) == 3
    with pytest.raises(CacheFormatError, match="kv_bits"):
        assemble_paged(
            exact.tail, [split_blocks(q8.segments[0], BLOCK)[0], *blocks[1:]], join=False
        )
    with pytest.raises(CacheFormatError, match="holds 53 positions, blocks and tail 37"):
        assemble_paged(exact.tail, blocks[:2], join=False)
    with pytest.raises(CacheFormatError, match="not a format-2/3 tail"):
        assemble_paged(blocks[0], blocks, join=False)
    assert assemble_paged(exact.tail, blocks, join=False) is None

    def refuse(files):
        raise CacheFormatError("refused by the check")

    tail, block_paths = write_paged(tmp_path, exact)
    with pytest.raises(CacheFormatError, match="refused by the check"):
        await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False, refuse)
    # A run past the end of its segment is refused before anything is joined.
    with pytest.raises(CacheFormatError, match="it holds 3"):
        await gemma.run(decode_paged, load_into_mlx, tail, [BlockRun(block_paths[0], 2, 2)], False)
    # A segment that is not whole blocks, or whose tensors disagree with its tokens.
    segment = exact.segments[0]
    with pytest.raises(CacheFormatError, match="not whole 20-token blocks"):
        split_blocks(segment, 20)
    with pytest.raises(CacheFormatError, match="block_tokens must be >= 1"):
        split_blocks(segment, 0)
    flat = dict(segment.tensors, tokens=segment.tensors["tokens"].reshape(3, BLOCK))
    with pytest.raises(CacheFormatError, match="not 1-D"):
        split_blocks(EncodedCache(flat, segment.metadata), BLOCK)
    broken = dict(segment.tensors, keys=segment.tensors["keys"][:, :, :-1])
    with pytest.raises(CacheFormatError, match="segment tensor 'keys' has shape"):
        split_blocks(EncodedCache(broken, segment.metadata), BLOCK)


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
@pytest.mark.parametrize("n", [10, 130])  # 10: the sliding windows still hold position 0
async def test_a_dequantized_layer_takes_its_first_tokens_exact_first_position(
    gemma, tmp_path, kv_bits, n
):
    """Read with ``first_positions`` (as a resume reads), a layer expanded from quantized
    words holds its first token's exact keys and values at position 0, where its words gave
    others (global layers; sliding ones until their window wraps); every other position, and
    every layer of an exact file, reads as without."""
    cache = await history(gemma, n)
    block = 2 * BLOCK if kv_bits == 4 else BLOCK
    paged = await gemma.run(encode_paged, cache, kv_bits, 32, block)
    tail, block_paths = write_paged(tmp_path, paged)
    plain = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False)
    exact = await gemma.run(
        decode_paged, load_into_mlx, tail, block_paths, False, None, None, gemma.first_positions
    )
    first = await gemma.run(
        lambda: [
            tuple(np.array(x.astype(mx.float32)) for x in pair)
            for pair in gemma.first_positions(cache.tokens[0])
        ]
    )
    held = await temporal_pairs(gemma, cache, cache)
    fixed = 0
    for layer, (words, got), want, (original, _) in zip(
        cache.layers, await temporal_pairs(gemma, plain, exact), first, held, strict=True
    ):
        holds_first = not isinstance(layer, RotatingKVCache) or n <= WINDOW
        for a, b, w, o in zip(words, got, want, original, strict=True):
            np.testing.assert_array_equal(a[..., 1:, :], b[..., 1:, :])
            if kv_bits is None or not holds_first:
                np.testing.assert_array_equal(a, b)
                continue
            np.testing.assert_array_equal(b[..., :1, :], w)
            np.testing.assert_allclose(o[..., :1, :], w, atol=1e-5)  # what the history held
            assert not np.array_equal(a[..., :1, :], w)
            fixed += 1
    if kv_bits is not None:
        holding = sum(not isinstance(x, RotatingKVCache) or n <= WINDOW for x in cache.layers)
        assert fixed == 2 * holding


@pytest.mark.parametrize("bits, group, block", [(8, 64, BLOCK), (4, 32, 2 * BLOCK)])
async def test_a_file_read_as_the_batch_holds_it_keeps_its_words_and_computes_nothing(
    gemma, tmp_path, bits, group, block
):
    """A q8 file into a q8 batch (its words packed as stored) and a q4 file into a q4 batch
    (its words kept; the batch reads the first position itself): given ``first_positions``,
    nothing is dequantized, so nothing asks for it, and the rows are those read without."""
    from agentkv.engine.batch.layout import KVLayout
    from agentkv.engine.batch.rows import is_packed

    cache = await history(gemma, 130)
    packing = (await gemma.run(KVLayout.of, gemma.model.model, bits, group)).packing
    paged = await gemma.run(encode_paged, cache, bits, group, block)
    tail, block_paths = write_paged(tmp_path, paged)
    asked = []

    def first_positions(token: int) -> list:
        asked.append(token)
        return gemma.first_positions(token)

    plain, got = [
        await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False, None, packing, f)
        for f in (None, first_positions)
    ]
    assert asked == [] and all(is_packed(x) for x in got.layers)
    for a, b in zip(plain.layers, got.layers, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert await gemma.run(lambda x=x, y=y: mx.array_equal(x, y).item())


async def test_a_first_position_that_cannot_be_had_leaves_the_words_and_is_logged(
    gemma, tmp_path, caplog
):
    """``first_positions`` failing (or having none: a token outside the vocabulary) costs the
    resume nothing but the exact first position: the cache reads as without, with a warning
    for the failure."""
    cache = await history(gemma, 40)
    paged = await gemma.run(encode_paged, cache, 8, 64, BLOCK)
    tail, block_paths = write_paged(tmp_path, paged)

    def failing(token: int) -> list:
        raise RuntimeError("out of memory")

    plain = await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False)
    with caplog.at_level(logging.WARNING, logger="agentkv.engine.kv.load"):
        got = [
            await gemma.run(decode_paged, load_into_mlx, tail, block_paths, False, None, None, f)
            for f in (failing, lambda token: None)
        ]
    assert [r.getMessage() for r in caplog.records] == [
        f"the first position of token {cache.tokens[0]} could not be computed: "
        "RuntimeError('out of memory')"
    ]
    for loaded in got:
        for (a, b), (c, d) in await temporal_pairs(gemma, plain, loaded):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, d)


# ---- recurrent state (a hybrid model's ArraysCache layers: engine/kv/state.py) --------------


@pytest.fixture(scope="module")
def hybrid():
    eng = asyncio.run(Engine.open("tiny:hybrid"))
    yield eng
    asyncio.run(eng.close())


def host(layer) -> list:
    """A layer's arrays as numpy (float32), or its keys and values up to its offset."""
    if is_state(layer):
        return [None if x is None else np.array(x.astype(mx.float32)) for x in layer.cache]
    n = layer.offset
    return [np.array(layer.keys[..., :n, :]), np.array(layer.values[..., :n, :])]


def same(a: PromptCache, b: PromptCache) -> bool:
    assert a.tokens == b.tokens
    for x, y in zip(a.layers, b.layers, strict=True):
        assert type(x) is type(y) or (is_state(x) and is_state(y))
        for p, q in zip(host(x), host(y), strict=True):
            assert (p is None and q is None) or np.array_equal(p, q)
    return True


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_a_state_layer_is_stored_in_its_own_precision(dtype):
    row = state_row([mx.random.normal((1, 3, 8)).astype(dtype), None, mx.ones((1, 2, 2))])
    tensors, layout = encode_state(row, 2, 7)
    assert layout["type"] == "ArraysCache" and layout["offset"] == 7
    assert layout["states"][1] is None and layout["states"][0][1] == [1, 3, 8]
    assert sorted(tensors) == ["layers.2.state.0", "layers.2.state.2"]
    stored = {n: np.array(x) for n, x in tensors.items()}  # bfloat16 as its uint16 bits
    back = decode_state(stored.__getitem__, 2, json.loads(json.dumps(layout)))
    assert back[0].dtype == dtype and back[1] is None
    assert mx.array_equal(back[0], row[0]).item() and mx.array_equal(back[2], row[2]).item()


def test_a_layer_with_no_state_is_not_stored():
    with pytest.raises(ValueError, match="holds no recurrent state"):
        encode_state(ArraysCache(2), 0, 5)


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
async def test_a_hybrid_cache_roundtrips_whole_with_its_state_exact(hybrid, kv_bits):
    original = await history(hybrid, 40)
    assert [is_state(x) for x in original.layers] == [True, True, True, False]
    encoded = await hybrid.run(encode_cache, original, kv_bits)
    for i in range(3):  # the state in the model's precision whatever kv_bits says
        assert encoded.tensors[f"layers.{i}.state.1"].dtype == np.float32
    decoded = await hybrid.run(decode_cache, encoded)
    states = [await hybrid.run(host, x) for x in decoded.layers[:3]]
    expected = [await hybrid.run(host, x) for x in original.layers[:3]]
    for got, want in zip(states, expected, strict=True):
        assert all(np.array_equal(p, q) for p, q in zip(got, want, strict=True))
    if kv_bits is None:
        assert await hybrid.run(same, original, decoded)
        assert await resume(hybrid, decoded) == await resume(hybrid, original)


@pytest.mark.parametrize("kv_bits", [None, 8])
async def test_a_hybrid_cache_roundtrips_paged_with_its_state_in_the_tail(
    hybrid, tmp_path, kv_bits
):
    original = await history(hybrid, 3 * BLOCK + 5)
    paged = await hybrid.run(encode_paged, original, kv_bits, 64, BLOCK)
    assert sorted(paged.segments) == [0]
    segment = paged.segments[0]
    assert not any(".state." in name for name in segment.tensors)  # blocks: KV only
    assert {f"layers.{i}.state.{e}" for i in range(3) for e in (0, 1)} <= set(paged.tail.tensors)
    tail, blocks = write_paged(tmp_path, paged)
    decoded = await hybrid.run(decode_paged, load_into_mlx, tail, blocks, False)
    if kv_bits is None:
        assert await hybrid.run(same, original, decoded)
        assert await resume(hybrid, decoded) == await resume(hybrid, original)
    else:
        got = await hybrid.run(lambda: [host(x) for x in decoded.layers[:3]])
        want = await hybrid.run(lambda: [host(x) for x in original.layers[:3]])
        for a, b in zip(got, want, strict=True):  # the state exact, the KV at 8 bits
            assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


def _changed(encoded: EncodedCache, layer: int, **fields) -> EncodedCache:
    layouts = json.loads(encoded.metadata["layers"])
    layouts[layer] |= fields
    return EncodedCache(encoded.tensors, encoded.metadata | {"layers": json.dumps(layouts)})


async def test_a_damaged_state_is_refused_with_what_is_wrong(hybrid):
    encoded = await hybrid.run(encode_cache, await history(hybrid, 20), None)
    dropped = dict(encoded.tensors)
    del dropped["layers.1.state.1"]
    cases = {
        "is missing": EncodedCache(dropped, encoded.metadata),
        "layers.0.state.0 is": EncodedCache(
            encoded.tensors | {"layers.0.state.0": encoded.tensors["layers.0.state.0"][:, :1]},
            encoded.metadata,
        ),
        "needs 'states'": _changed(encoded, 0, states=[]),
        "not \\[dtype, shape of one row\\]": _changed(encoded, 0, states=[["float32", [2, 3]]]),
        "has no max_size": _changed(encoded, 0, max_size=4),
        "unexpected tensors": EncodedCache(
            encoded.tensors | {"layers.0.state.9": np.zeros(1, np.float32)}, encoded.metadata
        ),
        "layer 2 holds 19 positions": _changed(encoded, 2, offset=19),
    }
    for match, damaged in cases.items():
        with pytest.raises(CacheFormatError, match=match):
            await hybrid.run(decode_cache, damaged)


async def test_a_state_of_another_shape_cannot_join_the_batch(hybrid):
    cache = await history(hybrid, 12)
    layers = list(cache.layers)
    layers[0] = state_row([mx.zeros((1, 3, 8)), mx.zeros((1, 2, 4, 4))])
    req = GenerationRequest([20, 21], max_tokens=2, cache=PromptCache(layers, cache.tokens))
    result = await hybrid.generate(req)
    assert result.finish_reason is FinishReason.ERROR
    assert isinstance(result.error, InvalidCacheError)
    assert "cache layer 0 holds recurrent state [(1, 3, 8), (1, 2, 4, 4)]" in str(result.error)
    assert (await hybrid.generate(GenerationRequest([20, 21], max_tokens=2))).token_ids


@pytest.mark.parametrize("spec", ["tiny:gemma3", "tiny:hybrid"])
@pytest.mark.parametrize("kv_bits", [None, 8])
async def test_a_tail_keeps_the_checkpoint_where_the_prompt_ended(tmp_path, spec, kv_bits):
    """A cache whose windows moved on past where its prompt ended keeps that checkpoint in its
    tail: read back, it is cut back there, and (exact files) resumes a rewritten reply as the
    prompt and the new text fed at once."""
    eng = await Engine.open(spec)
    try:
        asked = tokens(eng, 60)
        request = GenerationRequest(asked, max_tokens=40, ignore_eos=True, checkpoint_at=60)
        cache = (await eng.generate(request)).cache
        (point,) = cache.checkpoints
        assert point.prompt_end and point.num_tokens == 60 and cache.prefix(60) is None
        plain = await eng.run(encode_paged, cache, kv_bits, 32, BLOCK)
        assert "point" not in plain.tail.metadata
        assert not [n for n in plain.tail.tensors if n.startswith("point.")]
        paged = await eng.run(encode_paged, cache, kv_bits, 32, BLOCK, None, True)
        kept = json.loads(paged.tail.metadata["point"])
        assert kept["num_tokens"] == 60
        assert [x["index"] for x in kept["layers"]] == sorted(point.windows)
        tail, block_paths = write_paged(tmp_path, paged)
        got = await eng.run(decode_paged, load_into_mlx, tail, block_paths, False)
        assert got.tokens == cache.tokens
        (again,) = got.checkpoints
        assert (
            again.prompt_end
            and again.num_tokens == 60
            and sorted(again.windows) == sorted(point.windows)
        )
        if kv_bits is None:  # bit for bit the windows it kept
            for i, window in point.windows.items():
                want = await eng.run(lambda w=window: [np.array(x) for x in row_arrays(w)])
                have = await eng.run(
                    lambda w=again.windows[i]: [np.array(x) for x in row_arrays(w)]
                )
                assert len(want) == len(have)
                for a, b in zip(want, have, strict=True):
                    np.testing.assert_array_equal(a, b)
        cut = got.longest_prefix(70)
        assert cut is not None and cut.tokens == asked
        rewritten = tokens(eng, 12, salt=5)
        resumed = await eng.generate(GenerationRequest(rewritten, max_tokens=8, cache=cut))
        assert resumed.stats.cached_tokens == 60
        if kv_bits is None:
            whole = await eng.generate(GenerationRequest(asked + rewritten, max_tokens=8))
            assert resumed.token_ids == whole.token_ids
        # A point the tail's layers do not hold as windows is refused, not resumed wrongly.
        bad = json.loads(paged.tail.metadata["point"])
        bad["num_tokens"] = 200
        broken = EncodedCache(paged.tail.tensors, paged.tail.metadata | {"point": json.dumps(bad)})
        path = tmp_path / "bad"
        path.mkdir()
        bad_tail, _ = write_paged(path, PagedCache(paged.segments, broken, BLOCK))
        with pytest.raises(CacheFormatError, match="metadata 'point'"):
            await eng.run(decode_paged, load_into_mlx, bad_tail, block_paths, False)
    finally:
        await eng.close()
