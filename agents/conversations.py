"""Whole-conversation turns (``AgentRuntime.respond``): the client's copy is the document.

Claude Code and other clients that resend the whole conversation each time are answered here:
the conversation is rendered (tools included), the agent's cache is reused up to the longest
common token prefix (see :mod:`agentkv.document`), and afterwards the agent's transcript is the
conversation plus the reply. :class:`DocumentTurn` is the :class:`agentkv.turns.Turn` that
``TurnRunner`` runs; :class:`Conversations` keeps what it needs between turns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.document import (
    CachedReply,
    DocumentPrompt,
    generated_reply,
    recover_replies,
    render_document,
    tool_calls_of,
)
from agentkv.engine.request import GenerationResult
from agentkv.errors import EmptyMessageError, ToolsUnsupportedError, check_text
from agentkv.images import shows_images, unnamed_images, with_stored_images
from agentkv.messages import Message, checked_texts, common_prefix, off_loop
from agentkv.prompt import ChatRenderer
from agentkv.store import AgentRecord, MessageRecord, NewMessage
from agentkv.store.images import parts_text
from agentkv.tool_calls import ParsedReply, ToolFormat
from agentkv.turns import TurnRunner
from agentkv.types import CacheSource, Reply, TurnPlan


class Conversations:
    """The replies generated into each agent's hot cache (to find them in the next document
    the client sends), and reading and storing tool calls."""

    def __init__(self, runner: TurnRunner, tool_format: ToolFormat | None):
        self.runner = runner
        self.tool_format = tool_format
        self.replies: dict[str, list[CachedReply]] = {}

    async def turn(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> DocumentTurn:
        """The turn answering ``messages`` (checked: usable text, not ending with an assistant
        message, tools only for a model that can call them); ``template_kwargs``: variables
        for the chat template (``ChatRenderer.using``)."""
        self.check_tools(tools)
        renderer = self.runner.renderer.using(template_kwargs)
        messages = await off_loop(checked_texts, messages)
        if not messages or messages[-1]["role"] == "assistant":
            raise EmptyMessageError("the conversation must end with a non-assistant message")
        if shows_images(messages):
            self.runner.engine.check_images()
            messages = await with_stored_images(self.runner.registry.images, messages)
        return DocumentTurn(self, messages, tools, renderer)

    async def count_tokens(
        self, messages: list[Message], system: str | None, tools: list[dict[str, Any]] | None
    ) -> int:
        """Tokens of the conversation rendered ready to answer (in a worker thread)."""
        self.check_tools(tools)
        head = [{"role": "system", "content": check_text(system, "system")}] if system else []
        conversation = [*head, *await off_loop(checked_texts, messages)]
        if shows_images(conversation):  # (counted as any image of the model: not stored)
            self.runner.engine.check_images()
            conversation = [unnamed_images(m) for m in conversation]
        renderer = self.runner.renderer
        return len(await asyncio.to_thread(renderer.full_prompt, conversation, tools))

    def check_tools(self, tools: list[dict[str, Any]] | None) -> None:
        if tools and self.tool_format is None:
            raise ToolsUnsupportedError(
                f"model {self.runner.config.model!r} cannot call tools: its tokenizer has no "
                "tool-call format mlx-lm knows (no tool_call_start/tool_parser); send no tools"
            )

    def borrowed(self, messages: Sequence[Message], agent_id: str) -> list[CachedReply]:
        """Another agent's generated replies that ``messages`` repeat, each at its own place:
        the longest run of them from the first (that agent's conversation is most likely the
        one whose cache this one can resume). Spliced in as generated, they keep a new
        conversation's tokens equal to that cache's past its first reply (retokenized text
        may split otherwise), so siblings and branches share all they have in common."""
        best: list[CachedReply] = []
        for other, replies in self.replies.items():
            if other == agent_id or len(replies) <= len(best):
                continue
            run = []
            for reply in replies:
                at = reply.message
                if at is None or at >= len(messages) or messages[at]["role"] != "assistant":
                    break
                message = messages[at]
                if not reply.parsed.same_as(message.get("content") or "", tool_calls_of(message)):
                    break
                run.append(reply)
            if len(run) > len(best):
                best = run
        return best

    def remember(self, agent_id: str, replies: list[CachedReply]) -> None:
        """``agent_id``'s replies now in its cache. Only agents the hot tier holds keep them:
        an agent resumed from disk finds its replies again in its cache's tokens
        (``recover_replies``), so a long-running server holds no more of them than of caches."""
        self.replies[agent_id] = replies
        hot = self.runner.caches.hot
        if len(self.replies) > len(hot):
            for other in [a for a in self.replies if a not in hot]:
                del self.replies[other]

    def fork(self, source_id: str, agent_id: str) -> None:
        if source_id in self.replies:
            self.remember(agent_id, list(self.replies[source_id]))

    def drop(self, agent_id: str) -> None:
        self.replies.pop(agent_id, None)

    def parse(
        self,
        text: str,
        tools: list[dict[str, Any]] | None,
        opened: bool = False,
        cut: bool = False,
    ) -> ParsedReply:
        """A reply's answer (its reasoning left out; ``opened``: the reply started inside
        it), split into text and tool calls (``cut``: the reply did not end with an
        end-of-turn token, see :meth:`cut_short`)."""
        if (reasoning := self.runner.reasoning) is not None:
            _, text = reasoning.split(text, opened)
        if self.tool_format is None:
            return ParsedReply(text)
        return self.tool_format.parse(text, tools, cut)

    def cut_short(self, token_ids: Sequence[int]) -> bool:
        """Whether a reply of these tokens was cut short (max_tokens, the context, a stop
        string), not ended by the model: a tool call it was writing comes back as far as it
        was written (``agentkv.cut_calls``)."""
        return not token_ids or token_ids[-1] not in self.runner.renderer.eos_token_ids

    def stored_text(self, message: Message) -> str:
        """A message as transcripts store it: its text, then its tool calls' markup."""
        text = message.get("content") or ""
        if isinstance(text, list):  # content parts (images): their text
            text = parts_text(text)
        calls = tool_calls_of(message)
        if calls and self.tool_format is not None:
            text += self.tool_format.markup(calls)
        return text


@dataclass(slots=True)
class DocumentTurn:
    """A conversation the client resent whole, to answer (see the module docstring)."""

    conversations: Conversations
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    renderer: ChatRenderer
    document: DocumentPrompt | None = field(default=None, init=False)
    cached: CachedReply | None = field(default=None, init=False)
    message_id: int | None = field(default=None, init=False)

    async def plan(
        self, agent: AgentRecord, transcript: list[MessageRecord], priority: float
    ) -> TurnPlan:
        """Render the conversation and resume from the longest prefix the cache shares; with
        no usable cache of its own, from a stored prefix (another conversation's system prompt
        and tools)."""
        conversations, tools = self.conversations, self.tools
        runner = conversations.runner
        renderer = self.renderer
        start = time.perf_counter()
        # The cache's own tokens are compared with the document's: no digest check is needed.
        resumed = await runner.caches.resume(agent.id, agent.version)
        cache = resumed.cache if resumed else None
        source: CacheSource = resumed.source if resumed else "none"
        known = conversations.replies.get(agent.id)
        # No cache of its own: other conversations' replies, for a prefix of theirs (text).
        others = []
        if not cache and not shows_images(self.messages):
            others = conversations.borrowed(self.messages, agent.id)

        def render() -> tuple[DocumentPrompt, int]:
            replies = [r for r in known or [] if cache and r.is_in(cache.tokens)] or others
            if known is None and cache is not None:  # first turn since a restart
                replies = recover_replies(
                    renderer,
                    lambda text, cut: conversations.parse(text, tools, cut=cut),
                    lambda parsed: conversations.stored_text(parsed.as_message()),
                    cache.tokens,
                    [(str(m.role), m.content, m.token_count) for m in transcript],
                    first=1 if self.messages[0]["role"] == "system" else 0,
                )
            document = render_document(renderer, self.messages, tools, replies)
            shared = common_prefix(document.tokens, cache.tokens) if cache else 0
            return document, min(shared, len(document.tokens) - 1)  # prefill at least one

        document, shared = await asyncio.to_thread(render)
        self.document = document
        # A rewritten last turn: back to where it differs, else to the last turn boundary.
        kept = cache.longest_prefix(shared) if cache else None
        if kept is None and cache is not None:
            source = "rebuilt"
        n = kept.num_tokens if kept else 0
        heads = functools.partial(renderer.shared_heads, self.messages, document.tokens, tools)
        if n < max(shared, runner.caches.disk.block_tokens):
            # Its own cache falls short of where the conversation differs from it (or holds
            # less than a block): other conversations' caches may hold more.
            plan = await runner.plan_from_prefix(
                document.tokens, heads, source, start, priority, own=kept
            )
        else:
            plan = TurnPlan(
                document.tokens[n:],
                kept,
                source,
                time.perf_counter() - start,
                cache_points=await runner.cache_points(heads, n),
            )
        # Clients that resend whole conversations may send this reply back otherwise than it
        # is generated (a framework's own text for its tool calls, a template that drops the
        # reasoning) or drop it: where the history ends is kept, to resume all of it then.
        return dataclasses.replace(plan, checkpoint_at=history_end(renderer, document.tokens))

    async def commit(
        self,
        agent: AgentRecord,
        transcript: list[MessageRecord],
        plan: TurnPlan,
        result: GenerationResult,
    ) -> None:
        conversations, document, messages = self.conversations, self.document, self.messages
        reply = generated_reply(
            self.renderer,
            document.tokens,
            len(document.tokens),
            result.token_ids,
            conversations.parse(
                result.text,
                self.tools,
                conversations.runner.opened(plan),
                conversations.cut_short(result.token_ids),
            ),
            len(messages),  # the conversation's next message
        )
        self.cached = reply
        system, first = None, 0
        if messages[0]["role"] == "system":
            system, first = messages[0]["content"], 1
        # Replies keep their token counts: after a restart, recover_replies finds them by those.
        stored = [
            NewMessage(
                m["role"],
                conversations.stored_text(m),
                len(document.spliced[i].tokens) if i in document.spliced else None,
                tuple(m["content"]) if isinstance(m["content"], list) else None,
            )
            for i, m in enumerate(messages)
            if i >= first
        ]
        stored.append(
            NewMessage(
                "assistant",
                conversations.stored_text(reply.parsed.as_message()),
                len(reply.tokens),
            )
        )
        old = [(str(m.role), m.content, m.token_count, m.parts) for m in transcript]
        keep = common_prefix(old, [(m.role, m.content, m.token_count, m.parts) for m in stored])
        keep = min(keep, len(stored) - 1)  # the reply is always (re)written
        records = await conversations.runner.registry.append_messages(
            agent.id,
            stored[keep:],
            replace_from=keep,
            system_prompt=system,
            expected_version=agent.version,
        )
        self.message_id = records[-1].id
        head = [{"role": "system", "content": system}] if system else []
        covered = [
            *head,
            *({"role": m.role, "content": list(m.parts or ()) or m.content} for m in stored),
        ]
        # Clients that resend whole conversations rewrite their last turn: keep its start.
        await conversations.runner.keep(
            agent, result, plan, covered, len(stored), self.tools, checkpoint=True
        )
        conversations.remember(agent.id, [*document.replies, reply])

    def reply(self, reply: Reply) -> Reply:
        return dataclasses.replace(reply, parsed=self.cached.parsed, message_id=self.message_id)


def history_end(renderer: ChatRenderer, tokens: list[int]) -> int:
    """Where a prompt's history ends: before the generation prompt it ends with (all of it
    when it ends otherwise)."""
    opener = renderer.generation_prompt()
    n = len(opener)
    return len(tokens) - n if n and n < len(tokens) and tokens[-n:] == opener else len(tokens)
