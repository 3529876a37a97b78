"""The SQLite database behind the registry: engine, read/write sessions, Alembic migrations.

Transactions follow SQLAlchemy's documented SQLite recipe: the driver's own BEGIN handling is
switched off on connect (``isolation_level = None``) and a ``begin`` listener emits ``BEGIN``
itself. Connections carrying the :data:`WRITE` execution option begin with ``BEGIN IMMEDIATE``,
which takes SQLite's write lock up front, so concurrent writers (other tasks, other processes)
queue on the lock for up to ``busy_timeout`` instead of failing when a read lock cannot be
upgraded mid-transaction. Within one process, :meth:`Database.write` also takes an asyncio lock
so writers queue in FIFO order instead of polling SQLite's busy handler.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import URL, Connection, event, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import ConnectionPoolEntry

import migrations
from store.errors import MigrationError, RegistryClosedError, RegistryStorageError

DRIVER = "sqlite+aiosqlite"
PRAGMAS = ("busy_timeout=5000", "journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON")
_BEGIN_OPTION = "agentkv_sqlite_begin"
WRITE: dict[str, Any] = {_BEGIN_OPTION: "IMMEDIATE"}
"""Execution options for a connection whose transaction will write."""


class Database:
    """One async engine over a SQLite file, handing out one session per transaction."""

    def __init__(self, engine: AsyncEngine) -> None:
        """Wrap an engine made by :func:`create_engine` and already migrated."""
        self.engine = engine
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)
        self._write_lock = asyncio.Lock()
        self._closed = False

    @classmethod
    async def open(cls, target: str | os.PathLike[str]) -> Database:
        """Create the engine for ``target`` (see :func:`database_url`) and migrate to head."""
        engine = create_engine(database_url(target))
        try:
            await upgrade(engine)
        except BaseException:
            await engine.dispose()
            raise
        return cls(engine)

    async def close(self) -> None:
        """Dispose of the engine's connections; later sessions raise ``RegistryClosedError``."""
        self._closed = True
        await self.engine.dispose()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A session in a ``BEGIN DEFERRED`` transaction, committed on exit."""
        if self._closed:
            raise RegistryClosedError("registry is closed; open a new one with Registry.open")
        try:
            async with self._sessions.begin() as session:
                yield session
        except OperationalError as exc:  # the transaction was rolled back on the way out
            raise storage_error(exc) from exc

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """A session in a ``BEGIN IMMEDIATE`` transaction, committed on exit."""
        async with self._write_lock, self.read() as session:
            await session.connection(execution_options=WRITE)
            yield session


_CODES_BY_MESSAGE = (
    ("database or disk is full", "SQLITE_FULL"),
    ("readonly database", "SQLITE_READONLY"),
    ("database is locked", "SQLITE_BUSY"),
    ("disk i/o error", "SQLITE_IOERR"),
    ("unable to open database file", "SQLITE_CANTOPEN"),
)


_CANNOT_WRITE = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_FULL", "SQLITE_IOERR")
"""Codes that say the file cannot be opened or written, whatever the schema."""


def storage_error(exc: OperationalError, path: str | None = None) -> RegistryStorageError:
    """The RegistryStorageError an SQLite OperationalError stands for (naming ``path``)."""
    at = f" ({path})" if path else ""
    cause: BaseException | None = exc.orig
    while cause is not None:  # aiosqlite's adapter wraps sqlite3's error
        if name := getattr(cause, "sqlite_errorname", None):
            return RegistryStorageError(name, f"{cause}{at}")
        cause = cause.__cause__
    detail = str(exc.orig)
    for fragment, code in _CODES_BY_MESSAGE:
        if fragment in detail.lower():
            return RegistryStorageError(code, f"{detail}{at}")
    return RegistryStorageError("SQLITE_ERROR", f"{detail}{at}")


def database_url(target: str | os.PathLike[str]) -> URL:
    """Turn a SQLite file path or a SQLAlchemy URL into an aiosqlite URL.

    A path's parent directories are created. ``sqlite://`` URLs are switched to aiosqlite.

    Raises:
        ValueError: The target is empty, in-memory, or not SQLite.
    """
    if isinstance(target, str) and "://" in target:
        url = make_url(target)
        if url.drivername == "sqlite":
            url = url.set(drivername=DRIVER)
        if url.drivername != DRIVER:
            raise ValueError(f"unsupported database URL {target!r}: use {DRIVER}:///path/to/file")
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
    """An async engine whose connections have the registry's PRAGMAs and BEGIN handling."""
    engine = create_async_engine(url)
    event.listen(engine.sync_engine, "connect", _on_connect)
    event.listen(engine.sync_engine, "begin", _on_begin)
    return engine


def _on_connect(dbapi_connection: Any, connection_record: ConnectionPoolEntry) -> None:
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves, in _on_begin
    cursor = dbapi_connection.cursor()
    try:
        for pragma in PRAGMAS:
            cursor.execute(f"PRAGMA {pragma}")
            cursor.fetchall()
    finally:
        cursor.close()


def _on_begin(connection: Connection) -> None:
    mode = connection.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
    connection.exec_driver_sql(f"BEGIN {mode}")


def _set_foreign_keys(connection: Connection, enabled: bool) -> None:
    # On the raw DBAPI connection: through `connection` it would autobegin, and SQLite ignores
    # PRAGMA foreign_keys inside a transaction.
    cursor = connection.connection.cursor()
    try:
        cursor.execute(f"PRAGMA foreign_keys={'ON' if enabled else 'OFF'}")
    finally:
        cursor.close()


@contextmanager
def migration_transaction(connection: Connection) -> Iterator[None]:
    """Run the body in one write transaction with foreign keys off, as SQLite requires.

    Batch migrations copy a table, drop the original and rename the copy; with foreign keys on,
    dropping ``agents`` would cascade-delete every message. Integrity is checked before commit.

    Args:
        connection: A connection not yet in a transaction.

    Raises:
        MigrationError: The migrated data violates a foreign key (rolled back).
    """
    _set_foreign_keys(connection, False)
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
        _set_foreign_keys(connection, True)


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
            directory, a full disk).
        MigrationError: Alembic, SQLite or a revision script failed; nothing was changed.
    """
    config = alembic_config(script_location)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_upgrade, config, revision)
    except MigrationError:
        raise
    except OperationalError as exc:
        error = storage_error(exc, engine.url.database)
        if error.code.startswith(_CANNOT_WRITE):
            raise error from exc
        raise _not_migrated(engine, revision, exc) from exc
    except Exception as exc:  # alembic, or a bug in a revision script
        raise _not_migrated(engine, revision, exc) from exc


def _not_migrated(engine: AsyncEngine, revision: str, exc: Exception) -> MigrationError:
    return MigrationError(
        f"could not migrate {engine.url.render_as_string()} to {revision!r}: {exc}. If a "
        "newer agentkv wrote this database, upgrade agentkv; otherwise restore a backup"
    )


def _run_upgrade(connection: Connection, config: Config, revision: str) -> None:
    config.attributes["connection"] = connection  # picked up by migrations/env.py
    command.upgrade(config, revision)
