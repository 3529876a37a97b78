"""ORM tables of the agent registry: ``agents``, ``messages``, ``kv_caches``, ``kv_blocks``,
``kv_cache_blocks``, ``responses``, ``agent_leases`` and ``images``.

The schema changes only through Alembic revisions under ``migrations/versions``; edit these
classes, then autogenerate a revision (see ``migrations/env.py``). Nothing here is returned to
callers: ``agentkv.store.registry`` turns rows into the frozen records of ``agentkv.store.records``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine.interfaces import ExecutionContext
from sqlalchemy.ext.asyncio import AsyncAttrs
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Explicit names let Alembic's batch mode (table copy on SQLite) find and recreate constraints.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """The current time as a timezone-aware UTC datetime."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores aware datetimes as UTC and returns them aware: naive UTC on SQLite (which keeps no
    offset), the instant itself on PostgreSQL (``timestamptz``; asyncpg would read a naive
    value as the machine's local time)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware one, e.g. datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value if dialect.name == "postgresql" else value.replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


# PostgreSQL's text cannot hold NUL: there it is stored as _PUA "0" and a literal _PUA doubled.
_PUA = "\ue000"
_UNESCAPE = {_PUA: _PUA, "0": "\x00"}


class _TextEverywhere(TypeDecorator[str]):
    """Text any backend stores and returns exactly, NUL included (a tokenizer's ``<0x00>``
    byte token can put one in a reply): escaped on PostgreSQL, as it is on SQLite."""

    impl = Text
    cache_ok = True

    def bind_processor(self, dialect: Dialect) -> Any:
        return super().bind_processor(dialect) if dialect.name == "postgresql" else None

    def result_processor(self, dialect: Dialect, coltype: object) -> Any:
        return super().result_processor(dialect, coltype) if dialect.name == "postgresql" else None

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None:
            return value
        if "\x00" in value or _PUA in value:
            value = value.replace(_PUA, _PUA + _PUA).replace("\x00", _PUA + "0")
        return value

    def process_result_value(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None or _PUA not in value:
            return value
        return re.sub(_PUA + "(.)", lambda m: _UNESCAPE.get(m[1], m[0]), value, flags=re.DOTALL)


class StoredText(_TextEverywhere):
    """``Text`` that round-trips every string on every backend."""

    cache_ok = True


class StoredString(_TextEverywhere):
    """``String`` (unbounded) that round-trips every string on every backend."""

    impl = String
    cache_ok = True


ByteCount = BigInteger().with_variant(Integer(), "sqlite")
"""File sizes: 64-bit (a segment of a long prefill on a large model passes 2 GiB); SQLite's
INTEGER is 64-bit already (PostgreSQL's ``integer`` is not: 0007 widens it there)."""


def _name_defaults_to_id(context: ExecutionContext) -> str:
    return str(context.get_current_parameters()["id"])


class Base(AsyncAttrs, DeclarativeBase):
    """Declarative base holding the registry's metadata."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Agent(Base):
    """One agent: its identity, prompt, sampling settings and the model it was built for."""

    __tablename__ = "agents"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(StoredString, nullable=False, default=_name_defaults_to_id)
    system_prompt: Mapped[str | None] = mapped_column(StoredText, nullable=True)
    model_fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        UTCDateTime, nullable=False, default=utcnow, onupdate=utcnow
    )

    # Seconds without a turn after which the agent expires; NULL: never (added by 0003).
    idle_ttl_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Bumped by every change of the transcript or the system prompt (added by 0007): a turn
    # stores itself only if the agent is still at the version it read.
    version: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    # The tool definitions its conversation carries (added by 0008; NULL: none): the HTTP
    # server matches a stateless client's requests to an agent by system prompt and tools.
    tools: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)

    # passive_deletes: the database's ON DELETE CASCADE removes children, no ORM loads needed.

    messages: Mapped[list[Message]] = relationship(
        back_populates="agent",
        lazy="raise",
        order_by="Message.position",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )
    kv_cache: Mapped[KVCache | None] = relationship(
        back_populates="agent",
        lazy="raise",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )


class Message(Base):
    """One conversation turn part; positions per agent are dense, ``0..n-1``."""

    __tablename__ = "messages"
    # sqlite_autoincrement: ids are never reused after delete_agent().
    __table_args__ = (
        UniqueConstraint("agent_id", "position"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("agents.id", ondelete="CASCADE"), nullable=False
    )
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    role: Mapped[str] = mapped_column(String(16), nullable=False)
    content: Mapped[str] = mapped_column(StoredText, nullable=False)
    token_count: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    parts: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    """A message with images: its content parts in order, ``{"type": "text", "text": …}`` and
    ``{"type": "image", "image": <images.id>}`` (``content`` holds its text); NULL for text."""

    agent: Mapped[Agent] = relationship(back_populates="messages", lazy="raise")


class Image(Base):
    """An image some message shows, stored once by content (``sha256`` of its bytes)."""

    __tablename__ = "images"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sha256: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    media_type: Mapped[str] = mapped_column(String(32), nullable=False)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    width: Mapped[int] = mapped_column(Integer, nullable=False)
    height: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=utcnow)
    """When a turn last stored or reused it (an image no message shows is kept a while after:
    a turn stores its images before its messages)."""


class MessageImage(Base):
    """A message that shows an image (one row per image it shows, whatever the count)."""

    __tablename__ = "message_images"

    message_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("messages.id", ondelete="CASCADE"), primary_key=True
    )
    image_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("images.id"), primary_key=True, index=True
    )


class KVCache(Base):
    """The current on-disk KV cache of one agent (at most one row per agent)."""

    __tablename__ = "kv_caches"
    __table_args__ = (UniqueConstraint("agent_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("agents.id", ondelete="CASCADE"), nullable=False
    )
    path: Mapped[str] = mapped_column(String, nullable=False)
    token_count: Mapped[int] = mapped_column(Integer, nullable=False)
    # Rows from before revision 0002 read 0: coverage unknown (see that revision).
    message_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    kv_bits: Mapped[int | None] = mapped_column(Integer, nullable=True)
    group_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    model_fingerprint: Mapped[str] = mapped_column(String(64), nullable=False)
    nbytes: Mapped[int] = mapped_column(ByteCount, nullable=False)
    checksum: Mapped[str] = mapped_column(String(64), nullable=False)
    format_version: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)

    agent: Mapped[Agent] = relationship(back_populates="kv_cache", lazy="raise")


class KVBlock(Base):
    """One block of paged KV caches, stored once and shared (added by 0004).

    ``key`` is the hash chain of every token up to the block's end, the model and the storage
    settings, so two caches whose tokens start the same way list the same keys. The
    global-attention layers' keys and values for the block's tokens are in the *segment* file
    ``_blocks/<segment[:2]>/<segment>.safetensors`` (the run of blocks one save wrote), at
    ``segment_index`` within it; a block with ``segment`` NULL has its own file
    ``_blocks/<key[:2]>/<key>.safetensors`` (written before 0005). ``nbytes`` is the block's
    share of its file. ``window_*`` describe an optional second file with the sliding-window
    layers' state at the block's end (what lets a new cache start there). The blocks of a
    segment are garbage together, when no ``kv_cache_blocks`` row lists any of them.
    """

    __tablename__ = "kv_blocks"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    nbytes: Mapped[int] = mapped_column(ByteCount, nullable=False)
    checksum: Mapped[str] = mapped_column(String(64), nullable=False)
    window_nbytes: Mapped[int | None] = mapped_column(ByteCount, nullable=True)
    window_checksum: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    segment: Mapped[str | None] = mapped_column(String(80), nullable=True, index=True)  # 0005
    segment_index: Mapped[int | None] = mapped_column(Integer, nullable=True)  # 0005
    # Kept through garbage collection until then, listed or not (0007): a prefix stored by
    # one worker for turns of its own that have not saved yet, out of other workers' reach.
    pinned_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class KVCacheBlock(Base):
    """The blocks an agent's current cache is made of, in order (added by 0004).

    Deleting the agent deletes these rows; a block stays while any row lists it.
    """

    __tablename__ = "kv_cache_blocks"
    __table_args__ = (Index("ix_kv_cache_blocks_block_key", "block_key"),)

    agent_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    block_key: Mapped[str] = mapped_column(String(64), ForeignKey("kv_blocks.key"), nullable=False)


class AgentLease(Base):
    """Which worker runs the turns of an agent now (added by 0007; see ``agentkv.store.leases``).

    ``holder`` names one running process (its worker id and a random suffix); ``token`` grows
    with every acquisition, so a release meant for an earlier one removes nothing. A lease
    whose ``expires_at`` has passed is free: its holder stopped renewing it (it crashed).
    """

    __tablename__ = "agent_leases"

    agent_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True
    )
    holder: Mapped[str] = mapped_column(String(128), nullable=False, index=True)
    worker_id: Mapped[str] = mapped_column(String(64), nullable=False)
    token: Mapped[int] = mapped_column(Integer, nullable=False)
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)


class StoredResponse(Base):
    """One OpenAI Responses API response kept for ``previous_response_id`` (added by 0006).

    ``input`` holds the items the request sent itself (a chain's earlier items are in the
    responses ``previous_id`` leads to), ``output`` the response's output items, ``body`` the
    rest of the response object as returned; all three are JSON text, encoded and decoded off
    the event loop (``agentkv.store.responses``). ``agent_id`` and ``message_id`` name the agent
    and the reply message that answered; an agent deleted later leaves the response (``agent_id``
    NULL).
    """

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    agent_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("agents.id", ondelete="SET NULL"), nullable=True, index=True
    )
    message_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    previous_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    input: Mapped[str] = mapped_column(Text, nullable=False)
    output: Mapped[str] = mapped_column(Text, nullable=False)
    body: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = mapped_column(
        UTCDateTime, nullable=False, default=utcnow, index=True
    )
