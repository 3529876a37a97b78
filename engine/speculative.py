"""Speculative decoding in the running batch: drafts from the agent's own history.

An agent restates what its history holds: an edit copies the lines of a file it read, a tool
call repeats paths and ids, code comes back with small changes. :class:`PromptLookup` drafts
the tokens that followed the latest earlier occurrence of the sequence's last few tokens, in
everything its KV holds (its whole conversation, earlier turns included: prompt lookup), at no
cost but a search. A request may also give the text its reply is expected to restate
(:class:`Prediction`, OpenAI's Predicted Outputs), drafted from first. Where neither has
anything, an engine with a draft model drafts its continuation (``agentkv.engine.drafter``).

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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from agentkv.engine.drafter import DraftCache, DraftModel

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
MODEL_TRIAL = 3
"""Steps drafted by the draft model over which its drafts must pay for their cost."""
VERIFY_COST = 0.25
"""What a drafted step costs beyond a plain one, in plain steps (its rows, its tokens read
at once): a draft model's drafts must keep more than this and their own cost a step."""


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
        history's end itself); [] when it never occurred. Where they reach the history's end
        (a run that repeats itself: a row of dashes, a loop), the run goes on repeating."""
        held, n = self.tokens[: self.size], tail.size
        # (an occurrence starting at size - n would be the end itself)
        found = occurrences(held, tail, self.size - n)
        if not found.size:
            return []
        start = int(found[-1]) + n
        got = held[start : start + k].tolist()
        period = self.size - start
        while len(got) < k:
            got.append(got[len(got) - period])
        return got

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


def occurrences(held: np.ndarray, tail: np.ndarray, starts: int) -> np.ndarray:
    """Where ``tail`` occurs in ``held``, starting before ``starts``, in order."""
    n = tail.size
    starts = min(starts, held.size - n + 1)
    if starts <= 0:
        return np.zeros(0, dtype=np.int64)
    hits = np.ones(starts, dtype=bool)
    for j in range(n):
        hits &= held[j : starts + j] == tail[j]
    return np.flatnonzero(hits)


@dataclass(slots=True)
class Prediction:
    """Text the reply is expected to restate, given with the request (OpenAI's Predicted
    Outputs: a file to be rewritten with small changes), as tokens: drafts come from it first.

    While the reply so far is the prediction's start, the drafts are what follows that start;
    once the reply departs from it, they are what followed the reply's last few tokens in the
    prediction, at the first occurrence past where the previous drafts from it ended (a
    rewritten file goes through its lines in order, however often a line repeats)."""

    tokens: np.ndarray
    start: int  # where the reply begins in the sequence's history
    matched: int = 0  # reply tokens known to equal the prediction's start
    on_track: bool = True
    cursor: int = 0  # where the last drafts from the prediction ended

    @classmethod
    def of(cls, tokens: Sequence[int], start: int) -> Prediction:
        return cls(np.array(tokens, dtype=np.int64), start)

    def draft(self, history: list[int], last: int | None, k: int) -> list[int]:
        """As :meth:`PromptLookup.draft`, from the prediction; [] when it has nothing."""
        reply = len(history) - self.start
        if self.on_track:
            for i in range(self.matched, reply):
                if i >= self.tokens.size or history[self.start + i] != self.tokens[i]:
                    self.on_track = False
                    break
            else:
                self.matched = reply
        if self.on_track:
            at = reply
            if last is not None:
                if at >= self.tokens.size or last != self.tokens[at]:
                    return self._search(history, last, k)
                at += 1
            got = self.tokens[at : at + k + (last is None)]
            self.cursor = at + got.size
            return got.tolist()
        return self._search(history, last, k)

    def _search(self, history: list[int], last: int | None, k: int) -> list[int]:
        extra = last is None  # (the token expected next comes first)
        tail_of = history[-(NGRAMS[0]) :] + ([] if last is None else [last])
        for n in NGRAMS:
            if len(tail_of) < n:
                continue
            tail = np.array(tail_of[-n:], dtype=np.int64)
            found = occurrences(self.tokens, tail, self.tokens.size)
            if not found.size:
                continue
            ahead = found[found >= self.cursor - n]
            begin = int(ahead[0] if ahead.size else found[-1]) + n
            got = self.tokens[begin : begin + k + extra]
            if got.size:
                self.cursor = begin + got.size
                return got.tolist()
        return []


@dataclass(slots=True)
class Speculation:
    """A sequence's drafting: its lookup (and prediction), its draft length, what it drafted
    and kept."""

    max_tokens: int
    prediction: Prediction | None = None
    lookup: PromptLookup = field(default_factory=PromptLookup)
    k: int = FIRST_DRAFT
    active: bool = True
    stopped: bool = False  # it just stopped drafting (the scheduler may regroup it)
    steps: int = 0  # drafted steps
    chances: int = 0  # steps it could draft in
    drafted: int = 0
    accepted: int = 0
    predicted: bool = False  # the drafts fed last came from the prediction
    accepted_predicted: int = 0  # drafts from the prediction kept
    drafter: DraftModel | None = None  # the engine's draft model, if it has one
    draft_cache: DraftCache | None = None  # the sequence's draft KV, once it drafts with it
    from_model: bool = False  # the drafts fed last came from the draft model
    model_steps: int = 0  # steps fed the draft model's drafts
    model_drafted: int = 0
    model_kept: int = 0
    model_off: bool = False  # it stopped drafting with the draft model for its turn

    def __post_init__(self) -> None:
        self.k = min(self.k, self.max_tokens)

    def propose(self, history: list[int], pending: int | None, room: int) -> list[int]:
        """Drafts to feed after the pending token (``pending``, or None while the step in
        flight computes it: then the first of the returned tokens is the one expected, and
        the drafts follow it), at most ``room`` drafts (the tokens the sequence may still
        generate after its pending one); [] when it has none, or has stopped drafting.

        They come from the prediction, else the lookup, else the draft model (a step its
        draft KV spends catching up with the history drafts nothing and is no chance)."""
        if not self.active or room < 1:
            return []
        k = min(self.k, room)
        got = self._drafts(history, pending, k)
        if got is None:
            return []
        self.chances += 1
        if self.chances >= TRIAL_CHANCES and self.accepted < SAVING * self.chances:
            self.active, self.stopped = False, True
            return []
        return got

    def _drafts(self, history: list[int], pending: int | None, k: int) -> list[int] | None:
        self.from_model = False
        if self.prediction is not None:
            got = self.prediction.draft(history, pending, k)
            self.predicted = bool(got)
            if got:
                return got
        self.lookup.extend(history)
        got = self.lookup.draft(k, pending)
        if len(got) > (pending is None) or self.drafter is None or self.model_off:
            return got
        if self.draft_cache is None:
            if not self.drafter.worth_trying():
                self.model_off = True
                return got
            self.draft_cache = self.drafter.take(history)
        got = self.drafter.draft(self.draft_cache, history, pending, k)
        self.from_model = bool(got)
        return got

    def _settle_model(self, drafted: int, kept: int) -> None:
        """Stop drafting with the draft model for the turn once its drafts have not paid for
        themselves over :data:`MODEL_TRIAL` steps (the history's drafts go on)."""
        self.model_steps += 1
        self.model_drafted += drafted
        self.model_kept += kept
        cost = self.model_drafted * self.drafter.cost + VERIFY_COST * self.model_steps
        paid = self.model_kept > cost
        if self.model_steps == MODEL_TRIAL:
            self.drafter.trials.append(paid)
        if self.model_steps >= MODEL_TRIAL and not paid:
            self.model_off = True  # (its draft KV stays, for the next turn to catch up)

    def release(self, history: list[int]) -> None:
        """The turn ended with ``history``: its draft KV goes back to the draft model, for
        the conversation's next turn."""
        if self.draft_cache is not None:
            self.drafter.keep(self.draft_cache, history)
            self.draft_cache = None

    def settle(self, drafted: int, kept: int) -> None:
        """Account for a step that fed ``drafted`` drafts and kept ``kept`` of them: the next
        draft length, and whether drafting goes on (it stops for good once its trial shows
        its drafts do not pay)."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += kept
        if self.predicted:
            self.accepted_predicted += kept
        if self.from_model:
            self._settle_model(drafted, kept)
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
