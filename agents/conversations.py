"""Whole-conversation turns (``AgentRuntime.respond``): the client's copy is the document.

Claude Code and other clients that resend the whole conversation each time are answered here:
the conversation is rendered (tools included), the agent's cache is reused up to the longest
common token prefix (see :mod:`agents.document`), and afterwards the agent's transcript is the
conversation plus the reply. A mixin of :class:`agents.runtime.AgentRuntime`, whose state
(registry, engine, hot tier, disk caches, locks) it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

from agents.document import (
    CachedReply,
    DocumentPrompt,
    common_prefix,
    recover_replies,
    render_document,
    tool_calls_of,
)
from agents.errors import EmptyMessageError
from agents.prompt import Message, checked_texts
from agents.tool_calls import ParsedReply
from agents.types import CacheSource, Reply, TextDelta, TurnPlan
from engine.request import GenerationResult
from engine.sampling import SamplingParams
from store import AgentRecord, MessageRecord, NewMessage


class WholeConversations:
    """``respond`` and its helpers (mixed into AgentRuntime)."""

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
    ) -> AsyncIterator[TextDelta | Reply]:
        """Answer a whole conversation the client resends each time (the client's copy is the
        document; see :mod:`agents.document`). Yields TextDelta pieces, then the Reply.

        The agent's cache is reused up to the longest common token prefix with the rendered
        conversation; afterwards the agent's transcript is the conversation plus the reply and
        its system prompt that of the conversation. Rolled back like :meth:`stream`.

        Args:
            agent_id: the agent (it must exist).
            messages: the conversation in chat-template shape (``role``, ``content``,
                ``tool_calls``; roles system, user, assistant, tool); a leading system message
                is the system prompt. The last message is not an assistant message.
            tools: tool definitions in the OpenAI shape, rendered by the chat template.
            max_tokens, sampling, stop, priority: as for :meth:`stream`.
        """
        self._check_open()
        self._check_tools(tools)
        messages = checked_texts(messages)
        if not messages or messages[-1]["role"] == "assistant":
            raise EmptyMessageError("the conversation must end with a non-assistant message")
        options = {"max_tokens": max_tokens, "sampling": sampling, "stop": stop}
        started = time.perf_counter()
        self._begin()
        try:
            async with contextlib.aclosing(
                self._document_turn(agent_id, messages, tools, started, priority, options)
            ) as turn:
                async for event in turn:
                    yield event
        finally:
            self._end()

    async def _document_turn(
        self,
        agent_id: str,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        started: float,
        priority: float,
        options: dict[str, Any],
    ) -> AsyncIterator[TextDelta | Reply]:
        async with self._lock(agent_id):
            agent = await self._registry.get_agent(agent_id)
            history = await self._registry.transcript(agent_id)
            plan, document = await self._plan_document(agent_id, messages, tools, history, priority)
            try:
                async for event in self._generate(agent, plan, priority=priority, **options):
                    if isinstance(event, TextDelta):
                        yield event
                    else:
                        result = event
                reply = CachedReply(
                    len(document.tokens),
                    tuple(result.token_ids),
                    self._parse(result.text, tools),
                )
                await self._shielded(
                    self._commit_document(agent, history, messages, result, document, reply, plan)
                )
            except BaseException:
                if plan.release:  # idempotent: a save already scheduled calls it again, harmless
                    plan.release()
                raise
            self._sources[plan.source] += 1
            yield dataclasses.replace(
                self._reply(agent_id, plan, result, started), parsed=reply.parsed
            )

    async def _plan_document(
        self,
        agent_id: str,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        history: list[MessageRecord],
        priority: float = 0.0,
    ) -> tuple[TurnPlan, DocumentPrompt]:
        """Render the conversation and resume from the longest prefix the cache shares; with
        no usable cache of its own, from a stored prefix (another conversation's system prompt
        and tools)."""
        start = time.perf_counter()
        source: CacheSource = "hot"
        hot = self._hot.get(agent_id)
        cache = hot.cache if hot else None
        if cache is None:
            await self._disk.wait(agent_id)
            loaded = await self._disk.load(agent_id)
            cache, source = (loaded.cache, "disk") if loaded else (None, "none")
        known = self._replies.get(agent_id)

        def render() -> tuple[DocumentPrompt, int]:
            replies = [r for r in known or [] if cache and r.is_in(cache.tokens)]
            if known is None and cache is not None:  # first turn since a restart
                replies = recover_replies(
                    self._renderer,
                    lambda text: self._parse(text, tools),
                    lambda parsed: self.stored_text(parsed.as_message()),
                    cache.tokens,
                    [(str(m.role), m.content, m.token_count) for m in history],
                )
            document = render_document(self._renderer, messages, tools, replies)
            shared = common_prefix(document.tokens, cache.tokens) if cache else 0
            return document, min(shared, len(document.tokens) - 1)  # prefill at least one

        document, shared = await asyncio.to_thread(render)
        resumed = cache.prefix(shared) if cache else None
        if resumed is None and cache is not None:
            source = "rebuilt"
        if resumed is None or resumed.num_tokens < self._disk.block_tokens:
            # A stored prefix (at least a block) beats less than a block of the agent's own.
            head = functools.partial(self._renderer.shared_head, messages, document.tokens, tools)
            plan = await self._plan_from_prefix(document.tokens, head, source, start, priority)
            if plan.cache is not None or resumed is None:
                return plan, document
        kept = resumed.num_tokens if resumed else 0
        plan = TurnPlan(document.tokens[kept:], resumed, source, time.perf_counter() - start)
        return plan, document

    async def _commit_document(
        self,
        agent: AgentRecord,
        history: list[MessageRecord],
        messages: list[Message],
        result: GenerationResult,
        document: DocumentPrompt,
        reply: CachedReply,
        plan: TurnPlan,
    ) -> None:
        system, first = None, 0
        if messages[0]["role"] == "system":
            system, first = messages[0]["content"], 1
        # Replies keep their token counts: after a restart, recover_replies finds them by those.
        stored = [
            NewMessage(
                m["role"],
                self.stored_text(m),
                len(document.spliced[i].tokens) if i in document.spliced else None,
            )
            for i, m in enumerate(messages)
            if i >= first
        ]
        stored.append(
            NewMessage("assistant", self.stored_text(reply.parsed.as_message()), len(reply.tokens))
        )
        old = [(str(m.role), m.content, m.token_count) for m in history]
        keep = common_prefix(old, [(m.role, m.content, m.token_count) for m in stored])
        keep = min(keep, len(stored) - 1)  # the reply is always (re)written
        await self._registry.append_messages(
            agent.id, stored[keep:], replace_from=keep, system_prompt=system
        )
        self._hot.put(agent.id, result.cache, len(stored))
        self._disk.save(agent.id, result.cache, len(stored), then=plan.release)
        self._replies[agent.id] = [*document.replies, reply]

    def _parse(self, text: str, tools: list[dict[str, Any]] | None) -> ParsedReply:
        return self.tool_format.parse(text, tools) if self.tool_format else ParsedReply(text)

    def stored_text(self, message: Message) -> str:
        """A message as transcripts store it: its text, then its tool calls' markup."""
        text = message.get("content") or ""
        calls = tool_calls_of(message)
        if calls and self.tool_format is not None:
            text += self.tool_format.markup(calls)
        return text
