"""Who runs each step: admission under the KV budget, preemption, prefill chunks, policies.

Every step the scheduler (1) admits waiting turns while a slot and the KV budget allow,
pausing lower-priority turns when a higher-priority one needs their room (``fair`` also
rotates turns that used up their time slice), (2) merges sequences that finished their
prefill into a length group, and (3) picks the prefill chunks, sized by :class:`PrefillPacer`.

Policies (``EngineConfig.policy``):
    fair: turns wait in arrival order; every turn gets its share of steps: prefill tokens are
        split evenly, and when turns are waiting a turn that ran ``FAIR_SLICE_STEPS`` steps is
        paused and goes to the back of the line, where it waits as long before it takes
        anyone's place (round robin).
    latency_first: short and new turns first: a turn's place in line is its arrival plus its
        expected work (prefill, and decode up to its max_tokens or ``EXPECTED_REPLY_TOKENS``),
        so a new short turn displaces a long one that has run a few steps; short prompts are
        prefilled whole (prefill before decode).
    throughput_first: fill the batch, a whole ``prefill_step_size`` chunk for every prompt
        every step, turns keep their place once running (the youngest are paused first).
A request's ``priority`` (with aging) comes first under every policy; the place in line above
counts as its arrival time, from which its priority ages.

Memory: a turn reserves KV for what it holds after its next step (its prompt whole) and a
buffer growth beyond (:meth:`Scheduler.reserve_tokens`), never past its ``max_tokens``, and
its reservation grows as it decodes. When the budget has no room for a turn's next growth, the
turns last in line (lowest priority, then latest arrival) are paused, the growing one itself
when it is last: a paused turn rejoins where it was once its reservation fits. A turn is never
given more ``max_tokens`` than the budget holds for it alone (``Engine.submit``), so every turn
that fits alone finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agentkv.engine.admission import AdmissionQueue
from agentkv.engine.batch.buffers import growth
from agentkv.engine.batch.groups import KVGroup, best_group
from agentkv.engine.batch.layout import KVLayout
from agentkv.engine.config import EngineConfig, Policy
from agentkv.engine.pacing import MIN_CHUNK, PrefillPacer
from agentkv.engine.request import layer_nbytes
from agentkv.engine.sequence import SeqStatus, Sequence
from agentkv.engine.step import StepPlan, drafted

FAIR_SLICE_STEPS = 64  # under `fair`, a turn's steps before it yields to a waiting one
MIN_RUN_STEPS = 8  # a (re)admitted turn runs this many steps before it can be preempted
EXPECTED_REPLY_TOKENS = 512  # latency_first: the decode a turn is expected to run at most


class Scheduler:
    """The batch's members and their KV groups; decides each step (generation thread, except
    :meth:`enqueue`, :meth:`need` and the stats, which any thread may call)."""

    def __init__(
        self,
        config: EngineConfig,
        layout: KVLayout,
        budget_bytes: int,
        first_positions: Callable[[int], list] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``first_positions``: per layer, the keys and values a sequence starting with a
        token holds at its first position (``ModelRunner.first_positions``: what a q4 batch's
        global layers read in float, asked when the layout reads them)."""
        self.config = config
        self.first_positions = first_positions
        self.policy = Policy(config.policy)
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.queue: AdmissionQueue[Sequence] = AdmissionQueue(
            config.max_queue_size, config.priority_aging_per_s, clock
        )
        self.pacer = PrefillPacer(config)
        self.running: list[Sequence] = []
        self.groups: list[KVGroup] = []
        self.rejected: list[tuple[Sequence, Exception]] = []  # failed to join; the loop ends them
        self._clock = clock
        self._regroup = False
        self._rotation = 0  # fair: where the next step's prefill turns start
        self.steps = 0
        self.reserved_bytes = 0
        self.held_bytes = 0
        self.padding_bytes = 0
        self.waiting_for_memory = 0
        self.paused = 0
        self.paused_bytes = 0  # caches of paused turns: in memory, outside the budget
        self.preemptions = 0

    # ---- any thread --------------------------------------------------------------------------

    def need(self, seq: Sequence) -> int:
        """KV bytes ``seq`` reserves joining the batch now (``seq.cache`` while it is outside
        it): for :meth:`reserve_tokens`."""
        return self.need_for(self.reserve_tokens(seq), seq.cache, len(seq.prompt))

    @staticmethod
    def reserve_tokens(seq: Sequence) -> int:
        """The tokens a turn's reservation covers from now: what it holds after its whole
        prompt and next step, and a buffer growth beyond, at most its final length."""
        after = seq.tokens_after(1)
        return min(seq.final_tokens, after + growth(after))

    def need_for(self, final_tokens: int, layers: list | None, prompt: int) -> int:
        """KV bytes a turn holding at most ``final_tokens`` (history + prompt + generated)
        may hold in the batch, with its sliding windows' overhang (``KVLayout.overhang``)
        from its cache's ``layers`` and the ``prompt`` tokens it has still to feed."""
        overhang = self.layout.overhang(layers, prompt, self.config.prefill_step_size)
        return self.layout.reservation(final_tokens, overhang)

    def capacity(self, layers: list | None, prompt: int) -> int:
        """The most tokens (history + prompt + generated) a turn can hold in the budget
        alone (see ``need_for``)."""
        overhang = self.layout.overhang(layers, prompt, self.config.prefill_step_size)
        return self.layout.capacity(self.budget_bytes, overhang)

    def enqueue(self, seq: Sequence, arrival: float | None = None, force: bool = False) -> None:
        if arrival is None:
            arrival = self._clock()
            if self.policy is Policy.LATENCY_FIRST:  # shortest expected work first
                new_tokens = min(seq.max_tokens, EXPECTED_REPLY_TOKENS) - len(seq.token_ids)
                arrival += self.pacer.expected_seconds(len(seq.prompt), new_tokens)
        seq.arrival = arrival
        seq.queued_step = self.steps
        seq.ticket = self.queue.push(seq, seq.request.priority, arrival, force)

    # ---- the generation thread ---------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Admit, preempt and regroup; return the next step's plan."""
        self.steps += 1
        self._grow()
        self._admit()
        if self._regroup:
            self._merge_groups()
        decode = [g for g in self.groups if g.seqs[0].status is SeqStatus.DECODING]
        decode, verify = drafted(decode)
        for group in decode:  # one that stopped drafting may join a group of its length now
            spec = group.seqs[0].spec
            if spec is not None and spec.stopped:
                spec.stopped, self._regroup = False, True
        plan = StepPlan(decode, self._prefill_chunks(decoding=bool(decode or verify)), verify)
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
            self.reserved_bytes, seq.reserved = self.reserved_bytes - seq.reserved, 0
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
        dropped, self.running, self.groups, self.reserved_bytes = self.running, [], [], 0
        for seq in dropped:
            seq.group, seq.reserved = None, 0
        return dropped

    def dequeue(self, seq: Sequence) -> bool:
        if self.queue.remove(seq.ticket):
            self._unpause(seq)
            return True
        return False

    def observe(self, previous: StepPlan | None, plan: StepPlan, gap: float) -> None:
        """Tell the pacer a step's time: after a ``previous`` step, ``gap`` between their
        reports (pipelined: charged only when both had one shape, decoding alone or beside
        similar prefill); else what ``plan`` took alone (a step verifying drafts)."""
        if previous is None:
            return self.pacer.observe(plan.decode_rows, plan.prefill_tokens, gap)
        tokens = (previous.prefill_tokens + plan.prefill_tokens) / 2
        if bool(previous.prefill_tokens) == bool(plan.prefill_tokens) and (
            not tokens or abs(previous.prefill_tokens - plan.prefill_tokens) <= tokens / 2
        ):
            self.pacer.observe(plan.decode_rows, int(tokens), gap)

    # ---- admission and preemption ------------------------------------------------------------

    def _grow(self) -> None:
        """Extend the reservation of each turn whose next step would pass it, pausing the
        turns last in line where the budget has no room."""
        for seq in list(self.running):
            if seq.group is None or seq.tokens_after(1) <= seq.reserved_tokens:
                continue  # paused meanwhile, or covered
            tokens = self.reserve_tokens(seq)
            more = self.need_for(tokens, None, len(seq.prompt)) - seq.reserved
            if self.reserved_bytes + more > self.budget_bytes and not self._make_room(seq, more):
                continue  # seq itself was paused
            seq.reserved += more
            seq.reserved_tokens = tokens
            self.reserved_bytes += more

    def _make_room(self, growing: Sequence, more: int) -> bool:
        """Pause running turns, last in line first, until ``more`` bytes fit; False when
        ``growing`` itself was paused (it was last in line)."""
        now, aging = self._clock(), self.config.priority_aging_per_s
        for seq in sorted(self.running, key=lambda s: s.rank(now, aging)):
            if self.reserved_bytes + more <= self.budget_bytes:
                break
            self._pause(seq, rotate=False)
            if seq is growing:
                return False
        return True

    def _admit(self) -> None:
        self.waiting_for_memory = 0
        while (head := self.queue.peek()) is not None:
            blocked = self._blocked(head, self.running)
            if blocked and not self._preempt_for(head):
                if blocked == "memory":
                    free = self.config.completion_batch_size - len(self.running)
                    self.waiting_for_memory = min(free, len(self.queue))
                return
            if not self.queue.remove(head.ticket):
                continue  # cancelled meanwhile (the asyncio side may dequeue at any time)
            self._unpause(head)
            try:
                self._join(head)
            except Exception as exc:  # e.g. a cache of another model: only this turn fails
                self.rejected.append((head, exc))

    def _blocked(self, seq: Sequence, running: list[Sequence]) -> str | None:
        """Why ``seq`` cannot join a batch of ``running`` now: no free "slot", no free
        "prefill" slot, no "memory" in the budget; None when it can."""
        cfg = self.config
        if len(running) >= cfg.completion_batch_size:
            return "slot"
        if seq.prompt and (
            sum(s.status is SeqStatus.PREFILLING for s in running) >= cfg.prefill_batch_size
        ):
            return "prefill"
        if sum(s.reserved for s in running) + self.need(seq) > self.budget_bytes:
            return "memory"
        return None

    def _preempt_for(self, head: Sequence) -> bool:
        """Pause the fewest running turns that ``head`` may displace so that it fits."""
        now = self._clock()
        aging = self.config.priority_aging_per_s
        mine = head.rank(now, aging)
        # Round robin: a turn that was itself paused waits a whole slice before it takes
        # anyone's place for theirs (else one rotation would cascade through the batch).
        rotates = self.policy is Policy.FAIR and (
            not head.preemptions or self.steps - head.queued_step >= FAIR_SLICE_STEPS
        )
        victims = []
        for seq in self.running:
            if seq.steps < MIN_RUN_STEPS:
                continue
            outranked = seq.rank(now, aging) < mine
            slice_over = (
                rotates
                and seq.steps >= FAIR_SLICE_STEPS
                and seq.request.priority <= head.request.priority
            )
            if outranked or slice_over:
                victims.append(seq)
        # The lowest request priority first (not the aged one: a few ms of arrival must not
        # outweigh the policy's order), then the policy's order.
        victims.sort(key=lambda s: (s.request.priority, self._victim_order(s)))
        remaining, chosen = list(self.running), []
        while reason := self._blocked(head, remaining):
            frees = [  # only a prefilling turn frees a prefill slot
                v
                for v in victims
                if v not in chosen and (reason != "prefill" or v.status is SeqStatus.PREFILLING)
            ]
            if not frees:
                return False
            remaining.remove(frees[0])
            chosen.append(frees[0])
        for victim in chosen:
            self._pause(victim, rotate=victim.rank(now, aging) >= mine)
        return bool(chosen)

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
        self.paused_bytes += sum(layer_nbytes(layer) for layer in seq.cache)
        self.enqueue(seq, arrival=None if rotate else seq.arrival, force=True)

    def _unpause(self, seq: Sequence) -> None:
        """``seq`` left the queue: it no longer counts as paused."""
        if seq.status is SeqStatus.PAUSED:
            self.paused -= 1
            self.paused_bytes -= sum(layer_nbytes(layer) for layer in seq.cache)

    def _join(self, seq: Sequence) -> None:
        tokens = seq.tokens or seq.prompt
        first = None
        if self.first_positions is not None and tokens and self.layout.reads_first_positions:
            first = self.first_positions(tokens[0])
        group = KVGroup.start(self.layout, seq, seq.cache, first)
        seq.reserved = self.need(seq)
        seq.reserved_tokens = self.reserve_tokens(seq)
        seq.cache = None
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
        # A group whose last prompt chunk left its rings over their windows waits a step.
        settled = [g for g in decoding if g.settled]
        if len(settled) < len(decoding):
            self._regroup = True
        decoding = [g for g in settled if not g.seqs[0].drafting]  # (each alone meanwhile)
        for group in sorted(decoding, key=lambda g: len(g.seqs)):
            others = [g for g in decoding if g is not group and g.seqs]
            if not group.seqs or not others:
                continue
            target = best_group(self.layout, others, group.lengths)
            if target is not None:
                target.absorb(group)
                self.groups.remove(group)

    def _prefill_chunks(self, decoding: bool) -> list[tuple[Sequence, int]]:
        prefilling = [s for s in self.running if s.status is SeqStatus.PREFILLING and s.feedable()]
        if not prefilling:
            return []
        if self.policy is Policy.THROUGHPUT_FIRST:  # every prompt a whole chunk each step
            chunks = [(s, min(s.feedable(), self.config.prefill_step_size)) for s in prefilling]
        else:  # paced beside decoders; alone ~max_prefill_step_s, so newcomers start soon
            chunks = self._paced_chunks(prefilling, self.pacer.budget(decoding))
        chunks = [(s, s.chunk_within(n, self.layout.windowed)) for s, n in chunks]
        if any(n == len(s.prompt) for s, n in chunks):
            self._regroup = True  # decoding next step: it may join a group
        return chunks

    def _paced_chunks(self, prefilling: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """Split a step's prefill ``budget`` (0: a decode-only step to re-measure the pacer):
        shortest prompt first, a short one whole, under latency_first; under fair an even share
        each, at least ``MIN_CHUNK`` (what a short one leaves to the longer ones)."""
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
                chunks.append((seq, min(seq.feedable(), budget)))
                budget -= chunks[-1][1]
            return chunks
        # fair: an even share each; when the budget has not MIN_CHUNK for every prompt, it goes
        # to as many as it has, in turn.
        k = min(len(prefilling), max(1, budget // MIN_CHUNK))
        if k < len(prefilling):
            start = self._rotation % len(prefilling)
            self._rotation = start + k
            prefilling = (prefilling[start:] + prefilling[:start])[:k]
        sizes, left = {}, budget
        for i, seq in enumerate(sorted(prefilling, key=lambda s: s.feedable())):
            sizes[id(seq)] = min(seq.feedable(), max(MIN_CHUNK, left // (k - i)))
            left -= sizes[id(seq)]
        return [(s, sizes[id(s)]) for s in prefilling]

    def _measure(self) -> None:
        self.held_bytes = sum(g.held_bytes for g in self.groups)
        owned = sum(self.layout.owned_bytes(len(s.tokens)) for s in self.running)
        self.padding_bytes = max(0, self.held_bytes - owned)
