"""Conversations that start alike past their system prompt (a fan-out: workers handed one brief,
each with a task of its own) share the prefill of that start on sliding-window and hybrid
models: a new conversation keeps snapshots at its last block boundaries, the conversation that
parts from it resumes the latest one before that and stores the shared start as a head of its
own (blocks and a window), and those that follow resume it, in one process and after a
restart; those that arrive while the first is prefilled take the shared start out of the batch
from it.
Real SQLite files, real tiny models, real block files."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.caches.tiers import CacheTiers, Start
from agentkv.messages import common_prefix
from agentkv.models.tiny import tiny_model_dir

BLOCK = 16
SYSTEM = "Be brief."  # under a block: no shared head of its own
BRIEF = (
    "You are one worker among several in a review of a shipping company's parcel service. "
    "Read the notes below and answer only the task at the end, in one short sentence. Notes: "
    "parcels leave the depot at six in the morning and arrive by noon in town, by evening in "
    "the villages; late parcels are reported to the office, which calls the customer back; "
    "weekend deliveries cost extra and need a signature; damaged parcels are photographed "
    "before they are handed over. Task: "
)
TASKS = [
    "say when parcels leave.",
    "say what a weekend delivery needs.",
    "say who calls back about late parcels.",
    "say what happens to damaged parcels.",
    "say when village parcels arrive.",
]


def config(data_dir: Path, model: str, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=model, data_dir=data_dir, kv_block_tokens=BLOCK, **kw)


@functools.cache
def tokenizer(model: str):
    return load_tokenizer(tiny_model_dir(model))


def prompt(model: str, task: str, brief: str = BRIEF) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": brief + task}]
    ids = tokenizer(model).apply_chat_template(messages, add_generation_prompt=True)
    return list(ids)


def system_head(model: str) -> int:
    """Where the user's turn begins: the tokens every conversation with SYSTEM shares (a
    shared head of its own where it spans a block)."""
    return common_prefix(prompt(model, "0", ""), prompt(model, "1", ""))


def shared_start(model: str) -> int:
    """The tokens every worker's prompt begins with."""
    prompts = [prompt(model, task) for task in TASKS]
    return min(common_prefix(prompts[0], p) for p in prompts[1:])


async def ask(rt: AgentRuntime, task: str):
    agent = await rt.create_agent(system_prompt=SYSTEM)
    return await rt.chat(agent.id, BRIEF + task, max_tokens=6)


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_workers_handed_one_brief_share_its_prefill(tmp_path, model):
    start, head = shared_start(model), system_head(model)
    assert start >= head + 8 * BLOCK  # the brief: many blocks past the system prompt
    alone_config = config(tmp_path / "alone", model, share_prefixes=False)
    async with await AgentRuntime.open(alone_config) as rt:
        alone = [(await ask(rt, task)).token_ids for task in TASKS]

    shared = config(tmp_path / "shared", model)
    async with await AgentRuntime.open(shared) as rt:
        fed: list[int] = []  # the prompt tokens each step of the engine prefilled
        rt.engine.add_step_listener(lambda step: fed.append(step.prefill_tokens))
        replies = []
        for task in TASKS[:3]:
            fed.clear()
            replies.append(await ask(rt, task))
            prefilled = replies[-1].usage.prompt_tokens - replies[-1].usage.cached_tokens
            assert 0 <= prefilled - sum(fed) <= 4  # (a head's last token is forced, not fed)
        # The first prefills everything (past the system prompt's head, where it spans a
        # block), keeping snapshots at its last block boundaries; the second parts from it
        # after the brief: it resumes the latest snapshot before that (stored as it is, blocks
        # and a window), prefills the rest of the shared start alone and keeps its end as a
        # checkpoint; the third resumes all of the shared start from it.
        whole = start // BLOCK * BLOCK
        assert [r.usage.cached_tokens for r in replies] == [0, whole, start]
        assert whole >= 0.9 * start
        assert [r.cache_source for r in replies[1:]] == ["prefix", "prefix"]
        assert [r.token_ids for r in replies] == alone[:3]
    # After a restart (nothing in memory) new workers resume the shared start's whole blocks
    # from disk.
    async with await AgentRuntime.open(shared) as rt:
        replies = [await ask(rt, task) for task in TASKS[3:]]
        assert [r.cache_source for r in replies] == ["prefix", "prefix"]
        assert [r.usage.cached_tokens for r in replies] == [whole, whole]
        assert whole >= 0.9 * start
        assert [r.token_ids for r in replies] == alone[3:]


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid", "tiny:llama"])
async def test_workers_that_arrive_together_prefill_the_brief_once(tmp_path, model):
    # All at once: the first prefills its whole prompt, keeping snapshots at its last block
    # boundaries; the others, arriving while it runs, take the shared start out of the batch
    # from it (at the latest snapshot within it; anywhere, on full attention) once its prefill
    # has passed there (agentkv.caches.flights), and prefill less than a block of it again.
    # The first is the shortest task, so that its last block boundaries fall within the
    # shared start (a first whose own task runs past them leaves no snapshot there: the
    # others then part from it as when one follows another, storing the start once more).
    start = shared_start(model)
    alone_config = config(tmp_path / "alone", model, share_prefixes=False)
    async with await AgentRuntime.open(alone_config) as rt:
        alone = [(await ask(rt, task)).token_ids for task in TASKS]
    async with await AgentRuntime.open(config(tmp_path / "shared", model)) as rt:
        fed: list[int] = []  # the prompt tokens each step of the engine prefilled
        rt.engine.add_step_listener(lambda step: fed.append(step.prefill_tokens))
        first = asyncio.ensure_future(ask(rt, TASKS[0]))
        while not rt._caches.flights.flying:  # (its turn is in flight)
            await asyncio.sleep(0.005)
        replies = [await first, *await asyncio.gather(*(ask(rt, t) for t in TASKS[1:]))]
    prefilled = sum(r.usage.prompt_tokens - r.usage.cached_tokens for r in replies)
    # What the turns report is what the engine prefilled, but for the last token of each head
    # prefilled alone (forced, not prefilled: at most four heads a turn).
    assert 0 <= prefilled - sum(fed) <= 4 * len(TASKS)
    own = sum(r.usage.prompt_tokens - start for r in replies)
    assert min(map(len, (prompt(model, t) for t in TASKS))) == len(prompt(model, TASKS[0]))
    assert prefilled <= start + own + (len(TASKS) - 1) * BLOCK
    assert start > 4 * BLOCK  # (so that this is less than each prefilling the start)
    assert [r.cache_source for r in replies].count("prefix") == len(TASKS) - 1
    assert sorted(r.usage.cached_tokens for r in replies)[1] >= start // BLOCK * BLOCK
    assert [r.token_ids for r in replies] == alone


class Head:
    """A cache as ``CacheTiers._head`` sees it (``DiskCaches.extend`` is stubbed below)."""

    def __init__(self, tokens: list[int]):
        self.num_tokens = len(tokens)

    def as_head(self) -> Head:
        return self


async def test_turns_that_part_at_one_point_together_prefill_it_once():
    # Two turns that take the same head while the first prefills it: one prefill, one cache.
    released = asyncio.Event()
    calls = []

    class Prefixes:
        async def extend(self, cache, tokens, priority, points):
            calls.append(len(tokens))
            await released.wait()
            return Head(tokens)

    class Disk:
        prefixes = Prefixes()

    tiers = CacheTiers(None, Disk(), None)
    tokens = list(range(40))
    first = asyncio.ensure_future(tiers._head(Start(None), tokens, 0.0, ()))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(tiers._head(Start(None, fresh=5), tokens, 0.0, ()))
    await asyncio.sleep(0)
    released.set()
    one, two = await first, await second
    assert calls == [40]
    assert one.cache is two.cache
    assert (one.fresh, one.borrowed) == (40, 0)  # the first prefilled it
    assert (two.fresh, two.borrowed) == (5, 35)  # the second's own 5 tokens stay its own
    assert tiers._prefilling == []
