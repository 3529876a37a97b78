"""Speculative decoding in the running batch: drafts from the agent's own history.

An agent restates what its history holds: an edit copies the lines of a file it read, a tool
call repeats paths and ids, code comes back with small changes. :class:`PromptLookup` drafts
the tokens that followed the latest earlier occurrence of the sequence's last few tokens, in
everything its KV holds (its whole conversation, earlier turns included: prompt lookup), at no
cost but a search.

A sequence with drafts feeds its pending token and the drafts as one span of rows in the step
(its own length group, like a prompt's chunk), and the step computes the logits at every one
of them. Each position's token is then chosen as a plain step would choose it (the argmax, or
the sequence's sampler) and the drafts are kept while they match those tokens: the first
token that differs is kept instead and ends the run (``agentkv.engine.step.verify``). Greedy
output is therefore the tokens of decoding without drafts; sampled output keeps its distribution (a
draft, deterministic, is kept with the probability the model gives it; when it is not, the
token sampled is distributed as the model's distribution without it, which is the
speculative-sampling rule for a one-hot draft). The rejected positions are dropped from the
sequence's KV (``agentkv.engine.mlxlm.drop_newest``).

:class:`Speculation` keeps a sequence's drafting honest: its draft length follows its
acceptance (longer while every draft is kept, shorter after misses), and a sequence whose
drafts do not pay (fewer than :data:`PAYING` tokens kept a drafted step over its first
:data:`TRIAL_STEPS` of them, or fewer than :data:`SAVING` a step it could draft in over
:data:`TRIAL_CHANCES`) stops drafting for its turn, leaving its length group free to merge
with others. A step without drafts costs a drafting sequence nothing: its history is
searched with the tokens it knows, the one its last step is computing aside (the drafts then
begin with the token expected there), so the batch's steps stay pipelined.

Sequences draft only where a step of theirs can be cut back exactly and chosen position by
position: layers of ``KVCache`` / ``RotatingKVCache`` in the model's precision (not recurrent
state, not KV held quantized in the batch), and no logits processor (a grammar, a reasoning
budget, penalties, a bias), no log probabilities and no forced token asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NGRAMS = (4, 3)
"""Lengths of the trailing n-gram looked up, longest first (a shorter one drafts mostly what
prose does not repeat)."""
TRIAL_STEPS = 6
"""Drafted steps over which a sequence's drafts must pay."""
PAYING = 1.5
"""Draft tokens kept a drafted step (averaged over the trial) below which drafting stops: a
drafted step costs more than a plain one (its rows, a length group of its own, its tokens
read at once), and a kept draft is a step saved."""
TRIAL_CHANCES = 16
"""Steps a sequence could draft in over which its drafts must save :data:`SAVING` steps."""
SAVING = 0.5
"""Draft tokens kept a step it could draft in, below which drafting stops: meanwhile it
keeps a length group of its own, one attention call more a layer."""
FIRST_DRAFT = 4
"""Draft length a sequence starts with (at most ``EngineConfig.speculative_tokens``)."""


@dataclass(slots=True)
class PromptLookup:
    """The tokens a sequence's KV holds, as an array searched for earlier occurrences of its
    last tokens."""

    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    size: int = 0

    def extend(self, tokens: list[int]) -> None:
        """Catch up with ``tokens`` (the sequence's whole history, of which the first
        ``size`` are already held)."""
        new = tokens[self.size :]
        if not new:
            return
        need = self.size + len(new)
        if need > self.tokens.size:
            grown = np.zeros(max(need, 2 * self.tokens.size, 1024), dtype=np.int64)
            grown[: self.size] = self.tokens[: self.size]
            self.tokens = grown
        self.tokens[self.size : need] = new
        self.size = need

    def follow(self, tail: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of ``tail`` (not the
        history's end itself); [] when it never occurred."""
        held, n = self.tokens[: self.size], tail.size
        if self.size <= n:
            return []
        starts = self.size - n  # (an occurrence starting there would be the end itself)
        hits = np.ones(starts, dtype=bool)
        for j in range(n):
            hits &= held[j : starts + j] == tail[j]
        found = np.flatnonzero(hits)
        if not found.size:
            return []
        start = int(found[-1]) + n
        return held[start : start + k].tolist()

    def draft(self, k: int, last: int | None) -> list[int]:
        """What is expected to follow the history and the token about to be fed: ``last``
        when it is known (k tokens), else (``last`` still being computed) the token expected
        next and the ``k`` after it; [] when the history's last tokens never occurred."""
        held = self.tokens[: self.size]
        for n in NGRAMS:
            if last is not None and self.size >= n - 1:
                got = self.follow(np.append(held[self.size - n + 1 :], last), k)
            elif last is None and self.size >= n:
                got = self.follow(held[self.size - n :], k + 1)
            else:
                continue
            if got:
                return got
        return []


@dataclass(slots=True)
class Speculation:
    """A sequence's drafting: its lookup, its draft length, what it drafted and kept."""

    max_tokens: int
    lookup: PromptLookup = field(default_factory=PromptLookup)
    k: int = FIRST_DRAFT
    active: bool = True
    stopped: bool = False  # it just stopped drafting (the scheduler may regroup it)
    steps: int = 0  # drafted steps
    chances: int = 0  # steps it could draft in
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.k = min(self.k, self.max_tokens)

    def propose(self, history: list[int], pending: int | None, room: int) -> list[int]:
        """Drafts to feed after the pending token (``pending``, or None while the step in
        flight computes it: then the first of the returned tokens is the one expected, and
        the drafts follow it), at most ``room`` drafts (the tokens the sequence may still
        generate after its pending one); [] when it has none, or has stopped drafting."""
        if not self.active or room < 1:
            return []
        self.chances += 1
        if self.chances >= TRIAL_CHANCES and self.accepted < SAVING * self.chances:
            self.active, self.stopped = False, True
            return []
        self.lookup.extend(history)
        return self.lookup.draft(min(self.k, room), pending)

    def settle(self, drafted: int, kept: int) -> None:
        """Account for a step that fed ``drafted`` drafts and kept ``kept`` of them: the next
        draft length, and whether drafting goes on (it stops for good once its trial shows
        its drafts do not pay)."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += kept
        if kept == drafted:
            self.k = min(self.k * 2, self.max_tokens)
        else:
            self.k = max(1, kept + 1)
        if self.active and self.steps >= TRIAL_STEPS and self.accepted < PAYING * self.steps:
            self.active, self.stopped = False, True


def kept_drafts(drafts: list[int], chosen: list[int]) -> int:
    """How many of ``drafts`` a step keeps: the leading ones equal to the token chosen at the
    position before each (``chosen[i]`` follows the feed's ``i``-th token)."""
    kept = 0
    for draft, token in zip(drafts, chosen, strict=False):
        if draft != token:
            break
        kept += 1
    return kept
