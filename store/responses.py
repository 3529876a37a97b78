"""Stored OpenAI Responses API responses: what ``previous_response_id`` continues.

A response keeps the input items its request sent itself and the response object as returned;
the conversation a ``previous_response_id`` continues is the chain of responses it leads to,
oldest first, each one's input then its output. Deleting a response (or its expiry) folds its
items into the responses that continue it, so their conversations stay whole.

:class:`ResponseIndex` runs on the registry's database (``Registry.responses``); like the
registry, each call runs in one session and one transaction and returns frozen records.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, insert, literal, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from store import database
from store.errors import InvalidRecordError, ResponseNotFoundError
from store.models import Message, StoredResponse, utcnow
from store.records import NewResponse, ResponseRecord

_COLUMNS = (
    StoredResponse.id,
    StoredResponse.agent_id,
    StoredResponse.message_id,
    StoredResponse.previous_id,
    StoredResponse.input,
    StoredResponse.body,
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
        """
        if not isinstance(response, NewResponse):
            raise TypeError(f"response must be a NewResponse, got {type(response).__name__}")
        async with self._db.write() as session:
            if await session.get(StoredResponse, response.id) is not None:
                raise InvalidRecordError(f"id={response.id!r}: a response with it is stored")
            previous = response.previous_id
            if previous is not None and await session.get(StoredResponse, previous) is None:
                raise InvalidRecordError(f"previous_id={previous!r}: no such stored response")
            await session.execute(
                insert(StoredResponse),
                [
                    {
                        "id": response.id,
                        "agent_id": response.agent_id,
                        "message_id": response.message_id,
                        "previous_id": previous,
                        "input": response.input,
                        "body": response.body,
                        "created_at": utcnow(),
                    }
                ],
            )

    async def get(self, response_id: str) -> ResponseRecord:
        """The stored response. Raises ``ResponseNotFoundError``."""
        async with self._db.read() as session:
            row = (
                await session.execute(select(*_COLUMNS).where(StoredResponse.id == response_id))
            ).first()
        if row is None:
            raise ResponseNotFoundError(response_id)
        return ResponseRecord(*row)

    async def chain(self, response_id: str) -> list[ResponseRecord]:
        """The responses ``response_id`` continues and itself, oldest first (one query). The
        last one's ``latest`` says whether its reply is still its agent's last message.

        Raises:
            ResponseNotFoundError: no such response.
        """
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
            select(*_COLUMNS)
            .join(link, StoredResponse.id == link.c.id)
            .order_by(link.c.depth.desc())
        )
        async with self._db.read() as session:
            records = [ResponseRecord(*row) for row in await session.execute(query)]
            if not records:
                raise ResponseNotFoundError(response_id)
            last = records[-1]
            latest = last.agent_id is not None and last.message_id is not None
            if latest:
                newest = await session.scalar(
                    select(func.max(Message.id)).where(Message.agent_id == last.agent_id)
                )
                latest = newest == last.message_id
        if records[0].previous_id is not None:  # deleted by hand in the database
            raise ResponseNotFoundError(records[0].previous_id)
        records[-1] = ResponseRecord(*_fields(last), latest=latest)
        return records

    async def delete(self, response_id: str) -> None:
        """Delete the response; the responses that continue it get its items first.

        Raises:
            ResponseNotFoundError: no such response.
        """
        async with self._db.write() as session:
            if not await _delete(session, [response_id]):
                raise ResponseNotFoundError(response_id)

    async def expire(self, before: datetime) -> int:
        """Delete the responses created before ``before`` (folding their items into the
        younger responses that continue them). Returns how many were deleted."""
        async with self._db.write() as session:
            ids = list(
                await session.scalars(
                    select(StoredResponse.id)
                    .where(StoredResponse.created_at < before)
                    .order_by(StoredResponse.created_at)
                )
            )
            return await _delete(session, ids)


def _fields(record: ResponseRecord) -> tuple:
    return (
        record.id,
        record.agent_id,
        record.message_id,
        record.previous_id,
        record.input,
        record.body,
        record.created_at,
    )


async def _delete(session: AsyncSession, ids: list[str]) -> int:
    """Delete ``ids`` in order, each one's items prepended to its children's input."""
    deleted = 0
    for response_id in ids:
        gone = (
            await session.execute(select(*_COLUMNS).where(StoredResponse.id == response_id))
        ).first()
        if gone is None:
            continue
        gone = ResponseRecord(*gone)
        items = [*gone.input, *gone.body.get("output", [])]
        children = await session.execute(
            select(StoredResponse.id, StoredResponse.input).where(
                StoredResponse.previous_id == response_id
            )
        )
        for child_id, child_input in children.all():
            await session.execute(
                update(StoredResponse)
                .where(StoredResponse.id == child_id)
                .values(previous_id=gone.previous_id, input=[*items, *child_input])
            )
        await session.execute(delete(StoredResponse).where(StoredResponse.id == response_id))
        deleted += 1
    return deleted
