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

from sqlalchemy import delete, func, insert, select, tuple_, update
from sqlalchemy import literal as sa_literal
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from store import database, validation
from store.errors import AgentExistsError, AgentNotFoundError, BlocksMissingError
from store.ids import new_agent_id, validate_agent_id
from store.models import Agent, KVBlock, KVCache, KVCacheBlock, Message, UTCDateTime, utcnow
from store.records import (
    AgentRecord,
    CacheRecord,
    DiskUsage,
    MessageRecord,
    NewBlock,
    NewCacheEntry,
    NewMessage,
    Role,
    StoredBlock,
)

_INSERT_CHUNK = 1000
_IN_CHUNK = 500  # keys per IN (...) list, well under SQLite's bound-parameter limit


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
        idle_ttl_s: int | None = None,
    ) -> AgentRecord:
        """Create an agent.

        Args:
            agent_id: The id (see ``store.ids``); ``None`` generates one.
            name: Display name; defaults to the id.
            system_prompt: The system prompt, if any.
            model_fingerprint: Fingerprint of the model the agent runs on, if pinned.
            sampling: JSON-serialisable sampling settings; defaults to ``{}``.
            idle_ttl_s: Seconds without a turn after which :meth:`expired_agents` lists it;
                ``None`` (default): never.

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
            idle_ttl_s=idle_ttl_s,
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
                source = await session.get(Agent, source_id)
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
                        ["agent_id", "position", "role", "content", "token_count", "created_at"],
                        select(sa_literal(agent_id), *copied, sa_literal(now, UTCDateTime)).where(
                            Message.agent_id == source_id
                        ),
                    )
                )
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
    ) -> list[MessageRecord]:
        """Append messages at the end of the transcript, all or none; bumps ``updated_at``.

        Args:
            agent_id: The agent.
            messages: One or more messages; they get consecutive positions after the last one.
            replace_from: first delete the messages at positions ``>= replace_from`` (in the
                same transaction): the new messages replace the transcript's tail.
            system_prompt: also set the agent's system prompt (None clears it), in the same
                transaction; by default it is kept.

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
        changes = {} if system_prompt is KEEP else {"system_prompt": system_prompt}
        validation.agent_fields(**changes)
        async with self._db.write() as session:
            now = await _touch(session, agent_id, **changes)
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
                {
                    "agent_id": agent_id,
                    "position": first + offset,
                    "role": message.role,
                    "content": message.content,
                    "token_count": message.token_count,
                    "created_at": now,
                }
                for offset, message in enumerate(batch)
            ]
            # One executemany per chunk, not one ORM object per row: an import can be 10^4+
            # messages, and each chunk gives the event loop a turn.
            for i in range(0, len(rows), _INSERT_CHUNK):
                await session.execute(insert(Message.__table__), rows[i : i + _INSERT_CHUNK])
            ids = await session.scalars(
                select(Message.id)
                .where(Message.agent_id == agent_id, Message.position >= first)
                .order_by(Message.position)
            )
            return [
                MessageRecord(id=i, **row | {"role": Role(row["role"])})
                for i, row in zip(ids, rows, strict=True)
            ]

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
        columns = [getattr(Message, f.name) for f in fields(MessageRecord)]
        query = (
            select(*columns)  # plain rows: no ORM identity map for long transcripts
            .where(Message.agent_id == agent_id, Message.position >= start)
            .order_by(Message.position)
        )
        if limit is not None:
            validation.check_limit(limit)
            query = query.limit(limit)
        async with self._db.read() as session:
            await _require_agent(session, agent_id)
            rows = await session.execute(query)
            return [MessageRecord(*row[:3], Role(row[3]), *row[4:]) for row in rows]

    async def transcripts(self, id_prefix: str = "") -> dict[str, list[tuple[Role, str]]]:
        """(role, content) of every message of every agent whose id starts with ``id_prefix``,
        by agent, in order: one query, whatever the number of agents."""
        query = (
            select(Message.agent_id, Message.role, Message.content)
            .where(Message.agent_id.startswith(id_prefix, autoescape=True))
            .order_by(Message.agent_id, Message.position)
        )
        out: dict[str, list[tuple[Role, str]]] = {}
        async with self._db.read() as session:
            for agent_id, role, content in await session.execute(query):
                out.setdefault(agent_id, []).append((Role(role), content))
        return out

    async def message_count(self, agent_id: str) -> int:
        """Number of messages in the agent's transcript. Raises ``AgentNotFoundError``."""
        validate_agent_id(agent_id)
        async with self._db.read() as session:
            await _require_agent(session, agent_id)
            count = await session.scalar(
                select(func.count()).select_from(Message).where(Message.agent_id == agent_id)
            )
            return count or 0

    # -- KV cache entries -----------------------------------------------------------------

    async def set_cache(
        self,
        agent_id: str,
        entry: NewCacheEntry,
        *,
        blocks: Sequence[str] = (),
        new_blocks: Sequence[NewBlock] = (),
    ) -> CacheRecord | None:
        """Make ``entry`` the agent's current cache entry, made of ``blocks`` (in order).

        ``new_blocks`` (files just written) are recorded first, in the same transaction; a
        block already known keeps its row. Every key in ``blocks`` must then be known.

        Returns:
            The entry it replaced, so the caller can delete that file; else ``None``.

        Raises:
            TypeError: ``entry`` is not a ``NewCacheEntry``.
            AgentNotFoundError: No such agent.
            BlocksMissingError: A listed block is not recorded (collected meanwhile); nothing
                changed, so the caller can write it and try again.
        """
        validate_agent_id(agent_id)
        if not isinstance(entry, NewCacheEntry):
            raise TypeError(f"entry must be a NewCacheEntry, got {type(entry).__name__}")
        async with self._db.write() as session:
            await _require_agent(session, agent_id)
            await _record_blocks(session, new_blocks)
            if blocks:
                known = await _known_blocks(session, blocks)
                if missing := [key for key in blocks if key not in known]:
                    raise BlocksMissingError(missing)
            row = await _current_cache(session, agent_id)
            previous = None if row is None else CacheRecord.from_row(row)
            if row is None:
                row = KVCache(agent_id=agent_id)
                session.add(row)
            for column in fields(entry):
                setattr(row, column.name, getattr(entry, column.name))
            row.created_at = utcnow()
            await session.execute(delete(KVCacheBlock).where(KVCacheBlock.agent_id == agent_id))
            rows = [
                {"agent_id": agent_id, "position": i, "block_key": key}
                for i, key in enumerate(blocks)
            ]
            for start in range(0, len(rows), _INSERT_CHUNK):
                await session.execute(
                    insert(KVCacheBlock.__table__), rows[start : start + _INSERT_CHUNK]
                )
            return previous

    async def add_blocks(self, new_blocks: Sequence[NewBlock]) -> None:
        """Record block (and window) files no cache lists yet: a prefix stored for later
        caches. They are garbage to :meth:`collect_garbage` unless it is told to keep them (or
        a cache lists another block of their segment)."""
        async with self._db.write() as session:
            await _record_blocks(session, new_blocks)

    async def known_blocks(self, keys: Sequence[str]) -> dict[str, StoredBlock]:
        """Which of ``keys`` are recorded, each mapped to where its file is and whether it has a
        window file."""
        async with self._db.read() as session:
            return await _known_blocks(session, keys)

    async def collect_garbage(self, keep: Sequence[str] = ()) -> list[tuple[str, StoredBlock]]:
        """Delete the rows of blocks whose file no cache needs: a segment's blocks go together,
        when no cache lists any of them and none is in ``keep``.

        Returns:
            (key, where it was) of each deleted block: the caller deletes the files.
        """
        async with self._db.write() as session:
            file_of = func.coalesce(KVBlock.segment, KVBlock.key)
            needed = select(file_of).join(KVCacheBlock, KVCacheBlock.block_key == KVBlock.key)
            if keep:
                needed = needed.union(select(file_of).where(KVBlock.key.in_(list(keep))))
            rows = await session.execute(
                delete(KVBlock).where(file_of.not_in(needed)).returning(*_LOCATION)
            )
            return [(row[0], _stored_block(row)) for row in rows]

    async def block_keys(self) -> dict[str, StoredBlock]:
        """Every recorded block, mapped to where its file is (one query)."""
        async with self._db.read() as session:
            rows = await session.execute(select(*_LOCATION))
            return {row[0]: _stored_block(row) for row in rows}

    async def get_cache(self, agent_id: str) -> CacheRecord | None:
        """The agent's current cache entry, or ``None``. Raises ``AgentNotFoundError``."""
        validate_agent_id(agent_id)
        async with self._db.read() as session:
            await _require_agent(session, agent_id)
            row = await _current_cache(session, agent_id)
            if row is None:
                return None
            keys = await session.scalars(
                select(KVCacheBlock.block_key)
                .where(KVCacheBlock.agent_id == agent_id)
                .order_by(KVCacheBlock.position)
            )
            return CacheRecord.from_row(row, tuple(keys))

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

    async def cache_usage(self) -> DiskUsage:
        """Bytes and files of every current cache entry and recorded block."""
        async with self._db.read() as session:
            own = (
                await session.execute(
                    select(func.coalesce(func.sum(KVCache.nbytes), 0), func.count(KVCache.id))
                )
            ).one()
            blocks = (
                await session.execute(
                    select(
                        func.coalesce(func.sum(KVBlock.nbytes), 0),
                        func.coalesce(func.sum(KVBlock.window_nbytes), 0),
                        func.count(KVBlock.key),
                        func.count(KVBlock.window_nbytes),
                        func.count(func.distinct(func.coalesce(KVBlock.segment, KVBlock.key))),
                    )
                )
            ).one()
            return DiskUsage(
                bytes=int(own[0] + blocks[0] + blocks[1]),
                files=int(own[1] + blocks[4] + blocks[3]),
                blocks=int(blocks[2]),
            )

    async def coldest_caches(self, limit: int) -> list[CacheRecord]:
        """Current cache entries, those of the agents with the oldest last change first."""
        validation.check_limit(limit)
        async with self._db.read() as session:
            rows = await session.scalars(
                select(KVCache)
                .join(Agent, Agent.id == KVCache.agent_id)
                .order_by(Agent.updated_at, Agent.id)
                .limit(limit)
            )
            return [CacheRecord.from_row(row) for row in rows]

    async def clear_cache(self, agent_id: str, path: str) -> bool:
        """Forget the agent's cache entry if it still points at ``path`` (a newer save is kept).

        Returns:
            Whether the entry was removed; the caller then deletes the file.
        """
        validate_agent_id(agent_id)
        async with self._db.write() as session:
            deleted = await session.scalar(
                delete(KVCache)
                .where(KVCache.agent_id == agent_id, KVCache.path == path)
                .returning(KVCache.id)
            )
            if deleted is not None:
                await session.execute(delete(KVCacheBlock).where(KVCacheBlock.agent_id == agent_id))
            return deleted is not None

    async def cache_paths(self) -> dict[str, str | None]:
        """Every agent's id and its current cache file's path (None: no cache), in one query."""
        async with self._db.read() as session:
            rows = await session.execute(
                select(Agent.id, KVCache.path).outerjoin(KVCache, KVCache.agent_id == Agent.id)
            )
            return {agent_id: path for agent_id, path in rows}


async def _require_agent(session: AsyncSession, agent_id: str) -> None:
    if await session.scalar(select(Agent.id).where(Agent.id == agent_id)) is None:
        raise AgentNotFoundError(agent_id)


async def _touch(session: AsyncSession, agent_id: str, **changes: Any) -> datetime:
    """Set the agent's ``updated_at`` to now (and ``changes``) and return it;
    ``AgentNotFoundError`` if absent."""
    now = utcnow()
    touched = await session.scalar(
        update(Agent)
        .where(Agent.id == agent_id)
        .values(updated_at=now, **changes)
        .returning(Agent.id)
    )
    if touched is None:
        raise AgentNotFoundError(agent_id)
    return now


async def _record_blocks(session: AsyncSession, new_blocks: Sequence[NewBlock]) -> None:
    """Insert block rows; a known block's row takes the new file (it was written again because
    its file was gone), and gains a window file it lacked."""
    for block in new_blocks:
        if not isinstance(block, NewBlock):
            raise TypeError(f"blocks must be NewBlock, got {type(block).__name__}")
        window = {"window_nbytes": block.window_nbytes, "window_checksum": block.window_checksum}
        if block.nbytes is None:  # a window for a known block
            updated = await session.execute(
                update(KVBlock)
                .where(KVBlock.key == block.key)
                .values(window)
                .returning(KVBlock.key)
            )
            if updated.first() is None:
                raise BlocksMissingError([block.key])
            continue
        changes = {
            "nbytes": block.nbytes,
            "checksum": block.checksum,
            "segment": block.segment,
            "segment_index": block.segment_index,
        }
        statement = sqlite_insert(KVBlock).values(
            key=block.key, created_at=utcnow(), **changes, **window
        )
        if block.window_nbytes is not None:
            changes |= window
        await session.execute(
            statement.on_conflict_do_update(index_elements=[KVBlock.key], set_=changes)
        )


async def _known_blocks(session: AsyncSession, keys: Sequence[str]) -> dict[str, StoredBlock]:
    keys = list(dict.fromkeys(keys))
    known: dict[str, StoredBlock] = {}
    for start in range(0, len(keys), _IN_CHUNK):
        rows = await session.execute(
            select(*_LOCATION).where(KVBlock.key.in_(keys[start : start + _IN_CHUNK]))
        )
        known.update((row[0], _stored_block(row)) for row in rows)
    return known


_LOCATION = (
    KVBlock.key,
    KVBlock.window_nbytes.is_not(None),
    KVBlock.segment,
    KVBlock.segment_index,
)


def _stored_block(row: Any) -> StoredBlock:
    _, window, segment, index = row
    return StoredBlock(bool(window), segment, index or 0)


async def _current_cache(session: AsyncSession, agent_id: str) -> KVCache | None:
    return await session.scalar(select(KVCache).where(KVCache.agent_id == agent_id))
