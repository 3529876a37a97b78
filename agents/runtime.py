"""AgentRuntime: persistent agents over the continuously batched engine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from agents.caches import DiskCaches
from agents.config import RuntimeConfig
from agents.conversations import WholeConversations
from agents.document import CachedReply
from agents.errors import (
    ContextLengthError,
    EmptyMessageError,
    InvalidMessageError,
    RuntimeClosedError,
    ToolsUnsupportedError,
    TurnFailedError,
    check_text,
)
from agents.hot_tier import HotTier
from agents.prompt import ChatRenderer, Message, checked_texts
from agents.tool_calls import ToolFormat
from agents.types import CacheInfo, CacheSource, Reply, TextDelta, Timings, TurnPlan, Usage
from engine.engine import Engine
from engine.request import FinishReason, GenerationRequest, GenerationResult, PromptCache
from engine.sampling import SamplingParams
from store import (
    AgentNotFoundError,
    AgentRecord,
    MessageRecord,
    NewMessage,
    Registry,
    validate_agent_id,
)

log = logging.getLogger(__name__)


class AgentRuntime(WholeConversations):
    """Keeps many agents alive across restarts.

    Example:
        async with await AgentRuntime.open(RuntimeConfig(model="tiny:gemma3")) as rt:
            agent = await rt.create_agent(system_prompt="You are terse.")
            reply = await rt.chat(agent.id, "Hello")
    """

    def __init__(self, config: RuntimeConfig, registry: Registry, engine: Engine):
        self.config = config
        self._registry = registry
        self._engine = engine
        self._renderer = ChatRenderer(engine.tokenizer, engine.model.eos_token_ids)
        self.tool_format = ToolFormat.of(engine.tokenizer)
        """The model's tool-call markers and parser; None when it cannot call tools."""
        self._replies: dict[str, list[CachedReply]] = {}  # generated replies in each hot cache
        self._hot = HotTier(config.hot_cache_bytes)
        self._disk = DiskCaches(
            config.caches_path,
            registry,
            engine,
            config.kv_bits,
            config.kv_group_size,
            block_tokens=config.kv_block_tokens,
            budget_bytes=config.disk_budget_bytes,
            share_prefixes=config.share_prefixes,
            lock_of=self._lock,
        )
        self._locks: dict[str, asyncio.Lock] = {}
        self._sources: Counter[str] = Counter()
        self._closed = False
        self._in_flight = 0  # turns and their commits; close() lets them finish
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    async def open(cls, config: RuntimeConfig) -> AgentRuntime:
        """Open the registry (migrating it), load the model on the generation thread."""
        registry = await Registry.open(config.database)
        try:
            engine = await Engine.open(config.model, config.engine)
        except BaseException:
            await registry.close()
            raise
        runtime = cls(config, registry, engine)
        try:
            await runtime._disk.sweep()
        except BaseException:
            await runtime.close()
            raise
        return runtime

    async def __aenter__(self) -> AgentRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- agents ------------------------------------------------------------------------------

    async def create_agent(
        self,
        agent_id: str | None = None,
        *,
        system_prompt: str | None = None,
        name: str | None = None,
        sampling: SamplingParams | None = None,
        idle_ttl_s: int | None = None,
    ) -> AgentRecord:
        """Register a new agent. ``agent_id`` defaults to a fresh ``agent-<hex>`` id.

        ``idle_ttl_s``: after that many seconds without a turn, :meth:`expire_agents` deletes
        it (None: never).
        """
        self._check_open()
        if system_prompt is not None:
            check_text(system_prompt, "system_prompt")
        if name is not None:
            check_text(name, "name")
        return await self._registry.create_agent(
            agent_id,
            name=name,
            system_prompt=system_prompt,
            model_fingerprint=self._engine.model.fingerprint,
            sampling=(sampling or SamplingParams()).model_dump(exclude_defaults=True),
            idle_ttl_s=idle_ttl_s,
        )

    async def get_agent(self, agent_id: str) -> AgentRecord:
        return await self._registry.get_agent(agent_id)

    async def list_agents(
        self, *, limit: int | None = None, after_id: str | None = None
    ) -> list[AgentRecord]:
        """Agents, oldest first: all, or a page of at most ``limit`` after agent ``after_id``."""
        return await self._registry.list_agents(limit=limit, after_id=after_id)

    async def transcript(
        self, agent_id: str, *, start: int = 0, limit: int | None = None
    ) -> list[MessageRecord]:
        """The agent's messages from position ``start`` on (at most ``limit``), in order."""
        return await self._registry.transcript(agent_id, start=start, limit=limit)

    async def transcripts(self, id_prefix: str = "") -> dict[str, list[tuple[str, str]]]:
        """(role, content) of every message of the agents whose id starts with ``id_prefix``,
        by agent id (one registry query)."""
        return await self._registry.transcripts(id_prefix)

    async def message_count(self, agent_id: str) -> int:
        return await self._registry.message_count(agent_id)

    async def append_messages(self, agent_id: str, messages: Sequence[Message]) -> None:
        """Add messages to an agent's transcript without generating (e.g. importing history).

        Args:
            agent_id: the agent.
            messages: ``{"role": "user" | "assistant", "content": str}`` dicts, in order.

        The agent's cache stays valid: the next turn prefills these messages as part of its delta.
        To import history and run a turn atomically, pass it as ``chat(..., history=...)``.
        """
        self._check_open()
        messages = _checked_history(messages)
        async with self._lock(agent_id):
            agent = await self._registry.get_agent(agent_id)
            history = await self._registry.transcript(agent_id)
            # Store nothing the chat template would refuse later (e.g. two user turns in a row).
            await asyncio.to_thread(
                self._renderer.render, [*self._messages(agent, history), *messages], False
            )
            await self._registry.append_messages(
                agent_id, [NewMessage(m["role"], m["content"]) for m in messages]
            )

    async def count_tokens(
        self,
        messages: Sequence[Message],
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> int:
        """Tokens of a conversation rendered with the model's chat template, ready to answer.

        ``messages`` may be in chat-template shape (tool calls, role ``tool``). Rendering and
        tokenizing run in a worker thread: a long conversation does not stall the event loop.
        """
        self._check_tools(tools)
        head = [{"role": "system", "content": check_text(system, "system")}] if system else []
        conversation = [*head, *checked_texts(messages)]
        return len(await asyncio.to_thread(self._renderer.full_prompt, conversation, tools))

    async def delete_agent(self, agent_id: str) -> None:
        """Delete an agent, its transcript and every cache file it had."""
        self._check_open()
        async with self._lock(agent_id):
            await self._registry.get_agent(agent_id)
            await self._disk.wait(agent_id)
            await self._registry.delete_agent(agent_id)
            self._hot.drop(agent_id)
            self._replies.pop(agent_id, None)
            await self._disk.remove_agent(agent_id)

    async def fork(
        self, agent_id: str, new_id: str | None = None, *, name: str | None = None
    ) -> AgentRecord:
        """A new agent that continues ``agent_id``'s conversation: the same system prompt,
        sampling and transcript, resuming from the same cache (shared in memory, hard-linked
        on disk: nothing is prefilled or copied again). The two then go their own ways.

        Raises:
            AgentNotFoundError: no agent ``agent_id``.
            AgentExistsError: ``new_id`` is taken.
        """
        self._check_open()
        async with self._lock(agent_id):
            forked = await self._registry.fork_agent(agent_id, new_id, name=name)
            hot = self._hot.get(agent_id)
            if hot is not None:  # caches are merged into the batch by copy: safe to share
                self._hot.put(forked.id, hot.cache, hot.message_count)
            if agent_id in self._replies:
                self._replies[forked.id] = list(self._replies[agent_id])
            await self._disk.fork(agent_id, forked.id)
        return forked

    async def expire_agents(self) -> list[str]:
        """Delete the agents whose ``idle_ttl_s`` has passed since their last turn (transcript
        and cache files); agents with a turn in flight are left for the next call.

        Returns:
            The ids deleted.
        """
        self._check_open()
        expired = []
        for agent_id in await self._registry.expired_agents():
            if self._lock(agent_id).locked():
                continue
            try:
                await self.delete_agent(agent_id)
            except AgentNotFoundError:
                continue  # deleted meanwhile
            expired.append(agent_id)
        if expired:
            log.info("expired %d idle agents", len(expired))
        return expired

    # ---- turns -------------------------------------------------------------------------------

    async def chat(self, agent_id: str, message: str, **options: Any) -> Reply:
        """Send ``message`` as the agent's next user turn and return its reply.

        Args:
            agent_id: the agent.
            message: the user's text (not empty).
            **options: ``history`` (messages to add before this turn, stored with it or not
                at all), ``max_tokens``, ``sampling`` (a SamplingParams replacing the agent's
                defaults), ``stop`` (list of stop strings), ``priority``.

        Returns:
            The Reply. Turns of one agent run one after another in call order.
        """
        reply = None
        async for event in self.stream(agent_id, message, **options):
            if isinstance(event, Reply):
                reply = event
        assert reply is not None
        return reply

    async def stream(
        self,
        agent_id: str,
        message: str,
        *,
        history: Sequence[Message] = (),
        max_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        stop: list[str] | None = None,
        priority: float = 0.0,
    ) -> AsyncIterator[TextDelta | Reply]:
        """Like :meth:`chat`, yielding TextDelta pieces as they are generated, then the Reply.

        ``history`` (user/assistant message dicts) is added to the transcript before the new
        message, in the same transaction as the turn. A turn that fails, is refused (e.g. too
        long for the context), is cancelled, or whose stream is closed early is rolled back:
        nothing of it, the history included, is stored and the agent's cache stays as it was.
        """
        self._check_open()
        if check_text(message, "message").strip() == "":
            raise EmptyMessageError("message is empty: a turn needs some text")
        options = {
            "history": _checked_history(history),
            "max_tokens": max_tokens,
            "sampling": sampling,
            "stop": stop,
            "priority": priority,
        }
        started = time.perf_counter()
        self._begin()
        try:
            # aclosing: an abandoned stream must release the agent and the engine slot now.
            async with contextlib.aclosing(
                self._turn(agent_id, message, started, **options)
            ) as turn:
                async for event in turn:
                    yield event
        finally:
            self._end()

    def _begin(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()

    async def _turn(
        self,
        agent_id: str,
        message: str,
        started: float,
        *,
        history: list[Message],
        max_tokens: int | None,
        sampling: SamplingParams | None,
        stop: list[str] | None,
        priority: float,
    ) -> AsyncIterator[TextDelta | Reply]:
        async with self._lock(agent_id):
            agent = await self._registry.get_agent(agent_id)
            stored = await self._registry.transcript(agent_id)
            messages = [
                *self._messages(agent, stored),
                *history,
                {"role": "user", "content": message},
            ]
            plan = await self._plan(
                agent_id, messages, len(stored) + len(history), bool(stored), priority
            )
            options = {"max_tokens": max_tokens, "sampling": sampling, "stop": stop}
            try:
                async for event in self._generate(agent, plan, priority=priority, **options):
                    if isinstance(event, TextDelta):
                        yield event
                    else:
                        result = event
                await self._shielded(self._commit(agent_id, history, message, plan, result))
            except BaseException:
                if plan.release:  # idempotent: a save already scheduled calls it again, harmless
                    plan.release()
                raise
            self._sources[plan.source] += 1
            yield self._reply(agent_id, plan, result, started)

    async def _generate(
        self,
        agent: AgentRecord,
        plan: TurnPlan,
        *,
        max_tokens: int | None,
        sampling: SamplingParams | None,
        stop: list[str] | None,
        priority: float,
    ) -> AsyncIterator[TextDelta | GenerationResult]:
        """Run the plan's prompt on its cache (max_tokens clamped to the context; the agent's
        sampling by default): TextDelta pieces, then the GenerationResult. Raises
        ContextLengthError, or TurnFailedError when generation fails."""
        agent_id = agent.id
        request = GenerationRequest(
            plan.prompt_tokens,
            max_tokens=max_tokens or self.config.default_max_tokens,
            sampling=sampling or SamplingParams(**agent.sampling),
            stop=list(stop or []),
            priority=priority,
            cache=plan.cache,
        )
        self._check_context(request)
        async with self._engine.submit(request) as handle:
            async for event in handle:
                if event.text:
                    yield TextDelta(event.text)
            result = await handle.result()
        if result.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
            raise TurnFailedError(
                f"turn of agent {agent_id!r} failed: {result.error}"
            ) from result.error
        yield result

    async def _shielded(self, commit: Coroutine[Any, Any, None]) -> None:
        """Store a finished turn, uninterruptibly.

        Once the reply exists, storing it and its cache must not be cut short: a caller
        cancelled now cannot leave the transcript stored but the cache unrecorded. The commit
        counts as in flight on its own, so close() waits for it even when its caller is gone.
        """
        task = asyncio.ensure_future(commit)
        self._begin()
        task.add_done_callback(lambda _: self._end())
        await asyncio.shield(task)

    async def _commit(
        self,
        agent_id: str,
        history: list[Message],
        message: str,
        plan: TurnPlan,
        result: GenerationResult,
    ) -> None:
        stored = await self._registry.append_messages(
            agent_id,
            [
                *(NewMessage(m["role"], m["content"]) for m in history),
                NewMessage("user", message, len(plan.prompt_tokens)),
                NewMessage("assistant", result.text, len(result.token_ids)),
            ],
        )
        covered = stored[-1].position + 1
        self._hot.put(agent_id, result.cache, covered)
        self._disk.save(agent_id, result.cache, covered, then=plan.release)

    def _messages(self, agent: AgentRecord, history: list[MessageRecord]) -> list[Message]:
        system = [{"role": "system", "content": agent.system_prompt}] if agent.system_prompt else []
        return system + [{"role": str(m.role), "content": m.content} for m in history]

    async def _plan(
        self,
        agent_id: str,
        messages: list[Message],
        n_history: int,
        has_stored: bool,
        priority: float = 0.0,
    ) -> TurnPlan:
        """Pick the cache to resume from (hot, then disk, then a stored prefix) and the tokens
        still to prefill.

        ``n_history`` counts the messages before the new one (stored and imported);
        ``has_stored``: the agent had a transcript, so prefilling all of it is a rebuild.
        """
        start = time.perf_counter()
        offset = len(messages) - n_history - 1  # the system message, if any
        hot = self._hot.get(agent_id)
        candidates = [("hot", hot.cache, hot.message_count)] if hot else []
        if not candidates:
            await self._disk.wait(agent_id)  # a save in flight is the newest cache: let it land
            loaded = await self._disk.load(agent_id)
            if loaded is not None:
                candidates.append(("disk", loaded.cache, loaded.message_count))
        for source, cache, count in candidates:
            if count > n_history:
                continue  # newer than the transcript (cannot happen unless rows were removed)
            # Rendering and tokenizing grow with the history: keep them off the event loop.
            delta = await asyncio.to_thread(
                self._renderer.delta, messages, offset + count, cache.tokens[-1]
            )
            if delta is not None:
                return TurnPlan(delta, cache, source, time.perf_counter() - start)
            log.warning("agent %r: template did not extend its cache; re-prefilling", agent_id)
        tokens = await asyncio.to_thread(self._renderer.full_prompt, messages)
        source = "rebuilt" if has_stored else "none"
        head = functools.partial(self._renderer.shared_head, messages, tokens)
        return await self._plan_from_prefix(tokens, head, source, start, priority)

    async def _plan_from_prefix(
        self,
        tokens: list[int],
        head: Callable[[], int],
        source: CacheSource,
        start: float,
        priority: float,
    ) -> TurnPlan:
        """A plan for prefilling ``tokens`` (no cache of the agent's own), starting from a
        stored prefix or a shared head when there is one (``agents.caches.prefixes``)."""
        cache, fresh, release = await self._disk.prefix(tokens, head, priority)
        if cache is None:
            return TurnPlan(tokens, None, source, time.perf_counter() - start)
        return TurnPlan(
            tokens[cache.num_tokens :],
            cache,
            source if fresh else "prefix",
            time.perf_counter() - start,
            fresh=fresh,
            release=release,
        )

    def _check_context(self, request: GenerationRequest) -> None:
        """Clamp max_tokens to the context left; refuse a prompt that leaves none."""
        limit = self._engine.model.max_context
        if limit is None:
            return
        prompt = (request.cache.num_tokens if request.cache else 0) + len(request.prompt_tokens)
        if prompt >= limit:  # Anthropic's wording: clients (Claude Code) parse it to compact
            raise ContextLengthError(
                f"prompt is too long: {prompt} tokens > {limit - 1} maximum (the model's "
                f"context is {limit} tokens); shorten the conversation or start a new agent"
            )
        request.max_tokens = min(request.max_tokens, limit - prompt)

    def _check_tools(self, tools: list[dict[str, Any]] | None) -> None:
        if tools and self.tool_format is None:
            raise ToolsUnsupportedError(
                f"model {self.config.model!r} cannot call tools: its tokenizer has no tool-call "
                "format mlx-lm knows (no tool_call_start/tool_parser); send no tools"
            )

    def _reply(
        self, agent_id: str, plan: TurnPlan, result: GenerationResult, started: float
    ) -> Reply:
        s = result.stats
        resumed = plan.cache.num_tokens if plan.cache else 0
        cached = resumed - plan.fresh  # a head this turn prefilled itself is not cached
        return Reply(
            agent_id=agent_id,
            text=result.text,
            token_ids=list(result.token_ids),
            finish_reason=str(result.finish_reason),
            usage=Usage(resumed + len(plan.prompt_tokens), cached, len(result.token_ids)),
            cache_source=plan.source,
            timings=Timings(
                cache_load_s=plan.load_s,
                queue_s=s.queue_wait_s or 0.0,
                prefill_s=s.prefill_s or 0.0,
                ttft_s=(s.first_token_at or s.submitted_at) - started,
                decode_s=s.decode_s or 0.0,
                total_s=time.perf_counter() - started,
                decode_tps=s.decode_tps,
            ),
            stop_sequence=result.stop_sequence,
        )

    # ---- caches --------------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine this runtime drives: its model (``engine.model``), ``engine.run`` to call
        a function on the generation thread (where MLX arrays live), and its stats."""
        return self._engine

    async def cache_info(self, agent_id: str) -> CacheInfo:
        """What agentkv holds of the agent's KV cache: the entry on disk, the files a resume
        reads, the tokens of the copy in memory. Raises AgentNotFoundError."""
        self._check_open()
        await self._registry.get_agent(agent_id)
        stored = await self._registry.get_cache(agent_id)
        files: tuple = ()
        if stored is not None:
            blocks = await self._disk.block_files(stored.blocks)
            files = (self.config.caches_path / stored.path, *blocks)
        hot = self._hot.get(agent_id)
        return CacheInfo(stored, files, hot.cache.num_tokens if hot else None)

    async def export_cache(self, agent_id: str) -> PromptCache | None:
        """The agent's KV cache as its next turn would resume it: mlx-lm cache layers and the
        tokens they hold (the copy in memory, else the one on disk once its pending save has
        landed); None when it has no usable one. The layers may be the runtime's own: read
        them (e.g. ``mlx_lm.models.cache.save_prompt_cache(path, cache.layers)`` through
        ``engine.run``), do not change them. Raises AgentNotFoundError."""
        self._check_open()
        await self._registry.get_agent(agent_id)
        async with self._lock(agent_id):  # not while a turn changes it
            hot = self._hot.get(agent_id)
            if hot is not None:
                return hot.cache
            await self._disk.wait(agent_id)
            loaded = await self._disk.load(agent_id)
            return loaded.cache if loaded else None

    async def unload(self, agent_id: str) -> None:
        """Drop the agent's cache from memory (the hot tier) once its save has landed; its next
        turn loads it from disk. Raises AgentNotFoundError."""
        self._check_open()
        await self._registry.get_agent(agent_id)
        async with self._lock(agent_id):
            await self._disk.wait(agent_id)
            self._hot.drop(agent_id)

    # ---- lifecycle -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine, hot tier and cache counters (a snapshot)."""
        disk = self._disk.stats
        return {
            "engine": self._engine.stats(),
            "hot_tier": {
                "agents": len(self._hot),
                "bytes": self._hot.nbytes,
                "budget_bytes": self._hot.budget_bytes,
                "evictions": self._hot.evictions,
            },
            "cache_sources": dict(self._sources),
            "caches_saved": disk.saved,
            "cache_load_failures": disk.load_failures,
            "disk": {
                "bytes": disk.usage.bytes,
                "files": disk.usage.files,
                "blocks": disk.usage.blocks,
                "budget_bytes": self.config.disk_budget_bytes,
                "evictions": disk.evictions,
                "blocks_written": disk.blocks_written,
                "blocks_shared": disk.blocks_shared,
                "bytes_written": disk.bytes_written,
                "saves_in_flight": self._disk.saves_in_flight,
                "prefix_lookups": disk.prefix_lookups,
                "prefix_hits": disk.prefix_hits,
                "prefix_tokens": disk.prefix_tokens,
            },
        }

    async def flush(self) -> None:
        """Wait until every scheduled cache write is on disk and in the registry."""
        await self._disk.wait()

    async def close(self) -> None:
        """Let turns in flight finish, flush cache writes, stop the engine, close the registry."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._idle.wait()
            await self._disk.close()
        finally:
            await self._engine.close()
            await self._registry.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the runtime is closed")

    def _lock(self, agent_id: str) -> asyncio.Lock:
        validate_agent_id(agent_id)  # no lock (and no entry) for an id that cannot exist
        return self._locks.setdefault(agent_id, asyncio.Lock())


def _checked_history(messages: Sequence[Message]) -> list[Message]:
    """Copies of user/assistant message dicts whose content is usable text."""
    checked = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise InvalidMessageError(
                f"messages[{i}]: role must be 'user' or 'assistant', got {role!r}"
            )
        checked.append({"role": role, "content": check_text(content, f"messages[{i}].content")})
    return checked
