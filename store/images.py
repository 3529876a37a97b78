"""Images messages show: stored once by content, numbered by their row.

An image's number (``images.id``) is what the rest of agentkv knows it by: a message's parts
name it, and its tokens in a KV cache are made of it (``agentkv.engine.models.vision``), so the same
bytes shown by any conversation, before or after a restart, are the same tokens.

:class:`ImageIndex` runs on the registry's database (``Registry.images``); each call runs in
one session and one transaction. ``message_images`` records which message shows which image;
an image no message shows and no turn used for :data:`IMAGE_GRACE` is deleted by
:func:`collect_images` (when an agent is deleted or its turns replaced, and by
:meth:`ImageIndex.collect`). Numbers are never reused, so a cache that held a deleted image's
tokens never matches another image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, exists, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from agentkv.store import database
from agentkv.store.errors import InvalidRecordError
from agentkv.store.models import Image, Message, MessageImage, utcnow

IMAGE_GRACE = timedelta(hours=24)
"""How long an image no message shows is kept after a turn last stored or reused it: a turn
stores its images before its messages, which may come hours later (a long reply on a CPU)."""
ADD_ATTEMPTS = 3


@dataclass(slots=True, frozen=True)
class NewImage:
    """An image to store: its encoded bytes, their media type (``image/png``, …) and its size
    in pixels."""

    data: bytes
    media_type: str
    width: int
    height: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class ImageIndex:
    """The ``images`` table."""

    def __init__(self, db: database.Database) -> None:
        self._db = db

    async def add(self, images: Sequence[NewImage]) -> list[int]:
        """Store the images not stored yet and mark all of them used now; returns each one's
        number, in order (an image already stored keeps its number)."""
        for image in images:
            if not isinstance(image.data, bytes) or not image.data:
                raise InvalidRecordError("an image's data must be non-empty bytes")
        digests = [image.sha256 for image in images]
        for attempt in range(ADD_ATTEMPTS):
            try:
                async with self._db.write() as session:
                    return await _add(session, digests, images)
            except IntegrityError:  # another writer stored one of them first: theirs stand
                if attempt == ADD_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def collect(self, grace: timedelta = IMAGE_GRACE) -> int:
        """Delete the images no message shows that no turn used for ``grace``; returns how
        many."""
        async with self._db.write() as session:
            return await collect_images(session, grace)

    async def data(self, numbers: Iterable[int]) -> dict[int, bytes]:
        """The bytes of the stored images among ``numbers``, by number."""
        wanted = sorted(set(numbers))
        if not wanted:
            return {}
        async with self._db.read() as session:
            rows = await session.execute(select(Image.id, Image.data).where(Image.id.in_(wanted)))
            return {number: data for number, data in rows}

    async def sizes(self, numbers: Iterable[int]) -> dict[int, tuple[int, int]]:
        """(width, height) of the stored images among ``numbers``, by number."""
        wanted = sorted(set(numbers))
        if not wanted:
            return {}
        query = select(Image.id, Image.width, Image.height).where(Image.id.in_(wanted))
        async with self._db.read() as session:
            return {number: (w, h) for number, w, h in await session.execute(query)}

    async def numbers(self, digests: Sequence[str]) -> dict[str, int]:
        """The numbers of the stored images among ``digests`` (SHA-256 in hex), by digest."""
        if not digests:
            return {}
        async with self._db.read() as session:
            rows = await session.execute(
                select(Image.sha256, Image.id).where(Image.sha256.in_(set(digests)))
            )
            return dict(rows.all())


async def _add(session: AsyncSession, digests: list[str], images: Sequence[NewImage]) -> list[int]:
    now = utcnow()
    query = select(Image.sha256, Image.id).where(Image.sha256.in_(set(digests)))
    numbers = dict((await session.execute(query)).all())
    if numbers:
        used = update(Image).where(Image.id.in_(set(numbers.values()))).values(used_at=now)
        await session.execute(used)
    rows = {
        d: Image(sha256=d, media_type=i.media_type, data=i.data, width=i.width, height=i.height)
        for d, i in zip(digests, images, strict=True)
        if d not in numbers
    }
    for row in rows.values():
        row.created_at = row.used_at = now
    session.add_all(rows.values())
    await session.flush()
    numbers |= {d: row.id for d, row in rows.items()}
    return [numbers[d] for d in digests]


def shown_images(parts: Sequence[dict[str, Any]] | None) -> list[int]:
    """The numbers of the images a message of content ``parts`` shows (each once)."""
    return sorted({p["image"] for p in parts or () if p.get("type") == "image"})


async def link_images(session: AsyncSession, rows: Sequence[tuple[int, Any]]) -> None:
    """In ``session``'s transaction: record the images each new message shows; ``rows`` are
    ``(message id, its parts)``."""
    links = [{"message_id": m, "image_id": n} for m, parts in rows for n in shown_images(parts)]
    if links:
        await session.execute(insert(MessageImage.__table__), links)


async def copy_links(session: AsyncSession, source_id: str, agent_id: str) -> None:
    """In ``session``'s transaction: the images of ``agent_id``'s messages, copied from
    ``source_id``'s (a fork: the same messages at the same positions)."""
    new, old = aliased(Message), aliased(Message)
    copied = (
        select(new.id, MessageImage.image_id)
        .join(old, (old.agent_id == source_id) & (old.position == new.position))
        .join(MessageImage, MessageImage.message_id == old.id)
        .where(new.agent_id == agent_id)
    )
    await session.execute(
        insert(MessageImage.__table__).from_select(["message_id", "image_id"], copied)
    )


async def collect_images(session: AsyncSession, grace: timedelta = IMAGE_GRACE) -> int:
    """In ``session``'s transaction: delete the images no message shows that no turn used for
    ``grace``; returns how many."""
    shown = exists().where(MessageImage.image_id == Image.id)
    query = delete(Image).where(Image.used_at < utcnow() - grace, ~shown).returning(Image.id)
    return len((await session.execute(query)).all())


PART_JOINER = "\n"
"""Joins a message's text parts into the text ``Message.content`` holds."""


def parts_text(parts: Sequence[dict[str, Any]]) -> str:
    """The text a message of content ``parts`` stores as its ``content``: its text parts."""
    return PART_JOINER.join(p["text"] for p in parts if p.get("type") == "text")


def content_key(content: str | Sequence[dict[str, Any]] | None) -> str:
    """A message's content as one string that also names its images (by the SHA-256 of their
    bytes): what a conversation's digest is taken of, the same before and after its images
    are stored."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(
        p.get("text", "") if p.get("type") == "text" else f"\0image:{p.get('sha256')}\0"
        for p in content
    )
