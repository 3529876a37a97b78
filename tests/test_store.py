"""The agent registry against real SQLite files and PostgreSQL databases: CRUD, cascades, ids,
ordering under concurrency."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import closing
from dataclasses import FrozenInstanceError
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event

from agentkv.store import (
    AgentExistsError,
    AgentNotFoundError,
    InvalidAgentIdError,
    InvalidRecordError,
    NewCacheEntry,
    NewMessage,
    NewResponse,
    Registry,
    RegistryClosedError,
    RegistryStorageError,
    ResponseNotFoundError,
    ResponseRecord,
    Role,
    is_valid_agent_id,
    validate_agent_id,
)
from agentkv.store.models import Agent
from tests import postgres

ENTRY = NewCacheEntry(
    path="a/cache-1.safetensors",
    token_count=12,
    message_count=3,
    model_fingerprint="f" * 64,
    nbytes=4096,
    checksum="c" * 64,
    format_version=1,
    kv_bits=8,
    group_size=64,
)
REJECTED_IDS = ["../x", "a/b", "", "a" * 65, ".hidden", "a..b", "a b", "é"]
ACCEPTED_IDS = ["a" * 64, "a", "Agent_1.v-2"]

Call = Callable[[Registry, Any], Awaitable[object]]
# Every method that takes an agent id, called with harmless other arguments.
CALLS: dict[str, Call] = {
    "get_agent": lambda r, a: r.get_agent(a),
    "delete_agent": lambda r, a: r.delete_agent(a),
    "append_messages": lambda r, a: r.append_messages(a, [NewMessage("user", "hi")]),
    "transcript": lambda r, a: r.transcript(a),
    "message_count": lambda r, a: r.message_count(a),
    "set_cache": lambda r, a: r.caches.set(a, ENTRY),
    "get_cache": lambda r, a: r.caches.get(a),
}


SQLITE_ONLY = pytest.mark.parametrize("registry_url", ["sqlite"], indirect=True)
"""For tests of SQLite's own limits (a page limit, a read-only connection)."""


@pytest.fixture
async def registry(registry_url: str) -> AsyncIterator[Registry]:
    """A registry on each backend (conftest's ``registry_url``: a SQLite file, a PostgreSQL
    database)."""
    async with await Registry.open(registry_url) as registry:
        yield registry


async def rows(target: str, sql: str) -> list[tuple[Any, ...]]:
    """Run ``sql`` with the database's own driver (sqlite3, asyncpg), bypassing the registry
    entirely; a change is committed."""
    if target.startswith("postgresql"):
        return await postgres.fetch(target, sql)
    with closing(sqlite3.connect(target)) as db, db:
        return db.execute(sql).fetchall()


async def test_create_get_list(registry: Registry) -> None:
    b = await registry.create_agent(
        "b",
        name="Bee",
        system_prompt="Be brief.",
        model_fingerprint="m" * 64,
        sampling={"temperature": 0.7, "stop": ["\n"]},
    )
    a = await registry.create_agent("a")

    assert (b.id, b.name, b.system_prompt, b.model_fingerprint) == (
        "b",
        "Bee",
        "Be brief.",
        "m" * 64,
    )
    assert b.sampling == {"temperature": 0.7, "stop": ["\n"]}
    assert (a.name, a.system_prompt, a.model_fingerprint, a.sampling) == ("a", None, None, {})
    assert a.created_at.tzinfo is UTC and a.created_at == a.updated_at
    assert await registry.get_agent("b") == b
    assert await registry.get_agent("a") == a
    assert await registry.list_agents() == [b, a]  # creation order, not id order


async def test_model_defaults_apply_to_plain_orm_inserts(registry: Registry) -> None:
    async with registry._db.write() as session:
        session.add(Agent(id="raw"))
    raw = await registry.get_agent("raw")
    assert (raw.name, raw.sampling, raw.created_at.tzinfo) == ("raw", {}, UTC)


@pytest.fixture
def away_from_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time 5 hours behind UTC (and back after the test)."""
    monkeypatch.setenv("TZ", "EST+5")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize(
    "registry_url",
    [
        "sqlite",
        pytest.param("postgresql", marks=[pytest.mark.postgresql]),
    ],
    indirect=True,
)
async def test_timestamps_are_stored_as_utc(
    registry: Registry, registry_url: str, away_from_utc: None
) -> None:
    agent = await registry.create_agent("t")
    stored: Any = agent.created_at  # PostgreSQL: an instant (timestamptz)
    if not registry_url.startswith("postgresql"):  # SQLite: text, the UTC time without offset
        stored = agent.created_at.strftime("%Y-%m-%d %H:%M:%S.%f")
    assert await rows(registry_url, "SELECT created_at, updated_at FROM agents") == [
        (stored, stored)
    ]
    assert (await registry.get_agent("t")).created_at == agent.created_at


async def test_generated_ids_follow_the_rule(registry: Registry) -> None:
    first, second = await registry.create_agent(), await registry.create_agent()
    assert re.fullmatch(r"agent-[0-9a-f]{12}", first.id)
    assert first.id != second.id
    assert is_valid_agent_id(first.id)


async def test_duplicate_id_raises_and_keeps_the_original(registry: Registry) -> None:
    await registry.create_agent("dup", name="original")
    with pytest.raises(AgentExistsError, match="'dup'") as info:
        await registry.create_agent("dup", name="impostor")
    assert info.value.agent_id == "dup"
    assert (await registry.get_agent("dup")).name == "original"


async def test_concurrent_creates_of_one_id_yield_exactly_one_agent(registry: Registry) -> None:
    results = await asyncio.gather(
        *(registry.create_agent("same", name=f"n{i}") for i in range(10)),
        return_exceptions=True,
    )
    assert sum(isinstance(result, AgentExistsError) for result in results) == 9
    assert [agent.id for agent in await registry.list_agents()] == ["same"]


@pytest.mark.parametrize("method", CALLS)
async def test_unknown_agent_raises_not_found(registry: Registry, method: str) -> None:
    await registry.create_agent("known")
    with pytest.raises(AgentNotFoundError, match="'ghost'") as info:
        await CALLS[method](registry, "ghost")
    assert info.value.agent_id == "ghost"


@pytest.mark.parametrize("method", [*CALLS, "create_agent"])
async def test_ids_are_validated_before_the_database_is_touched(
    registry: Registry, method: str
) -> None:
    calls: dict[str, Call] = {**CALLS, "create_agent": lambda r, a: r.create_agent(a)}
    await registry.close()  # any database access would now raise RegistryClosedError
    with pytest.raises(InvalidAgentIdError):
        await calls[method](registry, "../x")
    with pytest.raises(RegistryClosedError):
        await calls[method](registry, "fine")


@pytest.mark.parametrize("agent_id", REJECTED_IDS)
async def test_rejected_ids(registry: Registry, agent_id: str) -> None:
    with pytest.raises(InvalidAgentIdError) as info:
        await registry.create_agent(agent_id)
    assert info.value.agent_id == agent_id
    assert repr(agent_id)[:20] in str(info.value)
    assert "[A-Za-z0-9][A-Za-z0-9_.-]{0,63}" in str(info.value)
    assert await registry.list_agents() == []


@pytest.mark.parametrize("agent_id", ACCEPTED_IDS)
async def test_accepted_ids(registry: Registry, agent_id: str) -> None:
    created = await registry.create_agent(agent_id)
    assert created.id == agent_id
    assert await registry.get_agent(agent_id) == created


@settings(database=None, max_examples=300)
@given(
    st.one_of(
        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", fullmatch=True),
        st.text(alphabet="aZ09_.-/\\ é\n", max_size=70),
        st.text(max_size=70),
    )
)
def test_id_validator_accepts_exactly_the_rule(candidate: str) -> None:
    expected = (
        re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", candidate) is not None
        and ".." not in candidate
    )
    assert is_valid_agent_id(candidate) is expected
    if expected:
        assert validate_agent_id(candidate) == candidate
        assert PurePosixPath(candidate).parts == (candidate,)  # one safe file name
    else:
        with pytest.raises(InvalidAgentIdError):
            validate_agent_id(candidate)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"name": ""}, "name=''"),
        ({"name": "n" * 257}, "name=<257 characters>: expected a str of 1-256 characters"),
        ({"sampling": {"bad": object()}}, "sampling="),
        ({"sampling": {1: "int key"}}, "sampling="),
        ({"system_prompt": 3}, "system_prompt=3"),
        ({"model_fingerprint": ""}, "model_fingerprint=''"),
        ({"idle_ttl_s": 0}, "idle_ttl_s=0"),
        ({"idle_ttl_s": True}, "idle_ttl_s=True"),
    ],
)
async def test_an_invalid_agent_field_creates_nothing(
    registry: Registry, fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidRecordError, match=match):
        await registry.create_agent("v", **fields)
    assert await registry.list_agents() == []


async def test_transcript_paging_arguments_are_validated(registry: Registry) -> None:
    await registry.create_agent("p")
    with pytest.raises(InvalidRecordError, match="start=-1"):
        await registry.transcript("p", start=-1)
    with pytest.raises(InvalidRecordError, match="limit=0"):
        await registry.transcript("p", limit=0)


async def test_records_are_frozen_copies(registry: Registry) -> None:
    agent = await registry.create_agent("f", sampling={"temperature": 1.0})
    with pytest.raises(FrozenInstanceError):
        agent.name = "other"  # type: ignore[misc]
    agent.sampling["temperature"] = 0.0
    assert (await registry.get_agent("f")).sampling == {"temperature": 1.0}


async def test_delete_cascades_and_returns_the_cache_entry(
    registry: Registry, registry_url: str
) -> None:
    await registry.create_agent("gone")
    await registry.create_agent("kept")
    for agent_id in ("gone", "kept"):
        await registry.append_messages(
            agent_id, [NewMessage("user", "a"), NewMessage("assistant", "b")]
        )
        await registry.caches.set(agent_id, ENTRY)

    current = await registry.caches.get("gone")
    removed = await registry.delete_agent("gone")

    assert removed is not None and removed == current
    assert (removed.agent_id, removed.path) == ("gone", ENTRY.path)
    assert await rows(registry_url, "SELECT id FROM agents") == [("kept",)]
    assert await rows(registry_url, "SELECT DISTINCT agent_id FROM messages") == [("kept",)]
    assert await rows(registry_url, "SELECT agent_id FROM kv_caches") == [("kept",)]
    with pytest.raises(AgentNotFoundError):
        await registry.get_agent("gone")
    await registry.create_agent("bare")
    assert await registry.delete_agent("bare") is None


async def test_append_assigns_contiguous_positions(registry: Registry) -> None:
    created = await registry.create_agent("t")
    first = await registry.append_messages(
        "t", [NewMessage(Role.SYSTEM, "sys"), NewMessage("user", "hello", token_count=3)]
    )
    second = await registry.append_messages("t", [NewMessage("assistant", "hi!")])

    assert [(m.position, m.role, m.content, m.token_count) for m in first + second] == [
        (0, Role.SYSTEM, "sys", None),
        (1, Role.USER, "hello", 3),
        (2, Role.ASSISTANT, "hi!", None),
    ]
    assert await registry.transcript("t") == first + second
    assert await registry.transcript("t", start=2) == second
    assert await registry.transcript("t", start=3) == []
    assert await registry.message_count("t") == 3
    assert (await registry.get_agent("t")).updated_at == second[0].created_at > created.updated_at


async def test_fifty_concurrent_appends_get_positions_0_to_49(registry: Registry) -> None:
    await registry.create_agent("busy")
    await asyncio.gather(
        *(registry.append_messages("busy", [NewMessage("user", f"m{i}")]) for i in range(50))
    )
    transcript = await registry.transcript("busy")
    assert [m.position for m in transcript] == list(range(50))
    assert sorted(m.content for m in transcript) == sorted(f"m{i}" for i in range(50))


async def test_concurrent_turns_stay_adjacent(registry: Registry) -> None:
    await registry.create_agent("chat")
    turns = [[NewMessage("user", f"q{i}"), NewMessage("assistant", f"a{i}")] for i in range(20)]
    await asyncio.gather(*(registry.append_messages("chat", turn) for turn in turns))
    transcript = await registry.transcript("chat")
    assert [m.position for m in transcript] == list(range(40))
    for question, answer in zip(transcript[::2], transcript[1::2], strict=True):
        assert question.role == Role.USER and answer.role == Role.ASSISTANT
        assert answer.content == "a" + question.content.removeprefix("q")


async def test_appends_from_separate_registries_serialize_on_the_database(
    registry_url: str,
) -> None:
    # Each registry has its own lock and pool, so only SQLite's BEGIN IMMEDIATE (PostgreSQL:
    # the agent's row lock) orders these.
    registries = [await Registry.open(registry_url) for _ in range(5)]
    try:
        await registries[0].create_agent("shared")
        await asyncio.gather(
            *(
                registry.append_messages("shared", [NewMessage("user", f"r{r}m{i}")])
                for i in range(10)
                for r, registry in enumerate(registries)
            )
        )
        transcript = await registries[-1].transcript("shared")
    finally:
        for registry in registries:
            await registry.close()
    assert [m.position for m in transcript] == list(range(50))
    assert len({m.content for m in transcript}) == 50


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (NewMessage("robot", "x"), r"messages\[1\]\.role='robot'"),
        (NewMessage("user", b"bytes"), r"messages\[1\]\.content is a bytes"),  # type: ignore[arg-type]
        (NewMessage("user", "x", token_count=-1), r"messages\[1\]\.token_count=-1"),
        ("user: x", r"messages\[1\] is a str"),
    ],
)
async def test_a_bad_message_appends_nothing(registry: Registry, bad: Any, match: str) -> None:
    await registry.create_agent("atomic")
    await registry.append_messages("atomic", [NewMessage("user", "before")])
    with pytest.raises(InvalidRecordError, match=match):
        await registry.append_messages("atomic", [NewMessage("user", "ok"), bad])
    assert [m.content for m in await registry.transcript("atomic")] == ["before"]


async def test_empty_batch_is_a_value_error(registry: Registry) -> None:
    await registry.create_agent("e")
    with pytest.raises(ValueError, match="empty"):
        await registry.append_messages("e", [])


async def test_set_cache_returns_the_entry_it_replaces(registry: Registry) -> None:
    await registry.create_agent("a")
    assert await registry.caches.get("a") is None
    assert await registry.caches.set("a", ENTRY) is None
    first = await registry.caches.get("a")
    assert first is not None
    assert (
        first.agent_id,
        first.path,
        first.kv_bits,
        first.group_size,
        first.token_count,
        first.message_count,
    ) == ("a", ENTRY.path, 8, 64, 12, 3)

    newer = NewCacheEntry("a/cache-2.safetensors", 20, "f" * 64, 8192, "d" * 64, 1, message_count=5)
    assert await registry.caches.set("a", newer) == first
    current = await registry.caches.get("a")
    assert current is not None
    assert (current.path, current.message_count, current.kv_bits) == (newer.path, 5, None)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"path": "/abs/file"}, "path"),
        ({"path": "../escape"}, "path"),
        ({"path": "a\\b"}, "path"),
        ({"kv_bits": 3}, "kv_bits"),
        ({"kv_bits": 8.0}, "kv_bits"),
        ({"kv_bits": 4, "group_size": None}, "group_size"),
        ({"kv_bits": None, "group_size": 64}, "group_size"),
        ({"token_count": -1}, "token_count"),
        ({"message_count": -1}, "message_count"),
        ({"message_count": True}, "message_count"),
        ({"message_count": 1.0}, "message_count"),
        ({"checksum": "x" * 65}, "checksum"),
        ({"format_version": 0}, "format_version"),
    ],
)
def test_cache_entry_validates_on_construction(changes: dict[str, Any], field: str) -> None:
    fields = {
        "path": "a/c.safetensors",
        "token_count": 1,
        "message_count": 1,
        "model_fingerprint": "m",
        "nbytes": 1,
        "checksum": "c",
        "format_version": 1,
        "kv_bits": 4,
        "group_size": 32,
    }
    with pytest.raises(InvalidRecordError, match=field):
        NewCacheEntry(**(fields | changes))


def test_cache_entry_message_count_is_required_and_keyword_only() -> None:
    # Positionally it could be swapped with token_count without any error.
    with pytest.raises(TypeError, match="message_count"):
        NewCacheEntry("a/c.safetensors", 1, "m", 1, "c", 1)  # type: ignore[call-arg]


async def test_open_accepts_a_url_and_creates_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "db.sqlite"
    async with await Registry.open(f"sqlite+aiosqlite:///{path}") as registry:
        await registry.create_agent("x")
    assert await rows(str(path), "SELECT id FROM agents") == [("x",)]


@pytest.mark.parametrize(
    "target",
    [":memory:", "sqlite+aiosqlite://", "mysql://u:secret@h/db", "postgresql+psycopg://h/db", ""],
)
async def test_open_rejects_unsupported_targets(target: str) -> None:
    with pytest.raises(ValueError) as caught:
        await Registry.open(target)
    assert "secret" not in str(caught.value)


async def _reconnect_with(registry: Registry, pragma: str) -> None:
    """Give every new connection of the registry ``pragma`` and drop the pooled ones."""
    engine = registry._db.engine  # white-box: SQLite limits are set per connection

    def on_connect(dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA {pragma}")
        cursor.fetchall()
        cursor.close()

    event.listen(engine.sync_engine, "connect", on_connect)
    await engine.dispose()


@SQLITE_ONLY
async def test_a_full_disk_is_a_storage_error_and_keeps_what_was_stored(
    registry: Registry, registry_url: str
) -> None:
    await registry.create_agent("full")
    await registry.append_messages("full", [NewMessage("user", "kept")])
    (pages,) = (await rows(registry_url, "PRAGMA page_count"))[0]
    await _reconnect_with(registry, f"max_page_count={pages}")

    with pytest.raises(RegistryStorageError, match="SQLITE_FULL") as caught:
        await registry.append_messages("full", [NewMessage("user", "x" * 200_000)])
    assert caught.value.is_full and "free disk space" in str(caught.value)
    with pytest.raises(RegistryStorageError, match="SQLITE_FULL"):
        await registry.create_agent("another", system_prompt="y" * 200_000)
    # Reads still work, and nothing of the failed calls was stored.
    assert [m.content for m in await registry.transcript("full")] == ["kept"]
    assert [a.id for a in await registry.list_agents()] == ["full"]


@SQLITE_ONLY
async def test_a_read_only_database_is_a_storage_error(registry: Registry) -> None:
    await registry.create_agent("ro")
    await _reconnect_with(registry, "query_only=ON")
    with pytest.raises(RegistryStorageError, match="SQLITE_READONLY") as caught:
        await registry.append_messages("ro", [NewMessage("user", "hi")])
    assert not caught.value.is_full
    assert await registry.transcript("ro") == []


# ---- stored responses ---------------------------------------------------------------------


def said(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def answered(text: str) -> dict[str, Any]:
    return {"output": [{"type": "message", "role": "assistant", "content": text}]}


async def chain_of(registry: Registry, agent_id: str, turns: int) -> list[str]:
    """``turns`` responses, each continuing the one before, each with its reply message."""
    ids, previous = [], None
    for i in range(turns):
        stored = await registry.append_messages(
            agent_id, [NewMessage("user", f"q{i}"), NewMessage("assistant", f"a{i}")]
        )
        response = NewResponse(
            f"resp_{i}", agent_id, stored[-1].id, previous, [said(f"q{i}")], answered(f"a{i}")
        )
        await registry.responses.put(response)
        ids.append(previous := response.id)
    return ids


def items(records: list[ResponseRecord]) -> list[Any]:
    return [item for r in records for item in [*r.input, *r.output]]


async def test_a_chain_is_read_oldest_first_and_knows_whether_it_is_the_latest(
    registry: Registry,
) -> None:
    agent = await registry.create_agent()
    ids = await chain_of(registry, agent.id, 3)
    chain = await registry.responses.chain("resp_2")
    assert [r.id for r in chain] == ids
    assert [i["content"] for i in items(chain)] == ["q0", "a0", "q1", "a1", "q2", "a2"]
    assert chain[-1].latest and chain[-1].agent_id == agent.id
    earlier = await registry.responses.chain("resp_1")
    assert [r.id for r in earlier] == ids[:2] and not earlier[-1].latest
    assert json.loads(await registry.responses.get_json("resp_1")) == answered("a1")
    with pytest.raises(ResponseNotFoundError, match="resp_9"):
        await registry.responses.chain("resp_9")
    with pytest.raises(ResponseNotFoundError, match="resp_9"):
        await registry.responses.get_json("resp_9")


async def test_a_response_is_stored_once_and_continues_a_stored_one(registry: Registry) -> None:
    agent = await registry.create_agent()
    await chain_of(registry, agent.id, 1)
    again = NewResponse("resp_0", agent.id, None, None, [], {})
    with pytest.raises(InvalidRecordError, match="resp_0"):
        await registry.responses.put(again)
    orphan = NewResponse("resp_x", agent.id, None, "resp_gone", [], {})
    with pytest.raises(InvalidRecordError, match="previous_id='resp_gone'"):
        await registry.responses.put(orphan)
    with pytest.raises(AgentNotFoundError):
        await registry.responses.put(NewResponse("resp_y", "nobody", None, None, [], {}))
    await registry.responses.put(NewResponse("resp_z", agent.id, None, "resp_0", [], {"a": 1}))
    assert json.loads(await registry.responses.get_json("resp_z")) == {"a": 1, "output": []}
    with pytest.raises(InvalidRecordError, match="id="):
        NewResponse("r" * 65, agent.id, None, None, [], {})
    assert [r.id for r in await registry.responses.chain("resp_0")] == ["resp_0"]


async def test_deleting_a_response_folds_its_items_into_the_ones_that_continue_it(
    registry: Registry,
) -> None:
    agent = await registry.create_agent()
    await chain_of(registry, agent.id, 3)
    branch = NewResponse("resp_b", agent.id, None, "resp_1", [said("qb")], answered("ab"))
    await registry.responses.put(branch)
    await registry.responses.delete("resp_1")
    with pytest.raises(ResponseNotFoundError):
        await registry.responses.get_json("resp_1")
    with pytest.raises(ResponseNotFoundError):
        await registry.responses.delete("resp_1")
    for last, tail in (("resp_2", ["q2", "a2"]), ("resp_b", ["qb", "ab"])):
        chain = await registry.responses.chain(last)
        assert [r.id for r in chain] == ["resp_0", last]
        assert [i["content"] for i in items(chain)] == ["q0", "a0", "q1", "a1", *tail]


async def test_responses_expire_oldest_first_and_outlive_their_agent(
    registry: Registry, registry_url: str
) -> None:
    agent = await registry.create_agent()
    await chain_of(registry, agent.id, 3)
    assert await registry.responses.expire(datetime(2021, 1, 1, tzinfo=UTC)) == 0
    await rows(registry_url, "UPDATE responses SET created_at = '2020-01-01' WHERE id != 'resp_2'")
    assert await registry.responses.expire(datetime(2021, 1, 1, tzinfo=UTC)) == 2
    chain = await registry.responses.chain("resp_2")
    assert [r.id for r in chain] == ["resp_2"]
    assert [i["content"] for i in items(chain)] == ["q0", "a0", "q1", "a1", "q2", "a2"]
    await registry.delete_agent(agent.id)
    kept = await registry.responses.chain("resp_2")
    assert kept[0].agent_id is None and not kept[0].latest
