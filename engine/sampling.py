"""Sampling parameters, validated once, turned into mlx-lm samplers and logits processors."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_repetition_penalty,
)
from pydantic import BaseModel, ConfigDict, Field, field_validator

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class SamplingParams(BaseModel):
    """How to pick each next token. The defaults are greedy decoding.

    Attributes:
        temperature: 0 means greedy (argmax); higher flattens the distribution.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep only the k most likely tokens; 0 disables it.
        min_p: drop tokens below ``min_p`` times the top token's probability; 0 disables it.
        repetition_penalty: > 1 discourages the last ``repetition_context_size`` tokens;
            1 disables it.
        repetition_context_size: how many recent tokens the penalty looks at.
        seed: makes sampling reproducible per request, independent of what else is in the batch.
        presence_penalty, frequency_penalty: OpenAI's, -2 to 2: each token already generated in
            this reply loses ``presence_penalty`` once and ``frequency_penalty`` per time.
        logit_bias: token id -> a number added to its logit before sampling, -100 to 100 (as
            OpenAI's ``logit_bias``): -100 bans a token, +100 forces it. E.g. a base model whose
            end-of-turn token was never trained ends its turns with a positive bias on it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    repetition_context_size: int = Field(default=20, ge=1, le=4096)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    logit_bias: dict[int, float] | None = Field(default=None, max_length=1024)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        for token, value in (bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} is negative")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias: token {token} has bias {value}, not in [-100, 100]")
        return bias or None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def make_sampler(self, vocab_size: int) -> Sampler | None:
        """A sampler for one sequence, or None for greedy (the batch shares one argmax call)."""
        if self.is_greedy:
            return None
        if self.top_k >= vocab_size:
            raise ValueError(f"top_k={self.top_k} must be below the vocabulary size {vocab_size}")
        return SeededSampler(self, self.seed if self.seed is not None else secrets.randbits(63))

    def make_logits_processors(self, vocab_size: int) -> list[LogitsProcessor]:
        """The processors, the bias last (so +100 forces a token whatever else applies)."""
        processors: list[LogitsProcessor] = []
        if self.repetition_penalty != 1.0:
            processors.append(
                make_repetition_penalty(self.repetition_penalty, self.repetition_context_size)
            )
        if self.presence_penalty or self.frequency_penalty:
            processors.append(OccurrencePenalty(self.presence_penalty, self.frequency_penalty))
        if self.logit_bias:
            if too_big := [t for t in self.logit_bias if t >= vocab_size]:
                raise ValueError(
                    f"logit_bias: token id {too_big[0]} is not in the vocabulary "
                    f"(ids 0..{vocab_size - 1})"
                )
            processors.append(LogitBias(self.logit_bias))
        return processors


class LogitBias:
    """Adds a bias to some tokens' logits. Its arrays are made on the first call, on the
    generation thread (the processor is built on the event loop, where no MLX op may run)."""

    __slots__ = ("_bias", "_ids", "_values")

    def __init__(self, bias: dict[int, float]):
        self._bias = bias
        self._ids: mx.array | None = None
        self._values: mx.array | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._ids is None:
            self._ids = mx.array(list(self._bias), dtype=mx.int32)
            self._values = mx.array(list(self._bias.values()))
        logits[:, self._ids] += self._values.astype(logits.dtype)
        return logits


class OccurrencePenalty:
    """OpenAI's presence and frequency penalties: each token the reply has generated so far
    (the prompt does not count) loses ``presence`` once and ``frequency`` per occurrence.

    The first call sees the prompt (what the cache holds) and remembers its length; each later
    call counts the token sampled since. Counts are made on the generation thread."""

    __slots__ = ("_counts", "_frequency", "_presence", "_seen")

    def __init__(self, presence: float, frequency: float):
        self._presence = presence
        self._frequency = frequency
        self._counts: mx.array | None = None
        self._seen = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._counts is None:
            self._counts = mx.zeros((logits.shape[-1],), dtype=mx.float32)
            self._seen = tokens.size
            return logits
        new = tokens[self._seen :]
        self._seen = tokens.size
        self._counts = self._counts.at[new].add(1.0)
        penalty = self._frequency * self._counts + self._presence * (self._counts > 0)
        return logits - penalty.astype(logits.dtype)


class SeededSampler:
    """Samples with its own PRNG key, so a sequence's draws do not depend on its batch-mates.

    The key is made on the first call, on the generation thread: the sampler itself is built
    wherever the request is submitted (the event loop), where no MLX op may run.
    """

    __slots__ = ("_key", "_params", "_seed")

    def __init__(self, params: SamplingParams, seed: int):
        self._params = params
        self._seed = seed
        self._key: mx.array | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        p = self._params
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        if self._key is None:
            self._key = mx.random.key(self._seed)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=sub)


__all__ = ["LogitsProcessor", "Sampler", "SamplingParams", "SeededSampler", "greedy_sampler"]
