"""One step of the batch: what the scheduler hands the runner (:class:`StepPlan`), and the
values of what it fed, read back on the host once (the tokens, their logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentkv.engine.request import TokenLogprob

if TYPE_CHECKING:
    from agentkv.engine.batch.groups import KVGroup
    from agentkv.engine.sequence import Sequence


@dataclass(slots=True)
class StepPlan:
    """What one step runs: every row of ``decode`` groups decodes one token, and each
    ``(sequence, n)`` of ``prefill`` feeds the next ``n`` tokens of its prompt."""

    decode: list[KVGroup]
    prefill: list[tuple[Sequence, int]]
    fed: list[tuple[Sequence, Any]] = field(default_factory=list)  # decode rows' tokens
    fed_logprobs: list[Any] = field(default_factory=list)  # and their logprobs (or None)

    @property
    def decode_rows(self) -> int:
        return sum(len(g.seqs) for g in self.decode)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


def token_values(pending: list) -> list[int]:
    """The ints of pending tokens: rows of sampled arrays (each read once) or ints."""
    read: dict[int, list[int]] = {}
    out = []
    for p in pending:
        if isinstance(p, int):
            out.append(p)
            continue
        array, index = p
        if id(array) not in read:
            read[id(array)] = array.tolist()
        out.append(read[id(array)][index])
    return out


def logprob_values(plan: StepPlan, tokens: list[int]) -> list[TokenLogprob | None]:
    """The reported logprobs of the tokens ``plan`` fed (None where not asked), each
    sequence's alternatives cut to what it asked for, most likely first."""
    read: dict[int, list] = {}
    out: list[TokenLogprob | None] = []
    for (seq, _), token, pending in zip(plan.fed, tokens, plan.fed_logprobs, strict=True):
        if pending is None:
            out.append(None)
            continue
        arrays, row = pending
        if id(arrays) not in read:
            read[id(arrays)] = [a.tolist() for a in arrays]
        values = read[id(arrays)]
        top: tuple[tuple[int, float], ...] = ()
        if len(values) > 1 and seq.request.logprobs:
            ranked = sorted(zip(values[1][row], values[2][row], strict=True), key=lambda t: -t[1])
            top = tuple(ranked[: seq.request.logprobs])
        out.append(TokenLogprob(token, values[0][row], top))
    return out
