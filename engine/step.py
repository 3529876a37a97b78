"""One step of the batch: what the scheduler hands the runner (:class:`StepPlan`), and the
values of what it fed, read back on the host once (the tokens, their logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from agentkv.engine.mlxlm import drop_newest
from agentkv.engine.request import TokenLogprob
from agentkv.engine.speculative import kept_drafts

if TYPE_CHECKING:
    from agentkv.engine.batch.groups import KVGroup
    from agentkv.engine.sequence import Sequence


@dataclass(slots=True)
class StepPlan:
    """What one step runs: every row of ``decode`` groups decodes one token, and each
    ``(sequence, n)`` of ``prefill`` feeds the next ``n`` tokens of its prompt."""

    decode: list[KVGroup]
    prefill: list[tuple[Sequence, int]]
    verify: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    """Sequences feeding their pending token and drafts (each alone in its group)."""
    fed: list[tuple[Sequence, Any]] = field(default_factory=list)  # decode rows' tokens
    fed_logprobs: list[Any] = field(default_factory=list)  # and their logprobs (or None)

    @property
    def decode_rows(self) -> int:
        """Sequences decoding (drafting or not)."""
        return sum(len(g.seqs) for g in self.decode) + len(self.verify)

    @property
    def draft_rows(self) -> int:
        return sum(len(drafts) for _, drafts in self.verify)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill and not self.verify


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


def drafted(decode: list[KVGroup]) -> tuple[list[KVGroup], list[tuple[Sequence, list[int]]]]:
    """The decode groups, less the sequences (each alone in its group) that feed drafts this
    step, and those with their drafts (``agentkv.engine.speculative``)."""
    plain, verify = [], []
    for group in decode:
        seq = group.seqs[0]
        if not seq.drafting or len(group.seqs) > 1:
            plain.append(group)
            continue
        known = seq.pending if isinstance(seq.pending, int) else None  # (else in flight)
        room = seq.max_tokens - len(seq.token_ids) - 1  # (fed: the pending, then drafts)
        drafts = seq.spec.propose(seq.tokens, known, room)
        if known is None:
            drafts = drafts[1:]  # after the token expected next, which is the one computed
        if drafts:
            verify.append((seq, drafts))
        else:
            plain.append(group)
    return plain, verify


def verify(plan: StepPlan) -> tuple[int, int]:
    """Keep each drafting sequence's drafts up to the first that differs from the token
    chosen before it (``agentkv.engine.speculative``; its samples evaluated): the kept ones
    join ``plan.fed``, the token chosen after them is its pending one, the rest leave its KV.
    Returns the drafts fed and kept, all sequences together."""
    fed = kept_all = 0
    for seq, drafts in plan.verify:
        samples, first = seq.verify
        chosen = samples[first : first + len(drafts) + 1].tolist()
        kept = kept_drafts(drafts, chosen)
        seq.spec.settle(len(drafts), kept)
        seq.stats.drafted_tokens += len(drafts)
        seq.stats.accepted_tokens += kept
        if seq.spec.predicted:
            seq.stats.accepted_prediction_tokens += kept
        plan.fed += [(seq, token) for token in drafts[:kept]]
        plan.fed_logprobs += [None] * kept
        seq.pending, seq.verify = chosen[kept], None
        drop_newest_of(seq, len(drafts) - kept)
        fed, kept_all = fed + len(drafts), kept_all + kept
    return fed, kept_all


def count_steps(plan: StepPlan, after_end: dict[int, int]) -> int:
    """Count the step for every sequence ``plan`` fed or prefilled, and take back the kept
    drafts a sequence fed after its reply ended (a stop string, max_tokens, its end token;
    ``after_end``: id of the sequence -> how many): they leave its KV and its counts, not
    being tokens of it. Returns how many there were."""
    total = 0
    for seq in {id(s): s for s, _ in plan.fed}.values():
        seq.steps += 1
        if n := after_end.get(id(seq), 0):
            drop_newest_of(seq, n)
            seq.stats.accepted_tokens -= n
            if seq.spec is not None and seq.spec.predicted:
                seq.stats.accepted_prediction_tokens -= n
            total += n
    for seq, _ in plan.prefill:
        seq.steps += 1
    return total


def drop_newest_of(seq: Sequence, n: int) -> None:
    """Drop the ``n`` newest positions of a drafting sequence's KV (alone in its group)."""
    if n:
        for layer in seq.group.layers:
            drop_newest(layer, n)


def join_inputs(pending: list[Any], chunks: list[list[Any]]) -> mx.array:
    """The step's input tokens: each decode row's pending token (a row of the array it was
    sampled in, or an int), then the drafting rows' and the prefill chunks' tokens (a
    drafting row's first: its pending token). Runs of one array are sliced once."""
    parts: list[mx.array] = []
    run: tuple[mx.array, int, int] | None = None  # (array, first index, last index)
    ints: list[int] = []

    def flush() -> None:
        nonlocal run
        if ints:
            parts.append(mx.array(ints, dtype=mx.uint32))
            ints.clear()
        if run is not None:
            array, first, last = run
            parts.append(
                array if first == 0 and last == array.size - 1 else array[first : last + 1]
            )
            run = None

    for p in [*pending, *(t for chunk in chunks for t in chunk)]:
        if isinstance(p, int):
            if run is not None:
                flush()
            ints.append(p)
            continue
        array, index = p
        if run is not None and run[0] is array and run[2] == index - 1:
            run = (array, run[1], index)
            continue
        flush()
        run = (array, index, index)
    flush()
    return parts[0] if len(parts) == 1 else mx.concatenate([p.astype(mx.uint32) for p in parts])
