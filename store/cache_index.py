"""The registry's index of KV cache files: each agent's current cache entry, the blocks it is
made of, and the block rows shared between caches (garbage once no cache lists them).

:class:`CacheIndex` runs on the registry's database (``Registry.caches``); like the registry,
each call runs in one session and one transaction and returns frozen records.

On PostgreSQL, where writers run side by side, :meth:`CacheIndex.set` locks the agent's row
(two saves of one agent take turns), and ``Lock.BLOCKS`` keeps :meth:`CacheIndex.collect_garbage`
apart from the writes that record or list blocks: it must not delete a block a save is about to
list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, func, insert, select, union, update
from sqlalchemy.ext.asyncio import AsyncSession

from agentkv.store import database, validation
from agentkv.store.errors import AgentNotFoundError, BlocksMissingError
from agentkv.store.ids import validate_agent_id
from agentkv.store.models import Agent, KVBlock, KVCache, KVCacheBlock, utcnow
from agentkv.store.postgres import Lock
from agentkv.store.records import CacheRecord, DiskUsage, NewBlock, NewCacheEntry, StoredBlock

INSERT_CHUNK = 1000
_IN_CHUNK = 500  # keys per IN (...) list, well under SQLite's bound-parameter limit


class CacheIndex:
    """Cache entries and blocks of one registry's database; reach it as ``registry.caches``."""

    def __init__(self, db: database.Database) -> None:
        self._db = db

    async def set(
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
            await database.hold(session, Lock.BLOCKS, shared=True)
            await require_agent(session, agent_id, lock=True)
            await _record_blocks(session, new_blocks)
            if blocks:
                known = await _known_blocks(session, blocks)
                if missing := [key for key in blocks if key not in known]:
                    raise BlocksMissingError(missing)
            row = await current_cache(session, agent_id)
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
            for start in range(0, len(rows), INSERT_CHUNK):
                await session.execute(
                    insert(KVCacheBlock.__table__), rows[start : start + INSERT_CHUNK]
                )
            return previous

    async def add_blocks(self, new_blocks: Sequence[NewBlock], keep_s: float = 0.0) -> None:
        """Record block (and window) files no cache lists yet: a prefix stored for later
        caches. They are garbage to :meth:`collect_garbage` unless it is told to keep them, a
        cache lists another block of their segment, or (``keep_s``) for that many seconds
        from now, whichever worker collects."""
        async with self._db.write() as session:
            await database.hold(session, Lock.BLOCKS, shared=True)
            await _record_blocks(session, new_blocks)
            if keep_s > 0 and new_blocks:
                keys = sorted({block.key for block in new_blocks})
                until = utcnow() + timedelta(seconds=keep_s)
                for start in range(0, len(keys), _IN_CHUNK):
                    await session.execute(
                        update(KVBlock)
                        .where(KVBlock.key.in_(keys[start : start + _IN_CHUNK]))
                        .values(pinned_until=until)
                    )

    async def known_blocks(self, keys: Sequence[str]) -> dict[str, StoredBlock]:
        """Which of ``keys`` are recorded, each mapped to where its file is and whether it has a
        window file."""
        async with self._db.read() as session:
            return await _known_blocks(session, keys)

    async def collect_garbage(self, keep: Sequence[str] = ()) -> list[tuple[str, StoredBlock]]:
        """Delete the rows of blocks whose file no cache needs: a segment's blocks go together,
        when no cache lists any of them, none is in ``keep`` and none is pinned (see
        :meth:`add_blocks`).

        Returns:
            (key, where it was) of each deleted block: the caller deletes the files.
        """
        async with self._db.write() as session:
            await database.hold(session, Lock.BLOCKS)  # no set or add_blocks meanwhile
            file_of = func.coalesce(KVBlock.segment, KVBlock.key)
            needed = [
                select(file_of).join(KVCacheBlock, KVCacheBlock.block_key == KVBlock.key),
                select(file_of).where(KVBlock.pinned_until > utcnow()),
            ]
            if keep:
                needed.append(select(file_of).where(KVBlock.key.in_(list(keep))))
            rows = await session.execute(
                delete(KVBlock).where(file_of.not_in(union(*needed))).returning(*_LOCATION)
            )
            return [(row[0], _stored_block(row)) for row in rows]

    async def block_keys(self) -> dict[str, StoredBlock]:
        """Every recorded block, mapped to where its file is (one query)."""
        async with self._db.read() as session:
            rows = await session.execute(select(*_LOCATION))
            return {row[0]: _stored_block(row) for row in rows}

    async def get(self, agent_id: str) -> CacheRecord | None:
        """The agent's current cache entry, or ``None``. Raises ``AgentNotFoundError``."""
        validate_agent_id(agent_id)
        async with self._db.read() as session:
            await require_agent(session, agent_id)
            row = await current_cache(session, agent_id)
            if row is None:
                return None
            keys = await session.scalars(
                select(KVCacheBlock.block_key)
                .where(KVCacheBlock.agent_id == agent_id)
                .order_by(KVCacheBlock.position)
            )
            return CacheRecord.from_row(row, tuple(keys))

    async def usage(self) -> DiskUsage:
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

    async def coldest(self, limit: int) -> list[CacheRecord]:
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

    async def clear(self, agent_id: str, path: str) -> bool:
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

    async def paths(self) -> dict[str, str | None]:
        """Every agent's id and its current cache file's path (None: no cache), in one query."""
        async with self._db.read() as session:
            rows = await session.execute(
                select(Agent.id, KVCache.path).outerjoin(KVCache, KVCache.agent_id == Agent.id)
            )
            return {agent_id: path for agent_id, path in rows}


async def require_agent(session: AsyncSession, agent_id: str, *, lock: bool = False) -> int:
    """The agent's version; raises ``AgentNotFoundError`` unless the agent exists.

    Args:
        lock: Also lock the agent's row until the transaction ends (``FOR NO KEY UPDATE`` on
            PostgreSQL, which waits for and blocks the agent's other writers and its deletion;
            SQLite's writers hold the whole file anyway).
    """
    query = select(Agent.version).where(Agent.id == agent_id)
    if lock:
        query = query.with_for_update(key_share=True)
    version = await session.scalar(query)
    if version is None:
        raise AgentNotFoundError(agent_id)
    return version


async def current_cache(session: AsyncSession, agent_id: str) -> KVCache | None:
    return await session.scalar(select(KVCache).where(KVCache.agent_id == agent_id))


async def _record_blocks(session: AsyncSession, new_blocks: Sequence[NewBlock]) -> None:
    """Insert block rows; a known block's row takes the new file (it was written again because
    its file was gone), and gains a window file it lacked."""
    # In key order: two saves sharing blocks then lock their rows in the same order (PostgreSQL),
    # never each waiting for the other.
    for block in sorted(new_blocks, key=_block_key):
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
        statement = database.upsert(session, KVBlock).values(
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


def _block_key(block: NewBlock) -> str:
    if not isinstance(block, NewBlock):
        raise TypeError(f"blocks must be NewBlock, got {type(block).__name__}")
    return block.key


_LOCATION = (
    KVBlock.key,
    KVBlock.window_nbytes.is_not(None),
    KVBlock.segment,
    KVBlock.segment_index,
)


def _stored_block(row: Any) -> StoredBlock:
    _, window, segment, index = row
    return StoredBlock(bool(window), segment, index or 0)
