"""Frozen values that go into and come out of the registry; never ORM objects."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from agentkv.store.errors import InvalidRecordError
from agentkv.store.models import Agent, KVCache, Message

MAX_FINGERPRINT_CHARS = 64
MAX_NAME_CHARS = 256
"""An agent's display name; its id is shorter still (see ``agentkv.store.ids``)."""
KV_BITS_CHOICES = (8, 4)
"""Quantized bit widths a cache entry may have; ``None`` means unquantized."""
MAX_CHECKSUM_CHARS = 64
MAX_SEGMENT_CHARS = 80
MAX_RESPONSE_ID_CHARS = 64


class Role(StrEnum):
    """Who wrote a message. A ``StrEnum``, so ``Role.USER == "user"``."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(slots=True, frozen=True)
class AgentRecord:
    """An agent as stored. ``sampling`` is a fresh dict per record; editing it changes nothing."""

    id: str
    name: str
    system_prompt: str | None
    model_fingerprint: str | None
    sampling: dict[str, Any] = field(hash=False)
    created_at: datetime
    updated_at: datetime
    idle_ttl_s: int | None = None
    """Seconds without a turn after which the agent expires; None: it never does."""
    version: int = 0
    """Changes of its transcript and system prompt so far (see ``Registry.append_messages``)."""
    tools: list[dict[str, Any]] | None = field(default=None, hash=False)
    """The tool definitions its conversation carries (None: none; a fresh list per record)."""

    @classmethod
    def from_row(cls, row: Agent) -> AgentRecord:
        return cls(
            id=row.id,
            name=row.name,
            system_prompt=row.system_prompt,
            model_fingerprint=row.model_fingerprint,
            sampling=dict(row.sampling),
            created_at=row.created_at,
            updated_at=row.updated_at,
            idle_ttl_s=row.idle_ttl_s,
            version=row.version or 0,
            tools=None if row.tools is None else json.loads(json.dumps(row.tools)),
        )


@dataclass(slots=True, frozen=True)
class NewMessage:
    """A message to append; ``Registry.append_messages`` validates the whole batch first.

    Attributes:
        role: One of ``system``, ``user``, ``assistant``, ``tool`` (a :class:`Role` or its value).
        content: The message text.
        token_count: Tokens of the rendered message, if the caller knows it.
    """

    role: str
    content: str
    token_count: int | None = None
    parts: tuple[dict[str, Any], ...] | None = None
    """A message with images: its content parts in order (``Message.parts``); ``content``
    then holds its text."""


@dataclass(slots=True, frozen=True)
class MessageRecord:
    """A stored message; ``position`` counts from 0 within its agent's transcript."""

    id: int
    agent_id: str
    position: int
    role: Role
    content: str
    token_count: int | None
    created_at: datetime
    parts: tuple[dict[str, Any], ...] | None = None
    """A message with images: its content parts in order, images by ``images.id``."""

    @classmethod
    def from_row(cls, row: Message) -> MessageRecord:
        return cls(
            id=row.id,
            agent_id=row.agent_id,
            position=row.position,
            role=Role(row.role),
            content=row.content,
            token_count=row.token_count,
            created_at=row.created_at,
            parts=None if row.parts is None else tuple(row.parts),
        )


@dataclass(slots=True, frozen=True)
class NewResponse:
    """A Responses API response to keep (see ``agentkv.store.responses``).

    Attributes:
        id: The response id (at most 64 characters).
        agent_id: The agent that answered.
        message_id: The reply's message id (``MessageRecord.id``), if it was stored.
        previous_id: The stored response this one continues, if any.
        input: The input items the request sent itself (JSON values).
        body: The response object as returned (JSON values, its ``output`` items included).
    """

    id: str
    agent_id: str
    message_id: int | None
    previous_id: str | None
    input: list[Any]
    body: dict[str, Any]

    def __post_init__(self) -> None:
        _check_text("id", self.id, MAX_RESPONSE_ID_CHARS)
        if self.previous_id is not None:
            _check_text("previous_id", self.previous_id, MAX_RESPONSE_ID_CHARS)


@dataclass(slots=True, frozen=True)
class ResponseRecord:
    """A stored response as a chain reads it: the items its request sent and its output
    items. ``agent_id`` is None once its agent was deleted; ``latest`` says whether the reply
    is still its agent's last message (set for the last of ``ResponseIndex.chain``)."""

    id: str
    agent_id: str | None
    message_id: int | None
    previous_id: str | None
    input: list[Any] = field(hash=False)
    output: list[Any] = field(hash=False)
    created_at: datetime
    latest: bool = False


@dataclass(slots=True, frozen=True)
class NewCacheEntry:
    """A KV cache file to record as an agent's current cache; validated on construction.

    Attributes:
        path: File path relative to the cache directory, using ``/``; no ``..`` parts.
        token_count: Tokens of the transcript the cache covers.
        message_count: Messages of the transcript (rows of ``messages``, from position 0) the
            cache covers; keyword-only, so it cannot be swapped with ``token_count``.
        model_fingerprint: Fingerprint of the model that produced the cache (at most 64 chars).
        nbytes: Size of the file in bytes.
        checksum: Checksum of the file, e.g. a SHA-256 hex digest (at most 64 chars).
        format_version: Version of the on-disk format, starting at 1.
        kv_bits: ``None`` for unquantized, else 8 or 4.
        group_size: Quantization group size; required when ``kv_bits`` is set, else ``None``.

    Raises:
        InvalidRecordError: A field is invalid; the message names it.
    """

    path: str
    token_count: int
    message_count: int = field(kw_only=True)
    model_fingerprint: str
    nbytes: int
    checksum: str
    format_version: int
    kv_bits: int | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        _check_relative_path(self.path)
        _check_int("token_count", self.token_count, minimum=0)
        _check_int("message_count", self.message_count, minimum=0)
        _check_text("model_fingerprint", self.model_fingerprint, MAX_FINGERPRINT_CHARS)
        _check_int("nbytes", self.nbytes, minimum=0)
        _check_text("checksum", self.checksum, MAX_CHECKSUM_CHARS)
        _check_int("format_version", self.format_version, minimum=1)
        bits = self.kv_bits
        if bits is not None and (type(bits) is not int or bits not in KV_BITS_CHOICES):
            raise InvalidRecordError(f"kv_bits={self.kv_bits!r}: use None (unquantized), 8 or 4")
        if self.kv_bits is None and self.group_size is not None:
            raise InvalidRecordError(
                f"group_size={self.group_size!r} without kv_bits: an unquantized cache has no "
                "group size; pass group_size=None or set kv_bits"
            )
        if self.kv_bits is not None:
            _check_int("group_size", self.group_size, minimum=1)


@dataclass(slots=True, frozen=True)
class CacheRecord:
    """An agent's current KV cache entry as stored; ``path`` is relative to the cache dir.

    ``message_count`` is how many transcript messages the cache covers; 0 on a row written
    before that column existed (migration 0002), where the coverage is unknown.
    """

    id: int
    agent_id: str
    path: str
    token_count: int
    message_count: int
    kv_bits: int | None
    group_size: int | None
    model_fingerprint: str
    nbytes: int
    checksum: str
    format_version: int
    created_at: datetime
    blocks: tuple[str, ...] = ()
    """Keys of the blocks the cache is made of, in order (formats 2 and 3); empty for format 1."""

    @classmethod
    def from_row(cls, row: KVCache, blocks: tuple[str, ...] = ()) -> CacheRecord:
        return cls(
            id=row.id,
            agent_id=row.agent_id,
            path=row.path,
            token_count=row.token_count,
            message_count=row.message_count,
            kv_bits=row.kv_bits,
            group_size=row.group_size,
            model_fingerprint=row.model_fingerprint,
            nbytes=row.nbytes,
            checksum=row.checksum,
            format_version=row.format_version,
            created_at=row.created_at,
            blocks=blocks,
        )


@dataclass(slots=True, frozen=True)
class NewBlock:
    """A block file (and optionally its window file) to record in ``kv_blocks``.

    Attributes:
        key: The block's key (hash chain; 1-64 characters).
        nbytes: The block's share of its file's size; None when only a window is added to a
            known block.
        checksum: Its file's checksum.
        window_nbytes, window_checksum: The window file's, when one was written.
        segment: The name of the segment file holding the block (None: its own file named
            after the key), and segment_index its place there.
    """

    key: str
    nbytes: int | None
    checksum: str | None
    window_nbytes: int | None = None
    window_checksum: str | None = None
    segment: str | None = None
    segment_index: int | None = None

    def __post_init__(self) -> None:
        _check_text("key", self.key, MAX_FINGERPRINT_CHARS)
        if not self.key.isalnum():
            raise InvalidRecordError(f"key={self.key!r}: expected letters and digits only")
        if (self.nbytes is None) != (self.checksum is None):
            raise InvalidRecordError("nbytes and checksum must both be set or both None")
        if (self.window_nbytes is None) != (self.window_checksum is None):
            raise InvalidRecordError("window_nbytes and window_checksum go together")
        if self.nbytes is None and self.window_nbytes is None:
            raise InvalidRecordError(f"block {self.key}: neither a block nor a window file")
        for name in ("nbytes", "window_nbytes"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        for name in ("checksum", "window_checksum"):
            if getattr(self, name) is not None:
                _check_text(name, getattr(self, name), MAX_CHECKSUM_CHARS)
        if (self.segment is None) != (self.segment_index is None):
            raise InvalidRecordError("segment and segment_index go together")
        if self.segment is not None:
            _check_text("segment", self.segment, MAX_SEGMENT_CHARS)
            if not self.segment.replace("-", "").isalnum():
                raise InvalidRecordError(
                    f"segment={self.segment!r}: expected letters, digits and '-' only"
                )
            _check_int("segment_index", self.segment_index, minimum=0)
            if self.nbytes is None:
                raise InvalidRecordError(f"block {self.key}: a segment without a block file")


@dataclass(slots=True, frozen=True)
class StoredBlock:
    """Where a recorded block is: ``segment`` (its file's name; None: its own file named after
    the key) and ``index`` there, and whether it has a window file."""

    window: bool
    segment: str | None = None
    index: int = 0


@dataclass(slots=True, frozen=True)
class DiskUsage:
    """What the current cache files take: ``bytes`` and ``files`` over agents' own files and
    blocks (window files included), ``blocks`` the number of blocks."""

    bytes: int
    files: int
    blocks: int


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidRecordError(f"{name}={value!r}: expected an int >= {minimum}")


def _check_text(name: str, value: object, max_chars: int) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise InvalidRecordError(f"{name}={value!r}: expected a str of 1-{max_chars} characters")


def _check_relative_path(path: object) -> None:
    # The caller later deletes files by this path, so it must stay inside the cache dir.
    if (
        not isinstance(path, str)
        or not path
        or "\\" in path
        or PurePosixPath(path).is_absolute()
        or PureWindowsPath(path).drive
        or ".." in PurePosixPath(path).parts
    ):
        raise InvalidRecordError(
            f"path={path!r}: expected a non-empty path relative to the cache directory, "
            "with '/' separators and no '..' parts"
        )


def message_rows(
    agent_id: str, first: int, now: datetime, batch: Sequence[NewMessage]
) -> list[dict[str, Any]]:
    """The ``messages`` table's rows of ``batch``, at positions from ``first`` on."""
    return [
        {
            "agent_id": agent_id,
            "position": first + offset,
            "role": message.role,
            "content": message.content,
            "token_count": message.token_count,
            "created_at": now,
            "parts": None if message.parts is None else list(message.parts),
        }
        for offset, message in enumerate(batch)
    ]


def transcript_records(rows: Iterable[Any]) -> list[MessageRecord]:
    """Records of the ``messages`` rows read in :class:`MessageRecord`'s field order."""
    return [
        MessageRecord(*row[:3], Role(row[3]), *row[4:7], None if row[7] is None else tuple(row[7]))
        for row in rows
    ]


def message_records(ids: Iterable[int], rows: list[dict[str, Any]]) -> list[MessageRecord]:
    """Records of rows :func:`message_rows` made, stored with these ids."""
    return [
        MessageRecord(
            id=i,
            **row
            | {
                "role": Role(row["role"]),
                "parts": None if row["parts"] is None else tuple(row["parts"]),
            },
        )
        for i, row in zip(ids, rows, strict=True)
    ]
