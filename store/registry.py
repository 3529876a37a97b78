"""The agent registry: the source of truth for every agent's conversation and KV cache entry.

One :class:`Registry` owns one ``store.database.Database`` (a SQLite file). Each call checks
its agent id first, then runs in one session and one transaction, and returns frozen records.
Writers are serialized (see ``store.database``), so message positions stay dense ``0..n-1``
however many tasks, registries or processes append at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime
from enum import Enum
from types import TracebackType
from typing import Any, Literal, Self

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from store import database, validation
from store.errors import AgentExistsError, AgentNotFoundError
from store.ids import new_agent_id, validate_agent_id
from store.models import Agent, KVCache, Message, utcnow
from store.records import (
    AgentRecord,
    CacheRecord,
    MessageRecord,
    NewCacheEntry,
    NewMessage,
    Role,
)


class _Unset(Enum):
    UNSET = "UNSET"


UNSET = _Unset.UNSET
"""Default of ``update_agent`` fields: leave the field as it is (``None`` means clear it)."""


class Registry:
    """Async registry of agents, their transcripts and their current KV cache entries.

    Create one with :meth:`open`; use it as ``async with await Registry.open(path) as reg:``
    or call :meth:`close` when done.
    """

    def __init__(self, db: database.Database) -> None:
        """Wrap an open, migrated database; use :meth:`open` instead."""
        self._db = db

    @classmethod
    async def open(cls, url: str | os.PathLike[str]) -> Registry:
        """Open (creating if needed) a registry and migrate it to the current schema.

        Args:
            url: A SQLite file path (parent directories are created) or a SQLAlchemy URL such
                as ``sqlite+aiosqlite:///data/agentkv.sqlite``.

        Raises:
            ValueError: ``url`` is empty, in-memory or not SQLite.
            MigrationError: The database could not be migrated (e.g. a newer agentkv wrote it).
        """
        return cls(await database.Database.open(url))

    async def close(self) -> None:
        """Close every connection; later calls raise ``RegistryClosedError``."""
        await self._db.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- agents ---------------------------------------------------------------------------

    async def create_agent(
        self,
        agent_id: str | None = None,
        *,
        name: str | None = None,
        system_prompt: str | None = None,
        model_fingerprint: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> AgentRecord:
        """Create an agent.

        Args:
            agent_id: The id (see ``store.ids``); ``None`` generates one.
            name: Display name; defaults to the id.
            system_prompt: The system prompt, if any.
            model_fingerprint: Fingerprint of the model the agent runs on, if pinned.
            sampling: JSON-serialisable sampling settings; defaults to ``{}``.

        Raises:
            InvalidAgentIdError: ``agent_id`` breaks the id rule.
            InvalidRecordError: Another argument is invalid.
            AgentExistsError: The id is taken.
        """
        agent_id = new_agent_id() if agent_id is None else validate_agent_id(agent_id)
        columns = validation.agent_fields(
            name=agent_id if name is None else name,
            system_prompt=system_prompt,
            model_fingerprint=model_fingerprint,
            sampling={} if sampling is None else sampling,
        )
        now = utcnow()
        row = Agent(id=agent_id, created_at=now, updated_at=now, **columns)
        try:
            async with self._db.write() as session:
                session.add(row)
        except IntegrityError as exc:  # the primary key settles races; no check-then-insert
            raise AgentExistsError(agent_id) from exc
        return AgentRecord.from_row(row)

    async def get_agent(self, agent_id: str) -> AgentRecord:
        """The agent with this id. Raises ``AgentNotFoundError`` if there is none."""
        validate_agent_id(agent_id)
        async with self._db.read() as session:
            row = await session.get(Agent, agent_id)
            if row is None:
                raise AgentNotFoundError(agent_id)
            return AgentRecord.from_row(row)

    async def list_agents(self) -> list[AgentRecord]:
        """All agents, oldest first (ties broken by id)."""
        async with self._db.read() as session:
            rows = await session.scalars(select(Agent).order_by(Agent.created_at, Agent.id))
            return [AgentRecord.from_row(row) for row in rows]

    async def update_agent(
        self,
        agent_id: str,
        *,
        name: str | Literal[_Unset.UNSET] = UNSET,
        system_prompt: str | Literal[_Unset.UNSET] | None = UNSET,
        model_fingerprint: str | Literal[_Unset.UNSET] | None = UNSET,
        sampling: dict[str, Any] | Literal[_Unset.UNSET] = UNSET,
    ) -> AgentRecord:
        """Change only the given fields of an agent (and its ``updated_at``).

        Returns:
            The agent as updated.

        Raises:
            InvalidRecordError: A given value is invalid.
            AgentNotFoundError: No such agent.
        """
        validate_agent_id(agent_id)
        given = {
            "name": name,
            "system_prompt": system_prompt,
            "model_fingerprint": model_fingerprint,
            "sampling": sampling,
        }
        changes = validation.agent_fields(**{k: v for k, v in given.items() if v is not UNSET})
        if not changes:
            return await self.get_agent(agent_id)
        async with self._db.write() as session:
            row = await session.get(Agent, agent_id)
            if row is None:
                raise AgentNotFoundError(agent_id)
            for key, value in changes.items():
                setattr(row, key, value)
            row.updated_at = utcnow()
            await session.flush()
            return AgentRecord.from_row(row)

    async def delete_agent(self, agent_id: str) -> CacheRecord | None:
        """Delete an agent with its messages and cache entry.

        Returns:
            The cache entry that was current, so the caller can delete its file; else ``None``.

        Raises:
            AgentNotFoundError: No such agent.
        """
        validate_agent_id(agent_id)
        async with self._db.write() as session:
            cache = await _current_cache(session, agent_id)
            deleted = await session.scalar(
                delete(Agent).where(Agent.id == agent_id).returning(Agent.id)
            )
            if deleted is None:
                raise AgentNotFoundError(agent_id)
            return None if cache is None else CacheRecord.from_row(cache)

    # -- messages -------------------------------------------------------------------------

    async def append_messages(
        self, agent_id: str, messages: Sequence[NewMessage], *, replace_from: int | None = None
    ) -> list[MessageRecord]:
        """Append messages at the end of the transcript, all or none; bumps ``updated_at``.

        Args:
            agent_id: The agent.
            messages: One or more messages; they get consecutive positions after the last one.
            replace_from: first delete the messages at positions ``>= replace_from`` (in the
                same transaction): the new messages replace the transcript's tail.

        Returns:
            The stored messages, in order.

        Raises:
            InvalidRecordError: ``messages`` is empty or a message is invalid (nothing stored).
            AgentNotFoundError: No such agent.
        """
        validate_agent_id(agent_id)
        batch = validation.new_messages(messages)
        if replace_from is not None:
            validation.check_count("replace_from", replace_from)
        async with self._db.write() as session:
            now = await _touch(session, agent_id)
            if replace_from is not None:
                await session.execute(
                    delete(Message).where(
                        Message.agent_id == agent_id, Message.position >= replace_from
                    )
                )
            last = await session.scalar(
                select(func.max(Message.position)).where(Message.agent_id == agent_id)
            )
            first = 0 if last is None else last + 1
            rows = [
                Message(
                    agent_id=agent_id,
                    position=first + offset,
                    role=Role(message.role).value,
                    content=message.content,
                    token_count=message.token_count,
                    created_at=now,
                )
                for offset, message in enumerate(batch)
            ]
            session.add_all(rows)
            await session.flush()
            return [MessageRecord.from_row(row) for row in rows]

    async def transcript(self, agent_id: str, *, start: int = 0) -> list[MessageRecord]:
        """The agent's messages from position ``start`` on, in order.

        Raises:
            InvalidRecordError: ``start`` is negative.
            AgentNotFoundError: No such agent.
        """
        validate_agent_id(agent_id)
        validation.check_count("start", start)
        async with self._db.read() as session:
            await _require_agent(session, agent_id)
            rows = await session.scalars(
                select(Message)
                .where(Message.agent_id == agent_id, Message.position >= start)
                .order_by(Message.position)
            )
            return [MessageRecord.from_row(row) for row in rows]

    async def message_count(self, agent_id: str) -> int:
        """Number of messages in the agent's transcript. Raises ``AgentNotFoundError``."""
        validate_agent_id(agent_id)
        async with self._db.read() as session:
            await _require_agent(session, agent_id)
            count = await session.scalar(
                select(func.count()).select_from(Message).where(Message.agent_id == agent_id)
            )
            return count or 0

    async def truncate_messages(self, agent_id: str, keep: int) -> int:
        """Delete the messages at positions ``>= keep`` (rolls back a failed turn).

        Returns:
            How many messages were deleted.

        Raises:
            InvalidRecordError: ``keep`` is negative.
            AgentNotFoundError: No such agent.
        """
        validate_agent_id(agent_id)
        validation.check_count("keep", keep)
        async with self._db.write() as session:
            await _touch(session, agent_id)
            deleted = await session.scalars(
                delete(Message)
                .where(Message.agent_id == agent_id, Message.position >= keep)
                .returning(Message.id)
            )
            return len(deleted.all())

    # -- KV cache entries -----------------------------------------------------------------

    async def set_cache(self, agent_id: str, entry: NewCacheEntry) -> CacheRecord | None:
        """Make ``entry`` the agent's current cache entry.

        Returns:
            The entry it replaced, so the caller can delete that file; else ``None``.

        Raises:
            TypeError: ``entry`` is not a ``NewCacheEntry``.
            AgentNotFoundError: No such agent.
        """
        validate_agent_id(agent_id)
        if not isinstance(entry, NewCacheEntry):
            raise TypeError(f"entry must be a NewCacheEntry, got {type(entry).__name__}")
        async with self._db.write() as session:
            await _require_agent(session, agent_id)
            row = await _current_cache(session, agent_id)
            previous = None if row is None else CacheRecord.from_row(row)
            if row is None:
                row = KVCache(agent_id=agent_id)
                session.add(row)
            for column in fields(entry):
                setattr(row, column.name, getattr(entry, column.name))
            row.created_at = utcnow()
            return previous

    async def get_cache(self, agent_id: str) -> CacheRecord | None:
        """The agent's current cache entry, or ``None``. Raises ``AgentNotFoundError``."""
        validate_agent_id(agent_id)
        async with self._db.read() as session:
            await _require_agent(session, agent_id)
            row = await _current_cache(session, agent_id)
            return None if row is None else CacheRecord.from_row(row)

    async def clear_cache(self, agent_id: str) -> CacheRecord | None:
        """Forget the agent's cache entry and return it (the caller deletes the file)."""
        validate_agent_id(agent_id)
        async with self._db.write() as session:
            await _require_agent(session, agent_id)
            row = await _current_cache(session, agent_id)
            if row is None:
                return None
            await session.delete(row)
            return CacheRecord.from_row(row)


async def _require_agent(session: AsyncSession, agent_id: str) -> None:
    if await session.scalar(select(Agent.id).where(Agent.id == agent_id)) is None:
        raise AgentNotFoundError(agent_id)


async def _touch(session: AsyncSession, agent_id: str) -> datetime:
    """Set the agent's ``updated_at`` to now and return it; ``AgentNotFoundError`` if absent."""
    now = utcnow()
    touched = await session.scalar(
        update(Agent).where(Agent.id == agent_id).values(updated_at=now).returning(Agent.id)
    )
    if touched is None:
        raise AgentNotFoundError(agent_id)
    return now


async def _current_cache(session: AsyncSession, agent_id: str) -> KVCache | None:
    return await session.scalar(select(KVCache).where(KVCache.agent_id == agent_id))
