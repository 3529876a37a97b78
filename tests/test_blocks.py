"""Paged, content-addressed cache storage and shared prefixes, through the real AgentRuntime:
real SQLite files, real tiny models, real block files."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer
from sqlalchemy import func, select, update

from agentkv import AgentRuntime, Reply, RuntimeConfig
from agentkv.caches import BLOCKS_DIR, DiskStats, chain_keys
from agentkv.caches.hot import HotTier
from agentkv.caches.janitor import Janitor
from agentkv.caches.layout import CacheLayout
from agentkv.caches.save import Saver
from agentkv.caches.shared import Shared
from agentkv.caches.writes import Writes
from agentkv.engine.request import Checkpoint, PromptCache
from agentkv.messages import common_prefix
from agentkv.models.tiny import tiny_model_dir
from agentkv.store import Registry
from agentkv.store.cache_files import read_cache_file
from agentkv.store.database import Database
from agentkv.store.models import KVBlock, KVCacheBlock, utcnow
from tests.alike import assert_q8_alike

BLOCK = 16
HEAD_DIM = 64  # tiny:llama's key and value heads
# About 120 tokens on the tiny models: seven full blocks of 16.
SYSTEM = (
    "You are a careful assistant for a shipping company. Answer questions about parcels, "
    "routes and delivery times in short plain sentences, and say when you do not know. "
    "Never invent tracking numbers; ask for them instead."
)


def config(data_dir: Path, model: str = "tiny:gemma3", **kw) -> RuntimeConfig:
    return RuntimeConfig(model=model, data_dir=data_dir, kv_block_tokens=BLOCK, **kw)


def segment_of(name: str) -> str:
    """A segment file's name without its random part and suffix: ``<last key>-<count>``."""
    match = re.fullmatch(r"([0-9a-f]{32}-\d+)-[0-9a-f]{8}\.safetensors", name)
    assert match is not None, name
    return match[1]


def block_files(rt: AgentRuntime) -> set[str]:
    return {p.name for p in (rt.config.caches_path / BLOCKS_DIR).glob("*/*")}


@contextlib.asynccontextmanager
async def database(rt: AgentRuntime):
    """A connection of its own to the runtime's registry file, to read or change rows."""
    db = await Database.open(rt.config.database)
    try:
        yield db
    finally:
        await db.close()


async def rows(rt: AgentRuntime, model) -> int:
    async with database(rt) as db, db.read() as session:
        return await session.scalar(select(func.count()).select_from(model))


async def listed_blocks(rt: AgentRuntime, agent_id: str) -> tuple[str, ...]:
    record = (await rt.cache_info(agent_id)).stored
    return record.blocks if record else ()


def layout_of(rt: AgentRuntime) -> CacheLayout:
    """The runtime's cache layout (paths, names, block keys), built from its settings."""
    c = rt.config
    fingerprint = rt.engine.model.fingerprint
    return CacheLayout(c.caches_path, fingerprint, c.kv_bits, c.disk_group_size, c.kv_block_tokens)


async def files_of(rt: AgentRuntime, keys) -> list[Path]:
    """The segment (or block) files holding these blocks, each once, in order."""
    async with await Registry.open(rt.config.database) as registry:
        known = await registry.caches.known_blocks(list(keys))
    layout = layout_of(rt)
    return list(dict.fromkeys(layout.file_of(key, known[key]) for key in keys if key in known))


def test_quantized_blocks_are_keyed_apart_from_those_of_earlier_schemes(tmp_path):
    seeds = {bits: CacheLayout(tmp_path, "fp", bits, 32, 256).seed for bits in (None, 8, 4)}
    # Exact keys are as they always were (their stored blocks stay found) ...
    assert seeds[None] == b"agentkv-blocks-v2|fp|None|32|256"
    # ... and q8 blocks, which now hold keys rotated, and q4 blocks, 5-bit keys per channel
    # over 32 positions, never meet the per-token, unrotated ones stored before (nor q4 blocks
    # of 4-bit keys per channel, over the values' group size or over 16 positions).
    assert seeds[8] == b"agentkv-blocks-v2|fp|8-rotated-keys|32|256"
    assert seeds[4] == b"agentkv-blocks-v2|fp|4-channels-32-5|32|256"


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:llama"])
async def test_a_turn_writes_its_new_blocks_and_a_tail(tmp_path, model):
    # (No shared head is stored for others: this counts the bytes of the agent's own saves.)
    settings = config(tmp_path, model, kv_bits=None, share_prefixes=False)
    async with await AgentRuntime.open(settings) as rt:
        agent = await rt.create_agent(system_prompt="You are terse.")
        seed = layout_of(rt).seed  # recompute the content keys
        segments = []
        for i in range(4):
            written = rt.stats()["disk"]["bytes_written"]
            before = set(await listed_blocks(rt, agent.id))
            await rt.chat(agent.id, f"Question {i}: where is my parcel today?", max_tokens=20)
            await rt.flush()
            cache = await rt.export_cache(agent.id)
            keys = chain_keys(seed, cache.tokens, BLOCK)
            assert await listed_blocks(rt, agent.id) == tuple(keys)
            assert len(keys) == cache.num_tokens // BLOCK
            new = [k for k in keys if k not in before]
            assert new == keys[len(before) :]
            info = await rt.cache_info(agent.id)
            assert info.hot_tokens == cache.num_tokens
            # The tail, then one segment per turn, each named after its last block and count.
            segments.append(f"{new[-1]}-{len(new)}")
            assert info.files[0] == rt.config.caches_path / info.stored.path
            assert [segment_of(f.name) for f in info.files[1:]] == segments
            block_bytes = info.files[-1].stat().st_size
            # Only the new blocks and the tail were written: nothing of the older history.
            wrote = rt.stats()["disk"]["bytes_written"] - written
            assert wrote == block_bytes + info.stored.nbytes
        # Every block file on disk is recorded and listed; nothing else is there.
        assert {segment_of(name) for name in block_files(rt)} == set(segments)
        assert [segment_of(f.name) for f in await files_of(rt, keys)] == segments
        assert await rows(rt, KVBlock) == len(keys)
        assert rt.stats()["disk"]["files"] == len(segments) + 1  # and the tail


async def test_resume_from_blocks_equals_uninterrupted_after_restart(tmp_path):
    turns = ["Tell me about the sea.", "And the mountains?", "Compare them.", "Which first?"]

    async def run(rt, agent_id, texts):
        return [(await rt.chat(agent_id, t, max_tokens=24)).token_ids for t in texts]

    async with await AgentRuntime.open(config(tmp_path / "one", kv_bits=None)) as rt:
        await rt.create_agent("a", system_prompt=SYSTEM)
        straight = await run(rt, "a", turns)
    async with await AgentRuntime.open(config(tmp_path / "two", kv_bits=None)) as rt:
        await rt.create_agent("a", system_prompt=SYSTEM)
        first = await run(rt, "a", turns[:2])
    async with await AgentRuntime.open(config(tmp_path / "two", kv_bits=None)) as rt:
        reply = await rt.chat("a", turns[2], max_tokens=24)
        assert reply.cache_source == "disk"
        rest = [reply.token_ids, *await run(rt, "a", turns[3:])]
    assert first + rest == straight


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_agents_with_one_system_prompt_prefill_and_store_it_once(tmp_path, model):
    # tiny:hybrid holds recurrent state: the head is resumed from its checkpoint (the stored
    # window: the state where the blocks end), never cut back from a longer cache.
    opened = functools.partial(config, model=model)
    async with await AgentRuntime.open(opened(tmp_path / "alone", share_prefixes=False)) as rt:
        alone = []
        for i in range(4):
            agent = await rt.create_agent(system_prompt=SYSTEM)
            alone.append(await rt.chat(agent.id, f"Parcel {i} is late.", max_tokens=12))

    async with await AgentRuntime.open(opened(tmp_path / "shared", kv_bits=None)) as rt:
        agents_ = [await rt.create_agent(system_prompt=SYSTEM) for _ in range(4)]
        fed: list[int] = []  # the prompt tokens each step of the engine prefilled
        rt.engine.add_step_listener(lambda step: fed.append(step.prefill_tokens))
        replies = await asyncio.gather(
            *(rt.chat(a.id, f"Parcel {i} is late.", max_tokens=12) for i, a in enumerate(agents_))
        )
        await rt.flush()
        end = head_length(model, SYSTEM, "Parcel 0 is late.")
        head = end // BLOCK * BLOCK
        assert head >= 6 * BLOCK and end > head
        prompts = [prompt_tokens(model, asked(SYSTEM, f"Parcel {i} is late.")) for i in range(4)]
        alike = max(common_prefix(a, b) for a in prompts for b in prompts if a is not b)
        # One turn prefilled the shared head; the others started from its stored blocks and
        # from as far on as a turn that came before had prefilled alone when they looked (its
        # end, or where their prompts part: "Parcel " is shared too).
        assert sorted(r.cache_source for r in replies) == ["none", "prefix", "prefix", "prefix"]
        cached = sorted(r.usage.cached_tokens for r in replies)
        assert cached[0] == 0 and all(head <= n <= alike for n in cached[1:])
        assert sum(fed) <= sum(r.usage.prompt_tokens for r in replies) - 3 * head  # the engine's
        assert [r.token_ids for r in replies] == [r.token_ids for r in alone]
        # Stored once: every agent lists the head's blocks, each is one row and one file.
        lists = [await listed_blocks(rt, a.id) for a in agents_]
        shared = lists[0][: head // BLOCK]
        assert all(ls[: len(shared)] == shared for ls in lists)
        assert await rows(rt, KVBlock) == len(set().union(*lists))
        names = block_files(rt)
        head_files = [f.name for f in await files_of(rt, shared)]
        assert [segment_of(f) for f in head_files] == [f"{shared[-1]}-{len(shared)}"]  # one
        assert set(head_files) <= names
        assert f"{shared[-1]}.window.safetensors" in names
        assert rt.stats()["disk"]["prefix_hits"] == 3
        assert rt.stats()["disk"]["prefix_lookups"] == 4  # the first one stored the head

    # After a restart a new agent starts from the stored head, read from disk.
    async with await AgentRuntime.open(opened(tmp_path / "shared", kv_bits=None)) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        reply = await rt.chat(agent.id, "Parcel 0 is late.", max_tokens=12)
        assert reply.cache_source == "prefix"
        assert reply.usage.cached_tokens == head
        assert reply.token_ids == alone[0].token_ids


async def test_a_turn_whose_lookup_missed_a_head_takes_it_when_it_is_prefilled(tmp_path):
    """Two turns with one system prompt: the second reads the registry while the first is
    prefilling the head and checks for heads in flight only after that one has finished
    prefilling (its write not yet landed). It takes that head instead of prefilling again."""
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        prefixes = rt._caches.disk.prefixes
        looked_up = prefixes._stored
        calls = 0

        async def look_up_late(keys):
            nonlocal calls
            calls += 1
            found = await looked_up(keys)
            if calls == 2 and not found:  # the second turn's read missed the first's head
                async with asyncio.timeout(60):
                    while not prefixes.heads:
                        await asyncio.sleep(0.005)
                    await asyncio.shield(next(iter(prefixes.heads.values())))
            return found

        prefixes._stored = look_up_late
        agents_ = [await rt.create_agent(system_prompt=SYSTEM) for _ in range(2)]
        replies = await asyncio.gather(
            *(rt.chat(a.id, f"Parcel {i} is late.", max_tokens=4) for i, a in enumerate(agents_))
        )
        await rt.flush()
        assert calls == 2
        assert sorted(r.cache_source for r in replies) == ["none", "prefix"]
        head = max(r.usage.cached_tokens for r in replies)
        assert sum(r.usage.prefilled_tokens for r in replies) == (
            sum(r.usage.prompt_tokens for r in replies) - head
        )
        assert rt.stats()["disk"]["heads_in_flight"] == 0  # given up once stored


def prompt_tokens(model: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The tokens the model's chat template makes of ``messages`` (and ``tools``), ready for
    the answer."""
    tokenizer = load_tokenizer(tiny_model_dir(model))
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def head_length(model: str, system: str, question: str) -> int:
    """Where the user's turn begins: the tokens every conversation with ``system`` shares."""
    ask = prompt_tokens(model, asked(system, question))
    probes = [prompt_tokens(model, asked(system, probe)) for probe in "01"]
    return min(common_prefix(ask, probe) for probe in probes)


def user_turn(text: str) -> dict:
    return {"role": "user", "content": text}


def asked(system: str, text: str) -> list[dict]:
    return [{"role": "system", "content": system}, user_turn(text)]


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
@pytest.mark.parametrize(
    "bits", [(None, None), (8, 8), (4, 8)], ids=["exact", "q8-batch-q8-files", "q8-batch-q4-files"]
)
async def test_new_conversations_resume_all_of_a_shared_head_exactly(tmp_path, bits, model):
    # Sliding windows of 32 tokens: a cache cannot be cut back where a window moved on, so the
    # head's end is kept as a checkpoint. Stored blocks end at a block boundary short of it.
    # With batch_kv_bits the caches in memory are packed (the head's checkpoint too) and, with
    # files of the batch's bits, the stored blocks are read packed as stored; q4 files in a q8
    # batch are quantized again as they join, so their tokens are not compared.
    kv_bits, batch_kv_bits = bits
    opened = functools.partial(config, model=model)
    questions = [f"Parcel {i} is late." for i in range(4)]
    alone_config = opened(tmp_path / "alone", share_prefixes=False, batch_kv_bits=batch_kv_bits)
    async with await AgentRuntime.open(alone_config) as rt:
        alone = []
        for question in questions:
            agent = await rt.create_agent(system_prompt=SYSTEM)
            alone.append((await rt.chat(agent.id, question, max_tokens=12)).token_ids)
    head = head_length(model, SYSTEM, questions[0])
    whole_blocks = head // BLOCK * BLOCK
    assert head % BLOCK and whole_blocks >= 6 * BLOCK

    shared = opened(tmp_path / "shared", kv_bits=kv_bits, batch_kv_bits=batch_kv_bits)
    async with await AgentRuntime.open(shared) as rt:
        replies = []
        for question in questions[:2]:
            agent = await rt.create_agent(system_prompt=SYSTEM)
            replies.append(await rt.chat(agent.id, question, max_tokens=12))
        # The first stored the head's whole blocks and prefilled the rest of it alone, once;
        # the second resumes all of the head from the first one's cache in memory.
        assert [r.cache_source for r in replies] == ["none", "prefix"]
        assert [r.usage.cached_tokens for r in replies] == [0, head]
        if kv_bits == batch_kv_bits:
            assert [r.token_ids for r in replies] == alone[:2]
    # After a restart (nothing in memory) the stored blocks are read, the head's end is
    # prefilled once more, and from then on conversations resume all of it again.
    async with await AgentRuntime.open(shared) as rt:
        replies = []
        for question in questions[2:]:
            agent = await rt.create_agent(system_prompt=SYSTEM)
            replies.append(await rt.chat(agent.id, question, max_tokens=12))
        assert [r.cache_source for r in replies] == ["prefix", "prefix"]
        assert [r.usage.cached_tokens for r in replies] == [whole_blocks, head]
        if batch_kv_bits is None:
            assert [r.token_ids for r in replies] == alone[2:]
        elif kv_bits == batch_kv_bits:  # the stored blocks, read packed as stored
            assert replies[0].token_ids == alone[2]


async def test_a_q8_batch_computes_past_a_shared_head_alike_resumed_or_not(tmp_path):
    # A q8 batch reads a position's newest predecessors in float, but none across a shared
    # head's end: a conversation prefilled whole (prefixes not shared) holds the bytes of one
    # that resumed the head from another's cache. tiny:llama: every layer global, so a cache
    # in memory is cut at any token; these questions part at their first token.
    model, questions = "tiny:llama", ["Alpha parcels are late.", "Bravo parcels are late."]
    head = head_length(model, SYSTEM, questions[0])
    prompts = [prompt_tokens(model, asked(SYSTEM, q)) for q in questions]
    assert common_prefix(*prompts) == head and head % BLOCK

    async def second(share: bool) -> tuple[Reply, list[np.ndarray]]:
        settings = config(
            tmp_path / str(share), model, share_prefixes=share, kv_bits=8, batch_kv_bits=8
        )
        async with await AgentRuntime.open(settings) as rt:
            for question in questions:
                agent = await rt.create_agent(system_prompt=SYSTEM)
                reply = await rt.chat(agent.id, question, max_tokens=6)
            version = (await rt.get_agent(agent.id)).version
            resumed = await rt._caches.resume(agent.id, version)  # the batch's q8 words
            assert resumed is not None and resumed.source == "hot"
            n = len(prompts[1])
            arrays = [x for c in resumed.cache.layers for x in (c.keys, c.values)]
            return reply, await rt.engine.run(lambda: [np.array(x[..., :n, :]) for x in arrays])

    (alone, alone_kv), (shared, shared_kv) = await second(False), await second(True)
    assert (alone.cache_source, shared.cache_source) == ("none", "prefix")
    assert shared.usage.cached_tokens == head
    assert shared.token_ids == alone.token_ids
    # The shared head's last token was a decode row, the rest a chunk after it; prefilled
    # whole, all of them one chunk: matmuls of other shapes, alike up to rounding.
    for a, b in zip(alone_kv, shared_kv, strict=True):
        assert_q8_alike(a, b, HEAD_DIM)


async def test_a_compacted_conversation_resumes_its_shared_head(tmp_path):
    # Claude Code's /compact: the conversation is replaced by the system prompt and tools and a
    # summary. The agent's own cache has moved on by many turns; the head's end is still kept.
    turns = [f"Where is parcel {i}, and when does it arrive?" for i in range(4)]
    summary = asked(SYSTEM, "Summary: four parcels asked.")

    async def converse(rt: AgentRuntime, agent_id: str) -> list[Reply]:
        messages, replies = [{"role": "system", "content": SYSTEM}], []
        for text in turns:
            messages.append(user_turn(text))
            replies.append(await respond(rt, agent_id, messages))
            messages.append({"role": "assistant", "content": replies[-1].text})
        return [*replies, await respond(rt, agent_id, summary)]

    async with await AgentRuntime.open(config(tmp_path / "alone", share_prefixes=False)) as rt:
        await rt.create_agent("a")
        await converse(rt, "a")
        await rt.create_agent("b")
        alone = await respond(rt, "b", summary)
    async with await AgentRuntime.open(config(tmp_path / "shared", kv_bits=None)) as rt:
        await rt.create_agent("a")
        *talk, compacted = await converse(rt, "a")
    assert [r.cache_source for r in talk] == ["none", "hot", "hot", "hot"]
    assert compacted.cache_source == "hot"
    assert compacted.usage.cached_tokens == head_length("tiny:gemma3", SYSTEM, "Summary")
    assert compacted.token_ids == alone.token_ids


def tool(name: str, what: str) -> dict:
    properties = {"parcel": {"type": "string", "description": f"The parcel to {what}."}}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{what.capitalize()} a parcel by its tracking number; say why.",
            "parameters": {"type": "object", "properties": properties, "required": ["parcel"]},
        },
    }


async def test_another_system_prompt_with_the_same_tools_resumes_the_tools(tmp_path):
    # Claude Code in another project: the same tools, rendered before a system prompt that
    # differs early on (the project's paths). The end of the tools is kept as a head of its own.
    model = "tiny:tools"  # tools rendered first; a sliding window of 128 tokens
    tools = [tool(name, what) for name, what in (("track", "track"), ("hold", "hold back"))]
    asks = [
        [{"role": "system", "content": f"Project {p}. {SYSTEM}"}, user_turn("List them.")]
        for p in ("alpha", "beta")
    ]
    rendered = functools.partial(prompt_tokens, model, tools=tools)

    probes = [rendered([{"role": "system", "content": t}, user_turn("0")]) for t in "01"]
    tools_end = common_prefix(*probes)
    assert common_prefix(rendered(asks[0]), rendered(asks[1])) > tools_end > 10 * BLOCK

    async def answers(settings: RuntimeConfig) -> list[Reply]:
        async with await AgentRuntime.open(settings) as rt:
            replies = []
            for messages in asks:
                agent = await rt.create_agent()
                async for event in rt.respond(agent.id, messages, tools=tools, max_tokens=8):
                    reply = event
                replies.append(reply)
            return replies

    alone = await answers(config(tmp_path / "alone", model, share_prefixes=False))
    shared = await answers(config(tmp_path / "shared", model, kv_bits=None))
    assert [r.cache_source for r in shared] == ["none", "prefix"]
    assert shared[1].usage.cached_tokens == tools_end
    assert [r.token_ids for r in shared] == [r.token_ids for r in alone]


async def test_a_short_system_prompt_after_the_tools_is_found_again_after_a_restart(tmp_path):
    # The tools end a head of their own and the system prompt after them is shorter than a
    # block: the head's whole blocks are stored (with the sliding layers' window) before the
    # way goes on to the tools' end, so a new conversation after a restart resumes them.
    model = "tiny:tools"
    tools = [tool(name, what) for name, what in (("track", "track"), ("hold", "hold back"))]
    asks = [[{"role": "system", "content": "Be brief."}, user_turn(q)] for q in ("Hi", "Yo")]
    rendered = functools.partial(prompt_tokens, model, tools=tools)

    probes = [rendered([{"role": "system", "content": t}, user_turn("0")]) for t in "01"]
    tools_end = common_prefix(*probes)
    others = (asks[1], [asks[0][0], user_turn("0")])
    head = min(common_prefix(rendered(asks[0]), rendered(other)) for other in others)
    assert tools_end // BLOCK == head // BLOCK and tools_end > 10 * BLOCK  # one block apart

    async def answer(settings: RuntimeConfig, messages: list[dict]) -> Reply:
        async with await AgentRuntime.open(settings) as rt:
            agent = await rt.create_agent()
            async for event in rt.respond(agent.id, messages, tools=tools, max_tokens=8):
                reply = event
            return reply

    alone = await answer(config(tmp_path / "alone", model, share_prefixes=False), asks[1])
    shared = config(tmp_path / "shared", model, kv_bits=None)
    first = await answer(shared, asks[0])
    again = await answer(shared, asks[1])  # a restart between the two
    assert first.cache_source == "none" and again.cache_source == "prefix"
    assert again.usage.cached_tokens == head // BLOCK * BLOCK  # the head's whole blocks
    assert again.token_ids == alone.token_ids


async def test_global_attention_conversations_share_up_to_where_they_differ(tmp_path):
    # Every layer global (tiny:llama): any cache in memory can be cut at any token, so a new
    # conversation resumes another's up to the first token they differ in, past the head.
    report = " ".join(f"Parcel {i} left the depot at {i + 7} o'clock." for i in range(12))
    asks = [f"{report} Which parcel left {w}?" for w in ("first", "last")]
    model = "tiny:llama"
    async with await AgentRuntime.open(
        config(tmp_path / "alone", model, share_prefixes=False)
    ) as rt:
        alone = []
        for text in asks:
            agent = await rt.create_agent(system_prompt=SYSTEM)
            alone.append((await rt.chat(agent.id, text, max_tokens=12)).token_ids)
    async with await AgentRuntime.open(config(tmp_path / "shared", model, kv_bits=None)) as rt:
        replies = []
        for text in asks:
            agent = await rt.create_agent(system_prompt=SYSTEM)
            replies.append(await rt.chat(agent.id, text, max_tokens=12))
    prompts = [
        prompt_tokens(model, [{"role": "system", "content": SYSTEM}, user_turn(t)]) for t in asks
    ]
    shared = common_prefix(*prompts)
    assert shared > head_length(model, SYSTEM, asks[0]) + 8 * BLOCK  # the report is shared
    assert replies[1].cache_source == "prefix"
    assert replies[1].usage.cached_tokens == shared
    assert [r.token_ids for r in replies] == alone


async def respond(rt: AgentRuntime, agent_id: str, messages: list[dict]) -> Reply:
    reply = None
    async for event in rt.respond(agent_id, messages, max_tokens=8):
        reply = event
    assert isinstance(reply, Reply)
    return reply


async def test_whole_conversations_share_a_stored_system_prompt(tmp_path):
    async with await AgentRuntime.open(config(tmp_path, "tiny:tools", kv_bits=None)) as rt:
        seen = []
        for i in range(3):
            agent = await rt.create_agent()
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Where is parcel {i}?"},
            ]
            reply = None
            async for event in rt.respond(agent.id, messages, max_tokens=8):
                reply = event
            await rt.flush()
            seen.append((reply.cache_source, reply.usage.cached_tokens))
        assert seen[0] == ("none", 0)
        assert seen[1][0] == seen[2][0] == "prefix"
        # The third also resumes where the second parted from the first ("Where is parcel ").
        assert seen[2][1] >= seen[1][1] >= 6 * BLOCK


async def test_blocks_are_collected_when_no_cache_lists_them(tmp_path):
    async with await AgentRuntime.open(config(tmp_path, kv_bits=8)) as rt:
        a = await rt.create_agent(system_prompt=SYSTEM)
        b = await rt.create_agent(system_prompt=SYSTEM)
        await rt.chat(a.id, "First parcel?", max_tokens=8)
        await rt.chat(b.id, "Second parcel?", max_tokens=8)
        await rt.flush()
        only_a = set(await listed_blocks(rt, a.id)) - set(await listed_blocks(rt, b.id))
        shared = set(await listed_blocks(rt, a.id)) & set(await listed_blocks(rt, b.id))
        assert shared and only_a
        shared_files = {f.name for f in await files_of(rt, shared)}
        only_a_files = {f.name for f in await files_of(rt, only_a)}
        assert not shared_files & only_a_files

        await rt.delete_agent(a.id)
        names = block_files(rt)
        assert shared_files <= names
        assert not only_a_files & names
        assert await rows(rt, KVBlock) == len(await listed_blocks(rt, b.id))

        await rt.delete_agent(b.id)
        # The head a's turn stored for others (the system prompt's blocks and window) is kept
        # through every worker's collection for a while, listed or not; then it goes too.
        async with database(rt) as db, db.read() as session:
            pinned = set(await session.scalars(select(KVBlock.key)))
            assert pinned and all(
                until > utcnow() for until in await session.scalars(select(KVBlock.pinned_until))
            )
        head_files = {f.name for f in await files_of(rt, pinned)}
        assert pinned <= shared and block_files(rt) - head_files == {
            f"{key}.window.safetensors" for key in pinned if f"{key}.window.safetensors" in names
        }
        async with database(rt) as db, db.write() as session:
            await session.execute(update(KVBlock).values(pinned_until=utcnow()))
        await rt.engine.run(lambda: None)
        assert await rt._caches.disk.janitor.collect() == len(pinned)
        assert block_files(rt) == set()
        assert await rows(rt, KVBlock) == await rows(rt, KVCacheBlock) == 0
        assert rt.stats()["disk"] == rt.stats()["disk"] | {"bytes": 0, "files": 0, "blocks": 0}


async def test_a_corrupt_block_is_rebuilt_and_written_again(tmp_path, caplog):
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        first = await rt.chat(agent.id, "Where is it?", max_tokens=8)
        await rt.flush()
        keys = await listed_blocks(rt, agent.id)
        [path] = await files_of(rt, keys[2:3])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        reply = await rt.chat(agent.id, "And now?", max_tokens=8)
        assert reply.cache_source == "rebuilt"
        assert "unusable" in caplog.text
        await rt.flush()
        [again_path] = await files_of(rt, keys[2:3])  # written anew, intact
        assert keys[2] in json.loads(read_cache_file(again_path).metadata["keys"])
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        again = await rt.chat(agent.id, "Once more?", max_tokens=8)
        assert again.cache_source == "disk"
        assert again.usage.cached_tokens == reply.usage.prompt_tokens + len(reply.token_ids)
    assert first.usage.prompt_tokens < reply.usage.prompt_tokens


async def test_sweep_removes_unrecorded_block_files_only(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        await rt.chat(agent.id, "Hello?", max_tokens=8)
        await rt.flush()
        kept = block_files(rt)
    root = tmp_path / "caches" / BLOCKS_DIR
    stray = root / "ab" / ("ab" + "0" * 30 + ".safetensors")
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"left by a crash")
    stray_segment = root / "ab" / ("ab" + "2" * 30 + "-3.safetensors")
    stray_segment.write_bytes(b"not recorded")
    temp = root / "ab" / (".ab" + "1" * 30 + ".safetensors.tmp-x1y2")
    temp.write_bytes(b"half written")
    foreign = root / "ab" / "notes.txt"
    foreign.write_text("not ours")
    async with await AgentRuntime.open(config(tmp_path)) as rt:  # too young: maybe a worker's
        assert block_files(rt) == kept | {stray.name, stray_segment.name, temp.name, "notes.txt"}
    async with await AgentRuntime.open(config(tmp_path, sweep_grace_s=0)) as rt:
        assert block_files(rt) == kept | {"notes.txt"}
    assert foreign.exists() and not stray.exists() and not temp.exists()
    assert not stray_segment.exists()


async def test_fork_lists_the_same_blocks_without_copying(tmp_path):
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        await rt.chat(agent.id, "Hello?", max_tokens=8)
        await rt.flush()
        before = block_files(rt)
        fork = await rt.fork(agent.id)
        assert await listed_blocks(rt, fork.id) == await listed_blocks(rt, agent.id)
        assert block_files(rt) == before
        tails = [(await rt.cache_info(a)).stored for a in (agent.id, fork.id)]
        inodes = {(rt.config.caches_path / t.path).stat().st_ino for t in tails}
        assert len(inodes) == 1  # the tail is hard-linked, not copied
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        a = await rt.chat(agent.id, "Go on.", max_tokens=8)
        b = await rt.chat(fork.id, "Go on.", max_tokens=8)
        assert a.cache_source == b.cache_source == "disk"
        assert a.token_ids == b.token_ids


async def test_disk_budget_evicts_cold_agents_but_keeps_blocks_others_list(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        cold = await rt.create_agent(system_prompt=SYSTEM)
        await rt.chat(cold.id, "First?", max_tokens=8)
        await rt.flush()
        shared = set(await listed_blocks(rt, cold.id))
    budget = rt.stats()["disk"]["bytes"] * 5 // 4  # one agent's cache fits, two do not
    async with await AgentRuntime.open(config(tmp_path, disk_budget_bytes=budget)) as rt:
        warm = await rt.create_agent(system_prompt=SYSTEM)
        await rt.chat(warm.id, "Second?", max_tokens=8)
        await rt.flush()
        assert rt.stats()["disk"]["evictions"] == 1
        assert (await rt.cache_info(cold.id)).stored is None
        assert shared & set(await listed_blocks(rt, warm.id))
        warm_files = await files_of(rt, await listed_blocks(rt, warm.id))
        assert {f.name for f in warm_files} <= block_files(rt)
        assert rt.stats()["disk"]["bytes"] <= budget
        reply = await rt.chat(cold.id, "Back again?", max_tokens=8)
        # Its own cache is gone; its system prompt's head is still stored (warm lists it).
        assert reply.cache_source == "prefix"


async def test_a_format_1_cache_still_resumes_and_its_next_save_is_paged(tmp_path):
    from agentkv.engine.kv.encoded import FORMAT_VERSION, PAGED_FORMAT_VERSION
    from agentkv.engine.kv.whole import encode_cache
    from agentkv.store import NewCacheEntry
    from agentkv.store.cache_files import write_cache_file

    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        first = await rt.chat(agent.id, "Where is it?", max_tokens=8)
        await rt.flush()
        # Replace its cache entry with the same cache stored whole, as versions before paging.
        cache = await rt.export_cache(agent.id)
        encoded = await rt.engine.run(encode_cache, cache, None)
        rel = f"{agent.id}/000002-0a1d0f11.safetensors"
        meta = encoded.metadata | {
            "model_fingerprint": rt.engine.model.fingerprint,
            "message_count": "2",
        }
        info = write_cache_file(rt.config.caches_path / rel, encoded.tensors, meta)
        entry = NewCacheEntry(
            path=rel,
            token_count=cache.num_tokens,
            message_count=2,
            model_fingerprint=rt.engine.model.fingerprint,
            nbytes=info.nbytes,
            checksum=info.checksum,
            format_version=FORMAT_VERSION,
        )
        async with await Registry.open(rt.config.database) as registry:
            await registry.caches.set(agent.id, entry)
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        # A whole conversation checks the cache by its tokens: the format-1 file resumes. (A
        # chat turn would rebuild once: such files carry no digest of their conversation.)
        conversation = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Where is it?"},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And now?"},
        ]
        reply = [e async for e in rt.respond(agent.id, conversation, max_tokens=8)][-1]
        assert reply.cache_source == "disk"
        assert reply.usage.cached_tokens == first.usage.prompt_tokens + len(first.token_ids)
        await rt.flush()
        record = (await rt.cache_info(agent.id)).stored
        # (exact: no rotated keys, so the format every version reads)
        assert record.format_version == 2 < PAGED_FORMAT_VERSION and record.blocks
        assert not (rt.config.caches_path / rel).exists()


async def test_a_damaged_tail_header_means_no_cache_not_a_failed_turn(tmp_path, caplog):
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        await rt.chat(agent.id, "Where is it?", max_tokens=8)
        await rt.flush()
        tail = rt.config.caches_path / ((await rt.cache_info(agent.id)).stored).path
    data = tail.read_bytes()
    assert data.count(b'"tokens"') == 1  # still valid JSON, but a tensor is missing by name
    tail.write_bytes(data.replace(b'"tokens"', b'"tokenz"'))
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        reply = await rt.chat(agent.id, "And now?", max_tokens=8)
        assert reply.cache_source == "prefix"  # not an exception: its own cache is dropped
        assert "unusable" in caplog.text and "checksum" in caplog.text


async def test_a_cancelled_turn_waiting_for_a_shared_head_leaves_it_stored(tmp_path):
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        a, b, c = [await rt.create_agent(system_prompt=SYSTEM) for _ in range(3)]
        first = asyncio.ensure_future(rt.chat(a.id, "Parcel one?", max_tokens=8))
        waiting = asyncio.ensure_future(rt.chat(b.id, "Parcel two?", max_tokens=8))
        while not rt.stats()["disk"]["heads_in_flight"]:  # a is prefilling the head; b waits for it
            await asyncio.sleep(0.001)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (await first).cache_source == "none"
        await rt.flush()
        later = await rt.chat(c.id, "Parcel three?", max_tokens=8)
        assert later.cache_source == "prefix"
        assert rt.stats()["disk"]["pinned_blocks"] == 0  # every pin released
        assert await rt.transcript(b.id) == []  # the cancelled turn stored nothing


async def test_a_prompt_over_the_context_stores_no_shared_head(tmp_path):
    from agentkv import ContextLengthError

    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        limit = rt.engine.model.max_context
        with pytest.raises(ContextLengthError, match="prompt is too long"):
            await rt.chat(agent.id, "word " * limit, max_tokens=4)
        await rt.flush()
        assert block_files(rt) == set()  # its head was not prefilled nor stored
        stats = rt.engine.stats()
        assert stats.completed == stats.failed == stats.tokens_generated == 0  # nothing ran


def disk_bytes(rt: AgentRuntime) -> int:
    return sum(f.stat().st_size for f in rt.config.caches_path.rglob("*") if f.is_file())


async def test_a_segment_stays_while_a_cache_lists_any_of_its_blocks(tmp_path):
    turns = [("a", "First parcel?"), ("b", "Second parcel?"), ("b", "Go on.")]

    async def run(data_dir: Path, restart: bool) -> list[list[int]]:
        settings = config(data_dir, kv_bits=None, share_prefixes=False)
        async with await AgentRuntime.open(settings) as rt:
            for agent_id in ("a", "b"):
                await rt.create_agent(agent_id, system_prompt=SYSTEM)
            out = [(await rt.chat(a, t, max_tokens=8)).token_ids for a, t in turns[:2]]
            await rt.flush()
            if not restart:
                return [*out, (await rt.chat("b", turns[2][1], max_tokens=8)).token_ids]
            a_keys, b_keys = [await listed_blocks(rt, x) for x in ("a", "b")]
            shared = [k for k in b_keys if k in a_keys]
            assert shared and len(shared) < len(a_keys)
            a_files, b_files = [await files_of(rt, keys) for keys in (a_keys, b_keys)]
            assert len(a_files) == 1 and b_files[0] == a_files[0]  # b reads a part of a's

            await rt.delete_agent("a")
            # a's segment stays, with all its blocks, while b lists some of them.
            assert a_files[0].exists()
            assert await rows(rt, KVBlock) == len(set(a_keys) | set(b_keys))
            assert rt.stats()["disk"]["bytes"] == disk_bytes(rt)
            assert rt.stats()["disk"]["files"] == len(b_files) + 1
        async with await AgentRuntime.open(settings) as rt:
            reply = await rt.chat("b", turns[2][1], max_tokens=8)
            assert reply.cache_source == "disk"
            await rt.delete_agent("b")
            assert block_files(rt) == set()
            assert await rows(rt, KVBlock) == 0
            assert rt.stats()["disk"]["bytes"] == disk_bytes(rt) == 0
            return [*out, reply.token_ids]

    assert await run(tmp_path / "restart", True) == await run(tmp_path / "straight", False)


async def test_blocks_stored_one_per_file_still_resume(tmp_path):
    """Caches written before segments (each block in ``<key>.safetensors``) still load, and
    their files stay while listed."""
    from sqlalchemy import update

    from agentkv.engine.kv.encoded import EncodedCache
    from agentkv.engine.kv.paged import split_blocks
    from agentkv.store.cache_files import write_cache_file

    settings = config(tmp_path, kv_bits=None, share_prefixes=False)
    async with await AgentRuntime.open(settings) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        first = await rt.chat(agent.id, "Where is it?", max_tokens=8)
        await rt.flush()
        keys = await listed_blocks(rt, agent.id)
        [segment] = await files_of(rt, keys)
        file = read_cache_file(segment)
        meta = {k: v for k, v in file.metadata.items() if k != "keys"}
        for key, block in zip(
            keys, split_blocks(EncodedCache(file.tensors, file.metadata), BLOCK), strict=True
        ):
            path = rt.config.caches_path / BLOCKS_DIR / key[:2] / f"{key}.safetensors"
            write_cache_file(path, block.tensors, meta | {"key": key})
        segment.unlink()
        async with database(rt) as db, db.write() as session:
            await session.execute(update(KVBlock).values(segment=None, segment_index=None))
        legacy = block_files(rt)
        assert legacy == {f"{k}.safetensors" for k in keys}
    async with await AgentRuntime.open(settings) as rt:
        assert block_files(rt) == legacy  # the sweep keeps recorded block files
        reply = await rt.chat(agent.id, "And now?", max_tokens=8)
        assert reply.cache_source == "disk"
        assert reply.usage.cached_tokens == first.usage.prompt_tokens + len(first.token_ids)
        await rt.flush()
        new = [k for k in await listed_blocks(rt, agent.id) if k not in keys]
        [segment] = block_files(rt) - legacy
        assert segment_of(segment) == f"{new[-1]}-{len(new)}"
    async with await AgentRuntime.open(settings) as rt:
        again = await rt.chat(agent.id, "Once more?", max_tokens=8)
        assert again.cache_source == "disk"  # old block files and a new segment, together


async def test_blocks_stored_meanwhile_are_cut_out_of_a_segment(tmp_path):
    """A save whose segment holds blocks another save stored since it looked writes only the
    rest, as a segment of its own: what a save of just those blocks writes."""
    from agentkv.engine.kv.paged import encode_paged

    settings = config(tmp_path, kv_bits=None, share_prefixes=False)
    async with await AgentRuntime.open(settings) as rt:
        agent = await rt.create_agent(system_prompt=SYSTEM)
        await rt.chat(agent.id, "Where is it?", max_tokens=8)
        await rt.flush()
        first = await listed_blocks(rt, agent.id)
        await rt.chat(agent.id, "Tell me more about the route, the depots and the vans.")
        await rt.flush()
        keys = await listed_blocks(rt, agent.id)
        [second] = await files_of(rt, keys[len(first) :])
        before = read_cache_file(second)
        second.unlink()  # its blocks are recorded but their file is gone (removed as corrupt)

        cache = await rt.export_cache(agent.id)
        paged = await rt.engine.run(encode_paged, cache, None, 32, BLOCK)  # every block
        assert list(paged.segments) == [0]
        written: list[Path] = []
        # A saver of its own over the same store (registry file, layout, model).
        async with await Registry.open(rt.config.database) as registry:
            writes = Writes()
            try:
                shared = Shared(layout_of(rt), registry, rt.engine, writes, DiskStats())
                saver = Saver(shared, Janitor(shared, None, lambda _: asyncio.Lock()))
                blocks = await asyncio.to_thread(saver.write_segments, paged, keys, written)
            finally:
                await writes.close()
        # Only the blocks whose file was gone, as a segment of the same blocks (a new file).
        [rewritten] = written
        assert rewritten.parent == second.parent and rewritten != second
        assert segment_of(rewritten.name) == segment_of(second.name)
        assert [(b.key, b.segment_index) for b in blocks] == [
            (k, i) for i, k in enumerate(keys[len(first) :])
        ]
        # The same tensors and metadata (the checksum covers both; the header's key order is
        # not fixed by safetensors, so the bytes may differ).
        again = read_cache_file(rewritten)
        assert again.checksum == before.checksum and again.metadata == before.metadata
        assert again.tensors.keys() == before.tensors.keys()
        for name, x in before.tensors.items():
            assert np.array_equal(again.tensors[name], x)


async def test_a_damaged_window_is_removed_and_stored_again(tmp_path, caplog):
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        first = await rt.create_agent(system_prompt=SYSTEM)
        await rt.chat(first.id, "Parcel 1?", max_tokens=8)
        await rt.unload(first.id)  # (in memory, its cache would hold the head for others)
        [window] = [f for f in (rt.config.caches_path / BLOCKS_DIR).glob("*/*.window.*")]
        # The header says something else than what was checksummed (same length, valid JSON).
        data = window.read_bytes()
        assert data.count(b'"block_tokens":"16"') == 1
        window.write_bytes(data.replace(b'"block_tokens":"16"', b'"block_tokens":"61"'))

        second = await rt.create_agent(system_prompt=SYSTEM)
        reply = await rt.chat(second.id, "Parcel 2?", max_tokens=8)
        assert reply.cache_source == "none" and "unusable" in caplog.text
        await rt.unload(second.id)
        assert read_cache_file(window).metadata["block_tokens"] == "16"  # stored again, intact
        third = await rt.create_agent(system_prompt=SYSTEM)
        assert (await rt.chat(third.id, "Parcel 3?", max_tokens=8)).cache_source == "prefix"


def test_the_hot_tier_counts_a_shared_head_once_while_an_entry_holds_it():
    head = Checkpoint(5, {}, 40, head=True)
    turn = Checkpoint(7, {}, 30)

    def cache(nbytes: int, *points: Checkpoint) -> PromptCache:
        return PromptCache([], list(range(9)), nbytes=nbytes, window_nbytes=0, checkpoints=points)

    hot = HotTier(budget_bytes=1000)
    hot.put("a", cache(100, turn, head), 2, "")
    hot.put("b", cache(200, head), 2, "")
    assert hot.nbytes == 100 + 30 + 200 + 40
    assert hot.report()["shared_heads"] == 1
    hot.drop("a")
    assert hot.nbytes == 200 + 40
    hot.put("b", cache(250, head), 4, "")  # replaced: the head is still held, once
    assert hot.nbytes == 250 + 40
    hot.drop("b")
    assert hot.nbytes == 0 and hot.report()["shared_heads"] == 0
    # Over the budget with its checkpoints, an entry is kept without them.
    hot.put("c", cache(990, turn, head), 2, "")
    assert hot.nbytes == 990 and hot.get("c").cache.checkpoints == ()
    # Holding a new entry evicts the least recently used ones, heads included.
    hot.put("d", cache(500, head), 2, "")
    assert len(hot) == 1 and hot.nbytes == 540 and hot.evictions == 1
