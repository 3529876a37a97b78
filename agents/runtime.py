"""AgentRuntime: persistent agents over the continuously batched engine."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from agentkv.caches import DiskCaches
from agentkv.caches.hot import HotTier
from agentkv.caches.tiers import CacheInfo, CacheTiers
from agentkv.chat_turn import ChatTurn
from agentkv.config import RuntimeConfig
from agentkv.conversations import Conversations
from agentkv.engine.call_formats import TOOL_CALL_STYLES
from agentkv.engine.engine import Engine
from agentkv.engine.grammar import Grammar, GrammarError
from agentkv.engine.request import PromptCache
from agentkv.engine.sampling import SamplingParams
from agentkv.errors import (
    InvalidMessageError,
    InvalidResponseFormatError,
    RuntimeClosedError,
    check_text,
)
from agentkv.formats import FREE, schema_of
from agentkv.harmony import Harmony
from agentkv.images import shows_images, with_stored_images
from agentkv.leases import Leases, WorkerClaim
from agentkv.messages import Message, checked_appended, off_loop
from agentkv.prompt import ChatRenderer
from agentkv.reasoning import ReasoningFormat
from agentkv.store import (
    AgentNotFoundError,
    AgentRecord,
    MessageRecord,
    Registry,
    RegistryStorageError,
    ResponseIndex,
)
from agentkv.store.models import utcnow
from agentkv.tool_calls import ToolFormat
from agentkv.turns import TurnRunner
from agentkv.types import ReasoningDelta, Reply, TextDelta, TurnOptions

log = logging.getLogger(__name__)


class AgentRuntime:
    """Keeps many agents alive across restarts.

    Example:
        async with await AgentRuntime.open(RuntimeConfig(model="tiny:gemma3")) as rt:
            agent = await rt.create_agent(system_prompt="You are terse.")
            reply = await rt.chat(agent.id, "Hello")
    """

    def __init__(
        self,
        config: RuntimeConfig,
        registry: Registry,
        engine: Engine,
        claim: WorkerClaim,
        harmony: Harmony | None = None,
    ):
        """Use :meth:`open`. ``claim``: this process's worker id, released at close;
        ``harmony``: the model's format when it speaks OpenAI's harmony (gpt-oss)."""
        config = config.resolved()
        self.config = config
        """The configuration, its "auto" budgets resolved to bytes."""
        self._registry = registry
        self._engine = engine
        vision = engine.model.vision
        self._renderer = ChatRenderer(
            engine.tokenizer,
            engine.model.eos_token_ids,
            engine.model.max_context,
            harmony=harmony,
            images=None if vision is None else vision.rule,
        )
        self.tool_format: ToolFormat | Harmony | None = harmony or ToolFormat.of(engine.tokenizer)
        """The model's tool-call markers and parser; None when it cannot call tools."""
        disk = DiskCaches(
            config.caches_path,
            registry,
            engine,
            config.kv_bits,
            config.disk_group_size,
            block_tokens=config.kv_block_tokens,
            budget_bytes=config.disk_budget_bytes,
            share_prefixes=config.share_prefixes,
            lock_of=self._lock,
            sweep_grace_s=config.sweep_grace_s,
        )
        self._caches = CacheTiers(HotTier(config.hot_cache_bytes), disk, registry)
        self.leases = Leases(registry.leases, claim, config.lease_s)
        """This worker's leases on agents (workers sharing the registry run each agent's
        turns one at a time)."""
        self._turns = TurnRunner(
            config, registry, engine, self._caches, self._renderer, self.leases
        )
        self._conversations = Conversations(self._turns, self.tool_format)
        self._closed = False

    @classmethod
    async def open(cls, config: RuntimeConfig) -> AgentRuntime:
        """Open the registry (migrating it), load the model on the generation thread.

        The "auto" budgets are measured here (see ``RuntimeConfig.resolved``) and logged.
        """
        config = await asyncio.to_thread(config.resolved)
        log.info(
            "hot tier budget %d bytes, disk budget %s",
            config.hot_cache_bytes,
            "none" if config.disk_budget_bytes is None else f"{config.disk_budget_bytes} bytes",
        )
        claim = await asyncio.to_thread(WorkerClaim.take, config.data_dir, config.worker_id)
        try:
            registry = await Registry.open(config.database)
        except BaseException:
            claim.release()
            raise
        try:
            engine = await Engine.open(config.model, config.engine_config())
        except BaseException:
            claim.release()
            await registry.close()
            raise
        try:
            harmony = await asyncio.to_thread(
                Harmony.of, engine.tokenizer, config.model, config.data_dir
            )
        except BaseException:
            claim.release()
            await registry.close()
            await engine.close()
            raise
        runtime = cls(config, registry, engine, claim, harmony)
        try:
            await runtime._caches.disk.janitor.sweep()
        except (RegistryStorageError, OSError) as exc:  # a full disk: tidy up another time
            log.warning("could not tidy the cache directory at open (%s); opened all the same", exc)
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
        tools: list[dict[str, Any]] | None = None,
    ) -> AgentRecord:
        """Register a new agent. ``agent_id`` defaults to a fresh ``agent-<hex>`` id.

        ``idle_ttl_s``: after that many seconds without a turn, :meth:`expire_agents` deletes
        it (None: never). ``tools``: the tool definitions its conversation carries, kept with
        it (the HTTP server matches stateless clients' requests on system prompt and tools);
        turns still take their tools from each call.
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
            sampling=(sampling or SamplingParams()).model_dump(mode="json", exclude_defaults=True),
            idle_ttl_s=idle_ttl_s,
            tools=tools or None,
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
            messages: ``{"role": "user" | "assistant", "content": str}`` dicts, in order; a
                user message's content may instead be a list of parts, ``{"type": "text",
                "text": str}`` and ``{"type": "image", "data": bytes}`` (an encoded PNG, JPEG,
                WebP or GIF image, for a vision-language model: stored as ``chat`` stores
                its images).

        Raises:
            InvalidMessageError: a message or part is malformed (named by its index).
            InvalidImageError: an image cannot be read or is too large (named by its index).
            UnsupportedModelError: images for a model that takes none.

        The agent's cache stays valid: the next turn prefills these messages as part of its delta.
        To import history and run a turn atomically, pass it as ``chat(..., history=...)``.
        """
        self._check_open()
        messages = await off_loop(checked_appended, messages)
        if shows_images(messages):
            self._engine.check_images()
            messages = await with_stored_images(self._registry.images, messages)
        await self._turns.append(agent_id, messages)

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
        return await self._conversations.count_tokens(list(messages), system, tools)

    async def delete_agent(self, agent_id: str, *, expected_version: int | None = None) -> None:
        """Delete an agent, its transcript and every cache file it had.

        Args:
            agent_id: the agent.
            expected_version: delete it only if it is still at this version (0: nothing was
                ever stored, by any worker), decided while holding it.

        Raises:
            AgentNotFoundError: no such agent.
            AgentChangedError: it is not at ``expected_version``; nothing was deleted.
        """
        self._check_open()
        await self._delete(agent_id, expected_version=expected_version)

    async def _delete(
        self, agent_id: str, if_expired: bool = False, expected_version: int | None = None
    ) -> bool:
        """Delete the agent (``if_expired``: only if its idle time is still over its
        ``idle_ttl_s`` once it is this worker's: another worker may have used it meanwhile).
        Returns whether it was deleted."""
        async with self._turns.hold(agent_id):
            if if_expired:
                agent = await self._registry.get_agent(agent_id)
                idle = (utcnow() - agent.updated_at).total_seconds()
                if agent.idle_ttl_s is None or idle <= agent.idle_ttl_s:
                    return False
            await self._caches.disk.writes.wait(agent_id)
            await self._registry.delete_agent(agent_id, expected_version)
            self._conversations.drop(agent_id)
            await self._caches.remove(agent_id)
        return True

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
        async with self._turns.hold(agent_id):
            forked = await self._registry.fork_agent(agent_id, new_id, name=name)
            self._conversations.fork(agent_id, forked.id)
            await self._caches.fork(agent_id, forked.id, forked.version)
        return forked

    async def expire_agents(self) -> list[str]:
        """Delete the agents whose ``idle_ttl_s`` has passed since their last turn (transcript
        and cache files); agents with a turn in flight are left for the next call. Then the
        images no message shows are deleted (``agentkv.store.images.IMAGE_GRACE``).

        Returns:
            The ids deleted.
        """
        self._check_open()
        expired = []
        for agent_id in await self._registry.expired_agents():
            if self._lock(agent_id).locked():
                continue
            try:
                if not await self._delete(agent_id, if_expired=True):
                    continue  # a turn (on another worker) since the list was read
            except AgentNotFoundError:
                continue  # deleted meanwhile
            expired.append(agent_id)
        if expired:
            log.info("expired %d idle agents", len(expired))
        if collected := await self._registry.images.collect():
            log.info("deleted %d images no message shows", collected)
        return expired

    # ---- turns -------------------------------------------------------------------------------

    async def chat(self, agent_id: str, message: str, **options: Any) -> Reply:
        """Send ``message`` as the agent's next user turn and return its reply.

        Args:
            agent_id: the agent.
            message: the user's text (not empty).
            **options: ``history`` (messages to add before this turn, stored with it or not
                at all), ``max_tokens``, ``sampling`` (a SamplingParams replacing the agent's
                defaults), ``stop`` (list of stop strings), ``priority``, ``response_format``
                (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
                {"schema": ...}}``: the reply is held to it, see ``agentkv.formats``),
                ``logprobs`` (None, or 0 to 20: ``Reply.logprobs`` gives each token's log
                probability and that many of the likeliest tokens at its step),
                ``template_kwargs`` (variables for the chat template, such as
                ``{"enable_thinking": False}``), ``reasoning_budget`` (on a reasoning model,
                the most tokens the reply thinks for before it answers), ``speculative``
                (False: the reply feeds no drafts where the engine would; greedy, its tokens
                are the same either way: ``agentkv.engine.speculative``), ``prediction``
                (text the reply is expected to restate, such as a file it rewrites with small
                changes: drafted from first, changing no token; ``Reply.usage`` counts its
                tokens accepted and rejected), ``images`` (encoded PNG, JPEG, WebP or GIF
                images the message shows before its text, for a vision-language model: stored
                once by content, their KV reused wherever a conversation shows them again). A
                reasoning model's
                thinking comes apart from the answer: ``Reply.reasoning`` (streamed as
                ``ReasoningDelta`` pieces), ``Reply.text`` the answer.

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
        response_format: dict[str, Any] | None = None,
        logprobs: int | None = None,
        template_kwargs: dict[str, Any] | None = None,
        reasoning_budget: int | None = None,
        speculative: bool = True,
        prediction: str | None = None,
        images: Sequence[bytes] = (),
    ) -> AsyncIterator[TextDelta | ReasoningDelta | Reply]:
        """Like :meth:`chat`, yielding TextDelta (and ReasoningDelta) pieces as they are
        generated, then the Reply.

        ``history`` (user/assistant message dicts) is added to the transcript before the new
        message, in the same transaction as the turn. A turn that fails, is refused (e.g. too
        long for the context), is cancelled, or whose stream is closed early is rolled back:
        nothing of it, the history included, is stored and the agent's cache stays as it was.
        """
        self._check_open()
        turn = await ChatTurn.checked(
            self._turns, message, history, self._conversations, template_kwargs, images
        )
        grammar = await self._grammar(response_format)
        options = TurnOptions(
            max_tokens,
            sampling,
            stop,
            priority,
            grammar,
            logprobs,
            self._budget(reasoning_budget),
            speculative,
            await self._prediction(prediction),
        )
        async for event in self._turns.run(agent_id, turn, options, time.perf_counter()):
            yield event

    async def respond(
        self,
        agent_id: str,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        stop: list[str] | None = None,
        priority: float = 0.0,
        response_format: dict[str, Any] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        logprobs: int | None = None,
        template_kwargs: dict[str, Any] | None = None,
        reasoning_budget: int | None = None,
        speculative: bool = True,
        prediction: str | None = None,
    ) -> AsyncIterator[TextDelta | ReasoningDelta | Reply]:
        """Answer a whole conversation the client resends each time (the client's copy is the
        document; see :mod:`agentkv.conversations`). Yields TextDelta (and ReasoningDelta)
        pieces, then the Reply.

        The agent's cache is reused up to the longest common token prefix with the rendered
        conversation; afterwards the agent's transcript is the conversation plus the reply and
        its system prompt that of the conversation. Rolled back like :meth:`stream`.
        ``max_tokens``, ``sampling``, ``stop``, ``priority``, ``response_format``,
        ``logprobs``, ``template_kwargs``, ``reasoning_budget``, ``speculative`` and
        ``prediction`` are as for :meth:`chat`.

        Args:
            agent_id: the agent (it must exist).
            messages: the conversation in chat-template shape (``role``, ``content``,
                ``tool_calls``; roles system, user, assistant, tool); a leading system message
                is the system prompt. The last message is not an assistant message.
            tools: tool definitions in the OpenAI shape, rendered by the chat template.
            tool_choice: None or ``"auto"`` (the model decides), ``"required"`` (the reply is
                one call of one of ``tools``) or ``{"name": NAME}`` (one call of that tool),
                held to the tool's parameters schema by constrained decoding; only for models
                whose tool-call format is JSON between markers (``ToolFormat.forcible``).
        """
        self._check_open()
        turn = await self._conversations.turn(messages, tools, template_kwargs)
        grammar = await self._grammar(response_format)
        if tool_choice not in (None, "auto"):
            if grammar is not None:
                raise InvalidResponseFormatError(
                    "tool_choice: a forced tool call and a response_format cannot both apply"
                )
            grammar = await self._tool_grammar(tools, tool_choice)
        options = TurnOptions(
            max_tokens,
            sampling,
            stop,
            priority,
            grammar,
            logprobs,
            self._budget(reasoning_budget),
            speculative,
            await self._prediction(prediction),
        )
        async for event in self._turns.run(agent_id, turn, options, time.perf_counter()):
            yield event

    async def _prediction(self, prediction: str | None) -> tuple[int, ...]:
        """A turn's predicted text as tokens (in a worker thread); () for none."""
        if not prediction:
            return ()
        return tuple(await asyncio.to_thread(self._renderer.prediction_tokens, prediction))

    def _budget(self, reasoning_budget: int | None) -> int | None:
        """A turn's cap on thinking, checked. Raises InvalidMessageError for one that is not
        a count of tokens, or for a model that does not think between one-token markers."""
        if reasoning_budget is None:
            return None
        if type(reasoning_budget) is not int or reasoning_budget < 0:
            raise InvalidMessageError(
                f"reasoning_budget must be a count of tokens, got {reasoning_budget!r}"
            )
        if self._engine.reasoning is None:
            raise InvalidMessageError(
                f"reasoning_budget: model {self.config.model!r} has no thinking markers "
                "(think_start / think_end, one token each, or harmony's analysis message) to "
                "cap its reasoning by"
            )
        return reasoning_budget

    async def _grammar(self, response_format: dict[str, Any] | None) -> Grammar | None:
        """The grammar a ``response_format`` asks for (None: free text), compiled in a worker
        thread. Raises InvalidResponseFormatError."""
        schema = schema_of(response_format)
        if schema is FREE:
            return None
        try:
            style = "harmony" if self._renderer.harmony is not None else None
            return await asyncio.to_thread(self._engine.grammars.json_schema, schema, style)
        except GrammarError as exc:
            raise InvalidResponseFormatError(
                f"response_format.json_schema.schema: cannot be compiled: {exc}"
            ) from None

    async def _tool_grammar(
        self, tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any]
    ) -> Grammar:
        """The grammar of the call ``tool_choice`` forces. Raises InvalidResponseFormatError."""
        name = tool_choice.get("name") if isinstance(tool_choice, dict) else None
        if tool_choice != "required" and not isinstance(name, str):
            raise InvalidResponseFormatError(
                f"tool_choice: {tool_choice!r} is not 'auto', 'required' or {{'name': ...}}"
            )
        form = self._conversations.tool_format
        if not tools:
            raise InvalidResponseFormatError("tool_choice: forcing a tool call needs tools")
        if form is None or not form.forcible:
            style = form.style if form else "none"
            raise InvalidResponseFormatError(
                f"tool_choice: model {self.config.model!r} writes tool calls in a format this "
                f"server cannot force ({style!r}; forcible: {', '.join(TOOL_CALL_STYLES)})"
            )
        try:
            return await asyncio.to_thread(
                self._engine.grammars.tool_call, form.start, form.end, tools, name, form.style
            )
        except GrammarError as exc:
            raise InvalidResponseFormatError(f"tool_choice: {exc}") from None

    @property
    def reasoning(self) -> ReasoningFormat | Harmony | None:
        """The model's thinking markers (``agentkv.reasoning``), or None for a model that does
        not reason apart from its answer."""
        return self._turns.reasoning

    @property
    def caps_reasoning(self) -> bool:
        """Whether a turn's ``reasoning_budget`` can cap this model's thinking (it thinks
        between one-token markers, or in harmony's analysis message)."""
        return self._engine.reasoning is not None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end the model's reply."""
        return self._engine.model.eos_token_ids

    @property
    def model_path(self) -> Path:
        """The directory the model was loaded from."""
        return self._engine.model.path

    @property
    def model_fingerprint(self) -> str:
        """The hash of the model's weights and configuration that its saved caches carry."""
        return self._engine.model.fingerprint

    @property
    def responses(self) -> ResponseIndex:
        """The Responses API's stored responses (``agentkv serve``: ``store: true``), kept in
        the registry; each names the agent and reply message that answered it."""
        self._check_open()
        return self._registry.responses

    async def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The bytes each token stands for (a special token: its name), e.g. to show
        ``TokenLogprob`` ids; read in a worker thread (the first call may wait for the
        tokenizer's byte index, seconds for a large vocabulary)."""
        return await asyncio.to_thread(self._engine.grammars.token_bytes, token_ids)

    def stored_text(self, message: Message) -> str:
        """A message as transcripts store it: its text, then its tool calls' markup."""
        return self._conversations.stored_text(message)

    # ---- caches --------------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine this runtime drives: its model (``runtime.engine.model``),
        ``runtime.engine.run`` to call
        a function on the generation thread (where MLX arrays live), and its stats."""
        return self._engine

    async def cache_info(self, agent_id: str) -> CacheInfo:
        """What agentkv holds of the agent's KV cache: the entry on disk, the files a resume
        reads, the tokens of the copy in memory. Raises AgentNotFoundError."""
        self._check_open()
        await self._registry.get_agent(agent_id)
        return await self._caches.info(agent_id)

    async def export_cache(self, agent_id: str) -> PromptCache | None:
        """The agent's KV cache as its next turn would resume it: mlx-lm cache layers and the
        tokens they hold (the copy in memory, else the one on disk once its pending save has
        landed); None when it has no usable one. The layers may be the runtime's own: read
        them (e.g. ``mlx_lm.models.cache.save_prompt_cache(path, cache.layers)`` through
        ``runtime.engine.run``), do not change them. Layers the runtime holds quantized
        (``batch_kv_bits``) come back expanded to the model's precision, as copies.
        Raises AgentNotFoundError."""
        self._check_open()
        async with self._lock(agent_id):  # not while a turn changes it
            agent = await self._registry.get_agent(agent_id)
            resumed = await self._caches.resume(agent_id, agent.version)
        if resumed is None:
            return None
        return await self._engine.expanded(resumed.cache)

    async def unload(self, agent_id: str) -> None:
        """Drop the agent's cache from memory (the hot tier) once its save has landed; its next
        turn loads it from disk. Raises AgentNotFoundError."""
        self._check_open()
        await self._registry.get_agent(agent_id)
        async with self._lock(agent_id):
            await self._caches.unload(agent_id)

    # ---- lifecycle -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine, hot tier and cache counters (a snapshot)."""
        disk = self._caches.disk
        return {
            "engine": self._engine.stats(),
            "hot_tier": self._caches.hot.report(),
            "cache_sources": dict(self._turns.sources),
            "caches_saved": disk.stats.saved,
            "cache_load_failures": disk.stats.load_failures,
            "disk": disk.report(),
            "leases": {
                "worker_id": self.leases.worker_id,
                "held": self.leases.held,
                "waits": self.leases.waits,
                "lost": self.leases.lost,
            },
        }

    async def flush(self, agent_id: str | None = None) -> None:
        """Wait until every scheduled cache write (of one agent, or all) is on disk and in the
        registry."""
        await self._caches.disk.writes.wait(agent_id)

    async def close(self) -> None:
        """Let turns in flight finish, flush cache writes, stop the engine, close the registry."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._turns.idle.wait()
            await self._caches.disk.writes.close()
            await self.leases.close()
        finally:
            await self._engine.close()
            await self._registry.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the runtime is closed")

    def _lock(self, agent_id: str) -> asyncio.Lock:
        return self._turns.lock(agent_id)
