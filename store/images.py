"""Images messages show: stored once by content, numbered by their row.

An image's number (``images.id``) is what the rest of agentkv knows it by: a message's parts
name it, and its tokens in a KV cache are made of it (``agentkv.engine.models.vision``), so the same
bytes shown by any conversation, before or after a restart, are the same tokens.

:class:`ImageIndex` runs on the registry's database (``Registry.images``); each call runs in
one session and one transaction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from agentkv.store import database
from agentkv.store.errors import InvalidRecordError
from agentkv.store.models import Image, utcnow


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
        """Store the images not stored yet; returns each one's number, in order (an image
        already stored keeps its number)."""
        for image in images:
            if not isinstance(image.data, bytes) or not image.data:
                raise InvalidRecordError("an image's data must be non-empty bytes")
        digests = [image.sha256 for image in images]
        numbers = await self.numbers(digests)
        missing = {d: i for d, i in zip(digests, images, strict=True) if d not in numbers}
        if missing:
            try:
                async with self._db.write() as session:
                    now = utcnow()
                    rows = [
                        Image(
                            sha256=d,
                            media_type=i.media_type,
                            data=i.data,
                            width=i.width,
                            height=i.height,
                            created_at=now,
                        )
                        for d, i in missing.items()
                    ]
                    session.add_all(rows)
                    await session.flush()
                    numbers |= {row.sha256: row.id for row in rows}
            except IntegrityError:  # another writer stored one of them first: theirs stand
                numbers = await self.numbers(digests)
        return [numbers[d] for d in digests]

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
