"""AgentRuntime end to end: real SQLite files, real tiny models, real cache files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from pydantic import ValidationError

import agentkv
import agentkv.engine.errors
import agentkv.errors
import agentkv.store.errors
from agentkv import (
    AgentExistsError,
    AgentKVError,
    AgentNotFoundError,
    AgentRuntime,
    CacheInfo,
    ContextLengthError,
    EmptyMessageError,
    EngineOverloadedError,
    InvalidAgentIdError,
    InvalidMessageError,
    RegistryStorageError,
    RuntimeConfig,
    SamplingParams,
    TextDelta,
)
from agentkv.engine.errors import CacheFormatError
from agentkv.engine.kv.assemble import assemble_paged
from agentkv.engine.kv.encoded import EncodedCache
from agentkv.engine.kv.paged import split_blocks
from agentkv.prompt import ChatRenderer
from agentkv.store import NewCacheEntry, Registry
from agentkv.store.cache_files import read_cache_file

SYSTEM_S = [{"role": "system", "content": "S"}]
TURNS = [
    "Tell me about the sea.",
    "And the mountains, in more detail please?",
    "Compare the two for me.",
    "Which would you visit first and why?",
]


def config(data_dir: Path, model: str = "tiny:gemma3", **kw) -> RuntimeConfig:
    return RuntimeConfig(model=model, data_dir=data_dir, **kw)


async def run_turns(rt, agent_id, turns, others=(), max_tokens=24):
    """Each turn of ``agent_id`` runs alongside a turn of every agent in ``others``."""
    replies = []
    for i, text in enumerate(turns):
        batch = [rt.chat(agent_id, text, max_tokens=max_tokens)]
        batch += [rt.chat(o, f"side chat {i} of {o}", max_tokens=max_tokens) for o in others]
        replies.append((await asyncio.gather(*batch))[0])
    return replies


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:llama", "tiny:hybrid"])
async def test_resume_after_restart_equals_uninterrupted(tmp_path, model):
    async with await AgentRuntime.open(config(tmp_path / "one", model, kv_bits=None)) as rt:
        await rt.create_agent("a", system_prompt="You are a guide.")
        await rt.create_agent("b", system_prompt="You are a poet.")
        await rt.create_agent("c")
        straight = await run_turns(rt, "a", TURNS, others=("b", "c"))

    data = tmp_path / "two"
    async with await AgentRuntime.open(config(data, model, kv_bits=None)) as rt:
        await rt.create_agent("a", system_prompt="You are a guide.")
        await rt.create_agent("b", system_prompt="You are a poet.")
        await rt.create_agent("c")
        first_half = await run_turns(rt, "a", TURNS[:2], others=("b", "c"))
    async with await AgentRuntime.open(config(data, model, kv_bits=None)) as rt:
        second_half = await run_turns(rt, "a", TURNS[2:], others=("b", "c"))
        transcript = await rt.transcript("a")

    resumed = first_half + second_half
    assert [r.token_ids for r in resumed] == [r.token_ids for r in straight]
    assert [r.cache_source for r in resumed] == ["none", "hot", "disk", "hot"]
    assert resumed[2].usage.cached_tokens > 32  # the history crossed the sliding window
    assert [m.content for m in transcript] == [
        x for turn, r in zip(TURNS, resumed, strict=True) for x in (turn, r.text)
    ]


async def test_sources_usage_and_streaming(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        agent = await rt.create_agent(system_prompt="Be brief.")
        first = await rt.chat(agent.id, "Hello", max_tokens=10)
        assert first.cache_source == "none" and first.usage.cached_tokens == 0
        pieces, reply = [], None
        async for event in rt.stream(agent.id, "Go on", max_tokens=12):
            if isinstance(event, TextDelta):
                pieces.append(event.text)
            else:
                reply = event
        assert reply.cache_source == "hot"
        assert "".join(pieces) == reply.text
        assert (
            reply.usage.cached_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        )
        assert reply.usage.completion_tokens == len(reply.token_ids)
        assert reply.timings.ttft_s <= reply.timings.total_s
        assert rt.stats()["cache_sources"] == {"none": 1, "hot": 1}


async def test_logprobs_come_with_the_reply_and_its_streamed_pieces(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        agent = await rt.create_agent()
        plain = await rt.chat(agent.id, "Hello", max_tokens=10)
        assert plain.logprobs is None and plain.message_id is not None
        pieces, reply = [], None
        async for event in rt.stream(agent.id, "Go on", max_tokens=12, logprobs=2):
            if isinstance(event, TextDelta):
                pieces.append(event)
            else:
                reply = event
        assert [lp.token_id for lp in reply.logprobs] == reply.token_ids
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in reply.logprobs)
        streamed = [lp for piece in pieces for lp in piece.logprobs]
        assert streamed == reply.logprobs[: len(streamed)] and len(streamed) >= len(pieces)
        assert [m.id for m in await rt.transcript(agent.id)][-1] == reply.message_id
        texts = await rt.token_bytes(reply.token_ids)
        # A lone byte of a random model's reply reads as U+FFFD in its text.
        shown = b"".join(texts[: len(streamed)]).decode("utf-8", "replace")
        assert shown == "".join(p.text for p in pieces)


async def test_agent_default_sampling_and_per_call_override(tmp_path):
    seeded = SamplingParams(temperature=1.0, seed=7)
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("s1", sampling=seeded)
        await rt.create_agent("s2", sampling=seeded)
        await rt.create_agent("g")
        assert (await rt.get_agent("s1")).sampling == {"temperature": 1.0, "seed": 7}
        a, b, greedy = await asyncio.gather(
            rt.chat("s1", "Hi", max_tokens=16),
            rt.chat("s2", "Hi", max_tokens=16),
            rt.chat("g", "Hi", max_tokens=16),
        )
        assert a.token_ids == b.token_ids != greedy.token_ids
        await rt.create_agent("s3", sampling=seeded)
        override = await rt.chat("s3", "Hi", max_tokens=16, sampling=SamplingParams())
        assert override.token_ids == greedy.token_ids


async def test_cache_info_export_and_unload_show_what_is_held(tmp_path):
    async with await AgentRuntime.open(config(tmp_path, kv_bits=None)) as rt:
        await rt.create_agent("c")
        assert await rt.cache_info("c") == CacheInfo(None, (), None)
        assert await rt.export_cache("c") is None
        await rt.chat("c", "Hello there", max_tokens=6)
        await rt.flush()
        info = await rt.cache_info("c")
        hot = await rt.export_cache("c")
        assert info.hot_tokens == hot.num_tokens == info.stored.token_count > 0
        assert info.files[0] == rt.config.caches_path / info.stored.path
        assert all(f.is_file() for f in info.files)
        await rt.unload("c")
        assert (await rt.cache_info("c")).hot_tokens is None
        from_disk = await rt.export_cache("c")  # read from its files, exact (kv_bits=None)
        assert from_disk.tokens == hot.tokens
        for a, b in zip(from_disk.layers, hot.layers, strict=True):
            assert type(a) is type(b) and a.offset == b.offset
            assert mx.array_equal(a.state[0], b.state[0]).item()
        again = await rt.chat("c", "Again", max_tokens=4)
        assert again.cache_source == "disk"
        for call in (rt.cache_info, rt.export_cache, rt.unload):
            with pytest.raises(AgentNotFoundError):
                await call("nobody")


async def test_quantized_caches_resume_from_disk(tmp_path):
    for bits in (8, 4):
        data = tmp_path / f"q{bits}"
        async with await AgentRuntime.open(config(data, kv_bits=bits)) as rt:
            await rt.create_agent("q")
            await rt.chat("q", "Hello there", max_tokens=20)
        async with await AgentRuntime.open(config(data, kv_bits=bits)) as rt:
            entry = (await rt.cache_info("q")).stored
            group = 128  # each precision's own (the head size 64: in 64s)
            assert (entry.kv_bits, entry.group_size, entry.message_count) == (bits, group, 2)
            reply = await rt.chat("q", "Again", max_tokens=8)
            assert reply.cache_source == "disk"
            assert len(await rt.transcript("q")) == 4


async def test_a_cache_resumed_from_quantized_files_holds_its_exact_first_position(tmp_path):
    """A q4 file read back into a batch in the model's precision: its global layers hold the
    first token's keys and values as the model computes them, not as the words give them
    (the loader's own test: the other positions are the file's)."""
    data = tmp_path / "q4"
    async with await AgentRuntime.open(config(data, kv_bits=4)) as rt:
        await rt.create_agent("q")
        await rt.chat("q", "Hello there, tell me a story", max_tokens=20)
    async with await AgentRuntime.open(config(data, kv_bits=4)) as rt:
        engine = rt._engine
        resumed = await rt._caches.resume("q")
        assert resumed is not None and resumed.source == "disk"
        cache = resumed.cache
        first = await engine.run(engine.first_positions, cache.tokens[0])
        globals_ = [i for i, x in enumerate(cache.layers) if not isinstance(x, RotatingKVCache)]
        assert globals_
        for i in globals_:
            layer = cache.layers[i]
            for held, want in zip((layer.keys, layer.values), first[i], strict=True):
                same = await engine.run(
                    lambda h=held, w=want: mx.array_equal(h[..., :1, :].astype(w.dtype), w).item()
                )
                assert same, i
        reply = await rt.chat("q", "Again", max_tokens=8)
        assert reply.cache_source == "disk"


async def test_a_q8_cache_saved_in_other_groups_resumes_and_is_saved_again_in_the_new(tmp_path):
    """Caches saved in q8 groups of 32 (the default before keys were rotated) resume from disk
    under the default groups, and the next save stores them in those."""
    data = tmp_path / "q8"
    async with await AgentRuntime.open(config(data, kv_group_size=32, batch_kv_bits=8)) as rt:
        await rt.create_agent("q")
        await rt.chat("q", "Hello there", max_tokens=12)
        await rt.flush()
        assert (await rt.cache_info("q")).stored.group_size == 32
    async with await AgentRuntime.open(config(data, batch_kv_bits=8)) as rt:
        reply = await rt.chat("q", "Again", max_tokens=8)
        assert reply.cache_source == "disk"
        assert reply.usage.cached_tokens > 0
        await rt.flush()
        assert (await rt.cache_info("q")).stored.group_size == 128
        assert len(await rt.transcript("q")) == 4


@pytest.mark.parametrize("bits", [8, 4])
async def test_device_and_host_dequantization_resume_identically(tmp_path, bits):
    """On a GPU a quantized cache is dequantized on the device, on a CPU in a worker thread:
    both give the cache the same bits, so the resumed turn's tokens are the same."""
    data = tmp_path / "data"
    async with await AgentRuntime.open(config(data, kv_bits=bits)) as rt:
        await rt.create_agent("d")
        await rt.chat("d", "Hello there, tell me a story", max_tokens=20)
    replies = []
    for on_gpu in (False, True):
        copy = tmp_path / f"on_gpu={on_gpu}"
        shutil.copytree(data, copy)
        async with await AgentRuntime.open(config(copy, kv_bits=bits)) as rt:
            rt.engine.model.on_gpu = on_gpu  # white-box: take the device path on this CPU
            replies.append(await rt.chat("d", "Again", max_tokens=12))
    assert [r.cache_source for r in replies] == ["disk", "disk"]
    assert replies[0].token_ids == replies[1].token_ids
    assert replies[0].usage.cached_tokens == replies[1].usage.cached_tokens > 0


async def saved_cache_path(data: Path, agent_id: str) -> Path:
    async with await AgentRuntime.open(config(data)) as rt:
        await rt.create_agent(agent_id)
        await rt.chat(agent_id, "First turn", max_tokens=12)
        await rt.flush()
        entry = (await rt.cache_info(agent_id)).stored
    return rt.config.caches_path / entry.path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", [truncate, flip, Path.unlink], ids=["truncated", "flipped", "missing"]
)
async def test_damaged_cache_file_is_rebuilt_from_transcript(tmp_path, damage, caplog):
    path = await saved_cache_path(tmp_path, "x")
    damage(path)
    with caplog.at_level(logging.WARNING, logger="agentkv.caches.load"):
        async with await AgentRuntime.open(config(tmp_path)) as rt:
            reply = await rt.chat("x", "Second turn", max_tokens=6)
            assert reply.cache_source == "rebuilt"
            assert [m.content for m in await rt.transcript("x")][::2] == [
                "First turn",
                "Second turn",
            ]
            assert (await rt.chat("x", "Third", max_tokens=4)).cache_source == "hot"
    assert "rebuilding from its transcript" in caplog.text


async def test_cache_file_of_another_model_is_rebuilt(tmp_path):
    foreign = await saved_cache_path(tmp_path / "gemma", "x")  # written by tiny:gemma3...
    async with await AgentRuntime.open(config(tmp_path, model="tiny:llama")) as rt:
        await rt.create_agent("x")
        await rt.chat("x", "First turn", max_tokens=4)
        await rt.flush()
        entry = (await rt.cache_info("x")).stored
        target = rt.config.caches_path / entry.path
        target.write_bytes(foreign.read_bytes())  # ...placed where tiny:llama's file was
        from agentkv.store.cache_files import read_cache_file

        checksum = read_cache_file(target).checksum
        async with await Registry.open(rt.config.database) as registry:
            await registry.caches.set(
                "x",
                NewCacheEntry(
                    path=entry.path,
                    token_count=entry.token_count,
                    model_fingerprint=entry.model_fingerprint,
                    nbytes=target.stat().st_size,
                    checksum=checksum,
                    format_version=entry.format_version,
                    kv_bits=entry.kv_bits,
                    group_size=entry.group_size,
                    message_count=entry.message_count,
                ),
            )
        await rt.unload("x")
        reply = await rt.chat("x", "Second turn", max_tokens=4)
        assert reply.cache_source == "rebuilt"


async def test_bad_input_errors(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("ok")
        with pytest.raises(AgentNotFoundError):
            await rt.chat("nobody", "hi")
        for empty in ("", "   \n"):
            with pytest.raises(EmptyMessageError):
                await rt.chat("ok", empty)
        for bad in ("../x", "a/b", "", "x" * 65):
            with pytest.raises(InvalidAgentIdError):
                await rt.create_agent(bad)
            with pytest.raises(InvalidAgentIdError):
                await rt.chat(bad, "hi")
        with pytest.raises(ContextLengthError, match=r"^prompt is too long: \d+ tokens > 8191 max"):
            await rt.chat("ok", "hi " * 9000)
        assert await rt.transcript("ok") == []


async def test_max_tokens_is_clamped_to_the_context_left(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("full")

        async def count(n: int) -> int:
            return await rt.count_tokens([{"role": "user", "content": "hi " * n}])

        low, high = 1, 9000  # the longest prompt that leaves a few tokens of context
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if await count(mid) <= 8190 else (low, mid - 1)
        prompt = await count(low)
        reply = await rt.chat("full", "hi " * low, max_tokens=100_000)
        assert reply.usage.prompt_tokens == prompt
        assert reply.usage.completion_tokens <= 8192 - prompt


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_bits", 3), ("kv_group_size", 48), ("hot_cache_bytes", -1), ("model", "")],
)
def test_invalid_config_names_the_field(tmp_path, field, value):
    with pytest.raises(ValidationError, match=field):
        RuntimeConfig(**{"model": "tiny:gemma3", "data_dir": tmp_path, field: value})


async def test_hundred_concurrent_chats_to_one_agent_are_ordered(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("busy")
        replies = await asyncio.gather(
            *(rt.chat("busy", f"msg {i}", max_tokens=2) for i in range(100))
        )
        transcript = await rt.transcript("busy")
    assert [m.position for m in transcript] == list(range(200))
    assert [m.content for m in transcript[::2]] == [f"msg {i}" for i in range(100)]
    assert [m.content for m in transcript[1::2]] == [r.text for r in replies]
    assert [r.cache_source for r in replies] == ["none"] + ["hot"] * 99


async def test_abandoned_stream_rolls_the_turn_back(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("a")
        first = await rt.chat("a", "one", max_tokens=6)
        async with contextlib.aclosing(rt.stream("a", "two", max_tokens=500)) as s:
            async for _ in s:
                break
        assert [m.content for m in await rt.transcript("a")] == ["one", first.text]
        again = await rt.chat("a", "two", max_tokens=6)
        assert again.cache_source == "hot"
        assert (
            again.usage.cached_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        )


async def test_delete_agent_leaves_no_files(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("gone")
        await rt.create_agent("kept")
        for _ in range(3):
            await asyncio.gather(
                rt.chat("gone", "hi", max_tokens=4), rt.chat("kept", "hi", max_tokens=4)
            )
        await rt.flush()
        caches = rt.config.caches_path
        assert len(list((caches / "gone").iterdir())) == 1  # old files replaced, not piling up
        await rt.delete_agent("gone")
        assert not (caches / "gone").exists()
        assert len(list((caches / "kept").iterdir())) == 1
        assert [a.id for a in await rt.list_agents()] == ["kept"]
        with pytest.raises(AgentNotFoundError):
            await rt.chat("gone", "hi")


KILLED_RIGHT_AFTER_REPLY = textwrap.dedent(
    """
    import asyncio, os, sys
    from agentkv import AgentRuntime, RuntimeConfig

    async def main():
        rt = await AgentRuntime.open(RuntimeConfig(model="tiny:gemma3", data_dir=sys.argv[1]))
        await rt.create_agent("k")
        await rt.chat("k", "before the crash", max_tokens=8)
        reply = await rt.chat("k", "the crash", max_tokens=8)
        print(reply.text, flush=True)
        os._exit(0)  # no close(), no flush: the last cache write may never happen

    asyncio.run(main())
    """
)


async def test_process_killed_right_after_a_reply_resumes_or_rebuilds(tmp_path):
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", KILLED_RIGHT_AFTER_REPLY, str(tmp_path)],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        entry = (await rt.cache_info("k")).stored
        reply = await rt.chat("k", "after the crash", max_tokens=6)
        assert reply.cache_source in ("disk", "rebuilt")
        if reply.cache_source == "disk":  # the newest cache written before the kill
            assert reply.usage.cached_tokens == entry.token_count
            assert entry.message_count in (2, 4)
        contents = [m.content for m in await rt.transcript("k")]
    assert contents[::2] == ["before the crash", "the crash", "after the crash"]
    assert len(contents) == 6


async def test_imported_history_is_prefilled_then_cached(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("imp", system_prompt="S")
        history = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]
        await rt.append_messages("imp", history)
        first = await rt.chat("imp", "u2", max_tokens=4)
        assert first.cache_source == "rebuilt"
        expected = await rt.count_tokens([*history, {"role": "user", "content": "u2"}], system="S")
        assert first.usage.prompt_tokens == expected
        await rt.append_messages("imp", [{"role": "user", "content": "aside"}])
        second = await rt.chat("imp", "u3", max_tokens=4)
        assert second.cache_source == "hot"
        assert (
            second.usage.cached_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        )
        contents = [m.content for m in await rt.transcript("imp")]
        assert contents == ["u1", "a1", "u2", first.text, "aside", "u3", second.text]
        with pytest.raises(ValueError, match="role must be 'user' or 'assistant'"):
            await rt.append_messages("imp", [{"role": "system", "content": "x"}])


async def test_close_lets_turns_in_flight_finish(tmp_path):
    rt = await AgentRuntime.open(config(tmp_path))
    await rt.create_agent("late")
    turn = asyncio.create_task(rt.chat("late", "still talking", max_tokens=200))
    await asyncio.sleep(0.01)
    assert not turn.done()
    await rt.close()
    reply = await turn
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        assert [m.content for m in await rt.transcript("late")] == ["still talking", reply.text]
        assert (await rt.chat("late", "again", max_tokens=4)).cache_source == "disk"


async def test_orphaned_cache_files_are_swept_on_open(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("a")
        await rt.chat("a", "hi", max_tokens=4)
    caches = tmp_path / "caches"
    (kept,) = (caches / "a").glob("*.safetensors")
    (caches / "a" / "000000-deadbeef.safetensors").write_bytes(b"left by a crash")
    (caches / "a" / f".{kept.name}.tmp-abc123").write_bytes(b"half written")
    (caches / "ghost").mkdir()
    (caches / "ghost" / "000002-aaaa.safetensors").write_bytes(b"agent deleted elsewhere")
    (caches / "notes.txt").write_text("not ours: left alone")
    (caches / "a" / "mine.safetensors").write_bytes(b"a name agentkv never writes: left alone")
    (caches / "a" / "000003-bbbb.safetensors").mkdir()  # ours by name, but cannot be unlinked
    everything = sorted(p.relative_to(caches).as_posix() for p in caches.rglob("*"))
    async with await AgentRuntime.open(config(tmp_path)):  # another worker may be writing them
        assert sorted(p.relative_to(caches).as_posix() for p in caches.rglob("*")) == everything
    async with await AgentRuntime.open(config(tmp_path, sweep_grace_s=0)) as rt:  # logged only
        left = sorted(p.relative_to(caches).as_posix() for p in caches.rglob("*"))
        assert left == sorted(
            ["a", "a/000003-bbbb.safetensors", f"a/{kept.name}", "a/mine.safetensors", "notes.txt"]
        )
        assert (await rt.chat("a", "again", max_tokens=4)).cache_source == "disk"


async def test_history_given_with_a_turn_is_stored_with_it_or_not_at_all(tmp_path):
    history = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("imp", system_prompt="S")
        # Refused (too long for the context): neither the history nor the turn is stored.
        with pytest.raises(ContextLengthError, match="prompt is too long"):
            await rt.chat("imp", "word " * 9000, history=history)
        assert await rt.transcript("imp") == []
        # A turn abandoned after its first piece of text stores nothing either.
        stream = rt.stream("imp", "u2", history=history, max_tokens=50)
        async with contextlib.aclosing(stream):
            assert isinstance(await anext(stream), TextDelta)
        assert await rt.transcript("imp") == []
        reply = await rt.chat("imp", "u2", history=history, max_tokens=4)
        assert reply.cache_source == "none"
        expected = await rt.count_tokens([*history, {"role": "user", "content": "u2"}], "S")
        assert reply.usage.prompt_tokens == expected
        contents = [(str(m.role), m.content) for m in await rt.transcript("imp")]
        assert contents == [
            ("user", "u1"),
            ("assistant", "a1"),
            ("user", "u2"),
            ("assistant", reply.text),
        ]


@pytest.mark.parametrize("where", ["message", "history", "system_prompt", "count_tokens"])
async def test_lone_surrogates_are_invalid_input_and_store_nothing(tmp_path, where):
    bad = "caf\ud800e"
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("s")
        with pytest.raises(InvalidMessageError, match=r"lone surrogate '\\ud800' at character 3"):
            if where == "message":
                await rt.chat("s", bad, max_tokens=2)
            elif where == "history":
                await rt.chat("s", "hi", history=[{"role": "user", "content": bad}])
            elif where == "system_prompt":
                await rt.create_agent("t", system_prompt=bad)
            else:
                await rt.count_tokens([{"role": "user", "content": bad}])
        assert [a.id for a in await rt.list_agents()] == ["s"]
        assert await rt.transcript("s") == []
        reply = await rt.chat("s", "caf\u00e9 \U0001f600", max_tokens=2)  # real non-ASCII is fine
        first, *_ = await rt.transcript("s")
        assert first.content == "caf\u00e9 \U0001f600"
        assert reply.finish_reason in ("stop", "length")


@pytest.fixture
def held_commits(monkeypatch) -> SimpleNamespace:
    """Turns' commits held at the registry write: ``entered`` is set when one gets there, and
    it (and every later one) goes on once ``release`` is set."""
    real_append = Registry.append_messages
    held = SimpleNamespace(entered=asyncio.Event(), release=asyncio.Event())

    async def held_append(*args, **kwargs):
        held.entered.set()
        await held.release.wait()
        return await real_append(*args, **kwargs)

    monkeypatch.setattr(Registry, "append_messages", held_append)
    return held


async def test_close_waits_for_the_commit_of_a_cancelled_caller(tmp_path, held_commits):
    """A caller cancelled while its finished turn is being stored: close() must not close the
    registry under that commit, and the turn must be there after a restart."""
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("c")
        caller = asyncio.create_task(rt.chat("c", "hello there", max_tokens=4))
        await held_commits.entered.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        closing = asyncio.create_task(rt.close())
        await asyncio.sleep(0.05)
        assert not closing.done()  # waiting for the commit, not closing the registry
        held_commits.release.set()
        await closing
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        transcript = await rt.transcript("c")
        assert [(str(m.role), m.content) for m in transcript][:1] == [("user", "hello there")]
        assert len(transcript) == 2
        again = await rt.chat("c", "more", max_tokens=2)
        assert again.cache_source == "disk"


async def test_a_cancelled_callers_commit_keeps_the_agent_until_it_is_stored(
    tmp_path, held_commits
):
    entered, release = held_commits.entered, held_commits.release
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("c")
        caller = asyncio.create_task(rt.chat("c", "first", max_tokens=4))
        await entered.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller  # the caller goes at once...
        entered.clear()
        following = asyncio.create_task(rt.chat("c", "second", max_tokens=4))
        await asyncio.sleep(0.1)
        assert not entered.is_set()  # ...but the next turn waits for its commit
        release.set()
        reply = await following
        assert reply.cache_source == "hot"  # it planned from the stored first turn
        contents = [m.content for m in await rt.transcript("c")]
        assert contents[0::2] == ["first", "second"]


async def test_count_tokens_renders_off_the_event_loop(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        renderer = ChatRenderer(rt.engine.tokenizer, rt.engine.model.eos_token_ids)
        threads = []  # the threads the rendering runs on
        real = ChatRenderer.full_prompt

        def recording(self, messages, tools=None):
            threads.append(threading.current_thread())
            return real(self, messages, tools)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ChatRenderer, "full_prompt", recording)
            count = await rt.count_tokens([{"role": "user", "content": "hello"}], "S")
        assert count == len(real(renderer, [*SYSTEM_S, {"role": "user", "content": "hello"}]))
        assert threads and threading.main_thread() not in threads


async def test_no_mlx_call_on_the_event_loop_during_a_seeded_turn(tmp_path):
    """The seeded sampler's PRNG key and the hot tier's byte count are made on the
    generation thread (MLX has thread affinity)."""
    calls = []
    real_key = mx.random.key

    def recording_key(seed):
        calls.append(("key", threading.current_thread()))
        return real_key(seed)

    nbytes = {cls: cls.nbytes for cls in (KVCache, RotatingKVCache)}

    def recording_nbytes(cls):
        def get(self):
            calls.append(("nbytes", threading.current_thread()))
            return nbytes[cls].fget(self)

        return property(get)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.random, "key", recording_key)
        for cls in nbytes:
            mp.setattr(cls, "nbytes", recording_nbytes(cls))
        async with await AgentRuntime.open(config(tmp_path)) as rt:
            await rt.create_agent("m")
            seeded = SamplingParams(temperature=0.8, seed=7)
            await rt.chat("m", "hello", max_tokens=3, sampling=seeded)
    assert {kind for kind, _ in calls} == {"key", "nbytes"}
    assert all(t is not threading.main_thread() for _, t in calls), calls


def test_every_public_error_derives_from_one_root():
    classes = [
        obj
        for module in (agentkv, agentkv.engine.errors, agentkv.store.errors, agentkv.errors)
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, Exception)
    ]
    assert len(classes) > 20
    assert all(issubclass(cls, AgentKVError) for cls in classes), [
        c for c in classes if not issubclass(c, AgentKVError)
    ]
    for cls in (AgentNotFoundError, EngineOverloadedError, CacheFormatError, RegistryStorageError):
        assert issubclass(cls, AgentKVError)


async def test_disk_budget_evicts_the_caches_of_the_agents_idle_longest(tmp_path):
    turn = {"max_tokens": 6}
    async with await AgentRuntime.open(config(tmp_path / "probe")) as rt:
        await rt.create_agent("p")
        await rt.chat("p", "Tell me a story", **turn)
        await rt.flush()
        one_cache = rt.stats()["disk"]["bytes"]
    assert one_cache > 0
    budget = int(2.5 * one_cache)
    data = tmp_path / "data"
    cfg = config(data, disk_budget_bytes=budget, hot_cache_bytes=0)
    async with await AgentRuntime.open(cfg) as rt:
        for agent_id in ("a", "b", "c"):  # "a" is the one idle longest
            await rt.create_agent(agent_id)
            await rt.chat(agent_id, "Tell me a story", **turn)
            await rt.flush()
        disk = rt.stats()["disk"]
        assert (disk["files"], disk["evictions"], disk["budget_bytes"]) == (2, 1, budget)
        assert disk["bytes"] <= budget
        assert (await rt.cache_info("a")).stored is None
        assert sorted(p.parent.name for p in (data / "caches").glob("*/*.safetensors")) == [
            "b",
            "c",
        ]
        again = await rt.chat("a", "And then?", **turn)  # evicted: rebuilt from its transcript
        assert again.cache_source == "rebuilt"
        assert len(await rt.transcript("a")) == 4
        assert (await rt.chat("c", "And then?", **turn)).cache_source == "disk"


async def test_auto_budgets_are_shares_of_memory_and_free_space(tmp_path, monkeypatch):
    free = 10**9
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))
    held = tmp_path / "caches" / "a" / "x.bin"
    held.parent.mkdir(parents=True)
    held.write_bytes(b"x" * 1000)
    os.link(held, held.with_name("y.bin"))  # a fork's hard-linked tail counts once
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hot = min(int(memory * 0.10), 4 * 1024**3)
    auto = config(tmp_path)
    assert (auto.hot_cache_bytes, auto.disk_budget_bytes) == ("auto", "auto")
    async with await AgentRuntime.open(auto) as rt:
        assert (rt.config.hot_cache_bytes, rt.config.disk_budget_bytes) == (
            hot,
            int(0.25 * (free + 1000)),
        )
        assert rt.stats()["hot_tier"]["budget_bytes"] == hot
        assert rt.stats()["disk"]["budget_bytes"] == int(0.25 * (free + 1000))
    given = config(tmp_path, hot_cache_bytes=5, disk_budget_bytes=None).resolved()
    assert (given.hot_cache_bytes, given.disk_budget_bytes) == (5, None)
    with pytest.raises(ValidationError, match="disk_budget_bytes"):
        config(tmp_path, disk_budget_bytes="lots")


async def test_agents_with_an_idle_ttl_expire_and_others_stay(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("keeps")
        await rt.create_agent("short", idle_ttl_s=1)
        await rt.create_agent("busy", idle_ttl_s=1)
        for agent_id in ("keeps", "short", "busy"):
            await rt.chat(agent_id, "hi", max_tokens=2)
        assert await rt.expire_agents() == []  # within its TTL
        await asyncio.sleep(1.2)
        turn = rt.stream("busy", "again", max_tokens=4)
        await anext(turn)  # "busy" has a turn in flight (it holds the agent until closed)
        assert await rt.expire_agents() == ["short"]
        await turn.aclose()
        assert [a.id for a in await rt.list_agents()] == ["keeps", "busy"]
        assert not (tmp_path / "caches" / "short").exists()
        assert await rt.expire_agents() == ["busy"]
        assert (await rt.get_agent("keeps")).idle_ttl_s is None
    with pytest.raises(ValidationError):
        RuntimeConfig(model="tiny:gemma3", disk_budget_bytes=-1)


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_fork_continues_the_conversation_from_the_same_cache(tmp_path, model):
    async with await AgentRuntime.open(config(tmp_path, model, kv_bits=None)) as rt:
        await rt.create_agent("src", system_prompt="You are a guide.")
        await run_turns(rt, "src", TURNS[:2])
        forked = await rt.fork("src", "copy", name="Copy")
        assert (forked.name, forked.system_prompt) == ("Copy", "You are a guide.")
        assert [(m.role, m.content) for m in await rt.transcript("copy")] == [
            (m.role, m.content) for m in await rt.transcript("src")
        ]
        a, b = await asyncio.gather(rt.chat("src", TURNS[2]), rt.chat("copy", TURNS[2]))
        assert b.cache_source == "hot" and b.usage.cached_tokens == a.usage.cached_tokens > 0
        assert a.token_ids == b.token_ids  # the same history, the same exact cache
        with pytest.raises(AgentExistsError):
            await rt.fork("src", "copy")
        with pytest.raises(AgentNotFoundError):
            await rt.fork("nobody")
        await rt.flush()
        before = {p.parent.name: p for p in (tmp_path / "caches").glob("*/*.safetensors")}
        assert set(before) == {"src", "copy"}
        late = await rt.fork("src", "late")  # after the saves: the file is linked, not copied
    files = {p.parent.name: p for p in (tmp_path / "caches").glob("*/*.safetensors")}
    assert files["late"].stat().st_ino == files["src"].stat().st_ino
    assert files["copy"].stat().st_ino != files["src"].stat().st_ino  # each turn wrote its own
    async with await AgentRuntime.open(config(tmp_path, model, kv_bits=None)) as rt:
        y = await rt.chat("src", TURNS[3])  # replaces (unlinks) its old file
        await rt.delete_agent("src")
        assert not (tmp_path / "caches" / "src").exists()
        x = await rt.chat(late.id, TURNS[3])  # its link outlived the source's files
        assert (x.cache_source, y.cache_source) == ("disk", "disk")
        assert x.token_ids == y.token_ids


async def test_a_turn_over_the_kv_budget_is_refused_and_stores_nothing(tmp_path):
    budget = 2 * 1024 * 1024
    engine_config = agentkv.EngineConfig(kv_budget_bytes=budget)
    async with await AgentRuntime.open(config(tmp_path, engine=engine_config)) as rt:
        await rt.create_agent("a")
        first = await rt.chat("a", "hello there", max_tokens=6)
        with pytest.raises(agentkv.KVBudgetError, match="generated") as refused:
            await rt.chat("a", "tell me everything " * 400, max_tokens=6)
        assert refused.value.budget_bytes == budget < refused.value.needed_bytes
        assert [m.content for m in await rt.transcript("a")] == ["hello there", first.text]
        again = await rt.chat("a", "tell me everything", max_tokens=6000)
        assert again.cache_source == "hot"  # the agent is as it was before the refused turn


async def test_an_agents_logit_bias_is_stored_and_used_after_a_restart(tmp_path):
    forced = SamplingParams(logit_bias={42: 100})
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("biased", sampling=forced)
        first = await rt.chat("biased", "hello", max_tokens=4)
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        assert (await rt.get_agent("biased")).sampling == {"logit_bias": {"42": 100.0}}
        again = await rt.chat("biased", "again", max_tokens=4)
    assert first.token_ids == again.token_ids == [42] * 4


# ---- quantized KV in memory (batch_kv_bits) --------------------------------------------------


def stored_tensors(info: CacheInfo, block_tokens: int) -> dict[str, tuple[int, np.ndarray]]:
    """Every stored tensor of an agent's cache (its tail and blocks joined, numpy), by name,
    with the position of its first entry."""
    tail = read_cache_file(info.files[0])
    by_key = {}
    for path in info.files[1:]:
        file = read_cache_file(path)
        keys = json.loads(file.metadata["keys"])
        blocks = split_blocks(EncodedCache(file.tensors, file.metadata), block_tokens)
        by_key |= dict(zip(keys, blocks, strict=True))
    blocks = [by_key[key] for key in info.stored.blocks]
    whole = assemble_paged(EncodedCache(tail.tensors, tail.metadata), blocks)
    layouts = json.loads(whole.metadata["layers"])
    return {
        name: (layouts[int(name.split(".")[1])]["offset"] - x.shape[2], x)
        for name, x in whole.tensors.items()
        if name != "tokens"
    }


async def resume_from_disk_and_compare(data: Path, batch_kv_bits: int | None, hot: int, turns: int):
    """An agent's turns (each resumed from disk when ``hot`` is 0): their tokens, the stored
    bytes compared between consecutive saves (positions both hold) and those that changed."""
    block = 16
    cfg = config(
        data, kv_bits=8, batch_kv_bits=batch_kv_bits, kv_block_tokens=block, hot_cache_bytes=hot
    )
    got, compared, changed = [], 0, []
    async with await AgentRuntime.open(cfg) as rt:
        await rt.create_agent("a", system_prompt="You are terse.")
        before = None
        for turn in range(turns):
            reply = await rt.chat("a", f"Turn {turn}: go on with the story.", max_tokens=12)
            got.append(reply.token_ids)
            await rt.flush()
            if turn:
                assert reply.cache_source == ("disk" if hot == 0 else "hot")
            if hot:
                continue
            now = stored_tensors(await rt.cache_info("a"), block)
            assert any(name.endswith(".q") for name in now)
            for name, (start, x) in (before or {}).items():
                again_start, again = now[name]
                low = max(start, again_start)
                end = start + x.shape[2]
                assert end <= again_start + again.shape[2]
                if end <= low:  # a window that moved past all it held
                    continue
                old = x[:, :, low - start :]
                new = again[:, :, low - again_start : end - again_start]
                compared += old.nbytes
                if old.tobytes() != new.tobytes():
                    changed.append((turn, name))
            before = now
    return got, compared, changed


async def test_q8_caches_go_from_disk_to_a_q8_batch_and_back_without_drift(tmp_path):
    """kv_bits=8 on disk and batch_kv_bits=8 in memory: a resume packs the stored words as
    they are and a save stores the batch's, so across ten resumes from disk every position a
    save stored is stored again bit for bit (the sliding windows' too), and each turn's
    tokens are those of resuming from the hot tier instead."""
    from_disk, compared, changed = await resume_from_disk_and_compare(tmp_path / "d", 8, 0, 11)
    assert compared > 0 and changed == []
    from_hot, _, _ = await resume_from_disk_and_compare(tmp_path / "h", 8, 1 << 30, 11)
    assert from_disk == from_hot


async def test_a_float_batch_requantizes_what_it_resumed_from_a_q8_file(tmp_path):
    """The control: with the batch in the model's precision, each resume expands the stored
    words and the next save quantizes them again, which moves some of them."""
    _, compared, changed = await resume_from_disk_and_compare(tmp_path, None, 0, 3)
    assert compared > 0 and changed


async def test_the_hot_tier_holds_caches_as_the_batch_held_them(tmp_path):
    """With batch_kv_bits the hot tier keeps the packed rows (bytes per token by precision in
    stats and /metrics), a resume from it is packed already, and export_cache expands them."""
    per_token = {}
    for bits in (None, 8, 4):
        cfg = config(tmp_path / f"b{bits}", batch_kv_bits=bits, kv_bits=8)
        async with await AgentRuntime.open(cfg) as rt:
            await rt.create_agent("h")
            await rt.chat("h", "Hello there, tell me a story", max_tokens=20)
            await rt.flush()
            report = rt.stats()["hot_tier"]
            precision = "model" if bits is None else f"q{bits}"
            assert list(report["by_precision"]) == [precision]
            row = report["by_precision"][precision]
            assert row["agents"] == 1 and row["bytes"] == report["bytes"] > 0
            held = rt._caches.hot.get("h").cache
            assert row["tokens"] == held.num_tokens
            assert row["token_bytes"] == held.nbytes / held.num_tokens
            per_token[bits] = row["token_bytes"]
            exported = await rt.export_cache("h")
            assert exported.packing is None
            assert all(layer.keys.dtype == mx.float32 for layer in exported.layers)
            if bits == 4:  # per position held: q4's bytes, and 48 positions in float
                for packed, floats in zip(held.layers, exported.layers, strict=True):
                    position = floats.nbytes / floats.keys.shape[2]
                    quantized = packed.nbytes / packed.keys.shape[2]
                    # Keys per channel in 5-bit codes over 32 positions, values in 4-bit ones
                    # in groups of 64 (128 does not divide the head size 64), each group's
                    # float16 scale and bias; the newest 16 and an open key group in float.
                    keys, values = 5 / 8 + 4 / 32, 0.5 + 4 / 64
                    assert quantized / position == pytest.approx((keys + values) / 2 / 4)
                    # (5-bit key words and a word of scales: not 4-bit keys over 16 positions,
                    # which take as many bytes)
                    assert packed.keys.shape[-1] == 64 * 5 // 32 + 64 // 32
                    assert sum(x.nbytes for x in packed.recent) == (16 + 32) * position
            again = await rt.chat("h", "Again", max_tokens=4)
            assert again.cache_source == "hot"
    # A float32 value is 4 bytes; at q8 in groups of 64 (128 does not divide the head size
    # 64) it is 1 byte, plus a float16 scale and bias (4 bytes) a group of 64.
    assert per_token[8] / per_token[None] == pytest.approx((1 + 4 / 64) / 4, rel=0.02)
    # q4: about half a byte a value and its scales and biases, but 48 positions in float (more
    # than this short cache holds: q4 pays off for long histories).
    assert per_token[4] > per_token[8]


@pytest.mark.parametrize(
    ("batch_bits", "disk_bits"), [(8, None), (8, 4), (4, 4), (4, 8), (4, None)]
)
async def test_a_batch_quantized_otherwise_than_the_disk_still_resumes(
    tmp_path, batch_bits, disk_bits
):
    """batch_kv_bits beside other kv_bits (and q4 beside q4: the batch's newest positions
    are float): saves store the batch's rows expanded (then quantized as the file says),
    resumes pack what they read."""
    cfg = config(tmp_path, kv_bits=disk_bits, batch_kv_bits=batch_bits, hot_cache_bytes=0)
    async with await AgentRuntime.open(cfg) as rt:
        await rt.create_agent("m")
        for text in ("Hello there", "Go on", "And then?"):
            reply = await rt.chat("m", text, max_tokens=8)
        await rt.flush()
        assert reply.cache_source == "disk"
        assert (await rt.cache_info("m")).stored.kv_bits == disk_bits
        assert len(await rt.transcript("m")) == 6


def test_runtime_batch_kv_bits_is_the_engines():
    from agentkv.engine.config import EngineConfig

    def engine(**kw):
        return RuntimeConfig(model="m", **kw).engine_config()

    assert engine(batch_kv_bits=8).batch_kv_bits == 8
    assert engine(engine=EngineConfig(batch_kv_bits=4)).batch_kv_bits == 4
    assert engine().batch_kv_bits is None
    assert engine(kv_group_size=64).batch_kv_group_size == 64
    given = EngineConfig(batch_kv_group_size=128, batch_kv_bits=8)
    assert engine(kv_group_size=64, engine=given).batch_kv_group_size == 128
    # Unset, each precision quantizes in its own groups, disk and batch alike.
    assert engine(batch_kv_bits=8).batch_group_size == 128
    assert engine(batch_kv_bits=4).batch_group_size == 128  # (q4: of the values)
    assert RuntimeConfig(model="m").disk_group_size == 128  # kv_bits 8
    assert RuntimeConfig(model="m", kv_bits=4).disk_group_size == 128
    assert RuntimeConfig(model="m", kv_bits=4, kv_group_size=64).disk_group_size == 64
    copied = RuntimeConfig(model="m").model_copy(update={"batch_kv_bits": 8})
    assert copied.engine_config().batch_kv_bits == 8
    with pytest.raises(ValidationError, match="disagree"):
        RuntimeConfig(model="m", batch_kv_bits=8, engine=EngineConfig(batch_kv_bits=4))
    with pytest.raises(ValidationError, match="batch_kv_bits"):
        RuntimeConfig(model="m", batch_kv_bits=3)
