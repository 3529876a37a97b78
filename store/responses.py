"""Stored OpenAI Responses API responses: what ``previous_response_id`` continues.

A response keeps the input items its request sent itself, its output items and the rest of
the response object as returned; the conversation a ``previous_response_id`` continues is the
chain of responses it leads to, oldest first, each one's input then its output. Deleting a
response (or its expiry) folds its items into the responses that continue it, so their
conversations stay whole.

Items and bodies are JSON text in the database, encoded and decoded in a worker thread: a
reply with logprobs runs to megabytes, which would hold the event loop. ``GET`` reads the
response object's text as it is, without decoding it.

:class:`ResponseIndex` runs on the registry's database (``Registry.responses``); like the
registry, each call runs in one session and one transaction and returns frozen records. Its
writes take turns, on PostgreSQL too (``Lock.RESPONSES``): a put checks the ids it links to,
a delete rewrites the responses that continue the deleted ones.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, insert, literal, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from agentkv.store import database
from agentkv.store.cache_index import require_agent
from agentkv.store.errors import InvalidRecordError, ResponseNotFoundError
from agentkv.store.models import Message, StoredResponse, utcnow
from agentkv.store.postgres import Lock
from agentkv.store.records import NewResponse, ResponseRecord

RESPONSE_ID_CHARS = StoredResponse.__table__.c.id.type.length
"""The longest response id the column holds."""
_IN_CHUNK = 500  # ids per IN (...) list, well under SQLite's bound-parameter limit
_CHAIN_COLUMNS = (
    StoredResponse.id,
    StoredResponse.agent_id,
    StoredResponse.message_id,
    StoredResponse.previous_id,
    StoredResponse.input,
    StoredResponse.output,
    StoredResponse.created_at,
)


class ResponseIndex:
    """Stored responses of one registry's database; reach it as ``registry.responses``."""

    def __init__(self, db: database.Database) -> None:
        self._db = db

    async def put(self, response: NewResponse) -> None:
        """Keep ``response``.

        Raises:
            TypeError: ``response`` is not a ``NewResponse``.
            InvalidRecordError: its id is taken, or ``previous_id`` names no stored response.
            AgentNotFoundError: its agent does not exist.
        """
        if not isinstance(response, NewResponse):
            raise TypeError(f"response must be a NewResponse, got {type(response).__name__}")
        row = await asyncio.to_thread(_encoded, response)
        async with self._db.write() as session:
            await database.hold(session, Lock.RESPONSES)
            if await _exists(session, response.id):
                raise InvalidRecordError(f"id={response.id!r}: a response with it is stored")
            previous = response.previous_id
            if previous is not None and not await _exists(session, previous):
                raise InvalidRecordError(f"previous_id={previous!r}: no such stored response")
            await require_agent(session, response.agent_id, lock=True)  # not deleted meanwhile
            await session.execute(insert(StoredResponse), [row])

    async def get_json(self, response_id: str) -> str:
        """The stored response object, as JSON text. Raises ``ResponseNotFoundError``."""
        _check_id(response_id)
        async with self._db.read() as session:
            row = (
                await session.execute(
                    select(StoredResponse.body, StoredResponse.output).where(
                        StoredResponse.id == response_id
                    )
                )
            ).first()
        if row is None:
            raise ResponseNotFoundError(response_id)
        body, output = row
        return f'{body[:-1]}{", " if body != "{}" else ""}"output": {output}}}'

    async def chain(self, response_id: str) -> list[ResponseRecord]:
        """The responses ``response_id`` continues and itself, oldest first (one query). The
        last one's ``latest`` says whether its reply is still its agent's last message.

        Raises:
            ResponseNotFoundError: no such response.
        """
        _check_id(response_id)
        link = (
            select(StoredResponse.id, StoredResponse.previous_id, literal(0).label("depth"))
            .where(StoredResponse.id == response_id)
            .cte("link", recursive=True)
        )
        link = link.union_all(
            select(StoredResponse.id, StoredResponse.previous_id, link.c.depth + 1).join(
                link, StoredResponse.id == link.c.previous_id
            )
        )
        query = (
            select(*_CHAIN_COLUMNS)
            .join(link, StoredResponse.id == link.c.id)
            .order_by(link.c.depth.desc())
        )
        async with self._db.read() as session:
            rows = (await session.execute(query)).all()
            if not rows:
                raise ResponseNotFoundError(response_id)
            if rows[0].previous_id is not None:  # a link deleted by hand in the database
                raise ResponseNotFoundError(rows[0].previous_id)
            last = rows[-1]
            latest = await _is_latest(session, last.agent_id, last.message_id)
        records = await asyncio.to_thread(_decoded, rows)
        records[-1] = ResponseRecord(*_fields(records[-1]), latest=latest)
        return records

    async def is_latest(self, agent_id: str, message_id: int) -> bool:
        """Whether ``message_id`` is the agent's last message (False: no such agent)."""
        async with self._db.read() as session:
            return await _is_latest(session, agent_id, message_id)

    async def delete(self, response_id: str) -> None:
        """Delete the response; the responses that continue it get its items first.

        Raises:
            ResponseNotFoundError: no such response.
        """
        _check_id(response_id)
        async with self._db.write() as session:
            await database.hold(session, Lock.RESPONSES)
            if not await _delete(session, [response_id]):
                raise ResponseNotFoundError(response_id)

    async def expire(self, before: datetime) -> int:
        """Delete the responses created before ``before`` (their items folded into the
        younger responses that continue them). Returns how many were deleted."""
        old = select(StoredResponse.id).where(StoredResponse.created_at < before)
        async with self._db.read() as session:  # most rounds find nothing: no write lock
            if await session.scalar(old.limit(1)) is None:
                return 0
        async with self._db.write() as session:
            await database.hold(session, Lock.RESPONSES)
            return await _delete(session, list(await session.scalars(old)))


def _check_id(response_id: str) -> None:
    """Raise ``ResponseNotFoundError`` for an id no response can have (one no backend can even
    compare: over the column's length, or holding NUL)."""
    if len(response_id) > RESPONSE_ID_CHARS or "\x00" in response_id:
        raise ResponseNotFoundError(response_id)


def _fields(record: ResponseRecord) -> tuple[Any, ...]:
    return (
        record.id,
        record.agent_id,
        record.message_id,
        record.previous_id,
        record.input,
        record.output,
        record.created_at,
    )


def _encoded(response: NewResponse) -> dict[str, Any]:
    body = {k: v for k, v in response.body.items() if k != "output"}
    return {
        "id": response.id,
        "agent_id": response.agent_id,
        "message_id": response.message_id,
        "previous_id": response.previous_id,
        "input": json.dumps(response.input),
        "output": json.dumps(response.body.get("output", [])),
        "body": json.dumps(body),
        "created_at": utcnow(),
    }


def _decoded(rows: Sequence[Any]) -> list[ResponseRecord]:
    return [
        ResponseRecord(r[0], r[1], r[2], r[3], json.loads(r[4]), json.loads(r[5]), r[6])
        for r in rows
    ]


async def _exists(session: AsyncSession, response_id: str) -> bool:
    found = select(StoredResponse.id).where(StoredResponse.id == response_id)
    return await session.scalar(found) is not None


async def _is_latest(session: AsyncSession, agent_id: str | None, message_id: int | None) -> bool:
    if agent_id is None or message_id is None:
        return False
    newest = await session.scalar(select(func.max(Message.id)).where(Message.agent_id == agent_id))
    return newest == message_id


async def _delete(session: AsyncSession, ids: list[str]) -> int:
    """Delete ``ids``; each response left that continues one of them gets the items of the
    deleted responses it continued (back to the first kept one) and continues that one."""
    gone, rows, heirs = set(ids), {}, []
    for i in range(0, len(ids), _IN_CHUNK):
        chunk = ids[i : i + _IN_CHUNK]
        found = await session.execute(
            select(
                StoredResponse.id,
                StoredResponse.previous_id,
                StoredResponse.input,
                StoredResponse.output,
            ).where(StoredResponse.id.in_(chunk))
        )
        rows.update((r.id, r) for r in found)
        continuing = await session.execute(
            select(StoredResponse.id, StoredResponse.previous_id, StoredResponse.input).where(
                StoredResponse.previous_id.in_(chunk)
            )
        )
        heirs += [h for h in continuing if h.id not in gone]
    for heir in heirs:
        folded, previous = [heir.input], heir.previous_id
        while previous in rows:  # up to the first response kept
            row = rows[previous]
            folded = [row.input, row.output, *folded]
            previous = row.previous_id
        joined = await asyncio.to_thread(_joined, folded)
        await session.execute(
            update(StoredResponse)
            .where(StoredResponse.id == heir.id)
            .values(previous_id=previous, input=joined)
        )
    for i in range(0, len(ids), _IN_CHUNK):
        await session.execute(
            delete(StoredResponse).where(StoredResponse.id.in_(ids[i : i + _IN_CHUNK]))
        )
    return len(rows)


def _joined(lists: list[str]) -> str:
    """JSON lists, as one list."""
    return json.dumps([item for text in lists for item in json.loads(text)])
