"""Alembic migrations against real SQLite files and PostgreSQL databases: schema parity, up and
down, idempotence, batch safety, CLI."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect

import agentkv.migrations as migrations
from agentkv.store import (
    InvalidRecordError,
    MigrationError,
    NewBlock,
    NewCacheEntry,
    NewMessage,
    NewResponse,
    Registry,
    StoredBlock,
    database,
)
from agentkv.store.models import Base
from tests import postgres

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {
    "alembic_version": ["version_num"],
    "agents": [
        "id",
        "name",
        "system_prompt",
        "model_fingerprint",
        "sampling",
        "created_at",
        "updated_at",
        "idle_ttl_s",  # added by 0003
        "version",  # added by 0007
        "tools",  # added by 0008
    ],
    # added by 0007
    "agent_leases": ["agent_id", "holder", "worker_id", "token", "acquired_at", "expires_at"],
    "messages": [
        *("id", "agent_id", "position", "role", "content", "token_count", "created_at"),
        "parts",  # added by 0009
    ],
    # added by 0009
    "images": ["id", "sha256", "media_type", "data", "width", "height", "created_at", "used_at"],
    "message_images": ["message_id", "image_id"],  # added by 0010 (and images.used_at)
    "kv_caches": [
        "id",
        "agent_id",
        "path",
        "token_count",
        "kv_bits",
        "group_size",
        "model_fingerprint",
        "nbytes",
        "checksum",
        "format_version",
        "created_at",
        "message_count",  # added by 0002, so last in the table
    ],
    # added by 0004
    "kv_blocks": [
        "key",
        "nbytes",
        "checksum",
        "window_nbytes",
        "window_checksum",
        "created_at",
        "segment",  # added by 0005
        "segment_index",
        "pinned_until",  # added by 0007
    ],
    "kv_cache_blocks": ["agent_id", "position", "block_key"],
    # added by 0006
    "responses": [
        *("id", "agent_id", "message_id", "previous_id", "input", "output", "body"),
        "created_at",
    ],
}
# A later revision that rebuilds `agents` the way batch mode does: copy, DROP, rename.
# NEXT_REVISION and HEAD_REVISION are filled in by with_revision().
RECREATE_AGENTS = '''"""Recreate agents."""

import sqlalchemy as sa
from alembic import op

revision = "NEXT_REVISION"
down_revision = "HEAD_REVISION"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("agents", recreate="always") as batch:
        batch.add_column(sa.Column("archived", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("agents", recreate="always") as batch:
        batch.drop_column("archived")
'''

BROKEN = '''"""Fails halfway."""

import sqlalchemy as sa
from alembic import op

revision = "NEXT_REVISION"
down_revision = "HEAD_REVISION"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("junk", sa.Column("id", sa.Integer(), primary_key=True))
    op.execute("SELECT * FROM no_such_table")


def downgrade() -> None:
    op.drop_table("junk")
'''


def schema_diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return compare_metadata(context, Base.metadata)


def columns(connection: Connection) -> dict[str, list[str]]:
    inspector = inspect(connection)
    return {
        table: [column["name"] for column in inspector.get_columns(table)]
        for table in inspector.get_table_names()
    }


def rows(db_path: Path, sql: str) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(db_path)) as db:
        return db.execute(sql).fetchall()


async def fetch(target: str, sql: str) -> list[tuple[Any, ...]]:
    """``rows`` on either backend (asyncpg for PostgreSQL); a change is committed."""
    if target.startswith("postgresql"):
        return await postgres.fetch(target, sql)
    with closing(sqlite3.connect(target)) as db, db:
        return db.execute(sql).fetchall()


def snapshot(connection: Connection) -> dict[str, dict[str, Any]]:
    """Every table's columns, primary key, unique constraints, indexes and foreign keys, as
    the database reports them."""
    inspector = inspect(connection)
    return {
        table: {
            "columns": [
                (c["name"], str(c["type"]), c["nullable"], c["default"])
                for c in inspector.get_columns(table)
            ],
            "primary_key": inspector.get_pk_constraint(table)["constrained_columns"],
            "unique": sorted(map(repr, inspector.get_unique_constraints(table))),
            "indexes": sorted(map(repr, inspector.get_indexes(table))),
            "foreign_keys": sorted(map(repr, inspector.get_foreign_keys(table))),
        }
        for table in inspector.get_table_names()
    }


async def schema_of(target: str) -> dict[str, dict[str, Any]]:
    engine = database.create_engine(database.database_url(target))
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(snapshot)
    finally:
        await engine.dispose()


HEAD = "0010"
NEXT = "9000"


def with_revision(scripts: Path, source: str) -> Path:
    """A copy of the real migrations with one more revision, ``NEXT``, on top of ``HEAD``."""
    shutil.copytree(
        Path(migrations.__file__).parent, scripts, ignore=shutil.ignore_patterns("__pycache__")
    )
    source = source.replace("NEXT_REVISION", NEXT).replace("HEAD_REVISION", HEAD)
    (scripts / "versions" / f"{NEXT}_next.py").write_text(source)
    return scripts


def head_revision() -> str | None:
    return ScriptDirectory.from_config(database.alembic_config()).get_current_head()


def revisions() -> list[str]:
    """Every revision, oldest first."""
    script = ScriptDirectory.from_config(database.alembic_config())
    return [r.revision for r in script.walk_revisions("base", "heads")][::-1]


async def migrate(path: Path | str, revision: str, *, down: bool = False) -> None:
    """Move the database at ``path`` (a file or a URL) to ``revision`` through env.py, like
    ``Registry.open``."""
    engine = database.create_engine(database.database_url(path))
    try:
        if down:
            async with engine.connect() as connection:
                await connection.run_sync(_downgrade, revision)
        else:
            await database.upgrade(engine, revision)
    finally:
        await engine.dispose()


def _downgrade(connection: Connection, revision: str) -> None:
    config = database.alembic_config()
    config.attributes["connection"] = connection  # picked up by migrations/env.py
    command.downgrade(config, revision)


async def test_upgrading_an_empty_database_gives_exactly_the_orm_schema(registry_url: str) -> None:
    async with (
        await Registry.open(registry_url) as registry,
        registry._db.engine.connect() as connection,
    ):
        diff = await connection.run_sync(schema_diff)
        tables = await connection.run_sync(columns)
    assert diff == []
    assert tables == SCHEMA


async def test_every_registry_connection_gets_the_pragmas(tmp_path: Path) -> None:
    pragmas = ("foreign_keys", "journal_mode", "busy_timeout", "synchronous")
    async with await Registry.open(tmp_path / "db.sqlite") as registry:
        engine = registry._db.engine
        # Two connections held at once, so the second is a fresh DBAPI connection.
        async with engine.connect() as first, engine.connect() as second:
            seen = [
                [(await conn.exec_driver_sql(f"PRAGMA {name}")).scalar() for name in pragmas]
                for conn in (first, second)
            ]
    assert seen == [[1, "wal", 5000, 1]] * 2  # synchronous=1 is NORMAL


async def test_opening_twice_is_idempotent(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    async with await Registry.open(path) as registry:
        await registry.create_agent("a")
    schema = rows(path, "SELECT type, name, sql FROM sqlite_master ORDER BY name")
    async with await Registry.open(path) as registry:
        assert [agent.id for agent in await registry.list_agents()] == ["a"]
    assert head_revision() == HEAD
    assert rows(path, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert rows(path, "SELECT type, name, sql FROM sqlite_master ORDER BY name") == schema


async def test_a_database_from_a_newer_version_is_refused(registry_url: str) -> None:
    async with await Registry.open(registry_url):
        pass
    await fetch(registry_url, "UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(MigrationError, match=r"'9999'.*upgrade agentkv"):
        await Registry.open(registry_url)


async def test_registries_opening_a_new_database_at_once_migrate_it_once(
    registry_url: str,
) -> None:
    # Like workers starting together: each registry has its own engine and connections.
    registries = await asyncio.gather(*(Registry.open(registry_url) for _ in range(4)))
    try:
        await registries[0].create_agent("a")
        assert [a.id for a in await registries[-1].list_agents()] == ["a"]
    finally:
        for registry in registries:
            await registry.close()
    assert await fetch(registry_url, "SELECT version_num FROM alembic_version") == [
        (head_revision(),)
    ]


def test_engines_connecting_to_a_new_sqlite_file_at_once_all_connect(tmp_path: Path) -> None:
    """Workers started together on a new registry (the scale-out cluster) each connect.

    Connections that switch a new file to WAL at the same moment can each hold a read lock the
    other's switch waits on, and SQLite fails one at once, without its busy handler. The race
    lasts under a millisecond: three engines in threads meet it in about one round in ten.
    """

    def connect(path: Path, start: threading.Barrier) -> str:
        async def main() -> str:
            engine = database.create_engine(database.database_url(path))
            try:
                start.wait()
                async with database.connect(engine) as connection:
                    return (await connection.exec_driver_sql("PRAGMA journal_mode")).scalar()
            finally:
                await engine.dispose()

        return asyncio.run(main())

    for round_ in range(60):
        path = tmp_path / f"{round_}.sqlite"
        start = threading.Barrier(3)
        with ThreadPoolExecutor(3) as pool:
            modes = list(pool.map(connect, [path] * 3, [start] * 3))
        assert modes == ["wal"] * 3, round_


async def test_each_downgrade_restores_the_schema_its_upgrade_started_from(
    registry_url: str,
) -> None:
    """Up one revision at a time from empty, down one at a time to empty with rows in every
    table, and up to head again: each step down gives back the schema seen on the way up."""
    steps = revisions()
    upward = {}
    for revision in steps:
        await migrate(registry_url, revision)
        upward[revision] = await schema_of(registry_url)

    async with await Registry.open(registry_url) as registry:
        await registry.create_agent("a")
        stored = await registry.append_messages("a", [NewMessage("user", "hi")])
        segment = [NewBlock(k, 6, "s", segment="k2-2", segment_index=i) for i, k in enumerate("12")]
        await registry.caches.set(
            "a",
            NewCacheEntry("a/t.safetensors", 40, "m", 5, "t", 2, message_count=1),
            blocks=["1", "2"],
            new_blocks=[*segment, NewBlock("0", 10, "c")],
        )
        await registry.responses.put(NewResponse("resp_0", "a", stored[0].id, None, [], {}))

    for below, revision in zip(steps[-2::-1], steps[:0:-1], strict=True):
        await migrate(registry_url, below, down=True)
        assert await schema_of(registry_url) == upward[below], f"downgrading {revision}"
    await migrate(registry_url, "base", down=True)
    assert list(await schema_of(registry_url)) == ["alembic_version"]
    assert await fetch(registry_url, "SELECT version_num FROM alembic_version") == []

    async with (
        await Registry.open(registry_url) as registry,
        registry._db.engine.connect() as connection,
    ):
        diff = await connection.run_sync(schema_diff)
    assert diff == []
    assert await schema_of(registry_url) == upward[steps[-1]]


OPEN_READ_ONLY = """
import asyncio, sys
from agentkv.store import Registry, RegistryStorageError
try:
    asyncio.run(Registry.open(sys.argv[1]))
except RegistryStorageError as exc:
    print(exc)
"""


@pytest.mark.parametrize("existing", [False, True])
async def test_a_read_only_directory_is_named_as_such(tmp_path: Path, existing: bool) -> None:
    """Not "upgrade agentkv": the file cannot be written, and the error says so."""
    path = tmp_path / "data" / "agentkv.sqlite"
    if existing:
        async with await Registry.open(path):
            pass
    path.parent.mkdir(exist_ok=True)
    path.parent.chmod(0o555)
    # root writes anywhere unless it gives up the capability to ignore permissions
    as_user = []
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv cannot make a directory read-only")
        drop = "-dac_override,-dac_read_search"
        as_user = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}"]
    try:
        command = [*as_user, sys.executable, "-c", OPEN_READ_ONLY, str(path)]
        said = subprocess.run(command, capture_output=True, text=True, cwd=REPO).stdout
    finally:
        path.parent.chmod(0o755)
    code = "SQLITE_READONLY" if existing else "SQLITE_CANTOPEN"
    assert said.startswith(f"the registry database could not be written ({code}")
    assert f"({path})" in said and "check that the file and its directory are writable" in said


async def test_open_leaves_logging_configuration_alone(tmp_path: Path) -> None:
    app_logger = logging.getLogger("agentkv.test_migrations")
    before = (list(logging.root.handlers), logging.root.level)
    alembic_handlers = list(logging.getLogger("alembic").handlers)
    async with await Registry.open(tmp_path / "db.sqlite"):
        pass
    assert (list(logging.root.handlers), logging.root.level) == before
    assert logging.getLogger("alembic").handlers == alembic_handlers
    assert app_logger.disabled is False


async def test_batch_migration_rebuilding_agents_keeps_child_rows(tmp_path: Path) -> None:
    # With foreign keys on, DROP TABLE agents would cascade-delete every message and cache row.
    path = tmp_path / "db.sqlite"
    async with await Registry.open(path) as registry:
        await registry.create_agent("a")
        await registry.append_messages(
            "a", [NewMessage("user", "hi"), NewMessage("assistant", "yo")]
        )
        await registry.caches.set(
            "a", NewCacheEntry("a/c.safetensors", 2, "m", 10, "c", 1, message_count=2)
        )
    scripts = with_revision(tmp_path / "scripts", RECREATE_AGENTS)

    engine = database.create_engine(database.database_url(path))
    try:
        await database.upgrade(engine, script_location=scripts)
        async with engine.connect() as connection:
            foreign_keys = (await connection.exec_driver_sql("PRAGMA foreign_keys")).scalar()
    finally:
        await engine.dispose()

    assert foreign_keys == 1  # switched back on after the migration
    assert rows(path, "SELECT version_num FROM alembic_version") == [(NEXT,)]
    assert rows(path, "SELECT id, archived FROM agents") == [("a", None)]
    assert rows(path, "SELECT position, content FROM messages") == [(0, "hi"), (1, "yo")]
    assert rows(path, "SELECT agent_id FROM kv_caches") == [("a",)]


async def test_a_failing_revision_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    async with await Registry.open(path):
        pass
    schema = rows(path, "SELECT name, sql FROM sqlite_master ORDER BY name")
    scripts = with_revision(tmp_path / "scripts", BROKEN)

    engine = database.create_engine(database.database_url(path))
    try:
        with pytest.raises(MigrationError, match="no_such_table"):
            await database.upgrade(engine, script_location=scripts)
    finally:
        await engine.dispose()

    assert rows(path, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert rows(path, "SELECT name, sql FROM sqlite_master ORDER BY name") == schema


def alembic_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_command_line_upgrade_matches_the_models(registry_url: str) -> None:
    if not registry_url.startswith("postgresql"):
        registry_url = f"sqlite+aiosqlite:///{registry_url}"
    url = f"url={registry_url}"
    upgrade = alembic_cli("-x", url, "upgrade", "head")
    assert upgrade.returncode == 0, upgrade.stderr
    check = alembic_cli("-x", url, "check")
    assert check.returncode == 0, check.stderr
    assert "No new upgrade operations detected" in check.stdout + check.stderr


def test_command_line_offline_sql_creates_the_tables() -> None:
    offline = alembic_cli("upgrade", "head", "--sql")
    assert offline.returncode == 0, offline.stderr
    for table in ("agents", "messages", "kv_caches"):
        assert f"CREATE TABLE {table} (" in offline.stdout


CACHE_0001 = (
    "a",
    "a/c.safetensors",
    7,
    8,
    64,
    "m" * 64,
    123,
    "c" * 64,
    1,
    "2026-01-02 03:04:05.000000",
)


async def test_a_0001_cache_row_upgrades_to_head_with_message_count_0(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    await migrate(path, "0001")
    with closing(sqlite3.connect(path)) as db, db:
        db.execute(
            "INSERT INTO agents VALUES ('a', 'a', NULL, NULL, '{}', ?, ?)", CACHE_0001[-1:] * 2
        )
        db.execute(
            "INSERT INTO kv_caches (agent_id, path, token_count, kv_bits, group_size, "
            "model_fingerprint, nbytes, checksum, format_version, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            CACHE_0001,
        )

    async with await Registry.open(path) as registry:
        cache = await registry.caches.get("a")
        async with registry._db.engine.connect() as connection:
            diff = await connection.run_sync(schema_diff)

    assert diff == []
    assert rows(path, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert cache is not None
    assert (cache.path, cache.token_count, cache.message_count, cache.kv_bits, cache.nbytes) == (
        "a/c.safetensors",
        7,
        0,
        8,
        123,
    )


async def test_downgrading_0002_drops_message_count_and_keeps_rows(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.sqlite"
    await migrate(fresh, "0001")
    path = tmp_path / "db.sqlite"
    async with await Registry.open(path) as registry:
        await registry.create_agent("a")
        await registry.append_messages("a", [NewMessage("user", "hi")])
        await registry.caches.set(
            "a", NewCacheEntry("a/c.safetensors", 3, "m", 10, "c", 1, message_count=1)
        )

    await migrate(path, "0001", down=True)
    # Batch mode rebuilt the table: same columns, unique index and cascading foreign key as 0001.
    for pragma in ("table_info", "index_list", "foreign_key_list"):
        sql = f"PRAGMA {pragma}(kv_caches)"
        assert rows(fresh, sql) and rows(path, sql) == rows(fresh, sql), pragma
    assert rows(path, "SELECT agent_id, path, token_count FROM kv_caches") == [
        ("a", "a/c.safetensors", 3)
    ]
    assert rows(path, "SELECT content FROM messages") == [("hi",)]

    async with await Registry.open(path) as registry:  # and back up again
        cache = await registry.caches.get("a")
    assert cache is not None and (cache.path, cache.message_count) == ("a/c.safetensors", 0)


async def test_0003_adds_idle_ttl_and_downgrades_keeping_rows(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    await migrate(path, "0002")
    with closing(sqlite3.connect(path)) as db, db:
        db.execute(
            "INSERT INTO agents VALUES ('a', 'a', NULL, NULL, '{}', ?, ?)", CACHE_0001[-1:] * 2
        )
        db.execute(
            "INSERT INTO messages VALUES (1, 'a', 0, 'user', 'hi', NULL, ?)", CACHE_0001[-1:]
        )
    async with await Registry.open(path) as registry:
        assert (await registry.get_agent("a")).idle_ttl_s is None  # existing agents never expire
        await registry.create_agent("b", idle_ttl_s=60)
        assert (await registry.get_agent("b")).idle_ttl_s == 60
    await migrate(path, "0002", down=True)
    assert rows(path, "SELECT id FROM agents ORDER BY id") == [("a",), ("b",)]
    assert rows(path, "SELECT content FROM messages") == [("hi",)]
    assert "idle_ttl_s" not in [r[1] for r in rows(path, "PRAGMA table_info(agents)")]


async def test_0005_records_segments_and_downgrades_dropping_only_their_caches(
    tmp_path: Path,
) -> None:
    fresh = tmp_path / "fresh.sqlite"
    await migrate(fresh, "0004")
    path = tmp_path / "db.sqlite"
    await migrate(path, "0004")
    async with await Registry.open(path) as registry:  # (upgrades to head)
        for agent in ("a", "b"):
            await registry.create_agent(agent)
        old = NewBlock("k0", 10, "c0")  # a block in its own file, as before 0005
        await registry.caches.set(
            "a",
            NewCacheEntry("a/t.safetensors", 20, "m", 5, "t", 2, message_count=1),
            blocks=["k0"],
            new_blocks=[old],
        )
        seg = [
            NewBlock(k, 6, "s", segment="k2-2", segment_index=i) for i, k in enumerate(["k1", "k2"])
        ]
        await registry.caches.set(
            "b",
            NewCacheEntry("b/t.safetensors", 40, "m", 5, "t", 2, message_count=1),
            blocks=["k1", "k2"],
            new_blocks=seg,
        )
        known = await registry.caches.known_blocks(["k0", "k1", "k2", "k9"])
        assert known == {
            "k0": StoredBlock(False, None, 0),
            "k1": StoredBlock(False, "k2-2", 0),
            "k2": StoredBlock(False, "k2-2", 1),
        }
        usage = await registry.caches.usage()
        assert (usage.bytes, usage.files, usage.blocks) == (5 + 5 + 10 + 12, 4, 3)

    await migrate(path, "0004", down=True)
    for pragma in (
        "table_info(kv_blocks)",
        "index_list(kv_blocks)",
        "foreign_key_list(kv_cache_blocks)",
    ):
        sql = f"PRAGMA {pragma}"
        assert rows(fresh, sql) and rows(path, sql) == rows(fresh, sql), pragma
    # b's cache listed blocks in a segment, which 0004 cannot read: b rebuilds; a keeps its own.
    assert rows(path, "SELECT agent_id FROM kv_caches") == [("a",)]
    assert rows(path, "SELECT key FROM kv_blocks") == [("k0",)]
    assert rows(path, "SELECT agent_id, block_key FROM kv_cache_blocks") == [("a", "k0")]


def test_a_segment_block_needs_its_index_and_a_file() -> None:
    with pytest.raises(InvalidRecordError, match="go together"):
        NewBlock("k1", 6, "s", segment="k1-1")
    with pytest.raises(InvalidRecordError, match="letters, digits and '-'"):
        NewBlock("k1", 6, "s", segment="../k1", segment_index=0)
    with pytest.raises(InvalidRecordError, match="segment without a block file"):
        NewBlock("k1", None, None, 3, "w", segment="k1-1", segment_index=0)
