"""The agent registry: the source of truth for every agent's conversation and KV cache entry.

One :class:`Registry` owns one ``agentkv.store.database.Database`` (a SQLite file, or a PostgreSQL
database that several workers share). Each call checks its agent id first, then runs in one
session and one transaction, and returns frozen records. Writers of one agent take turns
(SQLite's single writer; on PostgreSQL the agent's row lock, see ``agentkv.store.postgres``), so
message positions stay dense ``0..n-1`` however many tasks, registries or processes append at
once, and every change bumps the agent's ``version``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime
from enum import Enum
from types import TracebackType
from typing import Any, Literal, Self

from sqlalchemy import delete, func, insert, select, tuple_, update
from sqlalchemy import literal as sa_literal
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from agentkv.store import database, validation
from agentkv.store.cache_index import CacheIndex, current_cache, require_agent
from agentkv.store.errors import AgentChangedError, AgentExistsError, AgentNotFoundError
from agentkv.store.ids import new_agent_id, validate_agent_id
from agentkv.store.images import ImageIndex, collect_images, content_key, copy_links, link_images
from agentkv.store.leases import LeaseIndex
from agentkv.store.models import Agent, Message, UTCDateTime, utcnow
from agentkv.store.records import (
    AgentRecord,
    CacheRecord,
    MessageRecord,
    NewMessage,
    Role,
    message_records,
    message_rows,
    transcript_records,
)
from agentkv.store.responses import ResponseIndex


class _Keep(Enum):
    KEEP = "KEEP"


KEEP = _Keep.KEEP
"""Default of ``append_messages(system_prompt=)``: leave the system prompt as it is."""


class Registry:
    """Async registry of agents, their transcripts and their current KV cache entries.

    Create one with :meth:`open`; use it as ``async with await Registry.open(path) as reg:``
    or call :meth:`close` when done.
    """

    def __init__(self, db: database.Database) -> None:
        """Wrap an open, migrated database; use :meth:`open` instead."""
        self._db = db
        self.caches = CacheIndex(db)
        """Each agent's current KV cache entry and the blocks it is made of."""
        self.responses = ResponseIndex(db)
        """Stored Responses API responses (what ``previous_response_id`` continues)."""
        self.leases = LeaseIndex(db)
        self.images = ImageIndex(db)
        """Which worker runs each agent's turns now (workers sharing this registry)."""

    @classmethod
    async def open(cls, url: str | os.PathLike[str]) -> Registry:
        """Open (creating if needed) a registry and migrate it to the current schema.

        Args:
            url: A SQLite file path (parent directories are created) or a SQLAlchemy URL such
                as ``sqlite+aiosqlite:///data/agentkv.sqlite`` or
                ``postgresql+asyncpg://user@host:5432/agentkv``.

        Raises:
            ValueError: ``url`` is empty, in-memory, or of another database or driver.
            RegistryStorageError: The database cannot be opened or written (a read-only file
                or directory, a full disk, a PostgreSQL server that cannot be reached).
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
        idle_ttl_s: int | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> AgentRecord:
        """Create an agent: ``agent_id`` (see ``agentkv.store.ids``; None: a new one), ``name`` (the
        id by default), JSON ``sampling`` settings, ``idle_ttl_s``, the seconds without a
        turn after which :meth:`expired_agents` lists it (None: never), and the JSON ``tools``
        its conversation carries (None: none).

        Raises:
            InvalidAgentIdError, InvalidRecordError: an argument is invalid.
            AgentExistsError: The id is taken.
        """
        agent_id = new_agent_id() if agent_id is None else validate_agent_id(agent_id)
        columns = validation.agent_fields(
            name=agent_id if name is None else name,
            system_prompt=system_prompt,
            model_fingerprint=model_fingerprint,
            sampling={} if sampling is None else sampling,
            idle_ttl_s=idle_ttl_s,
            tools=tools,
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

    async def list_agents(
        self, *, limit: int | None = None, after_id: str | None = None
    ) -> list[AgentRecord]:
        """Agents, oldest first (ties broken by id): all of them, or one page.

        Args:
            limit: at most this many (None: no limit).
            after_id: start after this agent in that order (keyset paging: stable while
                agents are created or deleted between pages).

        Raises:
            InvalidRecordError: ``limit`` is not positive.
            AgentNotFoundError: ``after_id`` names no agent.
        """
        query = select(Agent).order_by(Agent.created_at, Agent.id)
        if limit is not None:
            validation.check_limit(limit)
            query = query.limit(limit)
        async with self._db.read() as session:
            if after_id is not None:
                validate_agent_id(after_id)
                anchor = await session.get(Agent, after_id)
                if anchor is None:
                    raise AgentNotFoundError(after_id)
                query = query.where(
                    tuple_(Agent.created_at, Agent.id) > tuple_(anchor.created_at, anchor.id)
                )
            rows = await session.scalars(query)
            return [AgentRecord.from_row(row) for row in rows]

    async def delete_agent(
        self, agent_id: str, expected_version: int | None = None
    ) -> CacheRecord | None:
        """Delete an agent with its messages and cache entry.

        Args:
            agent_id: the agent.
            expected_version: delete nothing unless the agent is at this version.

        Returns:
            The cache entry that was current, so the caller can delete its file; else ``None``.

        Raises:
            AgentNotFoundError: No such agent.
            AgentChangedError: It is not at ``expected_version`` (nothing deleted).
        """
        validate_agent_id(agent_id)
        async with self._db.write() as session:
            version = await require_agent(session, agent_id, lock=True)  # no cache set meanwhile
            if expected_version is not None and version != expected_version:
                raise AgentChangedError(agent_id, expected_version, version)
            cache = await current_cache(session, agent_id)
            deleted = await session.scalar(
                delete(Agent).where(Agent.id == agent_id).returning(Agent.id)
            )
            if deleted is None:
                raise AgentNotFoundError(agent_id)
            await collect_images(session)  # (those only its messages showed, unused lately)
            return None if cache is None else CacheRecord.from_row(cache)

    async def fork_agent(
        self, source_id: str, agent_id: str | None = None, *, name: str | None = None
    ) -> AgentRecord:
        """A new agent with the source's system prompt, sampling, model and a copy of its
        transcript (one transaction; the cache entry is the caller's to set).

        Raises:
            AgentNotFoundError: No source agent.
            AgentExistsError: ``agent_id`` is taken.
        """
        validate_agent_id(source_id)
        agent_id = new_agent_id() if agent_id is None else validate_agent_id(agent_id)
        now = utcnow()
        try:
            async with self._db.write() as session:
                # Locked against deletion until the transcript is copied (PostgreSQL).
                source = await session.get(
                    Agent, source_id, with_for_update={"read": True, "key_share": True}
                )
                if source is None:
                    raise AgentNotFoundError(source_id)
                columns = validation.agent_fields(name=agent_id if name is None else name)
                row = Agent(
                    id=agent_id,
                    system_prompt=source.system_prompt,
                    model_fingerprint=source.model_fingerprint,
                    sampling=dict(source.sampling),
                    created_at=now,
                    updated_at=now,
                    **columns,
                )
                session.add(row)
                await session.flush()
                copied = [Message.position, Message.role, Message.content, Message.token_count]
                await session.execute(
                    insert(Message.__table__).from_select(
                        [
                            "agent_id",
                            *("position", "role", "content", "token_count", "created_at"),
                            "parts",
                        ],
                        select(
                            sa_literal(agent_id),
                            *copied,
                            sa_literal(now, UTCDateTime),
                            Message.parts,
                        ).where(Message.agent_id == source_id),
                    )
                )
                await copy_links(session, source_id, agent_id)
        except IntegrityError as exc:
            raise AgentExistsError(agent_id) from exc
        return AgentRecord.from_row(row)

    # -- messages -------------------------------------------------------------------------

    async def append_messages(
        self,
        agent_id: str,
        messages: Sequence[NewMessage],
        *,
        replace_from: int | None = None,
        system_prompt: str | Literal[_Keep.KEEP] | None = KEEP,
        expected_version: int | None = None,
    ) -> list[MessageRecord]:
        """Append messages at the end of the transcript, all or none; bumps ``updated_at`` and
        the agent's ``version``.

        Args:
            agent_id: The agent.
            messages: One or more messages; they get consecutive positions after the last one.
            replace_from: first delete the messages at positions ``>= replace_from`` (in the
                same transaction): the new messages replace the transcript's tail.
            system_prompt: also set the agent's system prompt (None clears it), in the same
                transaction; by default it is kept.
            expected_version: store nothing unless the agent is at this version (the one the
                caller read): the version then becomes ``expected_version + 1``.

        Returns:
            The stored messages, in order.

        Raises:
            InvalidRecordError: ``messages`` is empty or a message is invalid (nothing stored).
            AgentNotFoundError: No such agent.
            AgentChangedError: The agent is not at ``expected_version`` (nothing stored).
        """
        validate_agent_id(agent_id)
        batch = await _off_loop(len(messages), validation.new_messages, messages)
        if replace_from is not None:
            validation.check_count("replace_from", replace_from)
        changes = {} if system_prompt is KEEP else {"system_prompt": system_prompt}
        validation.agent_fields(**changes)
        async with self._db.write() as session:
            now = await _touch(session, agent_id, expected_version, **changes)
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
            rows = await _off_loop(len(batch), message_rows, agent_id, first, now, batch)
            # One executemany per chunk, not one ORM object per row: an import can be 10^4+
            # messages, and each chunk (a few ms of parameters) gives the event loop a turn.
            for i in range(0, len(rows), MESSAGE_CHUNK):
                await session.execute(insert(Message.__table__), rows[i : i + MESSAGE_CHUNK])
            ids = list(
                await session.scalars(
                    select(Message.__table__.c.id)
                    .where(Message.agent_id == agent_id, Message.position >= first)
                    .order_by(Message.position)
                )
            )
            await link_images(session, [(i, r["parts"]) for i, r in zip(ids, rows, strict=True)])
            if replace_from is not None:
                await collect_images(session)  # (those only the replaced messages showed)
        return await _off_loop(len(rows), message_records, ids, rows)

    async def transcript(
        self, agent_id: str, *, start: int = 0, limit: int | None = None
    ) -> list[MessageRecord]:
        """The agent's messages from position ``start`` on (at most ``limit``), in order.

        Raises:
            InvalidRecordError: ``start`` is negative or ``limit`` not positive.
            AgentNotFoundError: No such agent.
        """
        validate_agent_id(agent_id)
        validation.check_count("start", start)
        table = Message.__table__.c
        columns = [table[f.name] for f in fields(MessageRecord)]
        query = (
            select(*columns)  # table columns: rows processed as they are read, off the loop
            .where(Message.agent_id == agent_id, Message.position >= start)
            .order_by(Message.position)
        )
        if limit is not None:
            validation.check_limit(limit)
            query = query.limit(limit)
        async with self._db.read() as session:
            await require_agent(session, agent_id)
            # The connection's Core result, not the session's: the ORM would process every
            # row here, on the event loop.
            result = await (await session.connection()).execute(query)
        # The rows are fetched; making records of them grows with the transcript (a worker
        # thread: the event loop serves other clients meanwhile).
        if limit is not None and limit < OFF_LOOP_ROWS:
            return transcript_records(result)
        return await asyncio.to_thread(transcript_records, result)

    async def transcripts(self, id_prefix: str = "") -> dict[str, list[tuple[Role, str]]]:
        """(role, content) of every message of every agent whose id starts with ``id_prefix``,
        by agent, in order: one query, whatever the number of agents. A message with images
        gives its :func:`~agentkv.store.images.content_key` (its images named by SHA-256)."""
        query = (
            select(Message.agent_id, Message.role, Message.content, Message.parts)
            .where(Message.agent_id.startswith(id_prefix, autoescape=True))
            .order_by(Message.agent_id, Message.position)
        )
        out: dict[str, list[tuple[Role, str]]] = {}
        async with self._db.read() as session:
            for agent_id, role, content, parts in await session.execute(query):
                text = content if parts is None else content_key(parts)
                out.setdefault(agent_id, []).append((Role(role), text))
        return out

    async def message_count(self, agent_id: str) -> int:
        """Number of messages in the agent's transcript. Raises ``AgentNotFoundError``."""
        validate_agent_id(agent_id)
        async with self._db.read() as session:
            await require_agent(session, agent_id)
            count = await session.scalar(
                select(func.count()).select_from(Message).where(Message.agent_id == agent_id)
            )
            return count or 0

    async def expired_agents(self, now: datetime | None = None) -> list[str]:
        """Ids of agents with an ``idle_ttl_s`` whose last change is older than that, oldest
        first."""
        now = now or utcnow()
        async with self._db.read() as session:
            rows = await session.execute(
                select(Agent.id, Agent.updated_at, Agent.idle_ttl_s)
                .where(Agent.idle_ttl_s.is_not(None))
                .order_by(Agent.updated_at)
            )
            return [
                agent_id
                for agent_id, updated_at, ttl in rows
                if (now - updated_at).total_seconds() > ttl
            ]


async def _touch(
    session: AsyncSession, agent_id: str, expected_version: int | None, **changes: Any
) -> datetime:
    """Set the agent's ``updated_at`` to now (and ``changes``), bump its version, and return
    the time. The update locks the agent's row until the transaction ends (PostgreSQL), so
    writers of one agent queue here.

    Raises:
        AgentNotFoundError: No such agent.
        AgentChangedError: It is not at ``expected_version`` (when given).
    """
    now = utcnow()
    statement = update(Agent).where(Agent.id == agent_id)
    if expected_version is not None:
        statement = statement.where(Agent.version == expected_version)
    touched = await session.scalar(
        statement.values(updated_at=now, version=Agent.version + 1, **changes).returning(Agent.id)
    )
    if touched is None:
        actual = await session.scalar(select(Agent.version).where(Agent.id == agent_id))
        if actual is None:
            raise AgentNotFoundError(agent_id)
        raise AgentChangedError(agent_id, expected_version or 0, actual)
    return now


OFF_LOOP_ROWS = 1000
"""Imports of at least this many messages are validated and turned into rows and records in a
worker thread: Python work growing with them would stall every other client's event loop."""
MESSAGE_CHUNK = 256
"""Messages inserted per statement."""


async def _off_loop(n: int, work: Any, *args: Any) -> Any:
    return work(*args) if n < OFF_LOOP_ROWS else await asyncio.to_thread(work, *args)
