"""What the generation loop counts: tokens, finished turns, the decode rate over a window, peak
memory; the :class:`EngineStats` snapshot built from them and the scheduler; and the
:class:`StepRecord` each step listener gets."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from agentkv.engine.request import FinishReason

if TYPE_CHECKING:
    from agentkv.engine.scheduler import Scheduler
    from agentkv.engine.step import StepPlan

log = logging.getLogger(__name__)
_COUNTER = {
    FinishReason.STOP: "completed",
    FinishReason.LENGTH: "completed",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.ERROR: "failed",
}


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot of the engine.

    Attributes:
        active: requests in the batch (prefilling or decoding).
        queued: requests waiting to join, paused ones included.
        batch_size: sequences in the latest step.
        policy: the scheduling policy.
        kv_budget_bytes: the KV memory budget of the batch.
        kv_reserved_bytes: budget set aside for the requests in the batch (each its history
            and prompt, growing as it decodes).
        kv_held_bytes: bytes of the batch's KV buffers now, padding included.
        kv_padding_bytes: of those, bytes no sequence owns (padding and growth room).
        kv_groups: length groups in the batch.
        waiting_for_memory: queued requests that a free slot awaits but the budget does not
            have room for.
        paused: requests preempted and waiting to rejoin.
        kv_paused_bytes: bytes of their caches, in memory outside the budget.
        preemptions: requests preempted since the engine started.
        prefill_tokens_per_step: the prefill token budget of the latest step with decoding
            sequences (sized so their inter-token gap stays bounded).
        tokens_generated: tokens generated since the engine started.
        decode_tps: generated tokens per second over the stats window.
        batch_kv_bits: the precision of the batch's KV (0: the model's).
        kv_token_bytes: K+V bytes one token of history holds in the batch, all layers (while
            the history is within the sliding windows), at that precision.
        drafted_tokens: drafts fed since the engine started (speculative decoding,
            ``agentkv.engine.speculative``).
        accepted_tokens: of them, those kept (each a token generated without a step of its
            own).
    """

    active: int
    queued: int
    batch_size: int
    completed: int
    cancelled: int
    failed: int
    tokens_generated: int
    decode_tps: float
    peak_memory_bytes: int
    policy: str
    kv_budget_bytes: int
    kv_reserved_bytes: int
    kv_held_bytes: int
    kv_padding_bytes: int
    kv_groups: int
    waiting_for_memory: int
    paused: int
    kv_paused_bytes: int
    preemptions: int
    prefill_tokens_per_step: int
    batch_kv_bits: int = 0
    kv_token_bytes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One step, as step listeners see it (``Engine.add_step_listener``).

    ``gap_s`` is the time since the previous step's tokens were reported (0.0 after an idle
    engine): the inter-token gap of the sequences that decoded in both.
    """

    decode_rows: int
    prefill_tokens: int
    prefilling: int
    groups: int
    gap_s: float
    kv_held_bytes: int
    kv_padding_bytes: int
    kv_reserved_bytes: int
    kv_budget_bytes: int


class Meter:
    """The loop's counters (written on the generation thread, read from any)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.listeners: list[Callable[[StepRecord], None]] = []
        self.batch_size = 0  # sequences in the latest step
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._counts: collections.Counter[str] = collections.Counter()
        self._peak_memory = 0

    def tokens(self, n: int) -> None:
        """``n`` tokens were generated now."""
        now = time.perf_counter()
        self._window.append((now, n))
        while now - self._window[0][0] > self.window_s:
            self._window.popleft()
        self._counts["tokens"] += n
        if self._counts["tokens"] % 64 < n:
            self._peak_memory = mx.get_peak_memory()

    def drafted(self, drafted: int, kept: int) -> None:
        """A sequence fed ``drafted`` drafts in a step and ``kept`` of them."""
        self._counts["drafted"] += drafted
        self._counts["accepted"] += kept

    def finished(self, reason: FinishReason) -> None:
        self._counts[_COUNTER[reason]] += 1

    def step(self, plan: StepPlan, gap: float, scheduler: Scheduler) -> None:
        """Tell the step listeners about a step (a failing listener is logged, not raised)."""
        self.batch_size = plan.decode_rows + len(plan.prefill)
        if not self.listeners:
            return
        record = StepRecord(
            decode_rows=plan.decode_rows,
            prefill_tokens=plan.prefill_tokens,
            prefilling=len(plan.prefill),
            groups=len(plan.decode) + len(plan.prefill),
            gap_s=gap,
            kv_held_bytes=scheduler.held_bytes,
            kv_padding_bytes=scheduler.padding_bytes,
            kv_reserved_bytes=scheduler.reserved_bytes,
            kv_budget_bytes=scheduler.budget_bytes,
        )
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("step listener failed")

    def stats(self, scheduler: Scheduler) -> EngineStats:
        now = time.perf_counter()
        window = [(t, n) for t, n in list(self._window) if now - t <= self.window_s]
        span = min(self.window_s, now - window[0][0]) if window else 0.0
        c, s = self._counts, scheduler
        return EngineStats(
            active=len(s.running),
            queued=len(s.queue),
            batch_size=self.batch_size,
            completed=c["completed"],
            cancelled=c["cancelled"],
            failed=c["failed"],
            tokens_generated=c["tokens"],
            decode_tps=sum(n for _, n in window) / span if span > 0 else 0.0,
            peak_memory_bytes=self._peak_memory,
            policy=str(s.policy),
            kv_budget_bytes=s.budget_bytes,
            kv_reserved_bytes=s.reserved_bytes,
            kv_held_bytes=s.held_bytes,
            kv_padding_bytes=s.padding_bytes,
            kv_groups=len(s.groups),
            waiting_for_memory=s.waiting_for_memory,
            paused=s.paused,
            kv_paused_bytes=s.paused_bytes,
            preemptions=s.preemptions,
            prefill_tokens_per_step=s.pacer.last_budget,
            batch_kv_bits=s.layout.bits or 0,
            kv_token_bytes=sum(s.layout.token_bytes),
            drafted_tokens=c["drafted"],
            accepted_tokens=c["accepted"],
        )
