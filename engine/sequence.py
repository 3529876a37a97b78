"""A request's state while the engine owns it, and the engine's aggregate stats."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from agentkv.engine.models.vision import IMAGE_BASE
from agentkv.engine.request import GenerationRequest, RequestStats, TokenLogprob
from agentkv.engine.sampling import LogitsProcessor, Sampler
from agentkv.engine.speculative import Speculation
from agentkv.engine.stopping import StopStrings

if TYPE_CHECKING:
    import mlx.core as mx

    from agentkv.engine.batch.groups import KVGroup


class SeqStatus(Enum):
    QUEUED = "queued"  # waiting to join the batch
    PREFILLING = "prefilling"  # in the batch, its prompt going in chunk by chunk
    DECODING = "decoding"  # in the batch, generating one token a step
    PAUSED = "paused"  # preempted: its cache left the batch; waiting to rejoin where it was
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine. Events go to ``events`` on the caller's ``loop``.

    Invariant between steps: ``tokens`` lists exactly what the sequence's KV holds (its
    group's row, or ``cache`` while it is outside the batch); ``prompt`` is still to be fed;
    ``pending`` is the token sampled last, fed by the next step and reported after it.
    """

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
    arrival: float = 0.0  # the queue's clock: priority ages from here
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    # Generation-thread state.
    tokens: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    cache: list[Any] | None = None  # per-layer caches to start or resume from
    pending: tuple[mx.array, int] | int | None = None
    pending_logprob: tuple[tuple[mx.array, ...], int] | None = None  # (arrays, row) of pending
    logprobs: list[TokenLogprob] = field(default_factory=list)  # reported, when asked
    group: KVGroup | None = None
    reserved: int = 0  # KV bytes set aside in the budget while it is in the batch
    context: Any = None  # mlx-lm TokenBuffer of what logits processors look back at
    steps: int = 0  # steps run since it (re)joined the batch
    queued_step: int = 0  # the scheduler's step count when it last went into the queue
    preemptions: int = 0
    prompt_end: Any = None  # engine.request.Checkpoint where its history ended (checkpoint_at)
    snapshots: dict[int, Any] = field(default_factory=dict)  # position -> Checkpoint there
    max_tokens: int = 1  # its request's max_tokens, within the context and the KV budget
    spec: Speculation | None = None  # its drafting, when it may draft (engine.speculative)
    verify: tuple[mx.array, int] | None = None  # (samples, first row) of its drafted step
    reserved_tokens: int = 0  # the tokens ``reserved`` covers (it grows as the turn decodes)
    rope_scan: Any = None  # engine.models.mrope.Scanned of its tokens (images' positions)
    rope_shift: int = 0  # what its images shift the rotary position of its next token by
    whole_images: bool = False  # its images' tokens attend both ways: no chunk ends in one
    images_at: tuple[tuple[int, int], ...] = ()  # (position, image token) of its prompt's images
    features: dict[int, Any] = field(default_factory=dict)  # image token -> features, once encoded

    def fence(self, position: int, block_tokens: int | None) -> int:
        """The latest point at or before ``position`` a cache of this conversation may start
        from: where it joined the engine, a multiple of ``block_tokens``, one of its request's
        ``cache_points`` or ``snapshots_at`` (a q8 batch reads no float copy across it)."""
        fence = self.stats.cached_tokens
        if block_tokens:
            fence = max(fence, position // block_tokens * block_tokens)
        for point in (*self.request.cache_points, *self.request.snapshots_at):
            if fence < point <= position:
                fence = point
        if self.prompt_end is not None and fence < self.prompt_end.num_tokens <= position:
            fence = self.prompt_end.num_tokens
        return fence

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_batch(self) -> bool:
        return self.status in (SeqStatus.PREFILLING, SeqStatus.DECODING)

    @property
    def final_tokens(self) -> int:
        """Tokens its KV holds when it ends at max_tokens."""
        return len(self.tokens) + len(self.prompt) + self.max_tokens - len(self.token_ids)

    def chunk_within(self, n: int, checkpoints: bool) -> int:
        """A prompt chunk of ``n`` tokens, cut where the sequence keeps a checkpoint
        (``checkpoints``: its layers hold windows or state), then carried on to the end of an
        image it would end inside (``whole_images``): the image's tokens attend to each other
        both ways, so all of them are in the step that feeds the first. (A snapshot inside an
        image is then not taken.)"""
        if checkpoints:
            n = self.chunk_to_checkpoint(n)
        prompt = self.prompt
        if not self.whole_images or not 0 < n < len(prompt) or prompt[n - 1] < IMAGE_BASE:
            return n
        while n < len(prompt) and prompt[n] == prompt[n - 1]:
            n += 1
        return n

    def feedable(self) -> int:
        """Prompt tokens it can feed now: all but from the first image still being encoded."""
        have = len(self.tokens)
        unready = (at - have for at, token in self.images_at if token not in self.features)
        return min(unready, default=len(self.prompt))

    def chunk_to_checkpoint(self, n: int) -> int:
        """A prompt chunk of ``n`` tokens, cut to end where the sequence keeps a checkpoint
        (``GenerationRequest.checkpoint_at``, ``snapshots_at``) when it would pass one."""
        have, request = len(self.tokens), self.request
        points = (*request.snapshots_at, request.checkpoint_at or 0)
        return min((at - have for at in points if have < at < have + n), default=n)

    def checkpoints(self) -> tuple[Any, ...]:
        """The checkpoints it took (its snapshots, where its history ended), latest first."""
        points = [*self.snapshots.values(), *([self.prompt_end] if self.prompt_end else [])]
        return tuple(sorted(points, key=lambda point: -point.num_tokens))

    def is_checkpoint(self, position: int) -> bool:
        """Whether the sequence keeps a checkpoint after ``position`` tokens."""
        request = self.request
        return position == request.checkpoint_at or position in request.snapshots_at

    def tokens_after(self, steps: int = 1) -> int:
        """Tokens its KV holds after its whole prompt and ``steps`` more decode steps (and
        the drafts it may feed in them)."""
        drafts = self.spec.k if self.spec is not None and self.spec.active else 0
        return len(self.tokens) + len(self.prompt) + steps * (1 + drafts)

    @property
    def drafting(self) -> bool:
        """Whether it may feed drafts (it keeps a length group of its own meanwhile)."""
        return self.spec is not None and self.spec.active

    def priority_at(self, now: float, aging_per_s: float) -> float:
        return self.request.priority + aging_per_s * (now - self.arrival)

    def rank(self, now: float, aging_per_s: float) -> tuple[float, float]:
        """Its place in line: higher first; priority with aging, then the earlier arrival."""
        return self.priority_at(now, aging_per_s), -self.arrival
