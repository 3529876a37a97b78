"""The generation thread: the only thread that touches MLX.

Each turn of the loop reads as a sentence: run commands (cancels, calls), let the scheduler
plan a step (admit, preempt, group, pick prefill chunks), run it, report the tokens the step
fed, and finish the sequences that ended. New requests join at the next step boundary; nothing
waits for the batch to drain.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit

from agentkv.engine.batch.budget import budget_bytes
from agentkv.engine.batch.buffers import held_arrays
from agentkv.engine.batch.rows import is_packed
from agentkv.engine.config import EngineConfig
from agentkv.engine.cuts import Cuts
from agentkv.engine.drafter import DraftModel, load_drafter
from agentkv.engine.errors import EngineClosedError
from agentkv.engine.meter import EngineStats, Meter
from agentkv.engine.models.loading import LoadedModel, load_model
from agentkv.engine.request import (
    FinishReason,
    GenerationResult,
    PromptCache,
    TokenEvent,
    TokenLogprob,
)
from agentkv.engine.runner import ModelRunner
from agentkv.engine.scheduler import Scheduler
from agentkv.engine.sequence import SeqStatus, Sequence
from agentkv.engine.step import StepPlan, count_steps, logprob_values, token_values, verify

log = logging.getLogger(__name__)
CLEAR_CACHE_STEPS = 256  # hand MLX's freed buffers back this often (and after prefill)


def _deliver(items: list[tuple[object, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class GenerationLoop(threading.Thread):
    """Owns the model and the batch; serves requests until stopped."""

    def __init__(self, model_spec: str, config: EngineConfig):
        super().__init__(name="agentkv-generation", daemon=True)
        self.config = config
        self._model_spec = model_spec
        self.model: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Event()
        self._stopping: str | None = None  # None, "drain" or "cancel"
        self._outbox: dict[object, list[tuple[object, object]]] = {}
        self.meter = Meter(config.stats_window_s)
        self._steps = 0
        # The step queued last (its plan, arrays to wait on); when the step before reported.
        self._in_flight: tuple[StepPlan, list] | None = None
        self._done_at: float | None = None
        self.runner: ModelRunner | None = None
        self.drafter: DraftModel | None = None  # (EngineConfig.draft_model)
        self.cuts = Cuts()  # cuts asked of running requests (RequestHandle.cut)

    # ---- called from other threads -------------------------------------------------------

    def wait_ready(self) -> LoadedModel:
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        assert self.model is not None
        return self.model

    def submit(self, seq: Sequence) -> None:
        if self._stopping or not self.is_alive():
            raise EngineClosedError("the engine is closing and takes no new requests")
        self.scheduler.enqueue(seq)
        self._wake.set()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this thread at the next step boundary."""
        if not self.is_alive():
            raise EngineClosedError("the generation thread is not running")
        self._commands.append(fn)
        self._wake.set()

    def cancel(
        self, seq: Sequence, keep_cache: bool = False, error: Exception | None = None
    ) -> None:
        """End ``seq`` at the next step boundary: cancelled, or failed with ``error``."""
        if not seq.is_finished and self.is_alive():
            self.call_soon(lambda: self._cancel(seq, keep_cache, error))

    def stop(self, drain: bool) -> None:
        self._stopping = "drain" if drain else "cancel"
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.meter.stats(self.scheduler)

    # ---- the generation thread -----------------------------------------------------------

    def run(self) -> None:
        try:
            self.model = load_model(self._model_spec)
            kv = (self.config.batch_kv_bits, self.config.batch_group_size)
            self.runner = ModelRunner(self.model.model, *kv, self.model.vision)
            self.runner.block_tokens = self.config.cache_block_tokens
            self.drafter = load_drafter(self.config, self.model, self.runner.can_draft)
            self.scheduler = Scheduler(
                self.config,
                self.runner.layout,
                budget_bytes(self.config.kv_budget_bytes, self.runner.layout),
                self.runner.first_positions,
            )
        except BaseException as exc:  # surfaced to the opener by wait_ready()
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            # mlx-lm's generation stream and wired memory limit (Apple), as its generators use.
            with wired_limit(self.model.model, [generation_stream]), mx.stream(generation_stream):
                self._serve()
        except BaseException as exc:
            # A bug, not a request's fault: fail everything so no caller waits forever.
            log.exception("the generation loop failed; failing every request")
            self._stopping = "cancel"
            self._fail_everything(exc)
            self._run_commands()  # pending run() calls and cancels still get their answer
        finally:
            self.cuts.drop()
            self._flush_outbox()

    def _serve(self) -> None:
        while True:
            self._run_commands()
            self.cuts.serve(self._whole)
            if self._stopping == "cancel" or (self._stopping and not self._has_work()):
                self._cancel_everything()
                return
            try:
                plan = self.scheduler.schedule()
            except Exception as exc:  # e.g. out of memory copying a group: as a failed step
                self._fail_batch(exc, "scheduling a step failed")
                continue
            for seq, exc in self.scheduler.rejected:
                self._finish(seq, FinishReason.ERROR, error=exc)
            self.scheduler.rejected.clear()
            if plan.is_empty:
                self.meter.batch_size, self._in_flight, self._done_at = 0, None, None
                self._flush_outbox()
                self._wake.clear()
                if not (self._commands or len(self.scheduler.queue) or self._stopping):
                    self._wake.wait(timeout=1.0)
                continue
            self._step(plan)
            self._flush_outbox()

    def _has_work(self) -> bool:
        return bool(self.scheduler.running or len(self.scheduler.queue) or self._commands)

    def _run_commands(self) -> None:
        while self._commands:
            fn = self._commands.popleft()
            try:
                fn()
            except Exception:  # commands report their own errors; never kill the loop
                log.exception("engine command failed")

    def _emit(self, seq: Sequence, item: TokenEvent | GenerationResult) -> None:
        self._outbox.setdefault(seq.loop, []).append((seq.events, item))

    def _flush_outbox(self) -> None:
        """One wake-up per caller event loop per step, not one per token."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            with contextlib.suppress(RuntimeError):  # a closed event loop has no listener
                loop.call_soon_threadsafe(_deliver, items)

    # ---- stepping ----------------------------------------------------------------------------

    def _step(self, plan: StepPlan) -> None:
        """Queue ``plan``, wait for the step before it, then report the tokens ``plan`` fed
        (sampled by that step): the host's work overlaps the next step's computation."""
        try:
            began = time.perf_counter()
            sampled = self.runner.run(plan)
            marker = [] if sampled is None else [sampled]
            layers = [layer for seq, _ in plan.prefill for layer in seq.group.layers]
            marker += [x for layer in layers for x in held_arrays(layer)[:1]]
            flight, self._in_flight = self._in_flight, (plan, marker)
            if flight is not None:
                mx.eval(flight[1])
                began = time.perf_counter()  # this step's computation starts
            drafts = (0, 0)
            if plan.verify:  # its drafts are checked now: nothing is left in flight
                mx.eval(marker)
                self._in_flight, took = None, time.perf_counter() - began
                drafts = verify(plan)
            tokens = token_values([p for _, p in plan.fed])
            logprobs = logprob_values(plan, tokens)
        except Exception as exc:
            self._fail_batch(exc, "generation step failed")
            return
        now = time.perf_counter()
        gap = 0.0
        if flight is not None and self._done_at is not None:
            gap = now - self._done_at  # what a decoding sequence waited for this token
        if plan.verify:  # run to its end before the next step was queued: its own time
            self.scheduler.observe(None, plan, took)
        elif gap:
            self.scheduler.observe(flight[0], plan, gap)
        self._done_at = now
        self.meter.step(plan, gap, self.scheduler)
        self._steps += 1
        if plan.prefill_tokens >= self.config.prefill_step_size or (
            self._steps % CLEAR_CACHE_STEPS == 0
        ):
            mx.clear_cache()
        if tokens:
            self.meter.tokens(len(tokens))
        after_end = self._report(plan, tokens, logprobs, now)
        if plan.verify:
            self.meter.drafted(drafts[0], drafts[1] - after_end)

    def _fail_batch(self, exc: Exception, what: str) -> None:
        """The batch's state is unknown after a failure inside a step: fail every turn in it
        (waiting turns stay queued), start afresh."""
        dropped = self.scheduler.drop_batch()
        log.exception("%s; failing the %d requests in the batch", what, len(dropped))
        self._in_flight = self._done_at = None
        if self.model.vision is not None:  # (deepstack features the step staged)
            self.model.vision.staged.clear()
        for seq in dropped:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ERROR, error=exc)

    def _report(
        self,
        plan: StepPlan,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
    ) -> int:
        """Hand each sequence the tokens ``plan`` fed, finish those that ended and take them
        out of the batch. Returns the kept drafts fed after a reply's end (not its tokens)."""
        ended: list[tuple[Sequence, FinishReason]] = []
        failed: list[tuple[Sequence, Exception]] = []
        eos = self.model.eos_token_ids
        done: dict[int, int] = {}  # ended sequences -> their tokens fed after the end
        for (seq, _), token, logprob in zip(plan.fed, tokens, logprobs, strict=True):
            if id(seq) in done:  # a kept draft after its end (a stop, max_tokens)
                done[id(seq)] += 1
                continue
            seq.tokens.append(token)
            reason = None
            if len(seq.token_ids) + 1 >= seq.max_tokens:
                reason = FinishReason.LENGTH
            if token in eos and not seq.request.ignore_eos:
                reason = FinishReason.STOP
            try:
                hit = self._on_token(seq, token, logprob, reason, now)
            except Exception as exc:
                failed.append((seq, exc))
                done[id(seq)] = 0
                continue
            if reason is not None or hit:
                ended.append((seq, reason or FinishReason.STOP))
                done[id(seq)] = 0
        after_end = count_steps(plan, done)
        if not (ended or failed):
            return after_end
        keep = {id(s) for s, _ in ended if s.request.return_cache}
        try:
            caches = self.scheduler.leave([s for s, _ in ended] + [s for s, _ in failed], keep)
        except Exception as exc:
            self._fail_batch(exc, "taking finished turns out of the batch failed")
            return after_end
        for seq, reason in ended:
            layers = caches.get(id(seq))
            cache = self._cache(layers, list(seq.tokens)) if layers else None
            if cache is not None and (points := seq.checkpoints()):
                cache = dataclasses.replace(cache, checkpoints=points)
            self._finish(seq, reason, cache)
        for seq, exc in failed:
            self._finish(seq, FinishReason.ERROR, error=exc)
        return after_end

    def _on_token(
        self,
        seq: Sequence,
        token: int,
        logprob: TokenLogprob | None,
        finish: str | None,
        now: float,
    ) -> bool:
        """Record one token; returns True when a stop string completed."""
        if seq.stats.first_token_at is None:
            seq.stats.first_token_at = now
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        seq.stats.decode_tokens += 1
        if not (finish == "stop" and token in self.model.eos_token_ids):
            seq.detokenizer.add_token(token)
        if finish is not None:
            seq.detokenizer.finalize()
        text, hit = seq.stops.feed(seq.detokenizer.last_segment)
        if finish is not None and not hit:
            text += seq.stops.flush()
        seq.text_parts.append(text)
        self._emit(seq, TokenEvent(token, text, logprob))
        return hit

    # ---- leaving -----------------------------------------------------------------------------

    def _cache(self, layers: list, tokens: list[int]) -> PromptCache:
        """A finished sequence's cache as the batch held it: rows held quantized stay packed,
        without a q8 row's float copies of its newest positions or a q4 row's float first
        one (a file stores neither; every tier resumes alike: ``ModelRunner.first_positions``)."""
        packing = self.runner.layout.packing
        packed = packing is not None and any(is_packed(row) for row in layers)
        if packed:
            for i, row in enumerate(layers):
                if is_packed(row) and not packing.channel_keys(i):
                    row.recent = None
                row.first_kv = None
        return PromptCache(layers, tokens, packing=packing if packed else None)

    def _whole(self, seq: Sequence) -> PromptCache | None:
        """``seq``'s cache as it is now, with its checkpoints: a copy (it runs on)."""
        layers = seq.group.extract(seq) if seq.in_batch else seq.cache
        if not layers:
            return None
        mx.eval([x for layer in layers for x in held_arrays(layer)])
        cache = self._cache(layers, list(seq.tokens))
        return dataclasses.replace(cache, checkpoints=seq.checkpoints())

    def _cancel(self, seq: Sequence, keep_cache: bool, error: Exception | None = None) -> None:
        if seq.is_finished:  # it ended between the cancel call and this step boundary
            return
        layers = None
        if seq.in_batch:
            layers = self.scheduler.leave([seq], {id(seq)} if keep_cache else None).get(id(seq))
        elif self.scheduler.dequeue(seq):
            layers = seq.cache if keep_cache else None
        cache = self._cache(layers, seq.tokens) if layers else None
        reason = FinishReason.CANCELLED if error is None else FinishReason.ERROR
        self._finish(seq, reason, cache, error)

    def _fail_everything(self, exc: BaseException) -> None:
        for seq in [*self.scheduler.drop_batch(), *self.scheduler.queue.drain()]:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ERROR, error=exc)

    def _cancel_everything(self) -> None:
        for seq in list(self.scheduler.running):
            self._cancel(seq, keep_cache=seq.request.keep_cache_on_cancel)
        for seq in self.scheduler.queue.drain():
            self._finish(seq, FinishReason.CANCELLED, error=EngineClosedError("engine closed"))

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        cache: PromptCache | None = None,
        error: BaseException | None = None,
    ) -> None:
        seq.status = SeqStatus.FINISHED
        seq.stats.finished_at = time.perf_counter()
        if seq.spec is not None and error is None:  # its draft KV, for its next turn
            seq.spec.release(seq.tokens)
        # A cancel passes a cache only when the caller asked for it back.
        if reason is not FinishReason.CANCELLED and not seq.request.return_cache:
            cache = None
        self.meter.finished(reason)
        result = GenerationResult(
            token_ids=seq.token_ids,
            text="".join(seq.text_parts),
            finish_reason=reason,
            stats=seq.stats,
            cache=cache,
            error=error,
            stop_sequence=seq.stops.matched,
            logprobs=seq.logprobs if seq.request.logprobs is not None else None,
        )
        self._emit(seq, result)
