"""The engine on real tiny models: batched equals solo, continuous admission, sampling,
stop strings, cancellation, overload, faults and shutdown."""

from __future__ import annotations

import asyncio
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from agentkv.engine.batch.layout import KVLayout
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.errors import EngineClosedError, EngineOverloadedError, InvalidCacheError
from agentkv.engine.request import FinishReason, GenerationRequest, PromptCache, TokenEvent
from agentkv.engine.sampling import SamplingParams
from tests.alike import assert_q8_alike, q8_alike

SPECS = ["tiny:gemma3", "tiny:llama"]
HEAD_DIM = 64  # tiny:llama's key and value heads


def open_engine(spec: str, **config) -> Engine:
    return asyncio.run(Engine.open(spec, EngineConfig(**config)))


@pytest.fixture(scope="module", params=SPECS)
def engine(request):
    eng = open_engine(request.param)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def gemma():
    eng = open_engine("tiny:gemma3")
    yield eng
    asyncio.run(eng.close())


def prompt(eng: Engine, n: int, salt: int = 0) -> list[int]:
    """n deterministic non-special token ids."""
    return [(7 * i + 11 * salt) % (eng.model.vocab_size - 16) + 16 for i in range(n)]


def solo_greedy(eng: Engine, tokens: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's single-sequence greedy tokens, stopping after an end-of-sequence token."""
    out = []
    for token, _ in generate_step(mx.array(tokens), eng.model.model, max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] in eng.model.eos_token_ids:
            break
    return out


async def test_batched_greedy_equals_single_sequence(engine):
    window = engine.model.sliding_window or 32
    lengths = [3, 17, window - 1, window, window + 9, 2 * window + 5]
    requests = [GenerationRequest(prompt(engine, n, salt=n), max_tokens=24) for n in lengths]
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    expected = await engine.run(
        lambda: [solo_greedy(engine, r.prompt_tokens, 24) for r in requests]
    )
    for req, res, exp in zip(requests, results, expected, strict=True):
        assert res.token_ids == exp
        assert res.cache.tokens == req.prompt_tokens + res.token_ids
        assert all(layer.offset == len(res.cache.tokens) for layer in res.cache.layers)


async def test_text_deltas_join_to_the_decoded_tokens(engine):
    handle = engine.submit(GenerationRequest(prompt(engine, 9), max_tokens=40))
    events = [e async for e in handle]
    result = await handle.result()
    assert [e.token_id for e in events] == result.token_ids
    assert "".join(e.text for e in events) == result.text
    body = [t for t in result.token_ids if t not in engine.model.eos_token_ids]
    assert result.text == engine.tokenizer.decode(body)


async def test_resuming_a_returned_cache_equals_prefilling_everything(gemma):
    first = await gemma.generate(GenerationRequest(prompt(gemma, 40), max_tokens=30))
    turn = prompt(gemma, 7, salt=3)
    resumed = await gemma.generate(GenerationRequest(turn, max_tokens=20, cache=first.cache))
    full = first.cache.tokens + turn
    assert resumed.stats.cached_tokens == len(first.cache.tokens)
    assert resumed.token_ids == await gemma.run(solo_greedy, gemma, full, 20)
    # The cache handed in is merged by copy: resuming it again gives the same tokens.
    again = await gemma.generate(GenerationRequest(turn, max_tokens=20, cache=first.cache))
    assert again.token_ids == resumed.token_ids


async def test_request_joins_while_others_decode(gemma):
    long_prompt, late_prompt = prompt(gemma, 5), prompt(gemma, 6, salt=1)
    long = gemma.submit(GenerationRequest(long_prompt, max_tokens=150, ignore_eos=True))
    first = await anext(long)
    assert isinstance(first, TokenEvent)
    late = await gemma.generate(GenerationRequest(late_prompt, max_tokens=5, ignore_eos=True))
    assert not long.done  # the late request finished while the long one was still decoding
    long_result = await long.result()
    assert late.stats.first_token_at < long_result.stats.finished_at
    # Joining mid-decode changed neither sequence's tokens.
    assert long_result.finish_reason is FinishReason.LENGTH
    assert long_result.token_ids == await gemma.run(solo_greedy_all, gemma, long_prompt, 150)
    assert late.token_ids == await gemma.run(solo_greedy_all, gemma, late_prompt, 5)


async def test_sampling_params_per_request_in_one_batch(gemma):
    p = prompt(gemma, 12)

    def req(**kw):
        return GenerationRequest(p, max_tokens=32, sampling=SamplingParams(**kw))

    greedy_a, greedy_b, seed1_a, seed1_b, seed2, top_k = await asyncio.gather(
        *(
            gemma.generate(r)
            for r in [
                req(),
                req(),
                req(temperature=1.0, seed=1),
                req(temperature=1.0, seed=1),
                req(temperature=1.0, seed=2),
                req(temperature=1.0, top_k=1, seed=5),
            ]
        )
    )
    assert greedy_a.token_ids == greedy_b.token_ids
    assert seed1_a.token_ids == seed1_b.token_ids
    assert seed1_a.token_ids != seed2.token_ids
    assert seed1_a.token_ids != greedy_a.token_ids
    assert top_k.token_ids == greedy_a.token_ids  # top_k=1 sampling is argmax


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("seed", -3)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


async def test_logit_bias_bans_and_forces_tokens_in_one_batch(gemma):
    p = prompt(gemma, 12, salt=7)
    free = await gemma.generate(GenerationRequest(p, max_tokens=12, ignore_eos=True))
    first = free.token_ids[0]
    banned, forced, plain = await asyncio.gather(
        *(
            gemma.generate(GenerationRequest(p, max_tokens=12, ignore_eos=True, sampling=s))
            for s in [
                SamplingParams(logit_bias={first: -100}),
                SamplingParams(logit_bias={42: 100}),
                SamplingParams(),
            ]
        )
    )
    assert plain.token_ids == free.token_ids  # batch-mates with a bias change nothing here
    assert banned.token_ids[0] != first
    assert first not in banned.token_ids
    assert forced.token_ids == [42] * 12


def test_logit_bias_is_checked():
    with pytest.raises(ValueError, match="logit_bias: token 5 has bias 101"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="logit_bias: token id -1 is negative"):
        SamplingParams(logit_bias={-1: 1})
    with pytest.raises(ValueError, match=r"token id 512 is not in the vocabulary \(ids 0..511\)"):
        SamplingParams(logit_bias={512: 1}).make_logits_processors(512)
    # A stored agent's sampling is JSON: its token ids come back as strings.
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}


async def test_stop_string_ends_generation_and_is_not_returned(gemma):
    p = prompt(gemma, 10, salt=4)
    free = await gemma.generate(GenerationRequest(p, max_tokens=60))
    text = free.text
    stop = next(text[i : i + 3] for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    cut = text.index(stop)
    stopped = await gemma.generate(GenerationRequest(p, max_tokens=60, stop=["zzzz-never", stop]))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.stop_sequence == stop
    assert free.stop_sequence is None
    assert stopped.text == text[:cut]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert stopped.cache.tokens == p + stopped.token_ids


async def test_cancel_frees_the_slot_for_a_queued_request():
    eng = await Engine.open(
        "tiny:gemma3", EngineConfig(completion_batch_size=1, prefill_batch_size=1)
    )
    try:
        p = prompt(eng, 8)
        running = eng.submit(GenerationRequest(p, max_tokens=10_000))
        await anext(running)
        queued = eng.submit(GenerationRequest(prompt(eng, 8, salt=2), max_tokens=4))
        await asyncio.sleep(0.05)
        assert eng.stats().queued == 1
        running.cancel(keep_cache=True)
        cancelled = await running.result()
        done = await queued.result()
        assert cancelled.finish_reason is FinishReason.CANCELLED
        assert cancelled.cache.tokens[: len(p)] == p
        assert (
            cancelled.cache.tokens[len(p) :]
            == cancelled.token_ids[: len(cancelled.cache.tokens) - len(p)]
        )
        assert done.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        stats = eng.stats()
        assert (stats.active, stats.queued, stats.cancelled) == (0, 0, 1)
    finally:
        await eng.close()


async def test_abandoned_stream_leaves_the_batch(gemma):
    before = gemma.stats().cancelled
    async with gemma.submit(GenerationRequest(prompt(gemma, 4), max_tokens=5000)) as handle:
        async for _ in handle:
            break  # leaving the handle unfinished cancels the request
    for _ in range(100):
        if gemma.stats().active == 0:
            break
        await asyncio.sleep(0.02)
    assert gemma.stats().active == 0
    assert gemma.stats().cancelled == before + 1


async def test_full_queue_is_refused_at_once():
    eng = await Engine.open(
        "tiny:gemma3", EngineConfig(completion_batch_size=1, prefill_batch_size=1, max_queue_size=1)
    )
    try:
        running = eng.submit(GenerationRequest(prompt(eng, 4), max_tokens=10_000))
        await anext(running)
        waiting = eng.submit(GenerationRequest(prompt(eng, 4), max_tokens=2))
        with pytest.raises(EngineOverloadedError, match="queue is full"):
            eng.submit(GenerationRequest(prompt(eng, 4), max_tokens=2))
        running.cancel()
        assert (await waiting.result()).finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    finally:
        await eng.close()


async def test_cache_from_another_model_fails_only_that_request(gemma):
    llama = await Engine.open("tiny:llama")
    try:
        foreign = (await llama.generate(GenerationRequest(prompt(llama, 5), max_tokens=3))).cache
    finally:
        await llama.close()
    bad, good = await asyncio.gather(
        gemma.generate(GenerationRequest(prompt(gemma, 3), max_tokens=3, cache=foreign)),
        gemma.generate(GenerationRequest(prompt(gemma, 3), max_tokens=3)),
    )
    assert bad.finish_reason is FinishReason.ERROR
    assert isinstance(bad.error, InvalidCacheError)
    assert good.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


@pytest.mark.parametrize(
    ("source", "target", "bits"),
    [
        ("tiny:gemma3", "tiny:llama", None),
        ("tiny:gemma3", "tiny:llama", 4),
        ("tiny:llama", "tiny:gemma3", 4),
        ("tiny:hybrid", "tiny:llama", None),  # recurrent state where the model holds KV
        ("tiny:llama", "tiny:hybrid", None),
        ("tiny:gemma3", "tiny:hybrid", 8),
    ],
)
async def test_a_cache_of_another_model_is_refused_as_invalid_at_any_precision(
    source, target, bits
):
    """Sizing a turn's reservation reads its cache's layers before joining checks them: a
    cache of another model (more or fewer layers, windows where the model has none) still
    fails as an InvalidCacheError, the batch held quantized or not."""
    other = await Engine.open(source)
    try:
        foreign = (await other.generate(GenerationRequest(prompt(other, 5), max_tokens=3))).cache
    finally:
        await other.close()
    eng = await Engine.open(target, EngineConfig(batch_kv_bits=bits))
    try:
        request = GenerationRequest(prompt(eng, 3), max_tokens=3, cache=foreign)
        assert eng.kv_bytes_needed(request) > 0
        result = await eng.generate(request)
    finally:
        await eng.close()
    assert result.finish_reason is FinishReason.ERROR
    assert isinstance(result.error, InvalidCacheError)


async def test_failed_step_fails_the_batch_and_engine_keeps_serving(gemma, monkeypatch):
    model_cls = type(gemma.model.model.layers[0])  # every forward pass runs it
    real_call = model_cls.__call__
    boom = RuntimeError("injected fault")

    def failing_call(self, *args, **kwargs):
        raise boom

    monkeypatch.setattr(model_cls, "__call__", failing_call)
    failed = await gemma.generate(GenerationRequest(prompt(gemma, 5), max_tokens=4))
    monkeypatch.setattr(model_cls, "__call__", real_call)
    assert failed.finish_reason is FinishReason.ERROR
    assert failed.error is boom
    ok = await gemma.generate(GenerationRequest(prompt(gemma, 5), max_tokens=4))
    assert ok.token_ids == await gemma.run(solo_greedy, gemma, prompt(gemma, 5), 4)


async def test_close_drains_or_cancels():
    eng = await Engine.open("tiny:gemma3")
    pending = eng.submit(GenerationRequest(prompt(eng, 5), max_tokens=20))
    await eng.close(drain=True)
    assert (await pending.result()).finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    with pytest.raises(EngineClosedError):
        eng.submit(GenerationRequest(prompt(eng, 5), max_tokens=2))

    eng = await Engine.open("tiny:gemma3")
    pending = eng.submit(GenerationRequest(prompt(eng, 5), max_tokens=100_000))
    await anext(pending)
    await eng.close(drain=False)
    assert (await pending.result()).finish_reason is FinishReason.CANCELLED
    # The generation thread is gone, its thread-local destructors (MLX's take the GIL) run:
    # a process that exits now does not abort.
    assert not os.path.exists(f"/proc/self/task/{eng._thread.native_id}")


async def test_request_and_aggregate_stats(gemma):
    before = gemma.stats()
    result = await gemma.generate(GenerationRequest(prompt(gemma, 20), max_tokens=12))
    s = result.stats
    assert (s.prompt_tokens, s.cached_tokens, s.decode_tokens) == (20, 0, len(result.token_ids))
    assert 0 <= s.queue_wait_s <= s.ttft_s
    assert s.prefill_s > 0 and s.decode_tps > 0
    after = gemma.stats()
    assert after.completed == before.completed + 1
    assert after.tokens_generated == before.tokens_generated + len(result.token_ids)
    assert after.peak_memory_bytes > 0


def test_bad_requests_are_rejected_with_clear_errors():
    with pytest.raises(ValueError, match="prompt_tokens is empty"):
        GenerationRequest([])
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationRequest([1], max_tokens=0)
    with pytest.raises(ValueError, match="prefill_batch_size"):
        EngineConfig(completion_batch_size=2, prefill_batch_size=4)


async def test_out_of_vocabulary_prompt_is_rejected(gemma):
    with pytest.raises(ValueError, match="vocabulary"):
        gemma.submit(GenerationRequest([gemma.model.vocab_size + 5], max_tokens=2))


async def test_a_decoding_sequence_is_joined_without_changing_its_tokens(gemma):
    a_prompt, b_prompt = prompt(gemma, 40), prompt(gemma, 9, salt=5)
    a = gemma.submit(GenerationRequest(a_prompt, max_tokens=60, ignore_eos=True))
    for _ in range(20):  # alone, past the 32-token window
        await anext(a)
    b = await gemma.generate(GenerationRequest(b_prompt, max_tokens=10, ignore_eos=True))
    a_result = await a.result()
    assert a_result.token_ids == await gemma.run(solo_greedy_all, gemma, a_prompt, 60)
    assert b.token_ids == await gemma.run(solo_greedy_all, gemma, b_prompt, 10)
    assert a_result.cache.tokens == a_prompt + a_result.token_ids
    assert all(layer.offset == len(a_result.cache.tokens) for layer in a_result.cache.layers)


async def test_a_returned_cache_resumes_beside_another_request(gemma):
    first = await gemma.generate(
        GenerationRequest(prompt(gemma, 40), max_tokens=30, ignore_eos=True)
    )
    turn = prompt(gemma, 5, salt=9)
    resumed, _ = await asyncio.gather(
        gemma.generate(GenerationRequest(turn, max_tokens=12, cache=first.cache, ignore_eos=True)),
        gemma.generate(GenerationRequest(prompt(gemma, 7, salt=2), max_tokens=12)),
    )
    full = first.cache.tokens + turn
    assert resumed.token_ids == await gemma.run(solo_greedy_all, gemma, full, 12)


async def test_seeded_sampling_does_not_depend_on_batch_mates(gemma):
    req = GenerationRequest(
        list(range(20, 50)), max_tokens=40, sampling=SamplingParams(temperature=0.8, seed=11)
    )
    alone = await gemma.generate(req)
    handle = gemma.submit(req)
    for _ in range(5):
        await anext(handle)
    joiners = await asyncio.gather(
        gemma.generate(GenerationRequest(list(range(30, 40)), max_tokens=5)),
        gemma.generate(GenerationRequest(prompt(gemma, 90, salt=3), max_tokens=9)),
    )
    beside = await handle.result()
    assert beside.token_ids == alone.token_ids
    assert all(j.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for j in joiners)


def solo_greedy_all(eng: Engine, tokens: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's single-sequence greedy tokens, not stopping at end-of-sequence tokens."""
    steps = generate_step(mx.array(tokens), eng.model.model, max_tokens=max_tokens)
    return [int(t) for t, _ in steps]


async def test_request_arriving_during_a_long_prefill_is_not_starved():
    eng = await Engine.open("tiny:gemma3", EngineConfig(prefill_step_size=16))
    try:
        long_prompt, short_prompt = prompt(eng, 400), prompt(eng, 6, salt=8)
        a = eng.submit(GenerationRequest(long_prompt, max_tokens=8, ignore_eos=True))
        while eng.stats().active == 0:  # wait until A prefills
            await asyncio.sleep(0.001)
        b = await eng.generate(GenerationRequest(short_prompt, max_tokens=4, ignore_eos=True))
        a_result = await a.result()
        assert b.stats.first_token_at < a_result.stats.first_token_at  # B did not wait for A
        assert a_result.token_ids == await eng.run(solo_greedy_all, eng, long_prompt, 8)
        assert b.token_ids == await eng.run(solo_greedy_all, eng, short_prompt, 4)
        assert a_result.cache.tokens == long_prompt + a_result.token_ids
    finally:
        await eng.close()


async def test_timings_charge_prefill_to_prefill(gemma):
    result = await gemma.generate(GenerationRequest(prompt(gemma, 300), max_tokens=2))
    assert result.stats.queue_wait_s < result.stats.prefill_s


async def test_a_bug_in_the_loop_fails_requests_instead_of_hanging(monkeypatch):
    from agentkv.engine.meter import Meter

    eng = await Engine.open("tiny:gemma3")
    boom = RuntimeError("bug in the loop")

    def broken(self, n):
        raise boom

    monkeypatch.setattr(Meter, "tokens", broken)  # outside the per-step error handling
    result = await asyncio.wait_for(
        eng.generate(GenerationRequest(prompt(eng, 5), max_tokens=4)), timeout=30
    )
    assert result.finish_reason is FinishReason.ERROR and result.error is boom
    await asyncio.wait_for(asyncio.to_thread(eng._thread.join), timeout=30)
    with pytest.raises(EngineClosedError):
        eng.submit(GenerationRequest(prompt(eng, 5), max_tokens=4))
    await asyncio.wait_for(eng.close(), timeout=30)


async def test_cancel_after_finish_is_a_no_op(gemma):
    before = gemma.stats()
    handle = gemma.submit(GenerationRequest(prompt(gemma, 5), max_tokens=3))
    result = await handle.result()
    # A cancel that lost the race: queued while the sequence was running, run after it ended.
    await gemma.run(gemma._thread._cancel, handle._seq, True)
    after = gemma.stats()
    assert (after.cancelled, after.completed) == (before.cancelled, before.completed + 1)
    assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


async def test_a_forced_token_is_generated_and_held_by_the_cache(engine):
    tokens = prompt(engine, 20, salt=3)
    natural = (await engine.generate(GenerationRequest(tokens, max_tokens=1))).token_ids[0]
    forced = (natural + 1) % engine.model.vocab_size
    # Alone and next to another request.
    other = asyncio.ensure_future(
        engine.generate(GenerationRequest(prompt(engine, 30, salt=4), max_tokens=8))
    )
    for _ in range(2):
        result = await engine.generate(
            GenerationRequest(tokens, max_tokens=1, forced_token=forced, ignore_eos=True)
        )
        assert result.token_ids == [forced]
        assert result.cache.tokens == [*tokens, forced]
    await other
    # Resuming from that cache equals prefilling prompt + the forced token.
    follow = prompt(engine, 5, salt=5)
    resumed = await engine.generate(GenerationRequest(follow, max_tokens=6, cache=result.cache))
    whole = await engine.generate(GenerationRequest([*tokens, forced, *follow], max_tokens=6))
    assert resumed.token_ids == whole.token_ids


async def test_a_forced_token_must_be_a_token_id(gemma):
    with pytest.raises(ValueError, match="forced_token must be a token id"):
        GenerationRequest([1, 2], forced_token=-1)
    with pytest.raises(ValueError, match="forced_token is outside the vocabulary"):
        gemma.submit(GenerationRequest([1, 2], forced_token=gemma.model.vocab_size))


def solo_logprobs(eng: Engine, tokens: list[int], max_tokens: int) -> list[tuple[int, list]]:
    """mlx-lm's single-sequence greedy tokens and the log-softmax vector of each step."""
    steps = generate_step(mx.array(tokens), eng.model.model, max_tokens=max_tokens)
    return [(int(t), lp.tolist()) for t, lp in steps]


async def test_logprobs_are_the_models_log_softmax_for_the_requests_that_ask(engine):
    asks = [None, 0, 5, 3]
    requests = [
        GenerationRequest(
            prompt(engine, 9 + 7 * i, salt=i), max_tokens=10, ignore_eos=True, logprobs=k
        )
        for i, k in enumerate(asks)
    ]
    streamed = engine.submit(requests[2])
    results = await asyncio.gather(*(engine.generate(r) for r in requests[:2] + requests[3:]))
    events = [e async for e in streamed if isinstance(e, TokenEvent)]
    results.insert(2, await streamed.result())
    expected = await engine.run(
        lambda: [solo_logprobs(engine, r.prompt_tokens, 10) for r in requests]
    )
    for k, result, steps in zip(asks, results, expected, strict=True):
        assert result.token_ids == [t for t, _ in steps]
        if k is None:
            assert result.logprobs is None
            continue
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
        for reported, (token, vector) in zip(result.logprobs, steps, strict=True):
            assert reported.logprob == pytest.approx(vector[token], abs=1e-4)
            assert len(reported.top) == k
            ranked = sorted(range(len(vector)), key=lambda t: -vector[t])[:k]
            assert [t for t, _ in reported.top] == ranked  # most likely first
            assert [v for _, v in reported.top] == pytest.approx(
                [vector[t] for t in ranked], abs=1e-4
            )
    assert [e.logprob for e in events] == results[2].logprobs  # streamed with each token


def test_logprobs_asks_for_at_most_20_alternatives():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs must be None or 0 to 20"):
            GenerationRequest([1, 2], logprobs=bad)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bits", [8, 4])
async def test_quantized_in_the_batch_each_sequence_decodes_as_it_does_alone(spec, bits):
    eng = await Engine.open(spec, EngineConfig(batch_kv_bits=bits, prefill_step_size=16))
    try:
        window = eng.model.sliding_window or 32
        lengths = [3, 17, window + 9, 2 * window + 5]
        requests = [
            GenerationRequest(prompt(eng, n, salt=n), max_tokens=12, ignore_eos=True)
            for n in lengths
        ]
        alone = [await eng.generate(r) for r in requests]
        together = await asyncio.gather(*(eng.generate(r) for r in requests))
        assert [r.token_ids for r in together] == [r.token_ids for r in alone]
        # A finished turn hands its cache back as the batch held it: packed, and says so.
        first = together[-1].cache
        assert first.packing == eng.packing and eng.packing.bits == bits
        assert all(layer.keys.dtype == mx.uint32 for layer in first.layers)
        assert first.num_tokens == lengths[-1] + 12
        expanded = await eng.expanded(first)
        assert expanded.packing is None and expanded.tokens == first.tokens
        assert [type(x) for x in expanded.layers] == [type(x) for x in first.layers]
        assert all(layer.keys.dtype == mx.float32 for layer in expanded.layers)
        stats = eng.stats()
        exact = sum(KVLayout.of(eng.model.model).token_bytes)
        assert stats.batch_kv_bits == bits and 0 < stats.kv_token_bytes < exact
    finally:
        await eng.close()


async def test_a_cache_packed_otherwise_than_the_batch_is_refused():
    q8 = await Engine.open("tiny:llama", EngineConfig(batch_kv_bits=8))
    try:
        packed = (await q8.generate(GenerationRequest(prompt(q8, 9), max_tokens=3))).cache
        floats = await q8.expanded(packed)
    finally:
        await q8.close()
    q4 = await Engine.open("tiny:llama", EngineConfig(batch_kv_bits=4))
    try:
        held = r"packed at 8 bits in groups of 64, keys rotated.*at 4 bits"
        with pytest.raises(InvalidCacheError, match=held):
            q4.submit(GenerationRequest([5], cache=packed))
        with pytest.raises(InvalidCacheError, match="no packing"):
            q4.submit(GenerationRequest([5], cache=PromptCache(packed.layers, packed.tokens)))
        # Expanded, it joins (quantized again at 4 bits).
        result = await q4.generate(GenerationRequest([5], max_tokens=3, cache=floats))
        assert result.error is None and result.cache.num_tokens == packed.num_tokens + 1 + 3
    finally:
        await q4.close()


def test_batch_kv_bits_takes_8_4_or_none():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="batch_kv_bits"):
        EngineConfig(batch_kv_bits=6)


async def test_a_model_that_cannot_attend_to_quantized_keys_keeps_its_precision(
    monkeypatch, caplog
):
    from agentkv.engine.attention import step

    quantized = step.quantized_attention

    def with_sinks(queries, held, scale, mask, sinks):  # as a model with attention sinks calls
        return quantized(queries, held, scale, mask, mx.zeros((queries.shape[1],)))

    monkeypatch.setattr(step, "quantized_attention", with_sinks)
    eng = await Engine.open("tiny:llama", EngineConfig(batch_kv_bits=8))
    try:
        assert eng.stats().batch_kv_bits == 0
        assert "cannot attend to quantized keys" in caplog.text and "sinks" in caplog.text
        result = await eng.generate(GenerationRequest(prompt(eng, 9), max_tokens=4))
        assert result.error is None and len(result.token_ids) == 4
    finally:
        await eng.close()


async def test_a_forced_token_is_held_at_q8_as_a_prompts_token():
    """A cache ending in a forced token (how a shared head is made) holds, at q8 in the batch,
    the bytes of the same tokens fed as a prompt: its decode step reads the positions before it
    as the prompt's chunk read them."""
    eng = await Engine.open("tiny:llama", EngineConfig(batch_kv_bits=8))
    try:
        tokens = [(7 * i) % 300 + 20 for i in range(40)]
        forced = await eng.generate(
            GenerationRequest(tokens[:-1], max_tokens=1, forced_token=tokens[-1])
        )
        prompted = await eng.generate(GenerationRequest(tokens, max_tokens=2))
        assert forced.cache.tokens == tokens == prompted.cache.tokens[: len(tokens)]

        def held(cache) -> list[np.ndarray]:
            n = len(tokens)
            return [np.array(x[..., :n, :]) for c in cache.layers for x in (c.keys, c.values)]

        assert forced.cache.layers[0].keys.dtype == mx.uint32  # packed: q8 words
        # The forced token is a decode row, the prompt's last a chunk's: alike up to rounding.
        ours, theirs = await eng.run(lambda: (held(forced.cache), held(prompted.cache)))
        for x, y in zip(ours, theirs, strict=True):
            assert_q8_alike(x, y, HEAD_DIM)
    finally:
        await eng.close()


async def test_q8_positions_past_a_cache_point_compute_as_resumed_from_there():
    """A q8 batch reads each position's newest predecessors in float, but none across a point
    a cache may start from (a stored block's boundary, a request's cache point): one request
    over 40 tokens holds the bytes, and decodes the tokens, of the same tokens resumed from a
    cache ending at its cache point or at a block boundary. Without the fences
    the positions after the point read their predecessors otherwise (the bytes differ)."""
    tokens = [(7 * i) % 300 + 20 for i in range(40)]
    fenced = await Engine.open("tiny:llama", EngineConfig(batch_kv_bits=8, cache_block_tokens=16))
    plain = await Engine.open("tiny:llama", EngineConfig(batch_kv_bits=8))

    async def run(eng: Engine, at: int | None, points: tuple[int, ...] = ()):
        cache = None
        if at is not None:
            head = await eng.generate(
                GenerationRequest(
                    tokens[: at - 1], max_tokens=1, forced_token=tokens[at - 1], cache_points=points
                )
            )
            cache = head.cache
        rest = tokens[at or 0 :]
        result = await eng.generate(
            GenerationRequest(rest, max_tokens=4, cache=cache, logprobs=0, cache_points=points)
        )
        return result

    def held(result) -> list[np.ndarray]:
        n = len(tokens)
        layers = result.cache.layers
        return [np.array(x[..., :n, :]) for layer in layers for x in (layer.keys, layer.values)]

    def alike(a, b) -> bool:
        pairs = zip(held(a), held(b), strict=True)
        return all(q8_alike(x, y, HEAD_DIM) for x, y in pairs)

    try:
        whole = await run(fenced, None, (23,))
        for at in (23, 32):  # the cache point; a block boundary
            resumed = await run(fenced, at, (23,))
            # Chunks of other sizes: matmuls of other shapes, whose floats may round apart
            # by an ulp, and so the q8 codes by a step where a value sits on a boundary.
            got, want = ([t.logprob for t in r.logprobs] for r in (resumed, whole))
            assert got == pytest.approx(want, abs=1e-3)
            assert resumed.token_ids == whole.token_ids
            assert await fenced.run(alike, whole, resumed), at
        # Unfenced, the positions after the point read their predecessors in float on one
        # path and quantized on the other: far more than rounding apart.
        assert not await plain.run(alike, await run(plain, None), await run(plain, 23))
    finally:
        await fenced.close()
        await plain.close()


@pytest.mark.parametrize("spec", ["tiny:gemma3", "tiny:hybrid"])
async def test_a_checkpoint_where_the_history_ends_resumes_a_rewritten_or_dropped_reply(spec):
    """A sliding window (32 positions) that moved on during the reply, or a recurrent state,
    cannot be cut back into the prompt; with ``checkpoint_at`` the cache keeps that point (the
    prompt's chunks end there), and a turn resumed from it equals the history and the new text
    fed at once: a reply rewritten (the prompt's last 3 tokens, its generation prompt, and
    other text) or dropped (other text at once)."""
    eng = await Engine.open(spec)
    try:
        asked = prompt(eng, 60)
        kept = GenerationRequest(asked, max_tokens=40, ignore_eos=True, checkpoint_at=57)
        first = await eng.generate(kept)
        plain = await eng.generate(GenerationRequest(asked, max_tokens=40, ignore_eos=True))
        assert plain.cache.longest_prefix(60) is None  # nothing to cut back to
        assert first.token_ids == plain.token_ids  # keeping it changes nothing generated
        assert [c.num_tokens for c in first.cache.checkpoints] == [57]
        cut = first.cache.longest_prefix(70)
        assert cut is not None and cut.tokens == asked[:57]
        for after in (asked[57:] + prompt(eng, 12, salt=5), prompt(eng, 12, salt=6)):
            resumed = await eng.generate(GenerationRequest(after, max_tokens=8, cache=cut))
            whole = await eng.generate(GenerationRequest(asked[:57] + after, max_tokens=8))
            assert resumed.token_ids == whole.token_ids
            assert resumed.stats.cached_tokens == 57
    finally:
        await eng.close()
