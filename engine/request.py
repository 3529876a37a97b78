"""What callers hand the engine and what they get back."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from enum import StrEnum

from agentkv.engine.grammar import Grammar
from agentkv.engine.prompt_cache import (
    CHECKPOINTS_KEPT,
    Checkpoint,
    PromptCache,
    layer_nbytes,
)
from agentkv.engine.sampling import SamplingParams

__all__ = [
    "CHECKPOINTS_KEPT",
    "MAX_TOP_LOGPROBS",
    "Checkpoint",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "PromptCache",
    "RequestStats",
    "TokenEvent",
    "TokenLogprob",
    "layer_nbytes",
]

MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask to see for each token (OpenAI's API allows 20)."""


class FinishReason(StrEnum):
    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class GenerationRequest:
    """One sequence to generate.

    Args:
        prompt_tokens: the tokens to prefill (after ``cache``, if given). At least one.
        max_tokens: upper bound on generated tokens, end-of-sequence token included; None:
            until the model stops or its context (or the KV budget, for it alone) is full.
        sampling: sampling parameters (greedy by default).
        stop: stop strings; generation ends at the first one and its text is not returned.
        priority: larger is admitted first; waiting requests age upwards so none starves.
        cache: a prompt cache to continue from (merged into the running batch).
        return_cache: hand back the per-sequence cache when the request finishes.
        keep_cache_on_cancel: also hand back the partial cache when it is cancelled.
        ignore_eos: keep generating past end-of-sequence tokens (benchmarks, fixed lengths).
        forced_token: generate this token (whatever the model predicts) instead of sampling:
            with ``max_tokens=1`` the returned cache holds exactly ``prompt + [forced_token]``.
        grammar: hold the reply to this grammar (``Engine.grammars``: a JSON Schema).
        logprobs: None, or report each generated token's log probability (``TokenLogprob``)
            with this many of the most likely tokens at its step (0 to ``MAX_TOP_LOGPROBS``).
        cache_points: positions of the conversation (counted from its first token, the
            cache's included) that other turns may resume a cache from besides where this one
            joined and the stored blocks' boundaries: shared heads' ends. A q8 batch reads no
            float copy across them, so the positions after them compute the same from such a
            cache (``agentkv.engine.batch.quantized.QuantizedLayer``).
        checkpoint_at: keep a checkpoint after this many tokens of the conversation (counted
            as ``cache_points`` are; within the prompt: where its history ends and the reply's
            generation prompt begins), on a model with sliding-window layers or recurrent state,
            whose cache cannot be cut back there otherwise: a client that sends the reply back
            otherwise than it was generated, or drops it, resumes all of the history. Also a
            fence, as ``cache_points`` are.
        snapshots_at: keep checkpoints after these many tokens too (counted as ``cache_points``
            are; within the prompt), on such a model: where other conversations that begin as
            this one does may be cut back to (a new conversation's last block boundaries before
            its history ends, ``agentkv.caches.tiers``). Fences too.
        reasoning_budget: on a reasoning model (``Engine.thinking``), the most tokens the reply
            may think for: then its thinking's end marker is forced, and the answer follows.
        speculative: let it feed drafts from its history (``EngineConfig.speculative``): the
            same tokens (greedy) or distribution (sampled), several a step where the reply
            restates its history; False: one token a step.
        prediction: tokens the reply is expected to restate (OpenAI's Predicted Outputs),
            drafted from first where the sequence drafts (``agentkv.engine.speculative``);
            they change no token generated.
        images: the encoded bytes (PNG, JPEG, WebP, GIF) of each image whose token
            (``agentkv.engine.models.vision.image_token``) the prompt holds, by token; a
            vision-language model's vision tower reads them where its prompt is fed.
        image_sizes: (width, height) of every image whose token the cache or the prompt
            holds, by token: where image tokens take positions of their own
            (``agentkv.engine.models.mrope``), what those positions are made of.
    """

    prompt_tokens: list[int]
    max_tokens: int | None = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    priority: float = 0.0
    cache: PromptCache | None = None
    return_cache: bool = True
    keep_cache_on_cancel: bool = False
    ignore_eos: bool = False
    forced_token: int | None = None
    grammar: Grammar | None = None
    logprobs: int | None = None
    cache_points: tuple[int, ...] = ()
    checkpoint_at: int | None = None
    snapshots_at: tuple[int, ...] = ()
    reasoning_budget: int | None = None
    speculative: bool = True
    prediction: tuple[int, ...] = ()
    images: dict[int, bytes] = field(default_factory=dict)
    image_sizes: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError("prompt_tokens is empty: a request needs at least one new token")
        try:
            # In C, about 10 ns a token: a prompt of millions is checked without stalling the
            # event loop it is made on. An unsigned array refuses negatives and non-integers.
            array("Q", self.prompt_tokens)
        except (TypeError, OverflowError):
            raise ValueError("prompt_tokens must be non-negative integers") from None
        try:
            array("Q", self.prediction)
        except (TypeError, OverflowError):
            raise ValueError("prediction must be non-negative integers (token ids)") from None
        if self.forced_token is not None and (
            not isinstance(self.forced_token, int) or self.forced_token < 0
        ):
            raise ValueError(f"forced_token must be a token id, got {self.forced_token!r}")
        if self.max_tokens is not None and (
            type(self.max_tokens) is not int or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be None or a count of tokens: {self.max_tokens!r}")
        if self.logprobs is not None and (
            type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs!r}"
            )
        if self.reasoning_budget is not None and (
            type(self.reasoning_budget) is not int or self.reasoning_budget < 0
        ):
            raise ValueError(
                f"reasoning_budget must be None or a count of tokens, got {self.reasoning_budget!r}"
            )
        points = (*self.cache_points, *self.snapshots_at, self.checkpoint_at or 0)
        if any(type(p) is not int or p < 0 for p in points):
            raise ValueError(
                f"cache_points, snapshots_at and checkpoint_at must be non-negative token "
                f"positions, got {self.cache_points!r}, {self.snapshots_at!r} and "
                f"{self.checkpoint_at!r}"
            )
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError("sampling must be a SamplingParams")
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a list of strings")
        if self.cache is not None and not self.cache.layers:
            raise ValueError("cache has no layers")
        if self.cache is not None:
            listed = len(self.cache.tokens)  # (recurrent state has no offset)
            held = next((x.offset for x in self.cache.layers if hasattr(x, "offset")), listed)
            if held != listed:
                raise ValueError(f"cache holds {held} positions but lists {listed} tokens")


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A generated token's log probability: the log-softmax of the model's logits at its step
    (before the request's logits processors, temperature and top-p/top-k: the model's own
    distribution), and the ``top`` most likely tokens then, as ``(token id, logprob)``, most
    likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class TokenEvent:
    """One generated token and the text it completed (may be empty while UTF-8 or a
    possible stop string is pending); ``logprob`` when the request asked for them."""

    token_id: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass(slots=True)
class RequestStats:
    prompt_tokens: int
    cached_tokens: int
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    decode_tokens: int = 0
    drafted_tokens: int = 0  # drafts fed (speculative decoding)
    accepted_tokens: int = 0  # of them, kept
    prediction_tokens: int = 0  # of the request's prediction
    accepted_prediction_tokens: int = 0  # drafts from it kept

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.submitted_at

    @property
    def prefill_s(self) -> float | None:
        if self.admitted_at is None or self.first_token_at is None:
            return None
        return self.first_token_at - self.admitted_at

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def decode_s(self) -> float | None:
        if self.first_token_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.first_token_at

    @property
    def decode_tps(self) -> float | None:
        """Tokens per second after the first token (which is charged to prefill)."""
        if not self.decode_s or self.decode_tokens < 2:
            return None
        return (self.decode_tokens - 1) / self.decode_s


@dataclass(slots=True)
class GenerationResult:
    """How a request ended.

    ``token_ids`` are all generated tokens, including a final end-of-sequence token or the
    tokens of a matched stop string; ``text`` excludes both. ``cache`` (when requested) holds
    prompt + cache tokens + ``token_ids``; its ``tokens`` list says exactly which.
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    cache: PromptCache | None = None
    error: BaseException | None = None
    stop_sequence: str | None = None  # the stop string that ended generation, if one did
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked

    @property
    def is_error(self) -> bool:
        return self.finish_reason is FinishReason.ERROR
