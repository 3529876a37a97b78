"""The database behind the registry: engine, read/write sessions, Alembic migrations.

A SQLite file is the default; a ``postgresql+asyncpg://`` URL selects a PostgreSQL database
instead, whose transactions are plain ``READ COMMITTED`` ones ordered by row and advisory locks
(see ``agentkv.store.postgres``).

SQLite transactions follow SQLAlchemy's documented SQLite recipe: the driver's own BEGIN
handling is switched off on connect (``isolation_level = None``) and a ``begin`` listener emits
``BEGIN`` itself. Connections carrying the :data:`WRITE` execution option begin with
``BEGIN IMMEDIATE``, which takes SQLite's write lock up front, so concurrent writers (other
tasks, other processes) queue on the lock for up to ``busy_timeout`` instead of failing when a
read lock cannot be upgraded mid-transaction. Within one process, :meth:`Database.write` also
takes an asyncio lock so writers queue in FIFO order instead of polling SQLite's busy handler.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import URL, Connection, Insert, event, make_url
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

import agentkv.migrations as migrations
from agentkv.store import postgres
from agentkv.store.errors import MigrationError, RegistryClosedError, RegistryStorageError
from agentkv.store.postgres import Lock
from agentkv.store.sqlite import (
    BUSY_TIMEOUT_MS,
    CANNOT_WRITE,
    RESERVE_SUFFIX,
    WRITE,
    give_up_reserve,
    keep_reserve,
    on_begin,
    on_connect,
    set_foreign_keys,
    storage_error,
)

log = logging.getLogger(__name__)

DRIVER = "sqlite+aiosqlite"
DRIVERS = {"sqlite": DRIVER, "postgresql": postgres.DRIVER}
"""The driver of each supported database; a URL naming the database alone gets this one."""


class Database:
    """One async engine over a SQLite file or a PostgreSQL database, handing out one session
    per transaction."""

    def __init__(self, engine: AsyncEngine) -> None:
        """Wrap an engine made by :func:`create_engine` and already migrated."""
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)
        self._write_lock = asyncio.Lock()
        self._closed = False

    @classmethod
    async def open(cls, target: str | os.PathLike[str]) -> Database:
        """Create the engine for ``target`` (see :func:`database_url`) and migrate to head.

        A SQLite registry keeps a reserve file beside it (:data:`RESERVE_BYTES`): when the
        disk is full, opening gives the reserve up so that SQLite can start (its shared-memory
        file, a read transaction) and the transcripts stay readable; writes then fail with
        ``RegistryStorageError`` once that space is used, and the reserve is made again at
        the next open with space to spare.
        """
        url = database_url(target)
        reserve = None if url.drivername != DRIVER else Path(f"{url.database}{RESERVE_SUFFIX}")
        for attempt in (1, 2):
            engine = create_engine(url)
            try:
                await upgrade(engine)
                break
            except RegistryStorageError as exc:
                await engine.dispose()
                if attempt == 2 or reserve is None or not exc.is_full:
                    raise
                if not await asyncio.to_thread(give_up_reserve, reserve):
                    raise
            except BaseException:
                await engine.dispose()
                raise
        if reserve is not None:
            await asyncio.to_thread(keep_reserve, reserve)
        return cls(engine)

    async def close(self) -> None:
        """Dispose of the engine's connections; later sessions raise ``RegistryClosedError``."""
        self._closed = True
        await self.engine.dispose()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A session in a transaction (``BEGIN DEFERRED`` on SQLite), committed on exit.

        Raises:
            RegistryStorageError: The database could not be reached, read or written; the
                transaction was rolled back.
        """
        if self._closed:
            raise RegistryClosedError("registry is closed; open a new one with Registry.open")
        if self.is_sqlite:
            try:
                async with self._sessions.begin() as session:
                    yield session
            except OperationalError as exc:  # the transaction was rolled back on the way out
                raise storage_error(exc) from exc
            return
        url = self.engine.url
        try:
            async with self._sessions.begin() as session:
                try:  # connect now: an OSError later would be the caller's own
                    await session.connection()
                except OSError as exc:  # refused, unreachable, unknown host
                    raise postgres.connection_error(exc, url) from exc
                yield session
        except DBAPIError as exc:
            if (error := postgres.storage_error(exc, url)) is None:
                raise  # a constraint violation or a bug: the caller's to handle
            raise error from exc

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """A session in a transaction that will write, committed on exit.

        On SQLite it is a ``BEGIN IMMEDIATE`` one, and this process's writers queue for it in
        turn. On PostgreSQL writers run side by side: what must not interleave takes a lock
        (a row lock on the agent, or :func:`hold`).
        """
        if not self.is_sqlite:
            async with self.read() as session:
                yield session
            return
        async with self._write_lock, self.read() as session:
            await session.connection(execution_options=WRITE)
            yield session


async def hold(session: AsyncSession, lock: Lock, *, shared: bool = False) -> None:
    """Hold ``lock`` until the session's transaction ends (see ``agentkv.store.postgres.Lock``).

    A no-op on SQLite, where a write transaction already holds the whole file.
    """
    if session.bind.dialect.name == postgres.DIALECT:
        await postgres.hold(session, lock, shared=shared)


def upsert(session: AsyncSession, table: Any) -> Insert:
    """An INSERT into ``table`` in the session's dialect, which has ``on_conflict_do_update``
    (SQLite's and PostgreSQL's share that API)."""
    dialect = session.bind.dialect.name
    insert = pg_dialect.insert if dialect == postgres.DIALECT else sqlite_dialect.insert
    return insert(table)


def database_url(target: str | os.PathLike[str]) -> URL:
    """Turn a SQLite file path or a SQLAlchemy URL into an aiosqlite or asyncpg URL.

    A path's parent directories are created. ``sqlite://`` URLs are switched to aiosqlite,
    ``postgresql://`` ones to asyncpg.

    Raises:
        ValueError: The target is empty, an in-memory SQLite database, or neither SQLite nor
            PostgreSQL.
    """
    if isinstance(target, str) and "://" in target:
        url = make_url(target)
        url = url.set(drivername=DRIVERS.get(url.drivername, url.drivername))
        if url.drivername == postgres.DRIVER:
            return url
        if url.drivername != DRIVER:
            raise ValueError(
                f"unsupported database URL {url.render_as_string()!r}: use "
                f"{DRIVER}:///path/to/file or {postgres.DRIVER}://user@host:port/database"
            )
    else:
        if not os.fspath(target):
            raise ValueError("empty database path: pass a file path such as data/agentkv.sqlite")
        url = URL.create(DRIVER, database=os.fspath(Path(target).expanduser()))
    database = url.database or ""
    in_memory = (
        database in ("", ":memory:")
        or database.startswith("file::memory:")
        or url.query.get("mode") == "memory"
    )
    if in_memory:
        raise ValueError(
            f"in-memory database {url.render_as_string()!r} is not supported (one shared "
            "connection cannot hold concurrent transactions): use a file, e.g. in a temp dir"
        )
    if url.query.get("uri") != "true":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    return url


def create_engine(url: URL) -> AsyncEngine:
    """An async engine for a URL from :func:`database_url`: on SQLite, its connections have the
    registry's PRAGMAs and BEGIN handling; on PostgreSQL, they are ``READ COMMITTED``."""
    if url.get_backend_name() == postgres.DIALECT:
        # pre_ping: a server restart costs a reconnect, not one failed call per pooled connection
        return create_async_engine(
            url, isolation_level=postgres.ISOLATION_LEVEL, pool_pre_ping=True
        )
    engine = create_async_engine(url)
    event.listen(engine.sync_engine, "connect", on_connect)
    event.listen(engine.sync_engine, "begin", on_begin)
    return engine


@contextmanager
def migration_transaction(connection: Connection) -> Iterator[None]:
    """Run the body in one write transaction; on SQLite with foreign keys off, as it requires.

    On SQLite, batch migrations copy a table, drop the original and rename the copy; with
    foreign keys on, dropping ``agents`` would cascade-delete every message. Integrity is
    checked before commit. PostgreSQL alters tables in place, checking foreign keys as it goes;
    there the transaction holds ``Lock.MIGRATION``, so processes that open a database at once
    migrate it one after the other (the later ones find it at head).

    Args:
        connection: A connection not yet in a transaction.

    Raises:
        MigrationError: The migrated data violates a foreign key (rolled back).
    """
    if connection.dialect.name == postgres.DIALECT:
        with connection.begin():
            postgres.hold_sync(connection, Lock.MIGRATION)
            yield
        return
    set_foreign_keys(connection, False)
    try:
        with connection.execution_options(**WRITE).begin():
            yield
            violations = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
            if violations:
                raise MigrationError(
                    f"migration left rows with dangling foreign keys {violations[:5]}; "
                    "rolled back, fix the revision's data steps"
                )
    finally:
        set_foreign_keys(connection, True)


def alembic_config(script_location: str | os.PathLike[str] | None = None) -> Config:
    """An Alembic config built in code: no alembic.ini, no logging setup, cwd-independent.

    Args:
        script_location: Migration scripts to use; defaults to the installed ``migrations``.
    """
    location = Path(migrations.__file__).parent if script_location is None else script_location
    config = Config()
    config.set_main_option("script_location", os.fspath(location).replace("%", "%%"))
    config.set_main_option("path_separator", "os")
    return config


async def upgrade(
    engine: AsyncEngine,
    revision: str = "head",
    *,
    script_location: str | os.PathLike[str] | None = None,
) -> None:
    """Migrate the engine's database to ``revision`` on one of its own connections.

    Raises:
        RegistryStorageError: The file cannot be opened or written (a read-only file or
            directory, a full disk), or the PostgreSQL server cannot be reached or written.
        MigrationError: Alembic, the database or a revision script failed; nothing was changed.
    """
    config = alembic_config(script_location)
    try:
        async with _migrating(), connect(engine) as connection:
            await connection.run_sync(_run_upgrade, config, revision)
    except MigrationError:
        raise
    except Exception as exc:  # alembic, the database, or a bug in a revision script
        raise _cannot_write(engine, exc) or _not_migrated(engine, revision, exc) from exc


_MIGRATING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


def _migrating() -> asyncio.Lock:
    """The event loop's migration lock. Alembic's ``context`` and ``op`` are module globals,
    and a migration yields to the loop at every statement: registries opened at once in one
    process migrate one after the other (other processes wait on the database's own lock)."""
    return _MIGRATING.setdefault(asyncio.get_running_loop(), asyncio.Lock())


@asynccontextmanager
async def connect(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection of the engine, closed on exit; on SQLite, connecting is retried while the
    file is locked, for about ``busy_timeout`` (no new attempt starts after it).

    Connections that switch a new file to WAL at the same moment (workers started together on
    one new registry) can each hold a read lock the other's switch waits on: SQLite then fails
    one at once with "database is locked", without calling its busy handler. Once the file is
    in WAL, connecting takes no lock that can clash this way.
    """
    connection = await _connected(engine)
    try:
        yield connection
    finally:
        await asyncio.shield(connection.close())  # as AsyncConnection's own __aexit__ does


async def _connected(engine: AsyncEngine) -> AsyncConnection:
    if engine.dialect.name != "sqlite":
        return await engine.connect()
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    delay = 0.005
    while True:
        try:
            return await engine.connect()
        except OperationalError as exc:  # SQLITE_BUSY, or SQLITE_BUSY_RECOVERY and the like
            busy = storage_error(exc).code.startswith("SQLITE_BUSY")
            if not busy or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


def _cannot_write(engine: AsyncEngine, exc: Exception) -> RegistryStorageError | None:
    """The storage error ``exc`` is when it says the database cannot be opened or written."""
    if engine.dialect.name == postgres.DIALECT:
        return postgres.storage_error(exc, engine.url)
    if not isinstance(exc, OperationalError):
        return None
    error = storage_error(exc, engine.url.database)
    return error if error.code.startswith(CANNOT_WRITE) else None


def _not_migrated(engine: AsyncEngine, revision: str, exc: Exception) -> MigrationError:
    return MigrationError(
        f"could not migrate {engine.url.render_as_string()} to {revision!r}: {exc}. If a "
        "newer agentkv wrote this database, upgrade agentkv; otherwise restore a backup"
    )


def _run_upgrade(connection: Connection, config: Config, revision: str) -> None:
    config.attributes["connection"] = connection  # picked up by migrations/env.py
    command.upgrade(config, revision)
