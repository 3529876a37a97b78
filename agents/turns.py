"""One turn, from the agent's lock to its reply: the skeleton every kind of turn shares.

A turn takes the agent's lock, reads the agent and its transcript, plans (which cache to resume
and what to prefill: :meth:`CacheTiers.resume`, :meth:`TurnRunner.plan_from_prefix`), generates
through the engine, stores itself uninterruptibly (transcript rows, hot tier, a scheduled save)
and replies. What differs between kinds is a :class:`Turn`: how it plans and what it stores.
``agentkv.chat_turn.ChatTurn`` is ``AgentRuntime.stream``'s (a new user message after the stored
transcript); ``agentkv.conversations.DocumentTurn`` is a whole conversation resent by the client.
A turn that fails, is refused, is cancelled or whose stream is closed early stores nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

from agentkv.caches.tiers import CacheTiers, Start
from agentkv.config import RuntimeConfig
from agentkv.engine.engine import Engine
from agentkv.engine.request import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PromptCache,
    TokenLogprob,
)
from agentkv.engine.sampling import SamplingParams
from agentkv.errors import ContextLengthError, TurnFailedError
from agentkv.images import request_images
from agentkv.leases import Leases
from agentkv.messages import Message, conversation_digest, transcript_messages
from agentkv.prompt import ChatRenderer
from agentkv.reasoning import PROMPT_TAIL, ReasoningFormat
from agentkv.replies import finished_reply, log_turn
from agentkv.store import AgentRecord, MessageRecord, NewMessage, Registry, validate_agent_id
from agentkv.store.images import parts_text
from agentkv.types import (
    CacheSource,
    ReasoningDelta,
    Reply,
    TextDelta,
    TurnOptions,
    TurnPlan,
)

log = logging.getLogger(__name__)


class Turn(Protocol):
    """What one kind of turn decides; :class:`TurnRunner` does the rest."""

    async def plan(
        self, agent: AgentRecord, transcript: list[MessageRecord], priority: float
    ) -> TurnPlan:
        """The cache to resume and the tokens to prefill (``priority``: a shared head this
        turn prefills first runs at it)."""

    async def commit(
        self,
        agent: AgentRecord,
        transcript: list[MessageRecord],
        plan: TurnPlan,
        result: GenerationResult,
    ) -> None:
        """Store the finished turn (it runs shielded from cancellation)."""

    def reply(self, reply: Reply) -> Reply:
        """The reply as returned (after the commit)."""


class TurnRunner:
    """Runs turns: the agents' locks, the turns in flight, planning, generation, storing."""

    def __init__(
        self,
        config: RuntimeConfig,
        registry: Registry,
        engine: Engine,
        caches: CacheTiers,
        renderer: ChatRenderer,
        leases: Leases,
    ):
        self.config = config
        self.registry = registry
        self.engine = engine
        self.caches = caches
        self.renderer = renderer
        self.leases = leases
        self.reasoning = renderer.harmony or ReasoningFormat.of(engine.tokenizer)
        self.sources: Counter[str] = Counter()
        # An agent's lock lives while a turn holds or awaits it: ids of deleted or idle agents
        # (thousands of stateless ones) leave nothing behind.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._in_flight = 0  # turns and their commits; close() lets them finish
        self.idle = asyncio.Event()
        self.idle.set()

    def lock(self, agent_id: str) -> asyncio.Lock:
        """The agent's turn lock in this process (see :meth:`hold` for all workers)."""
        validate_agent_id(agent_id)  # no lock (and no entry) for an id that cannot exist
        lock = self._locks.get(agent_id)
        if lock is None:
            lock = self._locks[agent_id] = asyncio.Lock()
        return lock

    async def acquire(self, agent_id: str) -> Callable[[], None]:
        """Take the agent, from every worker sharing the registry: its lock here, then its
        lease (waiting while another worker holds it). Returns what gives both back."""
        lock = self.lock(agent_id)
        await lock.acquire()
        try:
            await self.leases.hold(agent_id)
        except BaseException:
            lock.release()
            raise

        def release() -> None:
            self.leases.drop(agent_id)
            lock.release()

        return release

    @contextlib.asynccontextmanager
    async def hold(self, agent_id: str) -> AsyncIterator[None]:
        """The agent's turns wait while the body runs, on this worker and the others."""
        release = await self.acquire(agent_id)
        try:
            yield
        finally:
            release()

    async def run(
        self, agent_id: str, turn: Turn, options: TurnOptions, started: float
    ) -> AsyncIterator[TextDelta | Reply]:
        """TextDelta pieces as they are generated, then the Reply; stores the turn first."""
        self._begin()
        try:
            # aclosing: an abandoned stream must release the agent and the engine slot now.
            async with contextlib.aclosing(self._run(agent_id, turn, options, started)) as events:
                async for event in events:
                    yield event
        finally:
            self._end()

    async def _run(
        self, agent_id: str, turn: Turn, options: TurnOptions, started: float
    ) -> AsyncIterator[TextDelta | Reply]:
        unlock: Callable[[], None] | None = await self.acquire(agent_id)
        release = unlock
        try:
            agent = await self.registry.get_agent(agent_id)
            transcript = await self.registry.transcript(agent_id)
            plan = await turn.plan(agent, transcript, options.priority)
            result: GenerationResult | None = None
            try:
                async for event in self._generate(agent, plan, options):
                    if isinstance(event, (TextDelta, ReasoningDelta)):
                        yield event
                    else:
                        result = event
                commit = self._shielded(turn.commit(agent, transcript, plan, result))
                try:
                    await asyncio.shield(commit)
                except asyncio.CancelledError:
                    if not commit.done():  # the caller goes; the agent stays locked until the
                        commit.add_done_callback(lambda _: release())  # turn is stored
                        unlock = None
                    raise
            except BaseException:
                if plan.release:  # idempotent: a save already scheduled calls it again, harmless
                    plan.release()
                raise
            finally:
                if plan.flight is not None:  # (its cache is kept by now, unless it failed)
                    left = result.cache if result is not None else None
                    self.caches.flights.landed(plan.flight, left)
            self.sources[plan.source] += 1
            reply = finished_reply(
                agent_id, plan, result, started, self.reasoning, self.opened(plan)
            )
            log_turn(reply)
            yield turn.reply(reply)
        finally:
            if unlock is not None:
                unlock()

    def _begin(self) -> None:
        self._in_flight += 1
        self.idle.clear()

    def _end(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self.idle.set()

    async def append(self, agent_id: str, messages: list[Message]) -> None:
        """Store messages after the transcript without generating, in the agent's turn order."""
        async with self.hold(agent_id):
            agent = await self.registry.get_agent(agent_id)
            history = await self.registry.transcript(agent_id)
            # Store nothing the chat template would refuse later (e.g. two user turns in a row).
            conversation = [*transcript_messages(agent, history), *messages]
            await asyncio.to_thread(self.renderer.check, conversation)
            await self.registry.append_messages(
                agent_id,
                [
                    NewMessage(m["role"], parts_text(m["content"]), parts=tuple(m["content"]))
                    if isinstance(m["content"], list)  # (images, stored: by number)
                    else NewMessage(m["role"], m["content"])
                    for m in messages
                ],
                expected_version=agent.version,
            )
            self.caches.advanced(agent_id, agent.version)  # its caches still cover a prefix

    # ---- planning ----------------------------------------------------------------------------

    async def cache_points(self, heads: Callable[[], list[int]], n: int) -> tuple[int, ...]:
        """The shared heads' ends past ``n`` (a turn prefilling from there) where the batch
        holds q8 KV: other conversations may resume from them, so it reads no float copy
        across them, whether this turn resumed from them or not (``cache_points``)."""
        if self.engine.config.batch_kv_bits != 8:
            return ()
        return tuple(end for end in await asyncio.to_thread(heads) if end > n)

    async def plan_from_prefix(
        self,
        tokens: list[int],
        heads: Callable[[], list[int]],
        source: CacheSource,
        start: float,
        priority: float,
        own: PromptCache | None = None,
    ) -> TurnPlan:
        """A plan for prefilling ``tokens`` from ``own`` (the turn's own cache, of a prefix of
        them) or, where they hold more, other conversations' caches and shared heads
        (``heads``: their ends; :meth:`CacheTiers.prefix`). Without ``own`` (a new
        conversation) the plan keeps snapshots (:meth:`CacheTiers.snapshots`)."""
        limit, flight = self.engine.model.max_context, None
        if limit and len(tokens) >= limit:  # refused when it runs: store no head for it
            begin = Start(own)
        else:
            flight = self.caches.fly(tokens) if own is None else None
            try:
                begin = await self.caches.prefix(tokens, heads, priority, own, flight)
            except BaseException:
                if flight is not None:
                    self.caches.flights.landed(flight, None)
                raise
        n = begin.cache.num_tokens if begin.cache else 0
        points = await self.cache_points(heads, n)
        return TurnPlan(
            tokens[n:],
            begin.cache,
            "prefix" if begin.borrowed else source,
            time.perf_counter() - start,
            fresh=begin.fresh,
            release=begin.release,
            cache_points=points,
            # A new conversation keeps snapshots where others may part from it.
            snapshots_at=self.caches.snapshots(begin.cache, len(tokens)) if own is None else (),
            flight=flight,
        )

    # ---- generating and storing --------------------------------------------------------------

    def opened(self, plan: TurnPlan) -> bool:
        """Whether the plan's prompt leaves reasoning open (the reply starts inside it)."""
        if self.reasoning is None:
            return False
        tail = plan.prompt_tokens[-PROMPT_TAIL:]
        if len(tail) < PROMPT_TAIL and plan.cache is not None:
            tail = plan.cache.tokens[len(tail) - PROMPT_TAIL :] + tail
        return self.reasoning.opened(tail)

    async def _generate(
        self, agent: AgentRecord, plan: TurnPlan, options: TurnOptions
    ) -> AsyncIterator[TextDelta | ReasoningDelta | GenerationResult]:
        """Run the plan's prompt on its cache (max_tokens clamped to the context; the agent's
        sampling by default): TextDelta (and a reasoning model's ReasoningDelta) pieces, then
        the GenerationResult. Raises ContextLengthError, or TurnFailedError when generation
        fails."""
        request = GenerationRequest(
            plan.prompt_tokens,
            max_tokens=options.max_tokens or self.config.default_max_tokens,  # None: no cap
            sampling=options.sampling or SamplingParams(**agent.sampling),
            stop=list(options.stop or []),
            priority=options.priority,
            cache=plan.cache,
            grammar=options.grammar,
            logprobs=options.logprobs,
            cache_points=plan.cache_points,
            checkpoint_at=plan.checkpoint_at,
            snapshots_at=plan.snapshots_at,
            reasoning_budget=options.reasoning_budget,
            speculative=options.speculative,
            prediction=options.prediction,
            **await request_images(self.registry.images, plan.prompt_tokens, plan.cache),
        )
        self._check_context(request)
        held: list[TokenLogprob] = []  # of tokens whose text is still pending
        splitter = None
        if self.reasoning is not None:
            splitter = self.reasoning.splitter(self.opened(plan))
        async with self.engine.submit(request) as handle:
            if plan.flight is not None:  # new conversations arriving meanwhile cut from it
                plan.flight.started(handle, plan.snapshots_at)
            async for event in handle:
                if event.logprob is not None:
                    held.append(event.logprob)
                if not event.text:
                    continue
                if splitter is None:
                    yield TextDelta(event.text, tuple(held))
                    held.clear()
                    continue
                for inside, piece in splitter.feed(event.text):
                    yield (ReasoningDelta if inside else TextDelta)(piece, tuple(held))
                    held.clear()
            result = await handle.result()
            for inside, piece in splitter.flush() if splitter else ():
                yield (ReasoningDelta if inside else TextDelta)(piece, tuple(held))
                held.clear()
        if result.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
            raise TurnFailedError(
                f"turn of agent {agent.id!r} failed: {result.error}"
            ) from result.error
        yield result

    def _check_context(self, request: GenerationRequest) -> None:
        """Refuse a prompt that leaves no room in the context (the engine holds max_tokens
        within what the context and the KV budget leave)."""
        limit = self.engine.model.max_context
        if limit is None:
            return
        prompt = (request.cache.num_tokens if request.cache else 0) + len(request.prompt_tokens)
        if prompt >= limit:  # Anthropic's wording: clients (Claude Code) parse it to compact
            raise ContextLengthError(
                f"prompt is too long: {prompt} tokens > {limit - 1} maximum (the model's "
                f"context is {limit} tokens); shorten the conversation or start a new agent"
            )

    def _shielded(self, commit: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Store a finished turn, uninterruptibly: the task to await (shielded).

        Once the reply exists, storing it and its cache must not be cut short: a caller
        cancelled now cannot leave the transcript stored but the cache unrecorded. The commit
        counts as in flight on its own, so close() waits for it even when its caller is gone,
        and the agent's lock is released only when it is over (see ``_run``).
        """
        task = asyncio.ensure_future(commit)
        self._begin()
        task.add_done_callback(lambda _: self._end())
        return task

    async def keep(
        self,
        agent: AgentRecord,
        result: GenerationResult,
        plan: TurnPlan,
        messages: list[Message],
        covered: int,
        tools: list[dict[str, Any]] | None = None,
        checkpoint: bool = False,
    ) -> None:
        """After the transcript rows are stored (the agent now at the version after
        ``agent``'s): the turn's cache, covering ``covered`` transcript messages
        (``messages``: them, after the system prompt if any; ``tools``: those it was rendered
        with), goes to the hot tier and is saved to disk, the agent's lease held until it is.
        With ``checkpoint``, in memory it keeps a checkpoint where the cache it resumed ended
        (the previous turn boundary), so that a client rewriting this turn resumes from there;
        the end of a shared head it started from is kept in any case."""
        digest = await asyncio.to_thread(conversation_digest, messages, tools)
        cache = result.cache
        if cache is not None and plan.cache is not None:
            began = plan.checkpoint_at == plan.cache.num_tokens  # resumed where history ends
            cache = cache.checkpointed(plan.cache, recent=checkpoint, reply_began=began)
        self.leases.hold_more(agent.id)

        def saved() -> None:
            self.leases.drop(agent.id)
            if plan.release:
                plan.release()

        try:
            self.caches.keep(agent.id, cache, covered, digest, agent.version + 1, then=saved)
        except BaseException:
            saved()
            raise
