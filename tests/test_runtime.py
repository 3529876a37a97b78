"""AgentRuntime end to end: real SQLite files, real tiny models, real cache files."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from agents import (
    AgentNotFoundError,
    AgentRuntime,
    ContextLengthError,
    EmptyMessageError,
    InvalidAgentIdError,
    RuntimeConfig,
    SamplingParams,
    TextDelta,
)
from store import NewCacheEntry

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


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:llama"])
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


async def test_quantized_caches_resume_from_disk(tmp_path):
    for bits in (8, 4):
        data = tmp_path / f"q{bits}"
        async with await AgentRuntime.open(config(data, kv_bits=bits)) as rt:
            await rt.create_agent("q")
            await rt.chat("q", "Hello there", max_tokens=20)
        async with await AgentRuntime.open(config(data, kv_bits=bits)) as rt:
            entry = await rt._registry.get_cache("q")
            assert (entry.kv_bits, entry.group_size, entry.message_count) == (bits, 64, 2)
            reply = await rt.chat("q", "Again", max_tokens=8)
            assert reply.cache_source == "disk"
            assert len(await rt.transcript("q")) == 4


async def saved_cache_path(data: Path, agent_id: str) -> Path:
    async with await AgentRuntime.open(config(data)) as rt:
        await rt.create_agent(agent_id)
        await rt.chat(agent_id, "First turn", max_tokens=12)
        await rt.flush()
        entry = await rt._registry.get_cache(agent_id)
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
    with caplog.at_level(logging.WARNING, logger="agents.persistence"):
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
        entry = await rt._registry.get_cache("x")
        target = rt.config.caches_path / entry.path
        target.write_bytes(foreign.read_bytes())  # ...placed where tiny:llama's file was
        from store.cache_files import read_cache_file

        checksum = read_cache_file(target).checksum
        await rt._registry.set_cache(
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
        rt._hot.drop("x")
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

        def count(n: int) -> int:
            return rt.count_tokens([{"role": "user", "content": "hi " * n}])

        low, high = 1, 9000  # the longest prompt that leaves a few tokens of context
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if count(mid) <= 8190 else (low, mid - 1)
        prompt = count(low)
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
    from agents import AgentRuntime, RuntimeConfig

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
        entry = await rt._registry.get_cache("k")
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
        expected = rt.count_tokens([*history, {"role": "user", "content": "u2"}], system="S")
        assert first.usage.prompt_tokens == expected
        await rt.append_messages("imp", [{"role": "user", "content": "aside"}])
        second = await rt.chat("imp", "u3", max_tokens=4)
        assert second.cache_source == "hot"
        assert (
            second.usage.cached_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        )
        contents = [m.content for m in await rt.transcript("imp")]
        assert contents == ["u1", "a1", "u2", first.text, "aside", "u3", second.text]
        with pytest.raises(ValueError, match="user/assistant"):
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
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        left = sorted(p.relative_to(caches).as_posix() for p in caches.rglob("*"))
        assert left == ["a", f"a/{kept.name}", "notes.txt"]
        assert (await rt.chat("a", "again", max_tokens=4)).cache_source == "disk"
