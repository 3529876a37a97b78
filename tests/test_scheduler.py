"""The admission queue, and the scheduler through a real engine: the KV budget, preemption,
policies and prefill beside decoding."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from pydantic import ValidationError

from agentkv.engine.admission import AdmissionQueue
from agentkv.engine.batch.groups import KVGroup
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.errors import EngineOverloadedError, KVBudgetError
from agentkv.engine.meter import StepRecord
from agentkv.engine.pacing import MIN_CHUNK, MIN_PREFILL_ONLY, PACER_REFRESH_STEPS, PrefillPacer
from agentkv.engine.request import FinishReason, GenerationRequest
from agentkv.engine.sampling import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_higher_priority_first_then_arrival_order():
    q = AdmissionQueue(10, aging_per_s=0.1, clock=Clock())
    for name, prio in [("a", 0), ("b", 5), ("c", 0), ("d", 5)]:
        q.push(name, prio)
    assert q.drain() == ["b", "d", "a", "c"]


def test_aging_lets_a_long_waiter_overtake():
    clock = Clock()
    q = AdmissionQueue(10, aging_per_s=0.1, clock=clock)
    q.push("old-low", 0)
    clock.now = 20.0  # waited 20 s: effective priority 2.0
    q.push("new-mid", 1.5)
    q.push("new-high", 2.5)
    assert q.drain() == ["new-high", "old-low", "new-mid"]


def test_no_aging_never_overtakes():
    clock = Clock()
    q = AdmissionQueue(10, aging_per_s=0.0, clock=clock)
    q.push("old-low", 0)
    clock.now = 1e6
    q.push("new", 0.001)
    assert q.drain() == ["new", "old-low"]


def test_full_queue_refuses_and_removal_frees_room():
    q = AdmissionQueue(2, aging_per_s=0.1, clock=Clock())
    first = q.push("a", 0)
    q.push("b", 0)
    with pytest.raises(EngineOverloadedError, match="full"):
        q.push("c", 0)
    assert q.remove(first)
    assert not q.remove(first)
    q.push("c", 0)
    assert len(q) == 2
    assert q.drain() == ["b", "c"]


def test_invalid_size():
    with pytest.raises(ValueError, match="max_size"):
        AdmissionQueue(0, aging_per_s=0.1)


def test_peek_leaves_the_head_and_a_forced_push_ignores_the_limit():
    q = AdmissionQueue(1, aging_per_s=0.0, clock=Clock())
    q.push("a", 0)
    assert q.peek() == "a" and len(q) == 1
    q.push("paused", 5, force=True)  # a preempted turn always gets its place back
    assert q.drain() == ["paused", "a"]


# ---- the scheduler through a real engine --------------------------------------------------


def prompt(eng: Engine, n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 * salt) % (eng.model.vocab_size - 16) + 16 for i in range(n)]


def greedy(eng: Engine, tokens: list[int], max_tokens: int) -> list[int]:
    steps = generate_step(mx.array(tokens), eng.model.model, max_tokens=max_tokens)
    return [int(t) for t, _ in steps]


async def budget_for(
    spec: str, requests: list[GenerationRequest], config: EngineConfig | None = None
) -> int:
    """The KV bytes these requests set aside, together."""
    eng = await Engine.open(spec, config or EngineConfig())
    try:
        return sum(eng.kv_bytes_needed(r) for r in requests)
    finally:
        await eng.close()


async def test_a_turn_runs_as_far_as_the_budget_holds_it_and_one_that_never_fits_is_refused():
    """max_tokens past what the budget holds for a turn alone is held to it (the reply ends
    with ``length`` there, as at the end of the context); a prompt the budget cannot hold with
    one generated token is refused with the numbers."""
    small = GenerationRequest(list(range(20, 40)), max_tokens=8)
    budget = await budget_for("tiny:gemma3", [small, small])
    eng = await Engine.open("tiny:gemma3", EngineConfig(kv_budget_bytes=budget))
    try:
        huge = GenerationRequest(list(range(20, 40)), max_tokens=5000, ignore_eos=True)
        room = eng.max_tokens(huge)
        assert 8 < room < 5000
        assert eng.kv_bytes_needed(huge) <= budget
        assert eng._thread.scheduler.need_for(20 + room + 1, None, 20) > budget  # the most
        result = await eng.generate(huge)
        assert (result.finish_reason, len(result.token_ids)) == ("length", room)
        assert result.token_ids == greedy(eng, huge.prompt_tokens, room)
        unbounded = await eng.generate(GenerationRequest(huge.prompt_tokens, None, ignore_eos=True))
        assert unbounded.token_ids == result.token_ids
        long = GenerationRequest(prompt_of(1000), max_tokens=1)
        with pytest.raises(KVBudgetError, match=r"1000 new \+ 1 generated = 1001 tokens") as e:
            eng.submit(long)
        assert "kv_budget_bytes" in str(e.value)
        assert e.value.needed_bytes > e.value.budget_bytes == budget
        ok = await eng.generate(small)  # the engine serves on
        assert ok.token_ids == greedy(eng, small.prompt_tokens, len(ok.token_ids))
    finally:
        await eng.close()


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_the_budget_admits_only_what_fits_and_every_turn_completes(model):
    requests = [
        GenerationRequest(list(range(20 + i, 60 + i)), max_tokens=24, ignore_eos=True)
        for i in range(8)
    ]
    budget = await budget_for(model, requests[:2])  # room for two at a time
    eng = await Engine.open(model, EngineConfig(kv_budget_bytes=budget))
    steps: list[StepRecord] = []
    eng.add_step_listener(steps.append)
    try:
        waiting = []
        results = [asyncio.ensure_future(eng.generate(r)) for r in requests]
        while not all(r.done() for r in results):
            waiting.append(eng.stats().waiting_for_memory)
            await asyncio.sleep(0.005)
        results = [r.result() for r in results]
    finally:
        await eng.close()
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == greedy(eng, request.prompt_tokens, 24)
    assert max(s.decode_rows + s.prefilling for s in steps) == 2
    assert all(s.kv_held_bytes <= s.kv_reserved_bytes <= budget for s in steps)
    assert max(waiting) > 0  # turns waited for memory, not for a slot


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_reservations_grow_as_turns_decode_and_the_last_in_line_wait_for_room(model):
    """Four turns of 120 tokens in a budget that holds two of them whole: more than two start
    (each reserves its prompt and a buffer growth), their reservations grow as they decode, the
    latest arrivals are paused when the budget is full and rejoin where they were; each gives
    the tokens it gives alone and the budget is never exceeded."""
    requests = [
        GenerationRequest(prompt_of(40, salt=i), max_tokens=120, ignore_eos=True) for i in range(4)
    ]
    budget = await budget_for(model, requests[:2])
    eng = await Engine.open(model, EngineConfig(kv_budget_bytes=budget))
    steps: list[StepRecord] = []
    eng.add_step_listener(steps.append)
    try:
        results = await asyncio.gather(*(eng.generate(r) for r in requests))
        stats = eng.stats()
    finally:
        await eng.close()
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == greedy(eng, request.prompt_tokens, 120)
    assert max(s.decode_rows + s.prefilling for s in steps) > 2
    assert stats.preemptions > 0 and stats.paused == 0
    assert all(s.kv_held_bytes <= s.kv_reserved_bytes <= budget for s in steps)


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_a_higher_priority_turn_preempts_and_the_paused_turn_resumes_exactly(model):
    low = GenerationRequest(prompt_of(60), max_tokens=80, ignore_eos=True)
    high = GenerationRequest(prompt_of(30, salt=4), max_tokens=10, ignore_eos=True, priority=10)
    budget = await budget_for(model, [low])  # only one of them fits
    eng = await Engine.open(model, EngineConfig(kv_budget_bytes=budget))
    try:
        low_handle = eng.submit(low)
        for _ in range(20):  # well past the minimum run before it can be preempted
            await anext(low_handle)
        high_result = await eng.generate(high)
        stats = eng.stats()
        low_result = await low_handle.result()
    finally:
        await eng.close()
    assert stats.preemptions == 1
    assert high_result.stats.finished_at < low_result.stats.finished_at
    assert low_result.token_ids == greedy(eng, low.prompt_tokens, 80)
    assert high_result.token_ids == greedy(eng, high.prompt_tokens, 10)
    assert low_result.cache.tokens == low.prompt_tokens + low_result.token_ids


async def test_a_paused_q4_turn_counts_its_float_positions_in_the_paused_bytes():
    """A q4 row keeps float copies of its newest positions (and a global layer its first
    position) beside its words; while it is paused its bytes count them all, and nothing
    once it has resumed."""
    config = EngineConfig(batch_kv_bits=4)
    low = GenerationRequest(prompt_of(60), max_tokens=200, ignore_eos=True)
    high = GenerationRequest(prompt_of(30, salt=4), max_tokens=150, ignore_eos=True, priority=10)
    budget = await budget_for("tiny:gemma3", [low], config)  # only one of them fits
    eng = await Engine.open("tiny:gemma3", config.model_copy(update={"kv_budget_bytes": budget}))

    def paused_now() -> tuple[int, int, int, int]:  # on the generation thread, between steps
        scheduler = eng._thread.scheduler
        cache = scheduler.queue.peek().cache
        words = sum(layer.nbytes for layer in cache)
        floats = sum(sum(x.nbytes for x in layer.recent) for layer in cache)
        firsts = [layer.first_kv for layer in cache if layer.first_kv is not None]
        assert len(firsts) == scheduler.layout.windows.count(None)  # the global layers'
        floats += sum(x.nbytes for pair in firsts for x in pair)
        return scheduler.paused, scheduler.paused_bytes, words, floats

    try:
        low_handle = eng.submit(low)
        for _ in range(20):
            await anext(low_handle)
        high_handle = eng.submit(high)
        await anext(high_handle)  # high decodes (for 150 tokens): low is paused
        paused, paused_bytes, words, floats = await eng.run(paused_now)
        during = eng.stats()
        await high_handle.result()
        low_result = await low_handle.result()
        after = eng.stats()
    finally:
        await eng.close()
    assert paused == during.paused == 1 and floats > 0
    assert paused_bytes == during.kv_paused_bytes == words + floats
    assert after.paused == 0 and after.kv_paused_bytes == 0
    assert len(low_result.token_ids) == 200


async def histories_and_turns(eng: Engine, n: int) -> list[GenerationRequest]:
    """``n`` 4-token turns, each on a 200-token history of its own."""
    turns = []
    for i in range(n):
        history = GenerationRequest(prompt_of(200, salt=i), max_tokens=1, ignore_eos=True)
        cache = (await eng.generate(history)).cache
        turns.append(GenerationRequest([40 + i, 41, 42, 43], 12, ignore_eos=True, cache=cache))
    return turns


async def test_short_turns_on_long_histories_reserve_their_own_chunk_in_sliding_windows():
    """tiny:gemma3's sliding layers hold 32 positions. A 4-token turn on a 200-token history
    reserves 4 positions beyond them, not a whole ``prefill_step_size`` chunk: three such turns
    decode together in a budget that holds one of them reserving whole chunks, each as it
    decodes alone."""
    eng = await Engine.open("tiny:gemma3")
    try:
        turns = await histories_and_turns(eng, 3)
        layout = eng._thread.scheduler.layout
        windows = [w for w in layout.windows if w is not None]
        rings = [c.keys.shape[2] for c in turns[0].cache.layers if hasattr(c, "max_size")]
        final = turns[0].cache.num_tokens + 4 + 12
        whole_chunks = layout.reservation(final, overhang=512)
        budget = sum(eng.kv_bytes_needed(t) for t in turns)
        alone = [(await eng.generate(t)).token_ids for t in turns]
    finally:
        await eng.close()
    assert rings == [32] * len(rings) and windows == [32] * len(windows)
    assert budget < 2 * whole_chunks
    eng = await Engine.open("tiny:gemma3", EngineConfig(kv_budget_bytes=budget))
    steps: list[StepRecord] = []
    eng.add_step_listener(steps.append)
    try:
        results = await asyncio.gather(*(eng.generate(t) for t in turns))
    finally:
        await eng.close()
    assert [r.token_ids for r in results] == alone
    assert max(s.decode_rows for s in steps) == 3
    assert all(s.kv_held_bytes <= s.kv_reserved_bytes <= budget for s in steps)


async def test_a_group_merges_only_once_its_rings_are_back_within_their_windows(monkeypatch):
    """A prompt's last chunk leaves a row's sliding rings over their windows until its first
    decode step; a merge then would pad the other group's rows to that overhang, past what
    they reserved. Two short turns and a 200-token prompt prefilled in one chunk: every
    merge leaves the rings within their windows and the group within its rows' reservations,
    and each turn gives its tokens alone."""
    merges: list[tuple[bool, int, int]] = []
    absorb = KVGroup.absorb

    def recorded(self: KVGroup, other: KVGroup) -> None:
        absorb(self, other)
        merges.append((self.settled, self.held_bytes, sum(s.reserved for s in self.seqs)))

    monkeypatch.setattr(KVGroup, "absorb", recorded)
    # Each prompt in one chunk; no drafts (a drafting row keeps a group of its own).
    config = EngineConfig(policy="throughput_first", speculative="off")
    eng = await Engine.open("tiny:gemma3", config)
    try:
        turns = await histories_and_turns(eng, 2)
        turns.append(GenerationRequest(prompt_of(200, salt=5), 12, ignore_eos=True))
        alone = [(await eng.generate(t)).token_ids for t in turns]
        merges.clear()
        results = await asyncio.gather(*(eng.generate(t) for t in turns))
    finally:
        await eng.close()
    assert [r.token_ids for r in results] == alone
    assert merges and all(settled and held <= reserved for settled, held, reserved in merges)


async def test_a_preempted_sampled_turn_continues_its_own_random_stream():
    sampling = SamplingParams(temperature=0.9, seed=7)
    low = GenerationRequest(prompt_of(40), max_tokens=60, ignore_eos=True, sampling=sampling)
    high = GenerationRequest(prompt_of(30, salt=4), max_tokens=6, ignore_eos=True, priority=10)
    budget = await budget_for("tiny:gemma3", [low])
    eng = await Engine.open("tiny:gemma3", EngineConfig(kv_budget_bytes=budget))
    try:
        uninterrupted = await eng.generate(low)
        handle = eng.submit(low)
        for _ in range(15):
            await anext(handle)
        await eng.generate(high)
        interrupted = await handle.result()
        assert eng.stats().preemptions == 1
    finally:
        await eng.close()
    assert interrupted.token_ids == uninterrupted.token_ids


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 * salt) % 496 + 16 for i in range(n)]


@pytest.mark.parametrize(
    ("policy", "makes_room"),
    [("fair", True), ("latency_first", True), ("throughput_first", False)],
)
async def test_a_full_batch_makes_room_for_a_new_turn_unless_throughput_first(policy, makes_room):
    """fair pauses the long turn after its time slice, latency_first as soon as it may (the
    short turn's work is smaller); throughput_first lets it run to the end."""
    config = EngineConfig(completion_batch_size=1, prefill_batch_size=1, policy=policy)
    eng = await Engine.open("tiny:gemma3", config)
    try:
        long = eng.submit(GenerationRequest(prompt_of(20), max_tokens=200, ignore_eos=True))
        await anext(long)
        short = await eng.generate(
            GenerationRequest(prompt_of(12, salt=3), max_tokens=5, ignore_eos=True)
        )
        long_result = await long.result()
    finally:
        await eng.close()
    assert (short.stats.finished_at < long_result.stats.finished_at) is makes_room
    assert long_result.token_ids == greedy(eng, prompt_of(20), 200)
    assert short.token_ids == greedy(eng, prompt_of(12, salt=3), 5)


@pytest.mark.parametrize(("policy", "short_first"), [("latency_first", True), ("fair", False)])
async def test_latency_first_prefills_a_short_prompt_before_a_long_one(policy, short_first):
    config = EngineConfig(prefill_batch_size=1, prefill_step_size=16, policy=policy)
    eng = await Engine.open("tiny:gemma3", config)
    try:
        await eng.generate(GenerationRequest(prompt_of(5), max_tokens=2))  # warm up
        long_request = GenerationRequest(prompt_of(600), max_tokens=2, ignore_eos=True)
        short_request = GenerationRequest(prompt_of(10, salt=2), max_tokens=2, ignore_eos=True)
        blocker = eng.submit(GenerationRequest(prompt_of(8, salt=5), max_tokens=1))
        long, short = eng.submit(long_request), eng.submit(short_request)  # both wait for it
        await blocker.result()
        long_result, short_result = await long.result(), await short.result()
    finally:
        await eng.close()
    ttft_order = short_result.stats.first_token_at < long_result.stats.first_token_at
    assert ttft_order is short_first
    assert long_result.token_ids == greedy(eng, long_request.prompt_tokens, 2)


async def test_a_prompt_joining_decoding_turns_shares_their_steps():
    eng = await Engine.open("tiny:gemma3", EngineConfig(prefill_step_size=256))
    steps: list[StepRecord] = []
    try:
        alone = GenerationRequest(prompt_of(600, salt=1), max_tokens=2, ignore_eos=True)
        remove = eng.add_step_listener(steps.append)
        await eng.generate(alone)
        remove()
        assert [s.prefill_tokens for s in steps if s.prefill_tokens] == [256, 256, 88]
        steps.clear()
        eng.add_step_listener(steps.append)
        decoding = [
            eng.submit(GenerationRequest(prompt_of(8, salt=i), max_tokens=400, ignore_eos=True))
            for i in range(4)
        ]
        for handle in decoding:
            await anext(handle)
        steps.clear()  # all four are decoding now
        joined = await eng.generate(alone)
        for handle in decoding:
            handle.cancel()
    finally:
        await eng.close()
    assert joined.token_ids == greedy(eng, alone.prompt_tokens, 2)
    beside = [s for s in steps if s.prefill_tokens]
    assert all(s.decode_rows == 4 for s in beside)  # the prompt went in beside them, fused
    assert sum(s.prefill_tokens for s in beside) == 600


async def test_a_prompt_alone_prefills_in_steps_of_max_prefill_step_s():
    """Where a whole chunk takes longer than ``max_prefill_step_s`` (here a bound no step
    meets), a prompt alone prefills in the smallest steps, and a short turn that arrives
    meanwhile starts long before the prompt is done; the prompt's tokens are unchanged."""
    config = EngineConfig(prefill_step_size=256, max_prefill_step_s=1e-6)
    eng = await Engine.open("tiny:gemma3", config)
    steps: list[StepRecord] = []
    eng.add_step_listener(steps.append)
    try:
        long_request = GenerationRequest(prompt_of(2000, salt=1), max_tokens=2, ignore_eos=True)
        long = eng.submit(long_request)
        while not steps:
            await asyncio.sleep(0.001)
        short = eng.submit(GenerationRequest(prompt_of(10, salt=2), max_tokens=2, ignore_eos=True))
        long_result, short_result = await long.result(), await short.result()
    finally:
        await eng.close()
    alone = [s.prefill_tokens for s in steps if s.prefill_tokens and not s.decode_rows]
    assert max(alone) == MIN_PREFILL_ONLY and len(alone) > 10  # not prefill_step_size (256)
    assert short_result.stats.first_token_at < long_result.stats.first_token_at
    assert long_result.token_ids == greedy(eng, long_request.prompt_tokens, 2)


def pacer(**config) -> PrefillPacer:
    return PrefillPacer(EngineConfig(**config))


def test_the_pacer_sizes_chunks_to_the_stall_bound():
    paced = pacer(prefill_step_size=512, max_decode_stall=2.0)
    assert paced.budget(decoding=True) == 0  # decode time unknown: a decode-only step measures it
    paced.observe(decode_rows=8, prefill_tokens=0, seconds=0.100)
    assert paced.budget(True) == MIN_CHUNK  # cost of a prefill token unknown: start small
    paced.observe(decode_rows=8, prefill_tokens=16, seconds=0.132)  # 2 ms a token
    assert paced.budget(True) == 50  # (2 - 1) x 100 ms / 2 ms
    for _ in range(PACER_REFRESH_STEPS):
        paced.observe(decode_rows=8, prefill_tokens=50, seconds=0.200)
    assert paced.budget(True) == 0  # a decode-only step now and then keeps the decode time fresh
    paced.observe(decode_rows=8, prefill_tokens=0, seconds=0.100)
    assert paced.budget(True) == 50
    fast = pacer(prefill_step_size=512, max_decode_stall=2.0)
    fast.observe(decode_rows=8, prefill_tokens=0, seconds=0.100)
    fast.observe(decode_rows=8, prefill_tokens=100, seconds=0.101)
    assert fast.budget(True) == 512  # prefill that costs nothing beside decoding goes in whole


def test_a_step_that_only_prefills_lasts_about_max_prefill_step_s():
    paced = pacer(prefill_step_size=512, max_prefill_step_s=0.5)
    assert paced.budget(decoding=False) == 512  # the cost of a token unknown: a whole chunk
    paced.observe(decode_rows=8, prefill_tokens=100, seconds=1.0)  # 10 ms a token, with decode
    assert paced.budget(False) == 149  # till one is measured alone: 0.5 s / 3.35 ms (an EMA)
    paced.observe(decode_rows=0, prefill_tokens=512, seconds=1.792)  # 3.5 ms a token
    assert paced.budget(False) == 142  # 0.5 s / 3.5 ms
    paced.observe(decode_rows=8, prefill_tokens=16, seconds=1.0)  # beside decoders: not counted
    assert paced.budget(False) == 142
    for _ in range(20):  # a long prompt's late chunks cost more a token (more keys)
        paced.observe(decode_rows=0, prefill_tokens=64, seconds=1.0)
    assert paced.budget(False) == MIN_PREFILL_ONLY  # the floor: a step's fixed cost stays small
    fast = pacer(prefill_step_size=512, max_prefill_step_s=0.5)
    fast.observe(decode_rows=0, prefill_tokens=512, seconds=0.05)  # a GPU: the whole chunk
    assert fast.budget(False) == 512


def test_engine_config_names_the_bad_field():
    with pytest.raises(ValidationError, match="policy"):
        EngineConfig(policy="shortest_job")
    with pytest.raises(ValidationError, match="kv_budget_bytes"):
        EngineConfig(kv_budget_bytes=-1)
    with pytest.raises(ValidationError, match="kv_budget_bytes"):
        EngineConfig(kv_budget_bytes="lots")
    with pytest.raises(ValidationError, match="max_decode_stall"):
        EngineConfig(max_decode_stall=0.5)


async def test_a_budget_below_the_smallest_turn_is_refused_at_open():
    with pytest.raises(KVBudgetError, match="kv_budget_bytes=1000 is smaller than the smallest"):
        await Engine.open("tiny:gemma3", EngineConfig(kv_budget_bytes=1000))


def test_a_string_batch_size_is_read_as_the_number_it_names():
    config = EngineConfig(completion_batch_size="4")
    assert config.completion_batch_size == config.prefill_batch_size == 4
    with pytest.raises(ValidationError, match="completion_batch_size"):
        EngineConfig(completion_batch_size="many")


async def test_fair_rotates_one_turn_per_time_slice():
    """Three long turns, two slots: each slice one turn yields to the one waiting, and a turn
    that just yielded waits a whole slice before it takes anyone's place (no cascade)."""
    config = EngineConfig(completion_batch_size=2, prefill_batch_size=2, policy="fair")
    requests = [
        GenerationRequest(prompt_of(10, salt=i), max_tokens=160, ignore_eos=True) for i in range(3)
    ]
    eng = await Engine.open("tiny:gemma3", config)
    steps: list[StepRecord] = []
    eng.add_step_listener(steps.append)
    try:
        results = await asyncio.gather(*(eng.generate(r) for r in requests))
        preemptions = eng.stats().preemptions
    finally:
        await eng.close()
    # ~245 steps of two rows: a rotation at steps 64, 128, 192 (and perhaps 256).
    assert 3 <= preemptions <= 4, preemptions
    assert len(steps) < 260
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == greedy(eng, request.prompt_tokens, 160)


@pytest.mark.parametrize("where", ["agentkv.engine.scheduler.Scheduler._merge_groups", "leave"])
async def test_a_failure_while_scheduling_fails_the_batch_and_the_engine_serves_on(
    where, monkeypatch
):
    from agentkv.engine.scheduler import Scheduler

    eng = await Engine.open("tiny:gemma3")
    try:
        original = Scheduler.leave if where == "leave" else Scheduler._merge_groups
        calls = {"n": 0}

        def broken(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise MemoryError("[metal::malloc] out of memory")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Scheduler, "leave" if where == "leave" else "_merge_groups", broken)
        failed = await eng.generate(GenerationRequest(prompt_of(9), max_tokens=3))
        monkeypatch.undo()
        request = GenerationRequest(prompt_of(12, salt=2), max_tokens=5, ignore_eos=True)
        ok = await eng.generate(request)
        stats = eng.stats()
    finally:
        await eng.close()
    assert failed.finish_reason is FinishReason.ERROR and "out of memory" in str(failed.error)
    assert ok.token_ids == greedy(eng, request.prompt_tokens, 5)
    assert stats.active == 0 and stats.kv_reserved_bytes == 0


# ---- the scheduler alone, on a real model's layout --------------------------------------------


@pytest.fixture(scope="module")
def layout():
    from agentkv.engine.batch.layout import KVLayout
    from agentkv.engine.models.loading import load_model

    return KVLayout.of(load_model("tiny:gemma3").model)


def waiting(scheduler, n: int, priority: int = 0, salt: int = 0):
    from tests.test_runner import sequence

    seq = sequence(prompt_of(n, salt=salt))
    seq.request = GenerationRequest(seq.prompt, max_tokens=8, priority=priority)
    scheduler.enqueue(seq)
    return seq


def test_a_turn_queued_while_another_is_admitted_is_neither_lost_nor_admitted_twice(layout):
    from agentkv.engine.scheduler import Scheduler

    scheduler = Scheduler(EngineConfig(completion_batch_size=1), layout, budget_bytes=1 << 30)
    first = waiting(scheduler, 10)
    blocked = scheduler._blocked
    late = []

    def push_during_admission(seq, running):
        if not late:  # the asyncio side submits a higher-priority turn right now
            late.append(waiting(scheduler, 12, priority=5, salt=1))
        return blocked(seq, running)

    scheduler._blocked = push_during_admission
    scheduler.schedule()
    assert scheduler.running == [first]
    assert scheduler.queue.peek() is late[0] and len(scheduler.queue) == 1


def test_fair_prefill_gives_a_small_budget_to_a_few_prompts_in_turn(layout):
    from agentkv.engine.scheduler import Scheduler

    scheduler = Scheduler(EngineConfig(policy="fair"), layout, budget_bytes=1 << 30)
    prompts = [waiting(scheduler, 100, salt=i) for i in range(5)]
    first = scheduler._paced_chunks(list(prompts), 2 * MIN_CHUNK)
    second = scheduler._paced_chunks(list(prompts), 2 * MIN_CHUNK)
    third = scheduler._paced_chunks(list(prompts), 2 * MIN_CHUNK)
    assert [(s, n) for s, n in first] == [(prompts[0], MIN_CHUNK), (prompts[1], MIN_CHUNK)]
    assert [s for s, _ in second] == prompts[2:4]
    assert [s for s, _ in third] == [prompts[4], prompts[0]]
    even = scheduler._paced_chunks(list(prompts), 10 * MIN_CHUNK)
    assert [n for _, n in even] == [2 * MIN_CHUNK] * 5


def test_fair_prefill_gives_what_a_short_prompt_leaves_to_the_longer_ones(layout):
    from agentkv.engine.scheduler import Scheduler

    scheduler = Scheduler(EngineConfig(policy="fair"), layout, budget_bytes=1 << 30)
    long, short, middle = (waiting(scheduler, n, salt=n) for n in (500, 20, 70))
    chunks = scheduler._paced_chunks([long, short, middle], 140)
    assert chunks == [(long, 60), (short, 20), (middle, 60)]
    assert scheduler._paced_chunks([long, middle], 200) == [(long, 130), (middle, 70)]


def test_a_joining_q4_turn_reads_the_first_position_of_its_own_first_token():
    """A q4 batch's global layers read each row's first position as the model computes it
    for the sequence's first token: a resumed turn's history's, a new one's prompt's."""
    from mlx_lm.models.cache import make_prompt_cache

    from agentkv.engine.models.loading import load_model
    from agentkv.engine.runner import ModelRunner
    from agentkv.engine.scheduler import Scheduler
    from tests.test_runner import sequence

    model = load_model("tiny:gemma3").model
    runner = ModelRunner(model, kv_bits=4)
    asked = []

    def first_positions(token: int) -> list:
        asked.append(token)
        return runner.first_positions(token)

    config = EngineConfig(batch_kv_bits=4)
    scheduler = Scheduler(config, runner.layout, 1 << 30, first_positions)
    history = prompt_of(60, salt=2)
    cache = make_prompt_cache(model)
    model(mx.array(history)[None], cache=cache)
    fresh, resumed = sequence(prompt_of(10, salt=1)), sequence(prompt_of(5, salt=3))
    resumed.tokens, resumed.cache = list(history), cache
    for seq in (fresh, resumed):
        scheduler.enqueue(seq)
    scheduler.schedule()
    assert scheduler.running == [fresh, resumed]
    assert asked == [fresh.prompt[0], history[0]] and fresh.prompt[0] != history[0]
    for seq, token in ((fresh, fresh.prompt[0]), (resumed, history[0])):
        want, windows = runner.first_positions(token), runner.layout.windows
        assert len(want) == len(windows) and None in windows
        for layer, pair, w in zip(seq.group.layers, want, windows, strict=True):
            got = getattr(layer, "first_kv", None)
            assert (got is None) == (w is not None)  # q4's global layers read theirs
            assert got is None or all(
                mx.array_equal(x, y).item() for x, y in zip(got, pair, strict=True)
            )
    # A batch in the model's precision reads none: nothing is computed for it.
    plain = Scheduler(EngineConfig(), ModelRunner(model).layout, 1 << 30, first_positions)
    asked.clear()
    plain.enqueue(sequence(prompt_of(10, salt=4)))
    plain.schedule()
    assert len(plain.running) == 1 and asked == []
