"""What callers hand the engine and what they get back."""

from __future__ import annotations

import copy
import dataclasses
import time
from array import array
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agentkv.engine.grammar import Grammar
from agentkv.engine.sampling import SamplingParams

CHECKPOINTS_KEPT = 2
"""Earlier turn boundaries a cache can be cut back to (see :meth:`PromptCache.checkpointed`);
shared heads (``Checkpoint.head``) are kept besides."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask to see for each token (OpenAI's API allows 20)."""


@dataclass(slots=True, frozen=True)
class Checkpoint:
    """The sliding-window layers' state after a cache's first ``num_tokens`` tokens: with the
    global layers cut to that length, the cache as it was there, exactly.

    ``head``: the end of a shared head (a system prompt and tools other conversations start
    with, see ``agents.caches.tiers``): carried on through every later turn, where turn
    boundaries are kept only while recent. ``prompt_end``: where a prompt ended and its reply
    began (``GenerationRequest.checkpoint_prompt``); a saved cache keeps the latest such one
    (``engine.kv.paged``)."""

    num_tokens: int
    windows: dict[int, Any]  # layer index -> the RotatingKVCache as it was then (never changed)
    nbytes: int
    head: bool = False
    prompt_end: bool = False


@dataclass(slots=True)
class PromptCache:
    """Per-layer mlx-lm caches (KVCache / RotatingKVCache) and the exact tokens they hold.

    Made on the generation thread, which also sizes it (``nbytes``, and ``window_nbytes`` for
    its sliding-window layers), so that code on other threads (the hot tier's byte budget)
    never calls into MLX. ``checkpoints``: earlier points it can be cut back to although its
    sliding windows have moved on (most recent first; see :meth:`checkpointed`).

    ``packing``: set when some layers hold their keys and values quantized, as a batch with
    ``batch_kv_bits`` holds them (uint32 arrays, ``engine.batch.packing.Packing``; its
    ``expand`` gives the float layers); None when every layer is in the model's precision.
    """

    layers: list[Any]
    tokens: list[int]
    nbytes: int | None = None  # computed on construction when not given
    window_nbytes: int | None = None
    checkpoints: tuple[Checkpoint, ...] = ()
    packing: Any = None

    def __post_init__(self) -> None:
        if self.nbytes is None:
            self.nbytes = sum(layer_nbytes(layer) for layer in self.layers)
        if self.window_nbytes is None:
            self.window_nbytes = sum(
                layer_nbytes(layer) for layer in self.layers if _is_window(layer)
            )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def held_nbytes(self) -> int:
        """Bytes it keeps alive: its layers and its turn checkpoints' windows. Shared heads'
        windows are not counted: many caches hold the same ones (the hot tier counts them
        once, see ``agents.caches.hot``)."""
        return self.nbytes + sum(point.nbytes for point in self.checkpoints if not point.head)

    @property
    def _channel_packed(self) -> bool:
        """Whether some layers hold keys per channel (``batch_kv_bits=4``): their float copies
        of the newest positions are of this cache's end, so it cannot be cut shorter."""
        return self.packing is not None and self.packing.any_channel

    def as_head(self) -> PromptCache:
        """This cache, marked as a shared head: caches resumed from it keep a checkpoint where
        it ends (see :meth:`checkpointed`), so other conversations that start with the same
        tokens can be cut back to it exactly."""
        windows = {i: layer for i, layer in enumerate(self.layers) if _is_window(layer)}
        if not windows or not self.tokens or self._channel_packed:
            return self  # every layer is global: any prefix can be had anyway (or none)
        point = Checkpoint(self.num_tokens, windows, self.window_nbytes or 0, head=True)
        earlier = tuple(c for c in self.checkpoints if c.num_tokens < self.num_tokens)
        return dataclasses.replace(self, checkpoints=(point, *earlier))

    def checkpointed(self, earlier: PromptCache, recent: bool = True) -> PromptCache:
        """This cache, able to be cut back to where ``earlier`` ends (and to ``earlier``'s own
        checkpoints, :data:`CHECKPOINTS_KEPT` in all), although its sliding windows moved on;
        ``earlier``'s shared heads, and this cache's own checkpoints past ``earlier`` (where its
        prompt ended), are kept whatever ``recent`` says.

        ``earlier`` is the cache this one was resumed from: its first tokens are this one's,
        and this one's global layers hold the same keys and values for them, so only
        ``earlier``'s sliding-window layers are kept (a window each, not a history). A client
        that rewrites its last turn (resends it changed) then resumes from the turn before.
        """
        windows = {i: layer for i, layer in enumerate(earlier.layers) if _is_window(layer)}
        if not windows or not 0 < earlier.num_tokens < self.num_tokens or self._channel_packed:
            return self  # (a cache packed with keys per channel is only had whole)
        heads = [c for c in earlier.checkpoints if c.head]
        # Its own, past where it resumed: where this turn's prompt ended (``checkpoint_prompt``).
        own = [c for c in self.checkpoints if c.num_tokens > earlier.num_tokens]
        points: list[Checkpoint] = []
        if recent:
            turns = [c for c in earlier.checkpoints if not c.head]
            points = [Checkpoint(earlier.num_tokens, windows, earlier.window_nbytes or 0), *turns]
            points = points[:CHECKPOINTS_KEPT]
        at = {c.num_tokens: c for c in [*points, *own]} | {c.num_tokens: c for c in heads}
        kept = tuple(at[n] for n in sorted(at, reverse=True))
        return dataclasses.replace(self, checkpoints=kept)

    def longest_prefix(self, keep: int) -> PromptCache | None:
        """The cache of the first ``keep`` tokens if it can be had (:meth:`prefix`), else of
        the longest checkpoint within them; None when neither can."""
        cut = self.prefix(keep)
        if cut is not None or self._channel_packed:
            return cut
        from mlx_lm.models.cache import KVCache

        for point in sorted(self.checkpoints, key=lambda c: -c.num_tokens):
            if not 0 < point.num_tokens <= keep:
                continue
            layers = []
            for i, layer in enumerate(self.layers):
                if i in point.windows:
                    layers.append(point.windows[i])
                elif type(layer) is KVCache:
                    trimmed = _cut(layer, point.num_tokens)  # as in prefix()
                    layers.append(trimmed)
                else:
                    return None
            earlier = tuple(c for c in self.checkpoints if c.num_tokens < point.num_tokens)
            return PromptCache(
                layers,
                self.tokens[: point.num_tokens],
                nbytes=self.nbytes,
                window_nbytes=point.nbytes,
                checkpoints=(point, *earlier) if point.head else earlier,
                packing=self.packing,
            )
        return None

    def prefix(self, keep: int) -> PromptCache | None:
        """The cache of the first ``keep`` tokens, sharing this one's arrays (which it leaves
        as they are), or None when that is empty or cannot be had.

        A global-attention layer just holds fewer positions. A sliding-window layer can only
        give back positions it still holds: once its window has moved on (it dropped the
        oldest ones), only the whole cache is available. A cache packed with keys per channel
        (``batch_kv_bits=4``) is only available whole.
        """
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        if keep == self.num_tokens:
            return self
        if not 0 < keep < self.num_tokens or self._channel_packed:
            return None
        layers = []
        for layer in self.layers:
            kind = type(layer)
            if kind is not KVCache and not (
                kind is RotatingKVCache and layer.offset <= layer.max_size
            ):
                return None
            trimmed = _cut(layer, keep)
            if kind is RotatingKVCache:
                trimmed._idx = keep
            layers.append(trimmed)
        return PromptCache(  # the same arrays
            layers,
            self.tokens[:keep],
            nbytes=self.nbytes,
            window_nbytes=self.window_nbytes,
            checkpoints=tuple(c for c in self.checkpoints if c.num_tokens <= keep),
            packing=self.packing,
        )


def _cut(layer: Any, keep: int) -> Any:
    """A shallow copy of ``layer`` holding its first ``keep`` positions: no MLX work, and the
    original is intact (a quantized row's float copies of its newest positions are left
    behind: the batch expands the cut row's from its words)."""
    trimmed = copy.copy(layer)
    trimmed.offset = keep
    if getattr(layer, "recent", None) is not None:
        trimmed.recent = None
    return trimmed


def layer_nbytes(layer: Any) -> int:
    """A layer's bytes, with the float copies of a channel-packed row's newest positions and
    first position."""
    floats = [x for part in ("recent", "first_kv") for x in getattr(layer, part, None) or ()]
    return layer.nbytes + sum(x.nbytes for x in floats)


def _is_window(layer: Any) -> bool:
    """Whether a layer holds a window of the history rather than all of it: a sliding-window
    layer, or recurrent state (``engine.batch.state``: a window of no positions)."""
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    return type(layer) is RotatingKVCache or isinstance(layer, ArraysCache)


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
        max_tokens: upper bound on generated tokens, end-of-sequence token included.
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
            cache (``engine.batch.quantized.QuantizedLayer``).
        checkpoint_prompt: keep a checkpoint where the prompt ends and the reply begins (on a
            model with sliding-window layers or recurrent state, whose cache cannot be cut back
            there otherwise): a client that sends the reply back otherwise than it was
            generated (rewritten tool calls, reasoning dropped by the template) resumes all of
            the prompt. Also a fence, as ``cache_points`` are.
        reasoning_budget: on a reasoning model (``Engine.thinking``), the most tokens the reply
            may think for: then its thinking's end marker is forced, and the answer follows.
    """

    prompt_tokens: list[int]
    max_tokens: int = 256
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
    checkpoint_prompt: bool = False
    reasoning_budget: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError("prompt_tokens is empty: a request needs at least one new token")
        try:
            # In C, about 10 ns a token: a prompt of millions is checked without stalling the
            # event loop it is made on. An unsigned array refuses negatives and non-integers.
            array("Q", self.prompt_tokens)
        except (TypeError, OverflowError):
            raise ValueError("prompt_tokens must be non-negative integers") from None
        if self.forced_token is not None and (
            not isinstance(self.forced_token, int) or self.forced_token < 0
        ):
            raise ValueError(f"forced_token must be a token id, got {self.forced_token!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
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
        if any(type(p) is not int or p < 0 for p in self.cache_points):
            raise ValueError(
                f"cache_points must be non-negative token positions, got {self.cache_points!r}"
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
