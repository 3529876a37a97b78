"""The asyncio front of the generation thread.

The event loop never blocks on MLX: requests go to the thread through a queue, tokens come
back through ``loop.call_soon_threadsafe`` into a per-request asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from agentkv.engine import images
from agentkv.engine.batch.buffers import held_arrays
from agentkv.engine.batch.packing import Packing
from agentkv.engine.batch.rows import is_packed
from agentkv.engine.config import KEY_BITS, KEY_GROUP_SIZE, EngineConfig
from agentkv.engine.errors import (
    EngineClosedError,
    InvalidCacheError,
    KVBudgetError,
)
from agentkv.engine.grammar import Grammars
from agentkv.engine.handle import RequestHandle
from agentkv.engine.loop import GenerationLoop
from agentkv.engine.meter import EngineStats, StepRecord
from agentkv.engine.mlxlm import evaluated_products
from agentkv.engine.models.loading import LoadedModel
from agentkv.engine.models.vision import image_tokens_in
from agentkv.engine.request import (
    GenerationRequest,
    GenerationResult,
    PromptCache,
    RequestStats,
)
from agentkv.engine.sequence import Sequence
from agentkv.engine.speculative import Prediction, Speculation
from agentkv.engine.stopping import StopStrings
from agentkv.engine.thinking import AnalysisMarkers, ThinkingBudget, ThinkingMarkers

T = TypeVar("T")


def _until_gone(native_id: int | None, timeout: float = 5.0) -> None:
    """Wait until the OS thread ``native_id`` is gone, its thread-local destructors run
    (Linux: while ``/proc`` lists it). MLX's take the GIL: had the process begun to exit
    meanwhile, it would abort ("terminate called without an active exception")."""
    task, deadline = f"/proc/self/task/{native_id}", time.monotonic() + timeout
    while native_id is not None and os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.001)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """Schedule ``fn(*args)`` on ``loop`` from any thread; a closed loop has no one to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _describe(packing: Packing) -> str:
    groups = sorted({g for g in packing.group_sizes if g is not None})
    rotated = (
        ", keys rotated" if any(map(packing.keys_rotated, range(len(packing.schemes)))) else ""
    )
    if packing.any_channel:
        rotated = (
            f", keys per channel at {KEY_BITS} bits over {KEY_GROUP_SIZE} positions, values rotated"
        )
    return (
        f"at {packing.bits} bits in groups of {'/'.join(map(str, groups))}{rotated} "
        f"({packing.dtype})"
    )


def _expanded(cache: PromptCache) -> PromptCache:
    import mlx.core as mx

    layers = cache.packing.expand(cache.layers)
    mx.eval(*(x for layer in layers for x in held_arrays(layer) if x is not None))
    return PromptCache(layers, list(cache.tokens))


def _forcing(token: int) -> Callable[[object, object], object]:
    """A logits processor under which greedy decoding picks ``token`` (generation thread)."""
    import mlx.core as mx

    def force(tokens: object, logits: mx.array) -> mx.array:
        hit = mx.arange(logits.shape[-1]) == token
        forced = mx.where(hit, mx.array(0.0, logits.dtype), mx.array(-mx.inf, logits.dtype))
        return mx.broadcast_to(forced, logits.shape)

    return force


class Engine:
    """Continuous batching of mlx-lm models (length groups, KV budget, policies), driven from
    asyncio.

    Example:
        async with await Engine.open("tiny:gemma3") as engine:
            result = await engine.generate(GenerationRequest(prompt_tokens=[1, 2, 3]))
    """

    def __init__(self, thread: GenerationLoop, model: LoadedModel):
        self._thread = thread
        self.model = model
        self._closed = False
        self.grammars = Grammars(model.tokenizer, model.vocab_size)
        self.thinking = ThinkingMarkers.of(model.tokenizer)
        """A reasoning model's thinking markers (one token each), else None."""
        self.reasoning = self.thinking or AnalysisMarkers.of(model.tokenizer)
        """What a reasoning budget follows: the thinking markers, or gpt-oss's analysis
        message; None for a model whose reasoning cannot be capped."""
        """Compiles the grammars requests are held to (``GenerationRequest.grammar``)."""
        threading.Thread(target=self.grammars.warm, name="grammar-warm", daemon=True).start()
        if model.vision is not None:
            model.vision.decoding = lambda: images.decoding(self._thread.scheduler)
            model.vision.on_load = evaluated_products

    @classmethod
    async def open(cls, model: str | os.PathLike, config: EngineConfig | None = None) -> Engine:
        """Start the generation thread and load ``model`` on it (a tiny:* spec or a local dir)."""
        thread = GenerationLoop(str(model), config or EngineConfig())
        thread.start()
        loaded = await asyncio.to_thread(thread.wait_ready)
        return cls(thread, loaded)

    @property
    def config(self) -> EngineConfig:
        return self._thread.config

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def kv_budget_bytes(self) -> int:
        """The batch's KV memory budget (``EngineConfig.kv_budget_bytes`` or its default)."""
        return self._thread.scheduler.budget_bytes

    @property
    def packing(self) -> Packing | None:
        """How the batch holds KV quantized (``EngineConfig.batch_kv_bits``), None: in the
        model's precision. Caches it hands back (and the hot tier holds) are packed so."""
        return self._thread.scheduler.layout.packing

    @property
    def first_positions(self) -> Callable[[int], list | None]:
        """Per layer, the keys and values a sequence starting with a token holds at its first
        position (``ModelRunner.first_positions``), None for a token outside the vocabulary:
        to be called on the generation thread, by a function given to :meth:`run`
        (``agentkv.engine.kv.load.decode_paged`` takes it)."""
        runner, vocab_size = self._thread.runner, self.model.vocab_size

        def first_positions(token: int) -> list | None:
            return runner.first_positions(token) if 0 <= token < vocab_size else None

        return first_positions

    async def expanded(self, cache: PromptCache) -> PromptCache:
        """``cache`` with its packed layers (``PromptCache.packing``) dequantized to the model's
        precision: copies, made on the generation thread; ``cache`` itself when none is."""
        if cache.packing is None:
            return cache
        return await self.run(_expanded, cache)

    def kv_bytes_needed(self, request: GenerationRequest) -> int:
        """The most KV bytes ``request`` sets aside in the budget, at its ``max_tokens``
        (its reservation grows to it as it decodes; see ``agentkv.engine.scheduler``)."""
        cached = request.cache.num_tokens if request.cache else 0
        tokens = cached + len(request.prompt_tokens) + self.max_tokens(request)
        layers = request.cache.layers if request.cache else None
        return self._thread.scheduler.need_for(tokens, layers, len(request.prompt_tokens))

    def max_tokens(self, request: GenerationRequest) -> int:
        """The tokens ``request`` may generate: its ``max_tokens`` (None: no limit of its own)
        within the model's context and what the KV budget holds for it alone."""
        cached = request.cache.num_tokens if request.cache else 0
        held = cached + len(request.prompt_tokens)
        layers = request.cache.layers if request.cache else None
        limit = self._thread.scheduler.capacity(layers, len(request.prompt_tokens)) - held
        if self.model.max_context is not None:
            limit = min(limit, self.model.max_context - held)
        if request.max_tokens is not None:
            limit = min(limit, request.max_tokens)
        return max(1, limit)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request.

        Its ``max_tokens`` is held within the model's context and what the KV budget holds for
        it alone (:meth:`max_tokens`): a reply cut there ends with ``length``.

        Raises:
            EngineOverloadedError: the queue is full (retry later).
            KVBudgetError: its history + prompt and one generated token can never fit the KV
                budget.
            InvalidCacheError: its cache is packed otherwise than this engine's batch.
            ValueError: token ids outside the vocabulary.
        """
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if request.cache is not None:
            self._check_packing(request.cache)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        vocab_size = self.model.vocab_size
        forced = [] if request.forced_token is None else [_forcing(request.forced_token)]
        seq = Sequence(
            request=request,
            loop=loop,
            events=events,
            stats=RequestStats(
                prompt_tokens=len(request.prompt_tokens),
                cached_tokens=request.cache.num_tokens if request.cache else 0,
            ),
            sampler=None if forced else request.sampling.make_sampler(vocab_size),
            logits_processors=forced or self._processors(request, vocab_size),
            detokenizer=self.tokenizer.detokenizer,
            stops=StopStrings(request.stop),
            tokens=list(request.cache.tokens) if request.cache else [],
            prompt=list(request.prompt_tokens),
            cache=request.cache.layers if request.cache else None,
        )
        images.mark(self.model, request, seq)
        if request.prediction and max(request.prediction) >= vocab_size:
            raise ValueError(f"prediction contains ids outside the vocabulary (size {vocab_size})")
        if request.forced_token is not None and request.forced_token >= vocab_size:
            raise ValueError(f"forced_token is outside the vocabulary (size {vocab_size})")
        self._check_budget(request)
        seq.max_tokens = self.max_tokens(request)
        seq.stats.prediction_tokens = len(request.prediction)
        if self._drafts(request, seq):
            prediction = None
            if request.prediction:
                start = len(seq.tokens) + len(seq.prompt)  # where the reply begins
                prediction = Prediction.of(request.prediction, start)
            seq.spec = Speculation(
                self.config.speculative_tokens, prediction, drafter=self._thread.drafter
            )
        self._thread.submit(seq)
        images.encode(self.model.vision, self._thread, seq)
        return RequestHandle(self._thread, seq, events)

    def check_images(self) -> None:
        """Raise UnsupportedModelError, naming the model and why, unless it takes images."""
        images.vision_of(self.model)

    def _drafts(self, request: GenerationRequest, seq: Sequence) -> bool:
        """Whether ``seq`` may feed drafts (``agentkv.engine.speculative``): the engine and
        the request want them, the model's layers can be cut back, and every token it
        generates is chosen from the model's logits alone (no processor, no logprobs)."""
        return (
            self.config.speculative != "off"
            and request.speculative
            and self._thread.runner.can_draft
            and not seq.logits_processors
            and request.logprobs is None
            and not request.images  # (drafts would be ids: an image's tokens are not)
            and not image_tokens_in(seq.tokens)
        )

    def _check_packing(self, cache: PromptCache) -> None:
        """Refuse a cache whose packed layers this engine's batch would read otherwise."""
        packing, mine = cache.packing, self.packing
        if packing is None:
            if any(is_packed(layer) for layer in cache.layers):  # a dtype read, no MLX work
                raise InvalidCacheError(
                    "the cache holds packed (uint32) layers but no packing to read them by"
                )
            return
        if packing != mine:
            held = "in the model's precision" if mine is None else _describe(mine)
            raise InvalidCacheError(
                f"the cache holds layers packed {_describe(packing)}; this engine's batch holds "
                f"them {held}; expand them first (await engine.expanded(cache))"
            )

    def _processors(self, request: GenerationRequest, vocab_size: int) -> list:
        """The request's logits processors; a grammar's mask last (nothing it forbids comes
        back, whatever a bias says)."""
        processors = request.sampling.make_logits_processors(vocab_size)
        if request.reasoning_budget is not None and self.reasoning is not None:
            processors.append(ThinkingBudget(self.reasoning, request.reasoning_budget))
        if request.grammar is not None:
            eos = self.model.eos_token_ids
            processors.append(self.grammars.processor(request.grammar, eos, self.thinking))
        return processors

    def _check_budget(self, request: GenerationRequest) -> None:
        """Refuse a turn whose history and prompt leave no room for a token in the budget."""
        cached = request.cache.num_tokens if request.cache else 0
        tokens = cached + len(request.prompt_tokens) + 1
        layers = request.cache.layers if request.cache else None
        scheduler, budget = self._thread.scheduler, self.kv_budget_bytes
        needed = scheduler.need_for(tokens, layers, len(request.prompt_tokens))
        if needed <= budget:
            return
        mib = 1024 * 1024
        raise KVBudgetError(
            f"this turn needs {needed / mib:.1f} MiB of KV memory ({cached} cached + "
            f"{len(request.prompt_tokens)} new + 1 generated = {tokens} tokens) but the "
            f"engine's whole KV budget is {budget / mib:.1f} MiB (kv_budget_bytes={budget}); "
            "shorten the conversation or raise kv_budget_bytes",
            needed_bytes=needed,
            budget_bytes=budget,
        )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run a request to the end. Cancelling the awaiting task cancels the request."""
        async with self.submit(request) as handle:
            return await handle.result()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the generation thread between two steps and return its value."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(ok: bool, value: object) -> None:
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        def call() -> None:
            try:
                value = fn(*args)
            except BaseException as exc:
                _post(loop, settle, False, exc)
            else:
                _post(loop, settle, True, value)

        self._thread.call_soon(call)
        return await future

    def stats(self) -> EngineStats:
        return self._thread.stats()

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> Callable[[], None]:
        """Call ``listener`` with a StepRecord after every step, on the generation thread
        (keep it short; it must not call MLX). Returns a function that removes it."""
        listeners = self._thread.meter.listeners
        listeners.append(listener)
        return lambda: listener in listeners and listeners.remove(listener)

    async def close(self, drain: bool = True) -> None:
        """Stop taking requests, finish (``drain``) or cancel those in flight, join the thread."""
        if self._closed:
            return
        self._closed = True
        self._thread.stop(drain)
        await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(_until_gone, self._thread.native_id)
        if self._thread.model is not None and self._thread.model.vision is not None:
            await asyncio.to_thread(self._thread.model.vision.close)

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
