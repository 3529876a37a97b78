"""The generation thread: the only thread that touches MLX.

Each turn of the loop reads as a sentence: run commands (cancels, calls), admit waiting
requests into mlx-lm's BatchGenerator, step the batch once, hand every sequence its token,
and finish the ones that ended. New requests join at the next step boundary; nothing waits
for the batch to drain.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from engine.config import EngineConfig
from engine.errors import EngineClosedError, InvalidCacheError
from engine.models import LoadedModel, load_model
from engine.request import FinishReason, GenerationResult, PromptCache, TokenEvent
from engine.scheduler import AdmissionQueue
from engine.sequence import EngineStats, SeqStatus, Sequence
from engine.solo import SoloRun

log = logging.getLogger(__name__)
SOLO_UID = -1
_COUNTER = {
    FinishReason.STOP: "completed",
    FinishReason.LENGTH: "completed",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.ERROR: "failed",
}


def _deliver(items: list[tuple[object, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class GenerationLoop(threading.Thread):
    """Owns the model and a BatchGenerator; serves requests until stopped."""

    def __init__(self, model_spec: str, config: EngineConfig):
        super().__init__(name="agentkv-generation", daemon=True)
        self.config = config
        self._model_spec = model_spec
        self.model: LoadedModel | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._queue: AdmissionQueue[Sequence] = AdmissionQueue(
            config.max_queue_size, config.priority_aging_per_s
        )
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Event()
        self._stopping: str | None = None  # None, "drain" or "cancel"
        self._running: dict[int, Sequence] = {}  # BatchGenerator uid (or SOLO_UID) -> sequence
        self._solo: SoloRun | None = None
        self._outbox: dict[object, list[tuple[object, object]]] = {}
        self._decode_window: collections.deque[tuple[float, int]] = collections.deque()
        self._counts = collections.Counter()
        self._peak_memory = 0
        self._batch_size = 0

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
        seq.ticket = self._queue.push(seq, seq.request.priority)
        self._wake.set()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this thread at the next step boundary."""
        if not self.is_alive():
            raise EngineClosedError("the generation thread is not running")
        self._commands.append(fn)
        self._wake.set()

    def cancel(self, seq: Sequence, keep_cache: bool = False) -> None:
        if not seq.is_finished and self.is_alive():
            self.call_soon(lambda: self._cancel(seq, keep_cache))

    def stop(self, drain: bool) -> None:
        self._stopping = "drain" if drain else "cancel"
        self._wake.set()

    def stats(self) -> EngineStats:
        now = time.perf_counter()
        window_s = self.config.stats_window_s
        window = [(t, n) for t, n in list(self._decode_window) if now - t <= window_s]
        span = min(window_s, now - window[0][0]) if window else 0.0
        c = self._counts
        return EngineStats(
            active=len(self._running),
            queued=len(self._queue),
            batch_size=self._batch_size,
            completed=c["completed"],
            cancelled=c["cancelled"],
            failed=c["failed"],
            tokens_generated=c["tokens"],
            decode_tps=sum(n for _, n in window) / span if span > 0 else 0.0,
            peak_memory_bytes=self._peak_memory,
        )

    # ---- the generation thread -----------------------------------------------------------

    def run(self) -> None:
        try:
            self.model = load_model(self._model_spec)
            self._layer_types = [type(c) for c in make_prompt_cache(self.model.model)]
            self._eos = StopSequences([(t,) for t in sorted(self.model.eos_token_ids)])
            self._no_stop = StopSequences()
            self._batch = self._new_batch()
        except BaseException as exc:  # surfaced to the opener by wait_ready()
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        except BaseException as exc:
            # A bug, not a request's fault: fail everything so no caller waits forever.
            log.exception("the generation loop failed; failing every request")
            self._stopping = "cancel"
            self._fail_everything(exc)
            self._run_commands()  # pending run() calls and cancels still get their answer
        finally:
            self._flush_outbox()
            self._batch.close()

    def _serve(self) -> None:
        while True:
            self._run_commands()
            if self._stopping == "cancel" or (self._stopping and not self._has_work()):
                self._cancel_everything()
                return
            self._admit()
            if self._running:
                self._step()
            else:
                self._batch_size = 0
            self._flush_outbox()
            if not self._running:
                self._wake.clear()
                if not (self._commands or len(self._queue) or self._stopping):
                    self._wake.wait(timeout=1.0)

    def _has_work(self) -> bool:
        return bool(self._running or len(self._queue) or self._commands)

    def _new_batch(self) -> BatchGenerator:
        cfg = self.config
        return BatchGenerator(
            self.model.model,
            completion_batch_size=cfg.completion_batch_size,
            prefill_batch_size=cfg.prefill_batch_size,
            prefill_step_size=cfg.prefill_step_size,
        )

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

    # ---- admission ---------------------------------------------------------------------------

    def _admit(self) -> None:
        if self._solo is not None:
            if not len(self._queue):
                return
            self._join_batch()  # someone is waiting: the solo sequence moves into the batch
        free = self.config.completion_batch_size - len(self._running)
        while free > 0 and (seq := self._queue.pop()) is not None:
            try:
                if seq.request.cache is not None:
                    self._check_cache(seq.request.cache)
                if self.config.solo_fast_path and not self._running and not len(self._queue):
                    self._start_solo(seq)
                    return
                req = seq.request
                self._insert(seq, req.prompt_tokens, req.cache, req.max_tokens)
            except Exception as exc:
                self._finish(seq, FinishReason.ERROR, error=exc)
                continue
            free -= 1

    def _check_cache(self, cache: PromptCache) -> None:
        types = [type(layer) for layer in cache.layers]
        if types != self._layer_types:
            raise InvalidCacheError(
                f"cache layers {[t.__name__ for t in types]} do not match the model's "
                f"{[t.__name__ for t in self._layer_types]}"
            )

    def _mark_running(self, seq: Sequence, uid: int) -> None:
        seq.uid = uid
        seq.status = SeqStatus.RUNNING
        if seq.stats.admitted_at is None:
            seq.stats.admitted_at = time.perf_counter()
        self._running[uid] = seq

    def _insert(
        self, seq: Sequence, prompt: list[int], cache: PromptCache | None, max_tokens: int
    ) -> None:
        (uid,) = self._batch.insert(
            [prompt],
            max_tokens=[max_tokens],
            caches=[cache.layers if cache else None],
            all_tokens=[list(cache.tokens) if cache else []],
            samplers=[seq.sampler],
            logits_processors=[seq.logits_processors],
            stop_sequences=[self._no_stop if seq.request.ignore_eos else self._eos],
        )
        self._mark_running(seq, uid)

    def _start_solo(self, seq: Sequence) -> None:
        req = seq.request
        eos = frozenset() if req.ignore_eos else self.model.eos_token_ids
        self._mark_running(seq, SOLO_UID)
        self._solo = SoloRun(
            self.model.model,
            req,
            seq.sampler,
            seq.logits_processors,
            eos,
            self.config.prefill_step_size,
        )

    def _join_batch(self) -> None:
        """Move the solo sequence into the batch, continuing exactly where it was."""
        solo, seq = self._solo, self._running.pop(SOLO_UID)
        self._solo = None
        try:
            if not solo.is_prefilling:
                token, reason = solo.take_pending()
                hit = self._on_token(seq, token, reason, time.perf_counter())
                if reason is not None or hit:
                    if reason is None:
                        solo.feed_prompt()
                    self._finish(seq, FinishReason(reason or "stop"), solo.cache())
                    return
            h = solo.handover()
            self._insert(seq, h.prompt, h.cache, h.max_tokens)
        except Exception as exc:
            self._finish(seq, FinishReason.ERROR, error=exc)

    # ---- stepping ----------------------------------------------------------------------------

    def _step(self) -> None:
        if self._solo is not None:
            self._step_solo()
        else:
            self._step_batch()

    def _count(self, n: int) -> None:
        now = time.perf_counter()
        self._batch_size = n
        self._decode_window.append((now, n))
        while now - self._decode_window[0][0] > self.config.stats_window_s:
            self._decode_window.popleft()
        self._counts["tokens"] += n
        if self._counts["tokens"] % 64 < n:
            self._peak_memory = mx.get_peak_memory()

    def _step_solo(self) -> None:
        seq = self._running[SOLO_UID]
        try:
            reported = self._solo.step()
            if reported is None:
                return  # a prefill chunk
            token, reason = reported
            hit = self._on_token(seq, token, reason, time.perf_counter())
        except Exception as exc:
            log.exception("solo generation step failed")
            self._solo = None
            self._finish(seq, FinishReason.ERROR, error=exc)
            return
        self._count(1)
        if reason is not None or hit:
            cache, self._solo = self._solo.cache(), None
            self._finish(seq, FinishReason(reason or "stop"), cache)

    def _step_batch(self) -> None:
        try:
            _, responses = self._batch.next()
        except Exception as exc:
            # The batch's state is unknown after a failed step: fail what was in it, start fresh.
            log.exception("generation step failed; failing %d requests", len(self._running))
            for seq in list(self._running.values()):
                self._finish(seq, FinishReason.ERROR, error=exc)
            self._batch.close()
            self._batch = self._new_batch()
            return
        now = time.perf_counter()
        if responses:
            self._count(len(responses))
        stopped: list[Sequence] = []
        for r in responses:
            seq = self._running[r.uid]
            try:
                hit = self._on_token(seq, r.token, r.finish_reason, now)
            except Exception as exc:
                self._remove([seq])
                self._finish(seq, FinishReason.ERROR, error=exc)
                continue
            if r.finish_reason is not None:
                cache = PromptCache(r.prompt_cache, list(r.all_tokens))
                self._finish(seq, FinishReason(r.finish_reason), cache)
            elif hit:
                stopped.append(seq)
        if stopped:
            want = any(s.request.return_cache for s in stopped)
            caches = self._remove(stopped, want_caches=want)
            for seq in stopped:
                self._finish(seq, FinishReason.STOP, caches.get(seq.uid))

    def _on_token(self, seq: Sequence, token: int, finish: str | None, now: float) -> bool:
        """Record one token; returns True when a stop string completed."""
        if seq.stats.first_token_at is None:
            seq.stats.first_token_at = now
        seq.token_ids.append(token)
        seq.stats.decode_tokens += 1
        if not (finish == "stop" and token in self.model.eos_token_ids):
            seq.detokenizer.add_token(token)
        if finish is not None:
            seq.detokenizer.finalize()
        text, hit = seq.stops.feed(seq.detokenizer.last_segment)
        if finish is not None and not hit:
            text += seq.stops.flush()
        seq.text_parts.append(text)
        self._emit(seq, TokenEvent(token, text))
        return hit

    # ---- leaving -----------------------------------------------------------------------------

    def _remove(self, seqs: list[Sequence], want_caches: bool = False) -> dict[int, PromptCache]:
        raw = self._batch.remove([s.uid for s in seqs], return_prompt_caches=want_caches)
        return {
            uid: PromptCache(list(layers), list(tokens)) for uid, (layers, tokens) in raw.items()
        }

    def _cancel(self, seq: Sequence, keep_cache: bool) -> None:
        if seq.is_finished:  # it ended between the cancel call and this step boundary
            return
        cache = None
        if seq.status is SeqStatus.QUEUED:
            self._queue.remove(seq.ticket)
            cache = seq.request.cache if keep_cache else None
        elif self._running.get(SOLO_UID) is seq:
            solo, self._solo = self._solo, None
            cache = solo.cache() if keep_cache else None
        else:
            cache = self._remove([seq], want_caches=keep_cache).get(seq.uid)
        self._finish(seq, FinishReason.CANCELLED, cache)

    def _fail_everything(self, exc: BaseException) -> None:
        self._solo = None
        for seq in [*self._running.values(), *self._queue.drain()]:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ERROR, error=exc)

    def _cancel_everything(self) -> None:
        for seq in list(self._running.values()):
            self._cancel(seq, keep_cache=seq.request.keep_cache_on_cancel)
        for seq in self._queue.drain():
            self._finish(seq, FinishReason.CANCELLED, error=EngineClosedError("engine closed"))

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        cache: PromptCache | None = None,
        error: BaseException | None = None,
    ) -> None:
        if self._running.get(seq.uid) is seq:
            del self._running[seq.uid]
        seq.status = SeqStatus.FINISHED
        seq.stats.finished_at = time.perf_counter()
        # A cancel passes a cache only when the caller asked for it back.
        if reason is not FinishReason.CANCELLED and not seq.request.return_cache:
            cache = None
        self._counts[_COUNTER[reason]] += 1
        result = GenerationResult(
            token_ids=seq.token_ids,
            text="".join(seq.text_parts),
            finish_reason=reason,
            stats=seq.stats,
            cache=cache,
            error=error,
            stop_sequence=seq.stops.matched,
        )
        self._emit(seq, result)
