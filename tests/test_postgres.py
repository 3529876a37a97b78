"""The registry on PostgreSQL: URLs, storage errors, and the registry's invariants under
concurrent writers (separate registries, separate processes) on both backends."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import make_url

from agentkv.store import (
    NewBlock,
    NewCacheEntry,
    NewMessage,
    Registry,
    RegistryStorageError,
    StoredBlock,
    cache_index,
    database,
)
from agentkv.store import (
    registry as registry_module,
)
from tests import postgres
from tests.postgres import PostgresServer

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 0.5
"""How long a writer gets to finish while it should be waiting for a lock (it must not)."""


def entry(name: str) -> NewCacheEntry:
    return NewCacheEntry(f"a/{name}.safetensors", 12, "m", 100, "c", 2, message_count=1)


@pytest.fixture
async def two(registry_url: str) -> AsyncIterator[tuple[Registry, Registry]]:
    """Two registries on one database: their own engines and connections, like two workers."""
    first = await Registry.open(registry_url)
    second = await Registry.open(registry_url)
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()


def pause_after(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str
) -> tuple[asyncio.Event, asyncio.Event]:
    """Make the first call of ``module.name`` (a coroutine function), once it has returned,
    wait until released: its transaction stays open, holding whatever it locked.

    Returns:
        (reached, release): set when the call is paused; set it to let the call go on.
    """
    reached, release = asyncio.Event(), asyncio.Event()
    original: Callable[..., Awaitable[Any]] = getattr(module, name)

    async def paused(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        if not reached.is_set():
            reached.set()
            await release.wait()
        return result

    monkeypatch.setattr(module, name, paused)
    return reached, release


async def waits_for_the_paused_call(
    reached: asyncio.Event, release: asyncio.Event, first: Awaitable[Any], second: Awaitable[Any]
) -> tuple[Any, Any]:
    """Start ``first`` and, once it is paused, ``second``; check that ``second`` does not get
    through meanwhile. Returns both results."""
    first_task = asyncio.ensure_future(first)
    await reached.wait()
    second_task = asyncio.ensure_future(second)
    await asyncio.wait([second_task], timeout=WAIT_S)
    assert not second_task.done(), f"went through a lock held elsewhere: {second_task}"
    release.set()
    return await first_task, await second_task


# ---- URLs and storage errors ----------------------------------------------------------------


def test_a_postgresql_url_gets_asyncpg_and_keeps_its_parts() -> None:
    for scheme in ("postgresql", "postgresql+asyncpg"):
        target = f"{scheme}://u:pw@db.example:5433/agents"
        url = database.database_url(target)
        assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
            "postgresql+asyncpg",
            "u",
            "pw",
            "db.example",
            5433,
            "agents",
        )


async def test_an_unreachable_server_is_a_storage_error_naming_the_url_without_its_password() -> (
    None
):
    with socket.socket() as bound:  # bound, not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        with pytest.raises(RegistryStorageError) as caught:
            await Registry.open(f"postgresql://agentkv:s3cret@127.0.0.1:{port}/agents")
    message = str(caught.value)
    assert caught.value.code == "POSTGRES_CONNECTION_FAILURE" and not caught.value.is_full
    assert f"(postgresql+asyncpg://agentkv:***@127.0.0.1:{port}/agents)" in message
    assert "s3cret" not in message
    assert "check that the PostgreSQL server is running and reachable" in message


@pytest.mark.postgresql
async def test_a_missing_database_is_a_storage_error(postgres_server: PostgresServer) -> None:
    url = postgres_server.url("no_such_database")
    with pytest.raises(RegistryStorageError, match="POSTGRES_INVALID_CATALOG_NAME") as caught:
        await Registry.open(url)
    assert f"({make_url(url).render_as_string()})" in str(caught.value)


@pytest.mark.postgresql
async def test_a_read_only_database_is_a_storage_error(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    async with await Registry.open(postgres_url) as registry:
        await registry.create_agent("ro")
        name = make_url(postgres_url).database
        postgres_server.sql(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        await registry._db.engine.dispose()  # white-box: new connections get the setting
        with pytest.raises(
            RegistryStorageError, match="POSTGRES_READ_ONLY_SQL_TRANSACTION"
        ) as caught:
            await registry.append_messages("ro", [NewMessage("user", "hi")])
        assert not caught.value.is_full
        assert await registry.transcript("ro") == []


@pytest.mark.postgresql
async def test_connections_the_server_dropped_are_replaced(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    async with await Registry.open(postgres_url) as registry:
        await registry.create_agent("a")
        name = make_url(postgres_url).database
        postgres_server.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
        )
        await registry.append_messages("a", [NewMessage("user", "hi")])  # no error: pre-ping
        assert [m.content for m in await registry.transcript("a")] == ["hi"]


# ---- invariants under concurrent writers ------------------------------------------------------


async def test_an_append_waits_for_the_one_in_progress(
    two: tuple[Registry, Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first append has locked the agent (its row on PostgreSQL, the file on SQLite) and
    read nothing yet: the second must wait, or both would take position 0."""
    one, other = two
    await one.create_agent("a")
    reached, release = pause_after(monkeypatch, registry_module, "_touch")
    first, second = await waits_for_the_paused_call(
        reached,
        release,
        one.append_messages("a", [NewMessage("user", "q0"), NewMessage("assistant", "a0")]),
        other.append_messages("a", [NewMessage("user", "q1"), NewMessage("assistant", "a1")]),
    )
    assert [m.position for m in first + second] == [0, 1, 2, 3]
    transcript = await other.transcript("a")
    assert [(m.position, m.content) for m in transcript] == [
        (0, "q0"),
        (1, "a0"),
        (2, "q1"),
        (3, "a1"),
    ]


APPEND_FROM_A_PROCESS = """
import asyncio, sys
from agentkv.store import NewMessage, Registry

async def main(url, name, count):
    async with await Registry.open(url) as registry:
        for i in range(count):
            await registry.append_messages("shared", [NewMessage("user", f"{name}-{i}")])

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def test_appends_from_separate_processes_get_dense_positions(registry_url: str) -> None:
    async with await Registry.open(registry_url) as registry:
        await registry.create_agent("shared")
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", APPEND_FROM_A_PROCESS, registry_url, f"p{p}", "10", cwd=REPO
        )
        for p in range(3)
    ]
    codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in processes)), 120)
    assert codes == [0, 0, 0]
    async with await Registry.open(registry_url) as registry:
        transcript = await registry.transcript("shared")
    assert [m.position for m in transcript] == list(range(30))
    assert sorted(m.content for m in transcript) == sorted(
        f"p{p}-{i}" for p in range(3) for i in range(10)
    )
    for p in range(3):  # each process's appends in its own order
        mine = [m.content for m in transcript if m.content.startswith(f"p{p}-")]
        assert mine == [f"p{p}-{i}" for i in range(10)]


async def test_a_cache_set_waits_for_the_one_in_progress(
    two: tuple[Registry, Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first set found no entry and will insert one: the second must wait (the agent's
    row is locked), or it would insert one too and fail on kv_caches' unique agent_id."""
    one, other = two
    await one.create_agent("a")
    reached, release = pause_after(monkeypatch, cache_index, "current_cache")
    first, second = await waits_for_the_paused_call(
        reached, release, one.caches.set("a", entry("one")), other.caches.set("a", entry("two"))
    )
    assert first is None
    assert second is not None and second.path == "a/one.safetensors"
    current = await one.caches.get("a")
    assert current is not None and current.path == "a/two.safetensors"


async def test_many_concurrent_cache_sets_for_one_agent_all_succeed(registry_url: str) -> None:
    registries = [await Registry.open(registry_url) for _ in range(4)]
    try:
        await registries[0].create_agent("a")
        replaced = await asyncio.gather(
            *(
                registry.caches.set("a", entry(f"r{r}-{i}"), blocks=[], new_blocks=[])
                for i in range(5)
                for r, registry in enumerate(registries)
            )
        )
        current = await registries[0].caches.get("a")
    finally:
        for registry in registries:
            await registry.close()
    # Each set replaced the one before it: one None, and every other entry replaced once.
    assert sum(r is None for r in replaced) == 1
    assert current is not None
    paths = [r.path for r in replaced if r is not None] + [current.path]
    assert sorted(paths) == sorted(f"a/r{r}-{i}.safetensors" for r in range(4) for i in range(5))


async def test_garbage_collection_waits_for_a_set_listing_its_blocks(
    two: tuple[Registry, Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The set checked that block k is recorded and will list it: collecting k meanwhile would
    break the listing's foreign key (or leave a cache whose block file is deleted)."""
    one, other = two
    await one.create_agent("a")
    await one.caches.add_blocks([NewBlock("k", 10, "c")])  # no cache lists it: garbage now
    reached, release = pause_after(monkeypatch, cache_index, "_known_blocks")
    _, collected = await waits_for_the_paused_call(
        reached,
        release,
        one.caches.set("a", entry("t"), blocks=["k"]),
        other.caches.collect_garbage(),
    )
    assert collected == []  # the set listed k before the collection looked
    assert await one.caches.known_blocks(["k"]) == {"k": StoredBlock(False, None, 0)}
    cache = await one.caches.get("a")
    assert cache is not None and cache.blocks == ("k",)


async def test_saves_sharing_blocks_in_opposite_orders_do_not_deadlock(registry_url: str) -> None:
    registries = [await Registry.open(registry_url) for _ in range(2)]
    keys = [f"k{i:02d}" for i in range(20)]
    try:
        for agent in ("a", "b"):
            await registries[0].create_agent(agent)
        for round_ in range(5):
            new = [NewBlock(key, 10, f"c{round_}") for key in keys]
            await asyncio.gather(
                registries[0].caches.set("a", entry(f"a{round_}"), blocks=keys, new_blocks=new),
                registries[1].caches.set(
                    "b", entry(f"b{round_}"), blocks=keys[::-1], new_blocks=new[::-1]
                ),
                registries[1].caches.collect_garbage(),
            )
        a, b = await registries[0].caches.get("a"), await registries[0].caches.get("b")
    finally:
        for registry in registries:
            await registry.close()
    assert a is not None and a.blocks == tuple(keys)
    assert b is not None and b.blocks == tuple(keys[::-1])


@pytest.mark.postgresql
async def test_a_fresh_database_per_test(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    """The fixture's database is empty and the test's own; the server makes more on demand."""
    tables = "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
    assert await postgres.fetch(postgres_url, tables) == [(0,)]
    another = postgres_server.create_database()
    try:
        assert another != postgres_url
        async with await Registry.open(another) as registry:
            await registry.create_agent("x")
        assert await postgres.fetch(another, "SELECT id FROM agents") == [("x",)]
    finally:
        postgres_server.drop_database(another)
