"""Exceptions raised by the agent registry, the cache files and the cache writer.

Every error the store raises on purpose derives from :class:`StoreError` (itself an
``AgentKVError``, the root of all of agentkv's errors), so callers can catch the whole family or
one specific class::

    StoreError
    ├── InvalidAgentIdError  (also ValueError)   the id breaks the format rule; DB not touched
    ├── InvalidRecordError   (also ValueError)   a field of an agent, message or cache entry is bad
    ├── AgentNotFoundError   (also LookupError)  no agent with that id
    ├── AgentExistsError                         create_agent with an id already in use
    ├── AgentChangedError                        the agent changed since the caller read it
    ├── ResponseNotFoundError (also LookupError) no stored response with that id
    ├── RegistryClosedError                      the registry was used after close()
    ├── RegistryStorageError                     the database could not be read or written
    │                                            (disk full, read-only, I/O error, locked; a
    │                                            PostgreSQL server unreachable or refusing)
    ├── MigrationError                           the database could not be brought to schema head
    ├── CacheFileError                           a KV cache file cannot be used (also
    │   │                                        engine.errors.CacheUnusableError)
    │   ├── CacheFileMissingError (also FileNotFoundError)  no file at that path
    │   └── CacheFileCorruptError                truncated, not safetensors, or checksum mismatch
    └── CacheWriterClosedError (also RuntimeError)  a job was submitted after CacheWriter.close()

``OSError``s other than a missing cache file (permissions, a full disk) propagate unchanged.
"""

from __future__ import annotations

import errno
import os
from enum import StrEnum

from agentkv.engine.errors import AgentKVError, CacheUnusableError

_MAX_SHOWN = 80


def _shown(value: object) -> str:
    """``repr(value)``, shortened so a megabyte of junk does not end up in a log line."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else f"{text[: _MAX_SHOWN - 3]}..."


class StoreError(AgentKVError):
    """Base class of every error raised by the store."""


class InvalidAgentIdError(StoreError, ValueError):
    """An agent id does not follow the id rule; raised before any database access.

    Attributes:
        agent_id: The rejected value, exactly as given.
    """

    def __init__(self, agent_id: object, rule: str) -> None:
        self.agent_id = agent_id
        super().__init__(f"invalid agent id {_shown(agent_id)}: {rule}")


class InvalidRecordError(StoreError, ValueError):
    """A field of an agent, message or cache entry has a value the store cannot keep."""


class AgentNotFoundError(StoreError, LookupError):
    """No agent with the given id exists.

    Attributes:
        agent_id: The id that was looked up.
    """

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        super().__init__(
            f"no agent with id {agent_id!r}; create it with create_agent() "
            "or pick one from list_agents()"
        )


class ResponseNotFoundError(StoreError, LookupError):
    """No stored response with the given id (never stored, deleted or expired).

    Attributes:
        response_id: The id that was looked up.
    """

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        super().__init__(f"no stored response with id {_shown(response_id)}")


class AgentExistsError(StoreError):
    """``create_agent`` was given an id that is already taken.

    Attributes:
        agent_id: The id that is already in use.
    """

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        super().__init__(
            f"an agent with id {agent_id!r} already exists; choose another id, "
            "pass agent_id=None to generate one, or delete_agent() it first"
        )


class AgentChangedError(StoreError):
    """An agent changed after a turn (or an append) read it: another worker or client stored
    a turn meanwhile, so this one was not stored (it would have interleaved with that one).

    Attributes:
        agent_id: The agent.
        expected: The version the caller read.
        actual: The version the agent is at now.
    """

    def __init__(self, agent_id: str, expected: int, actual: int) -> None:
        self.agent_id = agent_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"agent {agent_id!r} changed while this turn ran (version {actual}, the turn read "
            f"{expected}): another worker or client stored a turn meanwhile; nothing of this "
            "turn was stored; send it again"
        )


class RegistryClosedError(StoreError):
    """The registry was used after ``close()``; open a new one with ``Registry.open``."""


class RegistryStorageError(StoreError):
    """The registry's database could not be read or written; the transaction was rolled back.

    Attributes:
        code: SQLite's error name, e.g. ``SQLITE_FULL`` or ``SQLITE_READONLY``; on PostgreSQL,
            ``POSTGRES_`` and the error condition's name, e.g. ``POSTGRES_DISK_FULL``, or
            ``POSTGRES_CONNECTION_FAILURE`` when the server could not be reached.
    """

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        if self.is_full:
            advice = "free disk space (or raise the database's size limit) and retry"
        elif code.startswith("POSTGRES_"):
            advice = (
                "check that the PostgreSQL server is running and reachable, that the database "
                "exists and that its user may write to it, then retry"
            )
        else:
            advice = (
                "check that the file and its directory are writable and that no other process "
                "holds the file, then retry"
            )
        super().__init__(
            f"the registry database could not be written ({code}: {detail}); nothing of this "
            f"call was stored; {advice}"
        )

    @property
    def is_full(self) -> bool:
        """The disk (or the database's page limit) is full (SQLite's shared-memory file could
        not grow, too)."""
        return self.code.startswith(("SQLITE_FULL", "SQLITE_IOERR_SHMSIZE")) or (
            self.code == "POSTGRES_DISK_FULL"
        )


class BlocksMissingError(StoreError, LookupError):
    """A cache entry lists blocks the registry does not hold (collected meanwhile)."""

    def __init__(self, keys: list[str]):
        self.keys = keys
        super().__init__(f"{len(keys)} listed blocks are not recorded, e.g. {keys[0]!r}")


class MigrationError(StoreError):
    """The database could not be migrated to the schema this code expects."""


class CacheFileError(StoreError, CacheUnusableError):
    """Base class of errors about one KV cache file.

    Attributes:
        path: The file's path.
    """

    path: str


class CacheFileMissingError(CacheFileError, FileNotFoundError):
    """No cache file exists at the path (it was deleted, or never written)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        super().__init__(
            errno.ENOENT,
            f"cache file {self.path} does not exist; clear the registry's cache entry and "
            "rebuild the cache from the transcript",
        )


class Corruption(StrEnum):
    """What is wrong with a corrupt cache file."""

    TRUNCATED = "truncated"
    NOT_SAFETENSORS = "not safetensors"
    NO_CHECKSUM = "no checksum"
    CHECKSUM_MISMATCH = "checksum mismatch"


class CacheFileCorruptError(CacheFileError):
    """A cache file exists but cannot be trusted; nothing of it was returned.

    Attributes:
        path: The file's path.
        kind: Which check failed.
        detail: What exactly was found.
    """

    def __init__(self, path: str | os.PathLike[str], kind: Corruption, detail: str) -> None:
        self.path = os.fspath(path)
        self.kind = kind
        self.detail = detail
        super().__init__(
            f"cache file {self.path} is corrupt ({kind}): {detail}; delete it and rebuild the "
            "cache from the transcript"
        )


class CacheWriterClosedError(StoreError, RuntimeError):
    """A job was submitted to a ``CacheWriter`` after ``close()``; make a new writer."""
