"""A request's state while the engine owns it, and the engine's aggregate stats."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine.request import GenerationRequest, RequestStats
from engine.sampling import LogitsProcessor, Sampler
from engine.stopping import StopStrings


class SeqStatus(Enum):
    QUEUED = "queued"
    RUNNING = "running"  # in the batch, or alone on the solo fast path
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine. Events go to ``events`` on the caller's ``loop``."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    stats: RequestStats
    sampler: Sampler | None
    logits_processors: list[LogitsProcessor]
    detokenizer: Any
    stops: StopStrings
    status: SeqStatus = SeqStatus.QUEUED
    ticket: int = -1
    uid: int | None = None  # BatchGenerator uid; SOLO_UID while on the solo fast path
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(slots=True, frozen=True)
class EngineStats:
    active: int
    queued: int
    batch_size: int
    completed: int
    cancelled: int
    failed: int
    tokens_generated: int
    decode_tps: float
    peak_memory_bytes: int
