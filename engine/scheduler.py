"""Who runs each step: admission under the KV budget, preemption, prefill chunks, policies.

Every step the scheduler (1) admits waiting turns while a slot and the KV budget allow,
pausing lower-priority turns when a higher-priority one needs their room (``fair`` also
rotates turns that used up their time slice), (2) merges sequences that finished their
prefill into a length group, and (3) picks the prefill chunks that run beside the decode rows,
sized by :class:`PrefillPacer` so decoding turns are not stalled.

Policies (``EngineConfig.policy``):
    fair: turns wait in arrival order; every turn gets its share of steps: prefill tokens are
        split evenly, and when turns are waiting a turn that ran ``FAIR_SLICE_STEPS`` steps is
        paused and goes to the back of the line.
    latency_first: short and new turns first: a prompt's place in line is its arrival plus
        its estimated prefill time; short prompts are prefilled whole at once (prefill before
        decode); the longest-served turns are paused first.
    throughput_first: fill the batch, whole ``prefill_step_size`` chunks for every prompt,
        turns keep their place once running (the youngest are paused first).
A request's ``priority`` (with aging) comes first under every policy.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from engine.config import EngineConfig, Policy
from engine.errors import EngineOverloadedError
from engine.kv_batch import KVGroup, KVLayout, best_group
from engine.runner import StepPlan
from engine.sequence import SeqStatus, Sequence

T = TypeVar("T")

FAIR_SLICE_STEPS = 64  # under `fair`, a turn's steps before it yields to a waiting one
MIN_RUN_STEPS = 8  # a (re)admitted turn runs this many steps before it can be preempted
MIN_CHUNK = 16
PACER_REFRESH_STEPS = 32  # a decode-only step every so often re-measures the decode time
EMA = 0.3


class AdmissionQueue(Generic[T]):
    """Thread-safe priority queue for requests waiting to join the batch.

    Effective priority is ``priority + aging_per_s * (now - arrival)``. Since every waiting
    item ages at the same rate, ordering by ``priority - aging_per_s * arrival`` is the same
    order at any instant, so a plain heap stays correct as time passes. Ties go to the
    earlier arrival.
    """

    def __init__(
        self, max_size: int, aging_per_s: float, clock: Callable[[], float] = time.monotonic
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self._max_size = max_size
        self._aging = aging_per_s
        self._clock = clock
        self._heap: list[tuple[float, float, int, T]] = []
        self._removed: set[int] = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._heap) - len(self._removed)

    def push(
        self, item: T, priority: float, arrival: float | None = None, force: bool = False
    ) -> int:
        """Queue an item; raises EngineOverloadedError at once when the queue is full
        (unless ``force``: a preempted turn always gets its place back)."""
        with self._lock:
            if not force and len(self._heap) - len(self._removed) >= self._max_size:
                raise EngineOverloadedError(
                    f"admission queue is full ({self._max_size} waiting requests); retry later"
                )
            ticket = next(self._ids)
            arrival = self._clock() if arrival is None else arrival
            heapq.heappush(self._heap, (-(priority - self._aging * arrival), arrival, ticket, item))
            return ticket

    def peek(self) -> T | None:
        """The waiting item with the highest effective priority, left in the queue."""
        with self._lock:
            self._drop_removed()
            return self._heap[0][3] if self._heap else None

    def pop(self) -> T | None:
        """Remove and return the waiting item with the highest effective priority, or None."""
        with self._lock:
            self._drop_removed()
            return heapq.heappop(self._heap)[3] if self._heap else None

    def remove(self, ticket: int) -> bool:
        """Drop a waiting item by ticket. Returns False if it was already popped."""
        with self._lock:
            if ticket in self._removed or not any(e[2] == ticket for e in self._heap):
                return False
            self._removed.add(ticket)
            return True

    def drain(self) -> list[T]:
        """Remove and return every waiting item in admission order."""
        items = []
        while (item := self.pop()) is not None:
            items.append(item)
        return items

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2])


class PrefillPacer:
    """Sizes the prefill tokens of a step that also decodes, so decoding sequences'
    inter-token gap stays within ``stall_factor`` times their decode-only step time.

    It learns two figures from the steps it is told about: the time of a decode-only step and
    the time one prefill token adds to a step (which grows as a long prompt's chunks attend to
    more keys), and picks ``(stall_factor - 1) * decode_time / token_time`` tokens.
    """

    def __init__(self, max_chunk: int, stall_factor: float):
        self.max_chunk = max_chunk
        self.stall_factor = stall_factor
        self.decode_s: float | None = None
        self.token_s: float | None = None  # added by one prefill token beside decoding
        self.prefill_token_s = 5e-4  # per prefill token in any step (queue estimates)
        self.mixed_since_decode = 0
        self.last_budget = max_chunk

    def budget(self) -> int:
        """Prefill tokens for the next step with decoding sequences (0: decode only)."""
        if self.decode_s is None or self.mixed_since_decode >= PACER_REFRESH_STEPS:
            return 0
        if self.token_s is None:
            self.last_budget = MIN_CHUNK
        else:
            chunk = (self.stall_factor - 1) * self.decode_s / max(self.token_s, 1e-9)
            self.last_budget = int(min(max(chunk, MIN_CHUNK), self.max_chunk))
        return self.last_budget

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        if prefill_tokens:
            self.prefill_token_s = _ema(self.prefill_token_s, seconds / prefill_tokens)
        if not decode_rows:
            return
        if not prefill_tokens:
            self.decode_s = _ema(self.decode_s, seconds)
            self.mixed_since_decode = 0
            return
        self.mixed_since_decode += 1
        if self.decode_s is not None:
            added = max(seconds - self.decode_s, 0.0) / prefill_tokens
            self.token_s = _ema(self.token_s, added)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)


class Scheduler:
    """The batch's members and their KV groups; decides each step (generation thread, except
    :meth:`enqueue`, :meth:`need` and the stats, which any thread may call)."""

    def __init__(
        self,
        config: EngineConfig,
        layout: KVLayout,
        budget_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.policy = Policy(config.policy)
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.queue: AdmissionQueue[Sequence] = AdmissionQueue(
            config.max_queue_size, config.priority_aging_per_s, clock
        )
        self.pacer = PrefillPacer(config.prefill_step_size, config.max_decode_stall)
        self.running: list[Sequence] = []
        self.groups: list[KVGroup] = []
        self.rejected: list[tuple[Sequence, Exception]] = []  # failed to join; the loop ends them
        self._clock = clock
        self._regroup = False
        self._rotation = 0
        self.reserved_bytes = 0
        self.held_bytes = 0
        self.padding_bytes = 0
        self.waiting_for_memory = 0
        self.paused = 0
        self.preemptions = 0

    # ---- any thread --------------------------------------------------------------------------

    def need(self, seq: Sequence) -> int:
        """KV bytes ``seq`` may hold in the batch: its history + prompt + max_tokens."""
        return self.layout.reservation(seq.final_tokens, self.config.prefill_step_size)

    def enqueue(self, seq: Sequence, arrival: float | None = None, force: bool = False) -> None:
        if arrival is None:
            arrival = self._clock()
            if self.policy is Policy.LATENCY_FIRST:  # shortest expected prefill first
                arrival += len(seq.prompt) * self.pacer.prefill_token_s
        seq.arrival = arrival
        seq.ticket = self.queue.push(seq, seq.request.priority, arrival, force)

    # ---- the generation thread ---------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Admit, preempt and regroup; return the next step's plan."""
        self._admit()
        if self._regroup:
            self._merge_groups()
        decode = [g for g in self.groups if g.seqs[0].status is SeqStatus.DECODING]
        plan = StepPlan(decode, self._prefill_chunks(decoding=bool(decode)))
        self._measure()
        return plan

    def leave(self, seqs: list[Sequence], keep: set[int] | None = None) -> dict[int, list]:
        """Take ``seqs`` out of the batch; returns the caches of those whose ``id`` is in
        ``keep`` (copied out of their groups before the rows go)."""
        caches = {}
        by_group: dict[int, tuple[KVGroup, list[Sequence]]] = {}
        for seq in seqs:
            if keep and id(seq) in keep:
                caches[id(seq)] = seq.group.extract(seq)
            by_group.setdefault(id(seq.group), (seq.group, []))[1].append(seq)
            self.running.remove(seq)
            self.reserved_bytes -= seq.reserved
            seq.reserved = 0
        for group, members in by_group.values():
            group.remove(members)
            if not group.seqs:
                self.groups.remove(group)
            elif group.compact(self.layout):
                self._regroup = True
        self._regroup = self._regroup or len(self.groups) > 1
        return caches

    def drop_batch(self) -> list[Sequence]:
        """Forget every sequence in the batch (after a failed step); returns them."""
        dropped, self.running, self.groups = self.running, [], []
        for seq in dropped:
            seq.group, seq.reserved = None, 0
        self.reserved_bytes = 0
        return dropped

    def dequeue(self, seq: Sequence) -> bool:
        if self.queue.remove(seq.ticket):
            self.paused -= seq.status is SeqStatus.PAUSED
            return True
        return False

    def observe(self, previous: StepPlan, plan: StepPlan, gap: float) -> None:
        """Tell the pacer the time between the reports of two consecutive steps. Steps are
        pipelined (on some backends more than others), so it is charged only when both steps
        had the same shape: decoding alone, or decoding beside similar prefill."""
        tokens = (previous.prefill_tokens + plan.prefill_tokens) / 2
        if bool(previous.prefill_tokens) == bool(plan.prefill_tokens) and (
            not tokens or abs(previous.prefill_tokens - plan.prefill_tokens) <= tokens / 2
        ):
            self.pacer.observe(plan.decode_rows, int(tokens), gap)

    # ---- admission and preemption ------------------------------------------------------------

    def _admit(self) -> None:
        self.waiting_for_memory = 0
        while (head := self.queue.peek()) is not None:
            blocked = self._blocked(head, self.running)
            if blocked and not self._preempt_for(head):
                if blocked == "memory":
                    free = self.config.completion_batch_size - len(self.running)
                    self.waiting_for_memory = min(free, len(self.queue))
                return
            self.queue.pop()
            self.paused -= head.status is SeqStatus.PAUSED
            try:
                self._join(head)
            except Exception as exc:  # e.g. a cache of another model: only this turn fails
                self.rejected.append((head, exc))

    def _blocked(self, seq: Sequence, running: list[Sequence]) -> str | None:
        """Why ``seq`` cannot join a batch of ``running`` now: "slots", "memory" or None."""
        cfg = self.config
        if len(running) >= cfg.completion_batch_size:
            return "slots"
        if seq.prompt and (
            sum(s.status is SeqStatus.PREFILLING for s in running) >= cfg.prefill_batch_size
        ):
            return "slots"
        reserved = sum(s.reserved for s in running)
        if reserved + self.need(seq) > self.budget_bytes:
            return "memory"
        return None

    def _preempt_for(self, head: Sequence) -> bool:
        """Pause the fewest running turns that ``head`` may displace so that it fits."""
        now = self._clock()
        aging = self.config.priority_aging_per_s
        mine = head.priority_at(now, aging)
        victims = []
        for seq in self.running:
            if seq.steps < MIN_RUN_STEPS:
                continue
            outranked = seq.priority_at(now, aging) < mine
            slice_over = (
                self.policy is Policy.FAIR
                and seq.steps >= FAIR_SLICE_STEPS
                and seq.request.priority <= head.request.priority
            )
            if outranked or slice_over:
                victims.append(seq)
        victims.sort(key=lambda s: (s.priority_at(now, aging), self._victim_order(s)))
        remaining, chosen = list(self.running), []
        for victim in victims:
            if not self._blocked(head, remaining):
                break
            remaining.remove(victim)
            chosen.append(victim)
        if not chosen or self._blocked(head, remaining):
            return False
        for victim in chosen:
            self._pause(victim, rotate=victim.priority_at(now, aging) >= mine)
        return True

    def _victim_order(self, seq: Sequence) -> float:
        if self.policy is Policy.THROUGHPUT_FIRST:
            return -seq.arrival  # keep the longest-running
        return -seq.steps  # the most served first

    def _pause(self, seq: Sequence, rotate: bool) -> None:
        """Move ``seq`` out of the batch with its cache and pending token, to rejoin later
        exactly where it was. ``rotate``: a fair time slice, so it queues at the back."""
        if isinstance(seq.pending, tuple):
            array, index = seq.pending
            seq.pending = int(array[index].item())
        seq.cache = self.leave([seq], keep={id(seq)})[id(seq)]
        seq.status = SeqStatus.PAUSED
        seq.preemptions += 1
        self.preemptions += 1
        self.paused += 1
        self.enqueue(seq, arrival=None if rotate else seq.arrival, force=True)

    def _join(self, seq: Sequence) -> None:
        group = KVGroup.start(self.layout, seq, seq.cache)
        seq.cache = None
        seq.reserved = self.need(seq)
        self.reserved_bytes += seq.reserved
        seq.status = SeqStatus.PREFILLING if seq.prompt else SeqStatus.DECODING
        seq.steps = 0
        self.running.append(seq)
        self.groups.append(group)
        self._regroup = True
        if seq.stats.admitted_at is None:
            seq.stats.admitted_at = time.perf_counter()

    # ---- groups and chunks -------------------------------------------------------------------

    def _merge_groups(self) -> None:
        """Merge decode groups (smallest first) into the group they pad least, within the
        tolerance: fewer groups, fewer attention calls per layer."""
        self._regroup = False
        decoding = [g for g in self.groups if g.seqs[0].status is SeqStatus.DECODING]
        for group in sorted(decoding, key=lambda g: len(g.seqs)):
            others = [g for g in decoding if g is not group and g.seqs]
            if not group.seqs or not others:
                continue
            target = best_group(self.layout, others, group.lengths)
            if target is not None:
                target.absorb(group)
                self.groups.remove(group)

    def _prefill_chunks(self, decoding: bool) -> list[tuple[Sequence, int]]:
        prefilling = [s for s in self.running if s.status is SeqStatus.PREFILLING]
        if not prefilling:
            return []
        step = self.config.prefill_step_size
        if not decoding or self.policy is Policy.THROUGHPUT_FIRST:
            chunks = [(s, min(len(s.prompt), step)) for s in prefilling]
        else:
            chunks = self._paced_chunks(prefilling, self.pacer.budget())
        if any(n == len(s.prompt) for s, n in chunks):
            self._regroup = True  # decoding next step: it may join a group
        return chunks

    def _paced_chunks(self, prefilling: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """Split a step's prefill ``budget`` (0: a decode-only step to re-measure): shortest
        prompt first, a short one whole, under latency_first; under fair every prefilling turn
        gets an even share, at least ``MIN_CHUNK``, so each keeps moving."""
        if not budget:
            return []
        if self.policy is Policy.LATENCY_FIRST:
            prefilling.sort(key=lambda s: len(s.prompt))
            if len(prefilling[0].prompt) <= self.config.prefill_step_size:
                budget = max(budget, len(prefilling[0].prompt))
            chunks = []
            for seq in prefilling:
                if budget <= 0:
                    break
                chunks.append((seq, min(len(seq.prompt), budget)))
                budget -= chunks[-1][1]
            return chunks
        share = max(MIN_CHUNK, budget // len(prefilling))
        return [(s, min(len(s.prompt), share)) for s in prefilling]

    def _measure(self) -> None:
        self.held_bytes = sum(g.held_bytes for g in self.groups)
        owned = sum(self.layout.owned_bytes(len(s.tokens)) for s in self.running)
        self.padding_bytes = max(0, self.held_bytes - owned)
