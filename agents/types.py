"""What AgentRuntime hands back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from agentkv.caches.flights import Flight
from agentkv.engine.grammar import Grammar
from agentkv.engine.request import PromptCache, TokenLogprob
from agentkv.engine.sampling import SamplingParams
from agentkv.tool_calls import ParsedReply

CacheSource = Literal["hot", "disk", "prefix", "none", "rebuilt"]
"""Where a turn's cache came from: the agent's own (hot tier, disk), stored blocks another
agent's prompt began with ("prefix"), or nothing (a new agent; "rebuilt": its cache was lost)."""


@dataclass(slots=True, frozen=True)
class Usage:
    """Token counts of one turn (OpenAI's convention: ``prompt_tokens`` includes cached ones).

    Attributes:
        prompt_tokens: every token the model attended to before answering.
        cached_tokens: of those, the ones resumed from a cache instead of prefilled.
        completion_tokens: generated tokens, end-of-turn token included.
        reasoning_tokens: of those, a reasoning model's thinking (its markers included).
        accepted_prediction_tokens: tokens of the turn's ``prediction`` the reply took from
            it as drafts (OpenAI's Predicted Outputs); 0 without one.
        rejected_prediction_tokens: the prediction's other tokens.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(slots=True, frozen=True)
class Timings:
    """Seconds spent in each phase of a turn.

    Attributes:
        cache_load_s: finding and loading the agent's cache (hot tier, disk, or nothing).
        queue_s: waiting for a place in the batch.
        prefill_s: from joining the batch to the first token.
        ttft_s: from the call to the first token.
        decode_s: from the first token to the last.
        total_s: the whole call.
        decode_tps: generated tokens a second after the first.
        drafted_tokens: drafts fed by speculative decoding (``agentkv.engine.speculative``).
        accepted_tokens: of them, those kept (tokens generated without a step of their own).
    """

    cache_load_s: float
    queue_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    total_s: float
    decode_tps: float | None
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(slots=True, frozen=True)
class Reply:
    """The outcome of one turn. ``finish_reason`` is "stop" (end of turn or a stop string) or
    "length" (max_tokens); ``stop_sequence`` is the stop string that ended it, if one did;
    ``message_id`` is the reply's row in the registry (``MessageRecord.id``); ``logprobs``,
    when the turn asked for them, has one entry per token id (see ``TokenLogprob``)."""

    agent_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    cache_source: CacheSource
    timings: Timings
    stop_sequence: str | None = None
    parsed: ParsedReply | None = None
    message_id: int | None = None
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    """What a reasoning model thought before answering (between its thinking markers, see
    ``agentkv.reasoning``); ``text`` is the answer without it."""

    @property
    def content(self) -> ParsedReply:
        """The reply's text and tool calls (tool calls are parsed in whole-conversation turns)."""
        return self.parsed if self.parsed is not None else ParsedReply(self.text)


@dataclass(slots=True, frozen=True)
class TextDelta:
    """A piece of the reply's text, streamed as it is generated; with ``logprobs`` asked
    for, those of the tokens generated since the previous piece (this piece's tokens)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True, frozen=True)
class ReasoningDelta:
    """A piece of the reply's reasoning (a reasoning model's thinking, streamed apart from the
    answer's TextDelta pieces); with ``logprobs`` asked for, those of this piece's tokens."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class TurnPlan:
    """Internal: the tokens a turn prefills after the cache it resumes from."""

    prompt_tokens: list[int]
    cache: PromptCache | None
    source: CacheSource
    load_s: float
    fresh: int = 0  # tokens of ``cache`` this turn prefilled itself (a shared head it stored)
    release: Callable[[], None] | None = None  # unpins the head's blocks once the turn saved
    cache_points: tuple[int, ...] = ()  # shared heads' ends it prefills past (engine's request)
    checkpoint_at: int | None = None  # keep a checkpoint there (engine's request)
    snapshots_at: tuple[int, ...] = ()  # and these (engine's request)
    flight: Flight | None = None  # a new conversation's first turn in flight (caches.flights)


@dataclass(slots=True)
class TurnOptions:
    """A turn's generation settings (None: the runtime's and the agent's defaults)."""

    max_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop: list[str] | None = None
    priority: float = 0.0
    grammar: Grammar | None = None  # the reply is held to it (see agentkv.formats)
    logprobs: int | None = None  # report tokens' logprobs, with this many alternatives
    reasoning_budget: int | None = None  # the most tokens a reasoning model thinks for
    speculative: bool = True  # may feed drafts (when the engine drafts: engine.speculative)
    prediction: tuple[int, ...] = ()  # tokens the reply is expected to restate
