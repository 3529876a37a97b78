"""What the registry needs of PostgreSQL: its URL, advisory locks, and which errors are storage
errors.

On PostgreSQL every transaction is a plain ``READ COMMITTED`` one; what SQLite's single writer
guaranteed for free is kept by locks that last until the transaction ends. Writers of one
agent's rows first lock the agent's row (``append_messages`` through its ``UPDATE``,
``CacheIndex.set`` with ``SELECT ... FOR NO KEY UPDATE``), so they take turns whichever process
they run in; and the advisory locks of :class:`Lock` order the writes no row lock covers
(migrations, block garbage collection, stored responses).
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import Any

from sqlalchemy import URL, Connection, Select, func, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession

from agentkv.store.errors import RegistryStorageError

DRIVER = "postgresql+asyncpg"
DIALECT = "postgresql"
ISOLATION_LEVEL = "READ COMMITTED"  # each statement sees what was committed before it began

_LOCK_SPACE = 0x61676B76  # "agkv": the first key of every advisory lock agentkv takes


class Lock(IntEnum):
    """Transaction-scoped advisory locks (``pg_advisory_xact_lock``), one per kind of write."""

    MIGRATION = 1
    """Held while migrating: processes opening one new database at once migrate it once."""
    BLOCKS = 2
    """Shared by the writes that record or list blocks, exclusive for garbage collection."""
    RESPONSES = 3
    """Stored responses are written one transaction at a time (chains are folded on delete)."""


def _lock_statement(lock: Lock, shared: bool) -> Select[Any]:
    take = func.pg_advisory_xact_lock_shared if shared else func.pg_advisory_xact_lock
    return select(take(_LOCK_SPACE, int(lock)))


async def hold(session: AsyncSession, lock: Lock, *, shared: bool = False) -> None:
    """Wait for ``lock`` and hold it until the session's transaction ends.

    Args:
        session: A session of a PostgreSQL database.
        lock: Which lock.
        shared: Share it with other shared holders; only exclusive holders wait.
    """
    await session.execute(_lock_statement(lock, shared))


def hold_sync(connection: Connection, lock: Lock) -> None:
    """:func:`hold`, exclusive, on a synchronous connection (Alembic's)."""
    connection.execute(_lock_statement(lock, False))


# SQLSTATE classes (and codes) that say the server cannot be reached or written, or that the
# transaction was rolled back and can simply be retried; anything else is a bug to surface.
_STORAGE_CLASSES = ("08", "28", "3D", "40", "53", "57", "58")
_STORAGE_CODES = ("25006", "42501")  # read-only transaction (a standby), insufficient privilege
CONNECTION_FAILURE = "POSTGRES_CONNECTION_FAILURE"


def storage_error(exc: BaseException, url: URL) -> RegistryStorageError | None:
    """The RegistryStorageError ``exc`` stands for, naming ``url`` (not its password); ``None``
    if ``exc`` is not about storage (a constraint violation, a bug).

    Args:
        exc: What asyncpg raised, as SQLAlchemy wraps it; an ``OSError`` while connecting.
        url: The database's URL.
    """
    if isinstance(exc, OSError):
        return connection_error(exc, url)
    if not isinstance(exc, DBAPIError):
        return None
    cause = _asyncpg_error(exc.orig) or exc.orig
    sqlstate = getattr(cause, "sqlstate", None) or ""
    if sqlstate[:2] in _STORAGE_CLASSES or sqlstate in _STORAGE_CODES:
        return RegistryStorageError(_code(cause, sqlstate), f"{cause}{_at(url)}")
    if exc.connection_invalidated:  # the connection broke mid-transaction
        return RegistryStorageError(CONNECTION_FAILURE, f"{cause}{_at(url)}")
    return None


def connection_error(exc: OSError, url: URL) -> RegistryStorageError:
    """The RegistryStorageError of an ``OSError`` from asyncpg's connect (refused, unreachable,
    unknown host, timed out)."""
    return RegistryStorageError(CONNECTION_FAILURE, f"{exc}{_at(url)}")


def _at(url: URL) -> str:
    return f" ({url.render_as_string(hide_password=True)})"


def _asyncpg_error(error: BaseException | None) -> BaseException | None:
    """asyncpg's own exception behind SQLAlchemy's adapter exception, if any."""
    while error is not None and not type(error).__module__.startswith("asyncpg"):
        error = error.__cause__
    return error


def _code(error: BaseException, sqlstate: str) -> str:
    """``POSTGRES_`` and the condition's name, from asyncpg's class name (``DiskFullError``:
    ``POSTGRES_DISK_FULL``), or else the SQLSTATE itself."""
    name = type(error).__name__.removesuffix("Error")
    if not type(error).__module__.startswith("asyncpg") or not name:
        return f"POSTGRES_{sqlstate}"
    return "POSTGRES_" + _CAMEL_WORDS.sub("_", name).upper()


_CAMEL_WORDS = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
