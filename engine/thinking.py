"""A reasoning model's thinking in the logits: a cap on how long it reasons, and where a
grammar begins.

A reasoning model writes its thinking between two marker tokens (mlx-lm's ``think_start_id``
/ ``think_end_id``: ``<think>`` … ``</think>``) before its answer; a chat template may open the
thinking at the end of the prompt. :class:`ThinkingState` follows a sequence's tokens to know
whether it is reasoning now. :class:`ThinkingBudget` forces the end marker once a reply has
reasoned for its budget of tokens (Anthropic's ``thinking.budget_tokens``); a grammar (a
forced tool call, a JSON reply) holds only the answer after the thinking
(``agentkv.engine.grammar.GrammarProcessor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.engine.models.o200k import ids_of

PROMPT_TAIL = 16
"""Tokens at a prompt's end read for thinking the template opened (or closed)."""


def prompt_thinking(
    prompt: Sequence[int], start: Sequence[int], end: Sequence[int]
) -> tuple[bool, bool]:
    """(open, closed): whether a prompt's last :data:`PROMPT_TAIL` tokens leave the thinking
    open (the reply starts inside it), or closed it (a template that switched it off), by the
    markers' token sequences ``start`` and ``end``."""
    tail = list(prompt[-PROMPT_TAIL:])
    last_start, last_end = _rfind(tail, tuple(start)), _rfind(tail, tuple(end))
    return last_start > last_end, 0 <= last_start < last_end


def _rfind(tokens: list[int], marker: tuple[int, ...]) -> int:
    """The last index where ``marker`` starts in ``tokens``, or -1."""
    n = len(marker)
    for i in range(len(tokens) - n, -1, -1):
        if tuple(tokens[i : i + n]) == marker:
            return i
    return -1


@dataclass(frozen=True, slots=True)
class ThinkingMarkers:
    """The token ids that open and close a model's thinking."""

    start: int
    end: int

    @property
    def opening(self) -> tuple[int, ...]:
        """The tokens that open the thinking."""
        return (self.start,)

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkingMarkers | None:
        """An mlx-lm TokenizerWrapper's markers when each is one token; else None."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        start, end = tokenizer.think_start_tokens, tokenizer.think_end_tokens
        if not start or not end or len(start) != 1 or len(end) != 1:
            return None
        return cls(start[0], end[0])


@dataclass(frozen=True, slots=True)
class AnalysisMarkers:
    """gpt-oss's thinking (OpenAI's harmony): a message on the ``analysis`` channel, opened by
    its header's tokens (``<|channel|>analysis<|message|>``) and closed by ``<|end|>``; what a
    reasoning budget follows (a grammar holds the whole reply in this format)."""

    opening: tuple[int, ...]
    end: int

    @classmethod
    def of(cls, tokenizer: Any) -> AnalysisMarkers | None:
        """The markers of an mlx-lm TokenizerWrapper whose vocabulary is o200k_harmony's."""
        ids = ids_of(tokenizer, ["<|channel|>", "<|message|>", "<|end|>"])
        if ids != [200005, 200008, 200007]:
            return None
        channel = list(tokenizer.encode("analysis", add_special_tokens=False))
        return cls((ids[0], *channel, ids[1]), ids[2])


class ThinkingState:
    """Whether a sequence is reasoning now, fed its context as logits processors see it (the
    first call: the prompt; then each token sampled since)."""

    __slots__ = ("_recent", "_seen", "closed", "inside", "markers", "reasoned", "replied")

    def __init__(self, markers: ThinkingMarkers | AnalysisMarkers):
        self.markers = markers
        self.inside = False
        self.closed = False  # the template closed the thinking (switched off) in the prompt
        self.reasoned = 0  # tokens of thinking generated so far
        self.replied = 0  # tokens generated so far
        self._seen: int | None = None
        self._recent: tuple[int, ...] = ()  # the last tokens, as many as open the thinking

    def update(self, tokens: Any) -> list[int]:
        """Follow the context up to now (an MLX or numpy array of token ids); returns the
        tokens generated since the previous call."""
        if self._seen is None:  # the prompt: thinking the template left open
            tail = tokens[-PROMPT_TAIL:].tolist()
            markers = self.markers
            self.inside, self.closed = prompt_thinking(tail, markers.opening, (markers.end,))
            self._seen = int(tokens.size)
            return []
        new = tokens[self._seen :].tolist()
        self._seen = int(tokens.size)
        opening = self.markers.opening
        for token in new:
            self.replied += 1
            self._recent = (*self._recent, token)[-len(opening) :]
            if self._recent == opening:
                self.inside = True
            elif token == self.markers.end:
                self.inside = False
            elif self.inside:
                self.reasoned += 1
        return new


class ThinkingBudget:
    """A logits processor: once a reply has reasoned for ``budget`` tokens, its next token is
    the end marker (the answer follows)."""

    __slots__ = ("budget", "state")

    def __init__(self, markers: ThinkingMarkers | AnalysisMarkers, budget: int):
        self.state = ThinkingState(markers)
        self.budget = budget

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        state = self.state
        state.update(tokens)
        if not state.inside or state.reasoned < self.budget:
            return logits
        end = mx.arange(logits.shape[-1]) == state.markers.end
        return mx.where(end, logits, mx.array(-float("inf"), dtype=logits.dtype))
