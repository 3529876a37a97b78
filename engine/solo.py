"""The solo fast path: one sequence alone decodes on plain per-layer caches.

mlx-lm's BatchGenerator pays for batch masks and bookkeeping even at batch size 1, which makes
one request a few percent slower than ``generate_step``. While a request is alone, the loop runs
it here instead, with the same pipelining as ``generate_step``. When another request arrives
it *joins the batch* at the next step boundary: during prefill, the unprocessed prompt becomes
the prompt of a BatchGenerator insert whose cache is this one; during decode, the pending
sampled token does. Either way the sequence continues exactly where it was.

Invariant (as in BatchGenerator): every reported token is in the cache; ``tokens`` lists exactly
what the cache holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from engine.request import GenerationRequest, PromptCache
from engine.sampling import LogitsProcessor, Sampler

PROCESSOR_CONTEXT = 4096  # >= SamplingParams.repetition_context_size's upper bound


@dataclass(slots=True, frozen=True)
class Handover:
    """What the batch needs to continue a solo sequence: prompt, cache, token budget."""

    prompt: list[int]
    cache: PromptCache
    max_tokens: int


class SoloRun:
    """One sequence prefilling and decoding outside the batch, one step per loop turn."""

    def __init__(
        self,
        model: Any,
        request: GenerationRequest,
        sampler: Sampler | None,
        logits_processors: list[LogitsProcessor],
        eos_token_ids: frozenset[int],
        prefill_step_size: int,
    ):
        self._model = model
        self._sampler = sampler
        self._processors = logits_processors
        self._eos = eos_token_ids
        self._max_tokens = request.max_tokens
        self._step_size = prefill_step_size
        self.num_generated = 0
        if request.cache is not None:
            # Decoding updates caches in place; the caller's cache (maybe a hot-tier entry) must
            # stay as it was.
            self.layers = copy.deepcopy(request.cache.layers)
            self.tokens = list(request.cache.tokens)
        else:
            self.layers = make_prompt_cache(model)
            self.tokens = []
        self._prompt = list(request.prompt_tokens)  # not yet in the cache
        self._pending: mx.array | None = None  # sampled, not yet fed nor reported

    @property
    def is_prefilling(self) -> bool:
        return self._pending is None

    def step(self) -> tuple[int, str | None] | None:
        """Prefill one chunk (returns None) or report the next token and its finish reason."""
        with mx.stream(generation_stream):
            if self.is_prefilling:
                self._prefill_chunk()
                return None
            y = self._pending
            # Queue the next step before waiting on this one, like generate_step.
            self._pending = self._feed(y)
        token = y.item()
        self.tokens.append(token)
        return token, self._finish_reason(token)

    def _prefill_chunk(self) -> None:
        if len(self._prompt) > 1:
            chunk = self._prompt[: min(self._step_size, len(self._prompt) - 1)]
            self._model(mx.array(chunk)[None], cache=self.layers)
            mx.eval([c.state for c in self.layers])
            self.tokens += chunk
            self._prompt = self._prompt[len(chunk) :]
            mx.clear_cache()
        else:
            self._pending = self._feed(mx.array(self._prompt))
            self.tokens += self._prompt
            self._prompt = []

    def _feed(self, token: mx.array) -> mx.array:
        """Run one token through the model (into the cache); return the lazily sampled next."""
        logits = self._model(token[None], cache=self.layers)[:, -1, :]
        if self._processors:
            context = mx.concatenate([mx.array(self.tokens[-PROCESSOR_CONTEXT:]), token])
            for processor in self._processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self._sampler(logprobs) if self._sampler else mx.argmax(logprobs, axis=-1)
        mx.async_eval(sampled)
        return sampled

    def _finish_reason(self, token: int) -> str | None:
        self.num_generated += 1
        if token in self._eos:
            return "stop"
        return "length" if self.num_generated >= self._max_tokens else None

    def take_pending(self) -> tuple[int, str | None]:
        """Report the sampled-but-unfed token, to hand the sequence over to the batch.

        If it ends the sequence it is fed here (the cache must hold it); otherwise the batch
        feeds it as the last prompt token of ``handover()``.
        """
        token = self._pending.item()
        reason = self._finish_reason(token)
        self._pending = None
        self._prompt = [token]
        if reason is not None:
            self.feed_prompt()
        return token, reason

    def feed_prompt(self) -> None:
        """Put what is left of the prompt into the cache (to finish with a complete cache)."""
        with mx.stream(generation_stream):
            self._model(mx.array(self._prompt)[None], cache=self.layers)
            mx.eval([c.state for c in self.layers])
        self.tokens += self._prompt
        self._prompt = []

    def handover(self) -> Handover:
        """The batch insert that continues this sequence (call while nothing is pending)."""
        return Handover(self._prompt, self.cache(), self._max_tokens - self.num_generated)

    def cache(self) -> PromptCache:
        mx.eval([c.state for c in self.layers])
        return PromptCache(self.layers, list(self.tokens))
