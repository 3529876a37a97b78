"""SQLite's side of the registry: its pragmas, its transactions (``BEGIN IMMEDIATE`` for a
write, see ``agentkv.store.database``), its error codes, and the reserve a registry keeps beside
it for a full disk."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import ConnectionPoolEntry

from agentkv.store.errors import RegistryStorageError

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 5000


PRAGMAS = (
    f"busy_timeout={BUSY_TIMEOUT_MS}",
    "journal_mode=WAL",
    "synchronous=NORMAL",
    "foreign_keys=ON",
)


RESERVE_SUFFIX = "-reserve"


RESERVE_BYTES = 4 * 1024 * 1024
"""A SQLite registry's reserve beside it, given up when a full disk keeps it from opening."""


_BEGIN_OPTION = "agentkv_sqlite_begin"


WRITE: dict[str, Any] = {_BEGIN_OPTION: "IMMEDIATE"}
"""Execution options for a connection whose transaction will write."""


_CODES_BY_MESSAGE = (
    ("database or disk is full", "SQLITE_FULL"),
    ("readonly database", "SQLITE_READONLY"),
    ("database is locked", "SQLITE_BUSY"),
    ("disk i/o error", "SQLITE_IOERR"),
    ("unable to open database file", "SQLITE_CANTOPEN"),
)


CANNOT_WRITE = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_FULL", "SQLITE_IOERR")
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


def on_connect(dbapi_connection: Any, connection_record: ConnectionPoolEntry) -> None:
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves, in on_begin
    cursor = dbapi_connection.cursor()
    try:
        for pragma in PRAGMAS:
            cursor.execute(f"PRAGMA {pragma}")
            cursor.fetchall()
    finally:
        cursor.close()


def on_begin(connection: Connection) -> None:
    mode = connection.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
    connection.exec_driver_sql(f"BEGIN {mode}")


def set_foreign_keys(connection: Connection, enabled: bool) -> None:
    # On the raw DBAPI connection: through `connection` it would autobegin, and SQLite ignores
    # PRAGMA foreign_keys inside a transaction.
    cursor = connection.connection.cursor()
    try:
        cursor.execute(f"PRAGMA foreign_keys={'ON' if enabled else 'OFF'}")
    finally:
        cursor.close()


def keep_reserve(path: Path) -> None:
    """Make the reserve file when it is missing and there is room (quietly not, otherwise)."""
    if path.exists():
        return
    temp = path.with_name(f"{path.name}.tmp")
    try:
        with open(temp, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, RESERVE_BYTES)  # blocks, not a sparse file
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)


def give_up_reserve(path: Path) -> bool:
    """Delete the reserve file; returns whether there was one."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    log.warning("the disk is full: gave up the registry's reserve (%s) to open it", path)
    return True
