"""Speculative decoding in the batch (``agentkv.engine.speculative``): drafts never change
what is generated. Greedy replies with drafts, good (the reply's own tokens, a few wrong) or
bad (random), equal the replies without, token for token, on every architecture that drafts;
the caches they leave continue alike; a run of kept drafts ends where a stop, max_tokens or
the end-of-sequence token ends the reply; sampled replies keep their distribution."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache
from openai import BadRequestError, OpenAI
from test_server import metric

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.meter import StepRecord
from agentkv.engine.mlxlm import temporal_order
from agentkv.engine.pacing import MIN_CHUNK
from agentkv.engine.request import GenerationRequest
from agentkv.engine.sampling import SamplingParams
from agentkv.engine.speculative import Prediction, PromptLookup, Speculation, kept_drafts
from agentkv.server.background import serve_in_thread
from tests.architectures import build_architecture
from tests.test_architectures import RUNS

PROMPT = [(7 * i + 3) % 400 + 16 for i in range(48)]


class Drafts:
    """Replaces the lookup's drafts: ``truth`` (the reply's own tokens, by position), wrong
    one time in ``wrong`` (0: never), or random ones (``truth`` None)."""

    def __init__(self, truth: list[int] | None, wrong: int = 0, seed: int = 0):
        self.truth, self.wrong, self.rng = truth, wrong, random.Random(seed)
        self.calls = 0

    def __call__(self, spec: Speculation, history: list[int], pending: int | None, room: int):
        self.calls += 1
        k = min(spec.k, room)
        if k < 1:
            return []
        first = 1 if pending is None else 0  # (the token expected next first: not known yet)
        if self.truth is None:
            return [self.rng.randrange(16, 500) for _ in range(k + first)]
        at = len(history) + 1 - len(PROMPT) - first  # the reply's position of the first
        drafts = self.truth[at : at + k + first]
        if self.wrong and drafts and self.rng.randrange(self.wrong) == 0:
            drafts[self.rng.randrange(len(drafts))] = self.rng.randrange(16, 500)
        return drafts


def assert_close_cache(got, want) -> None:
    """Two caches of the same tokens hold the same keys and values, within float32 rounding
    (positions computed in a span against one a step: matrices of other shapes)."""
    for g, w in zip(got.layers, want.layers, strict=True):
        assert type(g) is type(w) and g.offset == w.offset
        if isinstance(w, RotatingKVCache):  # in temporal order, as it is attended
            size = min(w.offset, w.max_size)
            pairs = [
                (temporal_order(g, x)[..., -size:, :], temporal_order(w, y)[..., -size:, :])
                for x, y in ((g.keys, w.keys), (g.values, w.values))
            ]
        else:
            pairs = [
                (x[..., : w.offset, :], y[..., : w.offset, :])
                for x, y in ((g.keys, w.keys), (g.values, w.values))
            ]
        for x, y in pairs:
            assert x.shape == y.shape and mx.allclose(x, y, rtol=1e-3, atol=1e-4).item()


def use(monkeypatch, drafts: Drafts) -> None:
    """Have every drafting sequence feed ``drafts``' drafts."""
    monkeypatch.setattr(Speculation, "propose", lambda spec, *args: drafts(spec, *args))


async def generate(model, mode: str, request: GenerationRequest, follow: list[int]):
    """The reply, and the reply to ``follow`` after it from the cache it leaves."""
    eng = await Engine.open(model, EngineConfig(speculative=mode))
    try:
        first = await eng.generate(request)
        after = GenerationRequest(follow, max_tokens=8, ignore_eos=True, cache=first.cache)
        second = await eng.generate(after)
        return first, second, eng.stats(), eng._thread.runner.can_draft
    finally:
        await eng.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root, built = tmp_path_factory.mktemp("speculative"), {}

    class Dirs(dict):
        def __missing__(self, name: str) -> Path:
            built[name] = build_architecture(name, root / name)
            return built[name]

    return Dirs()


@pytest.mark.parametrize("name", RUNS)
async def test_drafts_good_or_bad_never_change_a_greedy_reply(name, models, monkeypatch):
    model = models[name]
    request = GenerationRequest(PROMPT, max_tokens=40, ignore_eos=True)
    follow = [20, 21, 22, 23]
    plain, plain_after, _, can = await generate(model, "off", request, follow)
    if not can:  # recurrent state, nested caches: said so by the runner, no drafts fed
        use(monkeypatch, Drafts(None))
        got, _, stats, _ = await generate(model, "lookup", request, follow)
        assert got.token_ids == plain.token_ids and stats.drafted_tokens == 0
        return
    for drafts in (Drafts(plain.token_ids, wrong=3), Drafts(None)):
        use(monkeypatch, drafts)
        got, after, stats, _ = await generate(model, "lookup", request, follow)
        assert got.token_ids == plain.token_ids, drafts.truth is not None
        assert got.cache.tokens == plain.cache.tokens
        assert_close_cache(got.cache, plain.cache)  # (many random models repeat one token)
        assert after.token_ids == plain_after.token_ids  # the cache it left, cut back exactly
        assert stats.drafted_tokens > 0 and drafts.calls > 0
        if drafts.truth is not None:  # most of the reply came as kept drafts
            assert stats.accepted_tokens > len(plain.token_ids) // 2
            assert got.stats.accepted_tokens == stats.accepted_tokens


@pytest.mark.parametrize("spec", ["tiny:gemma3", "tiny:llama"])
async def test_a_run_of_kept_drafts_ends_at_max_tokens_a_stop_or_the_end(spec, monkeypatch):
    eng = await Engine.open(spec, EngineConfig(speculative="off"))
    try:
        plain = await eng.generate(GenerationRequest(PROMPT, max_tokens=30, ignore_eos=True))
        text = (await eng.generate(GenerationRequest(PROMPT, max_tokens=30, ignore_eos=True))).text
    finally:
        await eng.close()
    truth = plain.token_ids
    use(monkeypatch, Drafts(truth))
    eng = await Engine.open(spec, EngineConfig(speculative="lookup", speculative_tokens=16))
    kept = 0

    def counted(got):  # kept drafts are the reply's tokens after its first, no more
        nonlocal kept
        assert 0 < got.stats.accepted_tokens <= len(got.token_ids) - 1
        kept += got.stats.accepted_tokens
        assert eng.stats().accepted_tokens == kept

    try:
        for n in (5, 13, 30):  # max_tokens inside a run of kept drafts
            got = await eng.generate(GenerationRequest(PROMPT, max_tokens=n, ignore_eos=True))
            assert got.token_ids == truth[:n] and got.finish_reason == "length"
            assert got.cache.tokens == PROMPT + truth[:n]
            counted(got)
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        got = await eng.generate(
            GenerationRequest(PROMPT, max_tokens=30, ignore_eos=True, stop=[stop])
        )
        assert got.stop_sequence == stop and stop not in got.text
        assert got.cache.tokens == PROMPT + got.token_ids
        assert got.token_ids == truth[: len(got.token_ids)]
        counted(got)
        # The end-of-sequence token as a kept draft ends the reply there (the model's own
        # reply to a prompt it ends after 18 tokens; drafts past it are dropped).
        if spec == "tiny:gemma3":
            ending = [(7 * i + 4) % 400 + 16 for i in range(len(PROMPT))]
            ended = await eng.generate(GenerationRequest(ending, max_tokens=60, speculative=False))
            assert ended.finish_reason == "stop" and ended.token_ids[-1] in eng.model.eos_token_ids
            use(monkeypatch, Drafts([*ended.token_ids, *truth]))
            got = await eng.generate(GenerationRequest(ending, max_tokens=60))
            assert (got.token_ids, got.finish_reason) == (ended.token_ids, "stop")
            assert got.cache.tokens == ending + got.token_ids
            counted(got)
    finally:
        await eng.close()


async def test_drafting_sequences_decode_beside_others_as_alone():
    """Four turns at once, two of them restating their history: every reply equals it alone
    without drafts; the restating ones keep drafts, and no drafting row shares a group."""
    looping = [16 + (i % 12) for i in range(96)]  # a loop the model tends to continue
    prompts = [looping, PROMPT, looping[::-1], PROMPT[::-1]]
    eng = await Engine.open("tiny:llama", EngineConfig(speculative="off"))
    try:
        alone = [
            (await eng.generate(GenerationRequest(p, max_tokens=32, ignore_eos=True))).token_ids
            for p in prompts
        ]
    finally:
        await eng.close()
    eng = await Engine.open("tiny:llama", EngineConfig(speculative="lookup"))
    try:
        together = await asyncio.gather(
            *(eng.generate(GenerationRequest(p, max_tokens=32, ignore_eos=True)) for p in prompts)
        )
        stats = eng.stats()
    finally:
        await eng.close()
    assert [r.token_ids for r in together] == alone
    assert stats.drafted_tokens > 0


async def test_a_prompt_beside_drafting_turns_is_paced_by_their_measured_steps(monkeypatch):
    """A step that verifies drafts runs to its end before the next is queued, so the pacer is
    told its own time: a prompt joining a turn that drafts every step gets chunks sized to the
    stall bound, not the floor (``MIN_CHUNK``, or none, as when such steps went unmeasured)."""
    request = GenerationRequest(PROMPT, max_tokens=400, ignore_eos=True)
    eng = await Engine.open("tiny:llama", EngineConfig(speculative="off"))
    try:
        truth = (await eng.generate(request)).token_ids
    finally:
        await eng.close()
    use(monkeypatch, Drafts(truth))  # always right: every decoding step verifies drafts
    eng = await Engine.open("tiny:llama", EngineConfig(speculative_tokens=2))
    steps: list[StepRecord] = []
    eng.add_step_listener(steps.append)
    try:
        decoding = eng.submit(request)
        for _ in range(20):
            await anext(decoding)
        start = len(steps)
        await eng.generate(GenerationRequest(PROMPT[::-1] * 12, max_tokens=1, ignore_eos=True))
        decoding.cancel()
        pacer = eng._thread.scheduler.pacer
    finally:
        await eng.close()
    beside = [s.prefill_tokens for s in steps[start:] if s.prefill_tokens and s.decode_rows]
    assert pacer.token_s is not None and beside and max(beside) > MIN_CHUNK, beside


async def test_sampled_replies_keep_their_distribution(monkeypatch):
    """A draft is kept with the probability the model gives it: the first token of a sampled
    reply is distributed alike with drafts (always proposing the same token) and without."""
    sampling = SamplingParams(temperature=1.0)
    runs = 160

    async def firsts(mode: str) -> Counter:
        eng = await Engine.open("tiny:llama", EngineConfig(speculative=mode))
        try:
            replies = await asyncio.gather(
                *(
                    eng.generate(
                        GenerationRequest(
                            PROMPT,
                            max_tokens=3,
                            ignore_eos=True,
                            sampling=sampling.model_copy(update={"seed": seed}),
                        )
                    )
                    for seed in range(runs)
                )
            )
        finally:
            await eng.close()
        return Counter(r.token_ids[1] for r in replies)

    without = await firsts("off")
    favourite = without.most_common(1)[0][0]

    def propose(spec, history, pending, room):
        return ([] if pending is not None else [favourite]) + [favourite] if room >= 1 else []

    monkeypatch.setattr(Speculation, "propose", propose)
    drafted = await firsts("lookup")
    # The draft's token is kept at its model probability: the same share within sampling
    # noise (a two-sided 99.9% band of a binomial over `runs` draws).
    p = without[favourite] / runs
    band = 3.3 * (p * (1 - p) / runs) ** 0.5 * 2**0.5
    assert abs(drafted[favourite] / runs - p) <= band + 1 / runs
    # And the other tokens keep theirs: a chi-square over the common ones.
    tokens = [t for t, n in without.items() if n >= 8]
    chi = sum((drafted[t] - without[t]) ** 2 / (drafted[t] + without[t]) for t in tokens)
    assert chi < 3 * len(tokens) + 10


def test_the_lookup_drafts_what_followed_the_latest_occurrence():
    lookup = PromptLookup()
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2]
    lookup.extend(history)
    # The last tokens (1, 2) and the pending 3: "1 2 3" last occurred before "4 6 7".
    assert lookup.draft(3, 3) == [4, 6, 7]
    assert lookup.draft(3, 8) == []  # "1 2 8" never occurred
    # The pending token not known yet: the history's last tokens alone ("7 1 2", "6 7 1 2")
    # never occurred before, so nothing is drafted.
    assert lookup.draft(3, None) == []
    lookup.extend([*history, 3, 4])
    assert lookup.size == 16
    # "1 2 3 4" occurred before "6 7 1 2": the expected next token (6) and three after it.
    assert lookup.draft(3, None) == [6, 7, 1, 2]
    assert kept_drafts([4, 6, 7], [4, 6, 8, 1]) == 2 and kept_drafts([5], [4, 5]) == 0


def test_drafting_stops_for_a_turn_where_it_does_not_pay():
    spec = Speculation(8)
    assert spec.propose([1, 2, 3, 4, 5, 6], 7, 10) == []  # no occurrence: no draft, no cost
    assert spec.active
    for _ in range(6):
        spec.settle(2, 1)
    assert not spec.active and spec.stopped
    idle = Speculation(8)  # never a draft: its group of its own costs
    for _ in range(15):
        assert idle.propose([1, 2, 3, 4, 5, 6], 7, 10) == [] and idle.active
    idle.propose([1, 2, 3, 4, 5, 6], 7, 10)
    assert not idle.active
    paying = Speculation(8)
    for _ in range(6):
        paying.settle(4, 4)
    assert paying.active and paying.k == 8
    paying.settle(8, 2)
    assert paying.k == 3


def oracle(monkeypatch) -> None:
    """Have drafting sequences feed random drafts: some are kept (the tiny model's own
    choices come up), the rest are dropped."""
    use(monkeypatch, Drafts(None, seed=1))


async def test_a_turns_timings_count_its_drafts_and_a_turn_may_go_without(tmp_path, monkeypatch):
    oracle(monkeypatch)
    config = RuntimeConfig(model="tiny:llama", data_dir=tmp_path / "rt")
    async with await AgentRuntime.open(config) as rt:
        await rt.create_agent("a")
        reply = await rt.chat("a", "Tell me about the sea.", max_tokens=48)
        stats = rt.engine.stats()
        await rt.create_agent("b")  # the same turn, asked without drafts
        plain = await rt.chat("b", "Tell me about the sea.", max_tokens=48, speculative=False)
        after = rt.engine.stats()
    assert reply.timings.drafted_tokens == stats.drafted_tokens > 0
    assert reply.timings.accepted_tokens == stats.accepted_tokens
    assert plain.timings.drafted_tokens == 0 and after.drafted_tokens == stats.drafted_tokens
    assert plain.text == reply.text  # greedy: the same tokens either way
    off = RuntimeConfig(model="tiny:llama", data_dir=tmp_path, speculative="off")
    assert off.engine_config().speculative == "off"


def test_metrics_count_the_drafts(tmp_path, monkeypatch):
    oracle(monkeypatch)
    config = RuntimeConfig(model="tiny:llama", data_dir=tmp_path)
    with serve_in_thread(config) as url, httpx.Client(base_url=url, timeout=120) as http:
        body = {"model": "m", "max_tokens": 48, "messages": [{"role": "user", "content": "Hi"}]}
        assert http.post("/v1/messages", json=body).status_code == 200
        drafted = metric(http, "agentkv_engine_drafted_tokens")
        kept = metric(http, "agentkv_engine_accepted_tokens")
    assert drafted > 0 and 0 <= kept <= drafted


def test_a_prediction_drafts_its_start_then_what_follows_the_reply_in_it():
    prediction = Prediction.of([5, 6, 7, 8, 5, 6, 9, 10], start=3)
    history = [1, 2, 3]
    assert prediction.draft(history, None, 3) == [5, 6, 7, 8]  # the expected token first
    assert prediction.draft([*history, 5, 6], 7, 3) == [8, 5, 6]  # the reply is its start
    # The reply departs from it ([.., 8, 99]), then comes back: what followed its last
    # tokens, at the first occurrence past the drafts before (5 6 occurs twice).
    assert prediction.draft([*history, 5, 6, 7, 8, 99], 6, 3) == []
    assert not prediction.on_track
    assert prediction.draft([*history, 5, 6, 7, 8, 99, 6, 7], 8, 2) == [5, 6]
    assert prediction.draft([*history, 5, 6, 7, 8, 99, 6, 7, 8, 5], 6, 2) == [9, 10]


async def test_a_prediction_changes_no_token_and_its_kept_drafts_are_counted():
    request = GenerationRequest(PROMPT, max_tokens=40, ignore_eos=True)
    eng = await Engine.open("tiny:gemma3", EngineConfig(speculative="lookup"))
    try:
        plain = (await eng.generate(dataclasses.replace(request, speculative=False))).token_ids
        assert len(set(plain)) > 10  # (a reply that is not one token over and over)
        edited = [*plain[:10], 3, 4, *plain[10:25], *plain[27:]]  # a change, a cut
        rng = random.Random(0)
        for prediction, most in ((plain, 2 / 3), (edited, 1 / 2), (rng.sample(range(500), 40), 0)):
            got = await eng.generate(dataclasses.replace(request, prediction=tuple(prediction)))
            assert got.token_ids == plain
            assert got.stats.prediction_tokens == len(prediction)
            kept = got.stats.accepted_prediction_tokens
            assert kept <= got.stats.accepted_tokens
            # Every token after the first restates the prediction (a drafted step's token
            # after its kept drafts is no draft: 8 of 9 at most).
            assert kept >= len(plain) * most, (kept, got.stats.accepted_tokens)
        # A stop inside a run of kept drafts: those after it are not the reply's.
        text = eng.tokenizer.decode(plain)
        at = next(i for i in range(len(text) // 2, len(text)) if text.find(text[i : i + 3]) == i)
        stop = text[at : at + 3]  # (first found past the middle)
        asked = dataclasses.replace(request, prediction=tuple(plain), stop=[stop])
        got = await eng.generate(asked)
        assert got.stop_sequence == stop and got.token_ids == plain[: len(got.token_ids)]
        assert got.stats.accepted_prediction_tokens == got.stats.accepted_tokens
        assert 0 < got.stats.accepted_tokens <= len(got.token_ids) - 1
    finally:
        await eng.close()


def test_openai_predicted_outputs(tmp_path):
    config = RuntimeConfig(model="tiny:llama", data_dir=tmp_path)
    ask = {"model": "m", "max_tokens": 40, "temperature": 0}
    with serve_in_thread(config) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        say = [{"role": "user", "content": "Rewrite the list."}]
        plain = client.chat.completions.create(messages=say, user="plain", **ask)
        text = plain.choices[0].message.content
        assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
        predicted = client.chat.completions.create(
            messages=say,
            user="predicted",
            prediction={"type": "content", "content": [{"type": "text", "text": text}]},
            **ask,
        )
        assert predicted.choices[0].message.content == text
        details = predicted.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > plain.usage.completion_tokens // 2
        assert details.rejected_prediction_tokens >= 0
        for prediction, field in (
            ({"type": "diff", "content": text}, "prediction.type"),
            ({"type": "content", "content": 5}, "prediction.content"),
            ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content.0"),
        ):
            with pytest.raises(BadRequestError) as refused:
                client.chat.completions.create(messages=say, prediction=prediction, **ask)
            assert refused.value.body["param"] == field
        with pytest.raises(BadRequestError, match=r"prediction: .* cannot fit the model's"):
            huge = {"type": "content", "content": "word " * 200_000}
            client.chat.completions.create(messages=say, prediction=huge, **ask)
