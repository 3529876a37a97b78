"""Reasoning in model output, kept apart from the answer.

A reasoning model (Qwen3, DeepSeek-R1, GLM-4.x, Kimi …) writes its thinking between two
markers before its answer. mlx-lm's tokenizer wrapper names them per family (``think_start`` /
``think_end``: ``<think>`` … ``</think>``, Gemma 4's ``<|channel>thought`` … ``<channel|>``);
a model without them has no reasoning to split. A chat template may open the reasoning itself
at the end of the generation prompt (the reply then starts inside it), or close it at once
(``enable_thinking=False`` writes an empty block): :meth:`ReasoningFormat.opened` reads that off
the prompt's last tokens, as ``mlx_lm.server`` does.

The reasoning's own newlines (``<think>\\n`` … ``\\n</think>\\n\\n``) are dropped from both parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.engine.thinking import PROMPT_TAIL, prompt_thinking

__all__ = ["PROMPT_TAIL", "ReasoningFormat", "ReasoningSplitter"]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A model's reasoning markers, as text and as token ids."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> ReasoningFormat | None:
        """The markers of an mlx-lm TokenizerWrapper, or None for a model without any."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        start_ids, end_ids = tokenizer.think_start_tokens, tokenizer.think_end_tokens
        if not start_ids or not end_ids:
            return None
        return cls(tokenizer.think_start, tokenizer.think_end, tuple(start_ids), tuple(end_ids))

    @property
    def end_id(self) -> int | None:
        """The end marker's token id, when it is one token (what a reasoning budget forces)."""
        return self.end_ids[0] if len(self.end_ids) == 1 else None

    def opened(self, prompt: Sequence[int]) -> bool:
        """Whether a prompt (its last :data:`PROMPT_TAIL` tokens) leaves reasoning open: the
        reply starts inside it."""
        return prompt_thinking(prompt, self.start_ids, self.end_ids)[0]

    def tokens_of(self, reply: Sequence[int], opened: bool = False) -> int:
        """How many of a reply's tokens are its thinking: up to its end marker (all of them
        when the thinking never ended; none when there was none)."""
        tokens = list(reply)
        end = _find(tokens, self.end_ids)
        if end >= 0 and (opened or _find(tokens[:end], self.start_ids) >= 0):
            return end + len(self.end_ids)
        if opened or _find(tokens, self.start_ids) >= 0:
            return len(tokens) if end < 0 else 0
        return 0

    def splitter(self, opened: bool = False) -> ReasoningSplitter:
        """A splitter for a reply streamed in pieces (``opened``: it starts inside reasoning)."""
        return ReasoningSplitter(self, opened)

    def split(self, text: str, opened: bool = False) -> tuple[str, str]:
        """A whole reply's (reasoning, answer); ``opened``: it starts inside reasoning."""
        splitter = ReasoningSplitter(self, opened)
        parts = [*splitter.feed(text), *splitter.flush()]
        reasoning = "".join(piece for inside, piece in parts if inside)
        return reasoning, "".join(piece for inside, piece in parts if not inside)


@dataclass(slots=True)
class ReasoningSplitter:
    """Splits a reply streamed in pieces: :meth:`feed` returns ``(is_reasoning, text)`` pieces
    ready to show, holding back what may be the start of a marker (or newlines that may
    precede the end marker); :meth:`flush` returns the rest once the reply is over."""

    form: ReasoningFormat
    inside: bool = False
    _held: str = ""
    _lstrip: bool = field(default=False, init=False)  # drop newlines that open the next part

    def __post_init__(self) -> None:
        self._lstrip = self.inside

    def feed(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        held = self._held + text
        while True:
            marker = self.form.end if self.inside else self.form.start
            at = held.find(marker)
            if at < 0:
                break
            self._emit(out, held[:at], final=True)
            held = held[at + len(marker) :]
            self.inside = not self.inside
            self._lstrip = True
        marker = self.form.end if self.inside else self.form.start
        keep = _partial_suffix(held, marker)
        if self.inside:  # newlines right before the end marker are the template's
            shown = held[: len(held) - keep]
            keep += len(shown) - len(shown.rstrip("\n"))
        self._emit(out, held[: len(held) - keep], final=False)
        self._held = held[len(held) - keep :]
        return out

    def flush(self) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        held, self._held = self._held, ""
        self._emit(out, held, final=True)
        return out

    def _emit(self, out: list[tuple[bool, str]], text: str, final: bool) -> None:
        if self._lstrip:
            text = text.lstrip("\n")
            if text:
                self._lstrip = False
        if final and self.inside:
            text = text.rstrip("\n")
        if text:
            out.append((self.inside, text))


def _find(tokens: list[int], marker: tuple[int, ...]) -> int:
    """The first index where ``marker`` starts in ``tokens``, or -1."""
    n = len(marker)
    for i in range(len(tokens) - n + 1):
        if tuple(tokens[i : i + n]) == marker:
            return i
    return -1


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` begin ``marker`` (a marker cut mid-way)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0
