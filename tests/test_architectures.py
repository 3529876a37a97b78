"""Every mlx-lm architecture agentkv is asked to drive: it runs fully, or it is refused by name.

Each architecture is a tiny random-weight model built from mlx-lm's own classes
(``tests/architectures.py``) and loaded through ``mlx_lm.load``. One that runs: three agents
of different lengths take turns together in the batch, the runtime restarts, and each agent's
next turn resumes from its cache on disk; every reply equals the same agent's run alone and
uninterrupted (greedy tokens: the batch and a lone agent multiply matrices of other shapes, and
these tokens are where the margins allow it on every kernel family tried). Then the batch holds
its KV at 8 bits, or falls back to the model's precision with its warning. One that cannot run
is refused at open with an ``UnsupportedModelError`` that names its module and why: never
another exception. ``docs/models.md`` lists the same families.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from agentkv.config import RuntimeConfig
from agentkv.engine.errors import UnsupportedModelError
from agentkv.runtime import AgentRuntime
from tests.architectures import ARCHITECTURES, build_architecture

RUN = [
    "llama",
    "mistral",
    "mistral3",
    "ministral3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "glm4_moe",
    "olmo2",
    "phi3",
    "cohere2",
    "exaone4",
    "seed_oss",
    "minimax",
    "gemma3_text",
    "gpt_oss",
    "gemma4_text",
    "gemma4_text-moe",
    "gemma4_text-shared_kv",  # layers that attend to an earlier layer's KV (E2B / E4B)
    "phi",  # keys cast to float32 for attention
    "stablelm",
    "mixtral",
    "qwen2_moe",
    "olmoe",
    "olmo3",
    "smollm3",
    "granite",
    "granitemoe",
    "hunyuan",
    "hunyuan_v1_dense",
    "ernie4_5",
    "ernie4_5_moe",
    "glm4",
    "gemma",
    "phimoe",
    "starcoder2",
    "cohere",
    "exaone_moe",
    "deepseek_v2",
    "apertus",
    "nemotron",
    "helium",
    "internlm3",
    "bailing_moe",
    "afmoe",
    # hybrids: recurrent state (conv, SSM, gated delta) beside attention
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "granitemoehybrid",
    "granitemoehybrid-dense",
    "nemotron_h",
    "nemotron_h-dense",
    "lfm2",
    "lfm2_moe",
    "jamba",
    "recurrent_gemma",
    # attention that reads its cache itself (multi-head latent attention; written out)
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe_lite",
    "kimi_linear",
    "kimi_vl",  # Kimi-VL's language model: DeepSeek V3's
    "mistral4",  # with an attention scale per position, computed before the layers
    "gemma2",
    # two caches a layer (CacheList): attention and state, MLA and a sparse-attention index
    "falcon_h1",
    "deepseek_v32",
    "glm_moe_dsa",
    # no attention at all
    "mamba",
    "mamba2",
]
# What each refused architecture is refused for (its message names its mlx-lm module).
UNSUPPORTED_CACHE = "this one uses ChunkedKVCache"  # chunked local attention
REFUSED = {
    "llama4": UNSUPPORTED_CACHE,  # (mlx-lm's batch has no chunked cache either)
    # AltUp keeps several hidden states a token (a leading axis the batch's rows lack)
    "gemma3n": "its layers fail as a step of agentkv's batch",
}
SYSTEMS = {"a": "You are a guide.", "b": None, "c": "You keep a long log. " * 6}
TURNS = ["Hello there", "Tell me more about it", "And then?"]


# transformers warns about Kimi K2's rope_scaling while the tokenizer loads.
RUNS = [
    pytest.param(n, marks=pytest.mark.filterwarnings("ignore::FutureWarning"))
    if n == "kimi_k2"
    else n
    for n in RUN
]


def test_every_architecture_is_either_run_or_refused():
    assert set(RUN) | set(REFUSED) == set(ARCHITECTURES)
    assert not set(RUN) & set(REFUSED)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """name → model directory, built once per module on first use."""
    root, built = tmp_path_factory.mktemp("architectures"), {}

    class Dirs(dict):
        def __missing__(self, name: str) -> Path:
            built[name] = build_architecture(name, root / name)
            return built[name]

    return Dirs()


def config(model: Path, data: Path, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(model), data_dir=data, kv_bits=None, **kw)


async def agents(rt: AgentRuntime) -> None:
    for agent_id, system in SYSTEMS.items():
        await rt.create_agent(agent_id, system_prompt=system)


async def turn(rt: AgentRuntime, agent_id: str, i: int, logprobs: int | None = None):
    message = f"{TURNS[i]} ({agent_id})"
    return await rt.chat(agent_id, message, max_tokens=6 + 2 * i, logprobs=logprobs)


LOGPROB_TOLERANCE = 1e-3
"""How far a log probability in the batch may be from the same turn's alone (float32: the
batch multiplies matrices of other shapes)."""


def assert_close_logprobs(got, want) -> None:
    """The same tokens, each with nearly the same log probability and likeliest others.

    Random-weight models often repeat one token whatever their KV holds; the log
    probabilities of the tokens around it still follow what it attends to."""
    assert got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert abs(g.logprob - w.logprob) <= LOGPROB_TOLERANCE, (g, w)
        top_g, top_w = sorted(v for _, v in g.top), sorted(v for _, v in w.top)
        assert max(abs(a - b) for a, b in zip(top_g, top_w, strict=True)) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("name", RUNS)
async def test_an_architecture_runs_in_the_batch_and_resumes_from_disk(name, models, tmp_path):
    model = models[name]
    async with await AgentRuntime.open(config(model, tmp_path / "alone")) as rt:
        await agents(rt)
        alone = {a: [await turn(rt, a, i, 5) for i in range(3)] for a in SYSTEMS}

    data = tmp_path / "batch"
    async with await AgentRuntime.open(config(model, data)) as rt:
        await agents(rt)
        together = [await asyncio.gather(*(turn(rt, a, i, 5) for a in SYSTEMS)) for i in range(2)]
    async with await AgentRuntime.open(config(model, data)) as rt:  # a restart
        together.append(await asyncio.gather(*(turn(rt, a, 2, 5) for a in SYSTEMS)))

    for j, agent_id in enumerate(SYSTEMS):
        replies = [together[i][j] for i in range(3)]
        for got, want in zip(replies, alone[agent_id], strict=True):
            assert_close_logprobs(got, want)
        assert [r.cache_source for r in replies] == ["none", "hot", "disk"], agent_id
        assert replies[2].usage.cached_tokens == alone[agent_id][2].usage.cached_tokens > 0


@pytest.mark.parametrize("name", RUNS)
async def test_an_architecture_holds_its_batch_at_8_bits_or_says_why_not(
    name, models, tmp_path, caplog
):
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        async with await AgentRuntime.open(
            config(models[name], tmp_path, engine={"batch_kv_bits": 8})
        ) as rt:
            await agents(rt)
            replies = await asyncio.gather(*(turn(rt, a, 0) for a in SYSTEMS))
            bits = rt.engine.stats().batch_kv_bits
    assert all(r.finish_reason in ("stop", "length") and r.token_ids for r in replies)
    fell_back = [r for r in caplog.records if "batch_kv_bits=8" in r.getMessage()]
    assert (bits == 0) == bool(fell_back), (bits, [r.getMessage() for r in fell_back])


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers on Kimi K2's rope_scaling
@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_an_architecture_agentkv_cannot_drive_is_refused_by_name(name, models, tmp_path):
    with pytest.raises(UnsupportedModelError, match=REFUSED[name]) as refused:
        await AgentRuntime.open(config(models[name], tmp_path))
    assert "mlx_lm.models." in str(refused.value), str(refused.value)
    assert not list(tmp_path.glob("caches/*")), "a refused model wrote no cache"
