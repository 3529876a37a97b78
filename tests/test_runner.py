"""One step of rows through mlx-lm's model: decode rows of length groups and a prefill chunk
in one forward pass give the logits of ordinary forwards, sequence by sequence."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from agentkv.engine.attention.step import ragged_attention
from agentkv.engine.batch.groups import KVGroup
from agentkv.engine.batch.held import HeldQuantized
from agentkv.engine.models.loading import load_model
from agentkv.engine.request import GenerationRequest, RequestStats
from agentkv.engine.runner import ModelRunner
from agentkv.engine.sequence import SeqStatus, Sequence
from agentkv.engine.step import StepPlan
from agentkv.engine.stopping import StopStrings

SPECS = ["tiny:gemma3", "tiny:llama"]


@pytest.fixture(scope="module", params=SPECS)
def runner(request):
    return ModelRunner(load_model(request.param).model)


def tokens(n: int, salt: int) -> list[int]:
    return [(7 * i + 11 * salt) % 400 + 16 for i in range(n)]


def sequence(prompt: list[int]) -> Sequence:
    return Sequence(
        request=GenerationRequest(prompt, max_tokens=100),
        loop=None,
        events=None,
        stats=RequestStats(len(prompt), 0),
        sampler=None,
        logits_processors=[],
        detokenizer=None,
        stops=StopStrings([]),
        prompt=list(prompt),
    )


def reference_next(model, prompt: list[int]) -> int:
    """The greedy next token after ``prompt``, from one ordinary mlx-lm forward pass."""
    logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))
    return int(mx.argmax(logits[0, -1]).item())


def test_decode_groups_and_a_prefill_chunk_share_one_step(runner):
    model = runner.model
    layout = runner.layout
    # Two length groups (3 short sequences, 1 long one past the sliding window) ...
    prompts = [tokens(n, salt=n) for n in (6, 9, 7, 120)]
    seqs = [sequence(p) for p in prompts]
    for seq in seqs:
        KVGroup.start(layout, seq, None)
    runner.run(StepPlan([], [(s, len(s.prompt)) for s in seqs]))
    short = seqs[0].group
    short.absorb(seqs[1].group)
    short.absorb(seqs[2].group)
    long = seqs[3].group
    # ... decode beside a prompt that prefills its first 20 of 50 tokens in the same step.
    joining = sequence(tokens(50, salt=99))
    KVGroup.start(layout, joining, None)
    joining.status = SeqStatus.PREFILLING
    plan = StepPlan([short, long], [(joining, 20)])
    first = [s.pending for s in seqs]
    runner.run(plan)
    fed = [int(a[i].item()) for a, i in first]
    assert [p for _, p in plan.fed] == first
    assert joining.tokens == joining.request.prompt_tokens[:20] and len(joining.prompt) == 30
    # Each decode row's next token equals a plain forward over its prompt + the fed token.
    sampled = [int(s.pending[0][s.pending[1]].item()) for s in seqs]
    for seq, prompt, token, got in zip(seqs, prompts, fed, sampled, strict=True):
        assert token == reference_next(model, prompt)
        assert got == reference_next(model, [*prompt, token])
        assert seq.status is SeqStatus.DECODING
    # The chunk went in: finishing the prompt samples what a plain forward does.
    runner.run(StepPlan([], [(joining, 30)]))
    array, index = joining.pending
    assert int(array[index].item()) == reference_next(model, joining.request.prompt_tokens)


def test_the_models_attention_goes_through_the_ragged_path(runner):
    module = __import__(type(runner.model).__module__, fromlist=["_"])
    assert module.scaled_dot_product_attention is ragged_attention
    # Caches that are not a step's still take mlx-lm's own path: plain generation works.
    assert reference_next(runner.model, tokens(12, salt=1)) >= 0


def test_logits_processors_see_every_token_the_kv_holds(runner):
    """A prompt prefilled in chunks, first beside a decoding sequence (a sampled step), then
    alone (no logits at all), then to its end: its processors' context is the whole prompt."""
    layout = runner.layout
    decoder = sequence(tokens(8, salt=1))
    KVGroup.start(layout, decoder, None)
    runner.run(StepPlan([], [(decoder, 8)]))
    seen = []
    prompt = tokens(60, salt=2)
    joining = sequence(prompt)
    joining.logits_processors = [lambda context, logits: seen.append(context) or logits]
    KVGroup.start(layout, joining, None)
    joining.status = SeqStatus.PREFILLING
    runner.run(StepPlan([decoder.group], [(joining, 20)]))
    runner.run(StepPlan([], [(joining, 20)]))
    runner.run(StepPlan([], [(joining, 20)]))
    assert seen and seen[-1].tolist() == prompt


def test_q4_global_layers_read_the_first_position_the_model_computes_for_its_token(monkeypatch):
    """A q4 batch's global layers read each row's first position in float: what a plain
    forward pass of any sequence starting with that token holds there (causal attention makes
    it the first token's alone), computed once a token (every layer's); sliding layers and q8
    read none."""
    model = load_model("tiny:gemma3").model
    runner = ModelRunner(model, kv_bits=4)
    prompt = tokens(30, salt=3)  # (within the sliding windows of 32)
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    first = runner.first_positions(prompt[0])
    windows = runner.layout.windows
    assert len(first) == len(windows) and all(w is None or w > len(prompt) for w in windows)
    assert None in windows and any(w is not None for w in windows)
    for pair, layer in zip(first, cache, strict=True):  # (every layer still holds position 0)
        for got, held in zip(pair, (layer.keys, layer.values), strict=True):
            assert got.shape == (1, *held.shape[1:2], 1, held.shape[3])
            assert mx.allclose(got, held[..., :1, :], atol=1e-5).item()
    assert runner.first_positions(prompt[0]) is first  # kept, not computed again
    # Past the float positions (16 to 47 a layer), a decode step reads it from first_kv.
    reads = []
    column = HeldQuantized.first_column
    monkeypatch.setattr(
        HeldQuantized, "first_column", lambda held: reads.append(column(held)) or reads[-1]
    )
    long = tokens(100, salt=4)
    seq = sequence(long)
    group = KVGroup.start(runner.layout, seq, None, runner.first_positions(long[0]))
    for w, layer in zip(windows, group.layers, strict=True):
        assert (getattr(layer, "first_kv", None) is None) == (w is not None)
        assert w is not None or layer.first_held == [True]
    runner.run(StepPlan([], [(seq, len(long))]))
    assert all(got is None or not got[1].any().item() for got in reads)  # (in its chunk)
    reads.clear()
    seq.status = SeqStatus.DECODING
    runner.run(StepPlan([group], []))
    got = [r for r in reads if r is not None]
    assert len(got) == windows.count(None) and all(r[1].all().item() for r in got)
    assert runner.layout.reads_first_positions
    assert not ModelRunner(model, kv_bits=8).layout.reads_first_positions
