"""A chat turn: a new user message (and the history stored with it) after the agent's stored
transcript. It resumes the agent's cache (hot, then disk) and prefills only the messages the
cache does not cover, rendered as a delta (``agentkv.prompt``); without a usable cache it
prefills the whole conversation, from a stored prefix where there is one, with the replies
another agent generated at the same places spliced in as generated (``Conversations.borrowed``):
its cache is then that prefix past them. Each reply is recorded for the conversations after it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.caches.tiers import Resumed
from agentkv.conversations import Conversations
from agentkv.document import CachedReply, generated_reply, render_document
from agentkv.engine.request import GenerationResult
from agentkv.errors import EmptyMessageError, check_text
from agentkv.images import checked_images, image_parts, images_of
from agentkv.messages import (
    Message,
    checked_history,
    conversation_digest,
    off_loop,
    transcript_messages,
)
from agentkv.prompt import ChatRenderer
from agentkv.store import AgentRecord, MessageRecord, NewMessage
from agentkv.store.images import NewImage
from agentkv.turns import TurnRunner
from agentkv.types import Reply, TurnPlan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ChatTurn:
    """A new user message (after ``history``, stored with it) following the transcript."""

    runner: TurnRunner
    message: str
    history: list[Message]
    conversations: Conversations | None = None
    """Generated replies by agent: borrowed from, and this turn's recorded (None: neither)."""
    renderer: ChatRenderer | None = None
    """The runner's renderer with the turn's template variables (None: the runner's)."""
    images: list[NewImage] = field(default_factory=list)
    """The images the new message shows, before its text (checked, not stored yet)."""
    message_id: int | None = field(default=None, init=False)
    _replies: list[CachedReply] = field(default_factory=list, init=False)  # in its cache
    _content: str | list[dict[str, Any]] | None = field(default=None, init=False)

    @classmethod
    async def checked(
        cls,
        runner: TurnRunner,
        message: str,
        history: Sequence[Message],
        conversations: Conversations | None = None,
        template_kwargs: dict[str, Any] | None = None,
        images: Sequence[bytes] = (),
    ) -> ChatTurn:
        """A turn of ``message`` (some text, or none beside ``images``) after ``history``
        (user/assistant messages); ``template_kwargs``: variables for the chat template
        (``ChatRenderer.using``); ``images``: encoded images the message shows before its
        text. Raises UnsupportedModelError for images to a model that takes none."""
        if check_text(message, "message").strip() == "" and not images:
            raise EmptyMessageError("message is empty: a turn needs some text")
        checked = []
        if images:
            runner.engine.check_images()
            checked = await asyncio.to_thread(checked_images, images)  # (decodes each)
        renderer = runner.renderer.using(template_kwargs)
        history = await off_loop(checked_history, history)
        return cls(runner, message, history, conversations, renderer, checked)

    async def content(self) -> str | list[dict[str, Any]]:
        """The new message's content: its text, or its images (stored, by number) and text."""
        if self._content is None:
            self._content = self.message
            if self.images:
                numbers = await self.runner.registry.images.add(self.images)
                self._content = image_parts(numbers, self.images, self.message)
        return self._content

    async def plan(
        self, agent: AgentRecord, transcript: list[MessageRecord], priority: float
    ) -> TurnPlan:
        """Resume the agent's cache (hot, then disk) and prefill the messages it does not
        cover; without one, prefill everything, from a stored prefix when there is one."""
        runner, renderer = self.runner, self.renderer or self.runner.renderer
        messages = [
            *transcript_messages(agent, transcript),
            *self.history,
            {"role": "user", "content": await self.content()},
        ]
        n_history = len(transcript) + len(self.history)  # the messages before the new one
        start = time.perf_counter()
        offset = len(messages) - n_history - 1  # the system message, if any
        resumed = await runner.caches.resume(agent.id, agent.version)
        conversations = self.conversations
        if resumed is not None:
            # Hashing, rendering and tokenizing grow with the history: off the event loop.
            delta = await asyncio.to_thread(
                self._extend, agent.id, messages, offset, n_history, resumed
            )
            if delta is not None:
                if conversations is not None:
                    self._replies = list(conversations.replies.get(agent.id, []))
                return TurnPlan(delta, resumed.cache, resumed.source, time.perf_counter() - start)
        others = []  # (replies are spliced into text-only conversations)
        if conversations is not None and not images_of(messages):
            others = conversations.borrowed(messages, agent.id)
        if others:
            document = await asyncio.to_thread(render_document, renderer, messages, None, others)
            tokens, self._replies = document.tokens, document.replies
        else:
            tokens = await asyncio.to_thread(renderer.full_prompt, messages)
        source = "rebuilt" if transcript else "none"
        heads = functools.partial(renderer.shared_heads, messages, tokens)
        return await runner.plan_from_prefix(tokens, heads, source, start, priority)

    def _extend(
        self,
        agent_id: str,
        messages: list[Message],
        offset: int,
        n_history: int,
        resumed: Resumed,
    ) -> list[int] | None:
        """The tokens that follow the resumed cache, or None (logged) when it cannot be used:
        it was made from another conversation, or the template does not extend it."""
        count = resumed.message_count
        if count > n_history:  # newer than the transcript, which only removed rows cause
            return None
        digest = conversation_digest(messages[: offset + count])
        if resumed.digest != digest:
            made_from = (
                f"a conversation with digest {resumed.digest}"
                if resumed.digest
                else "a conversation it did not record (saved by an older agentkv)"
            )
            log.warning(
                "agent %r: its %s cache was made from %s, not from the %d messages of its "
                "transcript it claims to cover (digest %s); rebuilding from the transcript",
                agent_id,
                resumed.source,
                made_from,
                count,
                digest,
            )
            return None
        renderer = self.renderer or self.runner.renderer
        delta = renderer.delta(messages, offset + count, resumed.cache.tokens[-1])
        if delta is None:
            log.warning("agent %r: template did not extend its cache; re-prefilling", agent_id)
        return delta

    async def commit(
        self,
        agent: AgentRecord,
        transcript: list[MessageRecord],
        plan: TurnPlan,
        result: GenerationResult,
    ) -> None:
        content = await self.content()
        parts = None if isinstance(content, str) else tuple(content)
        stored = await self.runner.registry.append_messages(
            agent.id,
            [
                *(NewMessage(m["role"], m["content"]) for m in self.history),
                NewMessage("user", self.message, len(plan.prompt_tokens), parts),
                NewMessage("assistant", result.text, len(result.token_ids)),
            ],
            expected_version=agent.version,
        )
        messages = [
            *transcript_messages(agent, transcript),
            *self.history,
            {"role": "user", "content": content},
            {"role": "assistant", "content": result.text},
        ]
        await self.runner.keep(agent, result, plan, messages, stored[-1].position + 1)
        self.message_id = stored[-1].id
        if self.conversations is not None:
            held = (plan.cache.num_tokens if plan.cache else 0) + len(plan.prompt_tokens)
            opened = self.conversations.runner.opened(plan)
            cut = self.conversations.cut_short(result.token_ids)
            parsed = self.conversations.parse(result.text, None, opened, cut)
            renderer = self.renderer or self.runner.renderer
            reply = generated_reply(
                renderer, plan.prompt_tokens, held, result.token_ids, parsed, len(messages) - 1
            )
            self.conversations.remember(agent.id, [*self._replies, reply])

    def reply(self, reply: Reply) -> Reply:
        return dataclasses.replace(reply, message_id=self.message_id)
