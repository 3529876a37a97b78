"""A cache is used only for the conversation it was made from (agents.turns)."""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.messages import transcript_messages
from agentkv.prompt import ChatRenderer

FIRST = {"a0": "My name is Ada and I keep bees.", "a1": "My name is Bob; I sail boats."}


def config(data_dir: Path) -> RuntimeConfig:
    return RuntimeConfig(model="tiny:gemma3", data_dir=data_dir, kv_bits=None)


async def make_agents(data_dir: Path) -> None:
    """Two agents with transcripts of the same shape (so message counts alone cannot tell
    their caches apart), both caches saved."""
    async with await AgentRuntime.open(config(data_dir)) as rt:
        for agent_id, text in FIRST.items():
            await rt.create_agent(agent_id, system_prompt="Answer briefly.")
            await rt.chat(agent_id, text, max_tokens=8)
        await rt.flush()


def swap_caches(data_dir: Path) -> None:
    """Give each agent the other's cache: registry rows and files, as a restore from the
    wrong backup would."""
    caches = data_dir / "caches"
    shutil.move(caches / "a0", caches / "tmp")
    shutil.move(caches / "a1", caches / "a0")
    shutil.move(caches / "tmp", caches / "a1")
    with sqlite3.connect(data_dir / "agentkv.sqlite") as db:
        for table in ("kv_caches", "kv_cache_blocks"):
            for old, new in (("a0", "tmp"), ("a1", "a0"), ("tmp", "a1")):
                db.execute(f"UPDATE {table} SET agent_id = ? WHERE agent_id = ?", (new, old))
        for new, old in (("a0", "a1"), ("a1", "a0")):  # the paths of the files as moved
            db.execute(
                "UPDATE kv_caches SET path = ? || substr(path, 3) WHERE agent_id = ?", (new, new)
            )
            assert old != new


async def rebuilt_reply(rt: AgentRuntime, agent_id: str, text: str) -> list[int]:
    """The greedy reply of a fresh agent given ``agent_id``'s transcript but its last turn,
    to ``text``."""
    agent = await rt.get_agent(agent_id)
    history = [(str(m.role), m.content) for m in await rt.transcript(agent_id)][:-2]
    await rt.create_agent(f"{agent_id}-copy", system_prompt=agent.system_prompt)
    await rt.append_messages(f"{agent_id}-copy", [{"role": r, "content": c} for r, c in history])
    reply = await rt.chat(f"{agent_id}-copy", text, max_tokens=8)
    assert reply.cache_source == "rebuilt"
    return reply.token_ids


async def test_swapped_caches_are_rebuilt_from_each_agents_own_transcript(tmp_path, caplog):
    await make_agents(tmp_path)
    swap_caches(tmp_path)
    with caplog.at_level(logging.WARNING, logger="agentkv.chat_turn"):
        async with await AgentRuntime.open(config(tmp_path)) as rt:
            # The swap took: a0's entry now holds a1's conversation.
            foreign = await rt.export_cache("a0")
            a1_history = transcript_messages(await rt.get_agent("a1"), await rt.transcript("a1"))
            renderer = ChatRenderer(rt.engine.tokenizer, rt.engine.model.eos_token_ids)
            assert FIRST["a1"] in renderer.tokenizer.decode(list(foreign.tokens))
            assert len(await rt.transcript("a0")) == len(a1_history) - 1  # same shape
            replies = {a: await rt.chat(a, "What is my name?", max_tokens=8) for a in FIRST}
            for agent_id, reply in replies.items():
                assert reply.cache_source == "rebuilt"
                cache = await rt.export_cache(agent_id)
                own = transcript_messages(
                    await rt.get_agent(agent_id), await rt.transcript(agent_id)
                )[:-1]
                assert list(cache.tokens[: reply.usage.prompt_tokens]) == renderer.full_prompt(own)
                assert reply.token_ids == await rebuilt_reply(rt, agent_id, "What is my name?")
            # The rebuilt caches are the agents' own: the next turns resume them.
            for agent_id in FIRST:
                assert (await rt.chat(agent_id, "Thanks.", max_tokens=4)).cache_source == "hot"
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "agentkv.chat_turn" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 2
    for agent_id, message in zip(FIRST, warnings, strict=True):
        assert message.startswith(f"agent {agent_id!r}: its disk cache was made from")
        assert "not from the 2 messages of its transcript it claims to cover" in message


async def test_hot_cache_of_a_transcript_changed_underneath_is_not_used(tmp_path, caplog):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("a0", system_prompt="Answer briefly.")
        await rt.chat("a0", FIRST["a0"], max_tokens=8)
        await rt.flush()
        # Another writer (a restored backup, a manual fix) changes the stored conversation.
        with sqlite3.connect(tmp_path / "agentkv.sqlite") as db:
            db.execute(
                "UPDATE messages SET content = ? WHERE agent_id = 'a0' AND position = 0",
                (FIRST["a1"],),
            )
        with caplog.at_level(logging.WARNING, logger="agentkv.chat_turn"):
            reply = await rt.chat("a0", "What is my name?", max_tokens=8)
        assert reply.cache_source == "rebuilt"
        assert "its hot cache was made from a conversation with digest" in caplog.text
        renderer = ChatRenderer(rt.engine.tokenizer, rt.engine.model.eos_token_ids)
        own = transcript_messages(await rt.get_agent("a0"), await rt.transcript("a0"))[:-1]
        assert own[1]["content"] == FIRST["a1"]
        cache = await rt.export_cache("a0")
        assert list(cache.tokens[: reply.usage.prompt_tokens]) == renderer.full_prompt(own)


async def test_a_fork_resumes_the_cache_it_shares(tmp_path, caplog):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("a0", system_prompt="Answer briefly.")
        await rt.chat("a0", FIRST["a0"], max_tokens=8)
        await rt.fork("a0", "a0-fork")
        await rt.flush()
        await rt.unload("a0-fork")
        with caplog.at_level(logging.WARNING, logger="agentkv.chat_turn"):
            assert (await rt.chat("a0-fork", "More.", max_tokens=4)).cache_source == "disk"
            assert (await rt.chat("a0", "More.", max_tokens=4)).cache_source == "hot"
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_every_turn_logs_one_line_with_its_cache_source_and_costs(tmp_path, caplog):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        await rt.create_agent("a0")
        with caplog.at_level(logging.INFO, logger="agentkv.turns"):
            first = await rt.chat("a0", FIRST["a0"], max_tokens=4)
            second = await rt.chat("a0", "More.", max_tokens=4)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "agentkv.turns" and r.levelno == logging.INFO
    ]
    assert len(lines) == 2
    for line, reply in zip(lines, (first, second), strict=True):
        u = reply.usage
        assert line.startswith(
            f"agent 'a0': cache {reply.cache_source}, prompt {u.prompt_tokens} tokens "
            f"({u.cached_tokens} cached, {u.prompt_tokens - u.cached_tokens} prefilled), "
            f"{u.completion_tokens} generated, ttft "
        )
    assert (first.cache_source, second.cache_source) == ("none", "hot")
    assert second.usage.cached_tokens == first.usage.prompt_tokens + len(first.token_ids)
