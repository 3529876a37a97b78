"""The solo fast path: one sequence alone decodes on plain per-layer caches.

mlx-lm's BatchGenerator pays for batch masks and bookkeeping even at batch size 1, which makes
one request a few percent slower than ``generate_step``. While a request is alone, the loop runs
it here instead, with the same pipelining as ``generate_step``. When another request arrives
it *joins the batch*: the pending sampled token becomes the prompt of a BatchGenerator insert
whose cache is this one, so the sequence continues exactly where it was.

Invariant (as in BatchGenerator): every reported token is in the cache; ``tokens`` lists exactly
what the cache holds.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from engine.request import GenerationRequest, PromptCache
from engine.sampling import LogitsProcessor, Sampler

PROCESSOR_CONTEXT = 4096  # >= SamplingParams.repetition_context_size's upper bound


class SoloRun:
    """One sequence decoding outside the batch."""

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
        self.num_generated = 0
        if request.cache is not None:
            # Decoding updates caches in place; the caller's cache (maybe a hot-tier entry) must
            # stay as it was.
            self.layers = copy.deepcopy(request.cache.layers)
            self.tokens = list(request.cache.tokens)
        else:
            self.layers = make_prompt_cache(model)
            self.tokens = []
        prompt = request.prompt_tokens
        with mx.stream(generation_stream):
            for start in range(0, len(prompt) - 1, prefill_step_size):
                chunk = prompt[start : min(start + prefill_step_size, len(prompt) - 1)]
                model(mx.array(chunk)[None], cache=self.layers)
                mx.eval([c.state for c in self.layers])
                self.tokens += chunk
                mx.clear_cache()
            self._pending = self._feed(mx.array(prompt[-1:]))
        self.tokens.append(prompt[-1])

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

    def step(self) -> tuple[int, str | None]:
        """Report the next token (already fed into the cache) and its finish reason, if any."""
        y = self._pending
        with mx.stream(generation_stream):
            # Queue the next step before waiting on this one, like generate_step.
            self._pending = self._feed(y)
        token = y.item()
        self.tokens.append(token)
        return token, self._finish_reason(token)

    def _finish_reason(self, token: int) -> str | None:
        self.num_generated += 1
        if token in self._eos:
            return "stop"
        return "length" if self.num_generated >= self._max_tokens else None

    def take_pending(self) -> tuple[int, str | None]:
        """Report the sampled-but-unfed token, to hand the sequence over to the batch.

        If it ends the sequence it is fed here (the cache must hold it); otherwise the caller
        inserts it as the prompt of a batch request continuing from ``cache()``.
        """
        token = self._pending.item()
        reason = self._finish_reason(token)
        if reason is not None:
            self.feed_last(token)
        return token, reason

    def feed_last(self, token: int) -> None:
        with mx.stream(generation_stream):
            self._model(mx.array([[token]]), cache=self.layers)
            mx.eval([c.state for c in self.layers])
        self.tokens.append(token)

    @property
    def remaining_tokens(self) -> int:
        return self._max_tokens - self.num_generated

    def cache(self) -> PromptCache:
        mx.eval([c.state for c in self.layers])
        return PromptCache(self.layers, list(self.tokens))
