"""Prompts of conversations a client resends whole (Claude Code, stateless SDK clients).

Such a request is the document: its system prompt, tools and messages are rendered with the
chat template and compared, token by token, with what the agent's cache holds; the longest
common prefix is reused and only the rest is prefilled. An edited system prompt or a dropped
message thus re-prefills from the first changed token on.

Rendering and re-tokenizing does not reproduce the tokens a reply was generated as (see
:mod:`agentkv.prompt`), so replies the model generated are spliced in as their generated
tokens: each assistant message the client sends back that says what a cached reply said, at
the reply's own place in the conversation, is rendered as a placeholder, and the placeholder is
replaced by that reply's tokens. A reply is matched to its place, not to the first message equal
to it: agents repeat identical tool calls, and a conversation imported before the agent's first
reply holds messages equal to later replies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.escapes import PLACEHOLDER_CHARS, placeholder_at
from agentkv.images import images_of
from agentkv.prompt import ChatRenderer, Message
from agentkv.tool_calls import ParsedReply, ToolCall


@dataclass(slots=True, frozen=True)
class CachedReply:
    """A generated reply: where its tokens start in the agent's cache, what it said, and which
    message of the conversation it is (its index, the system prompt counted; None: unknown)."""

    start: int
    tokens: tuple[int, ...]
    parsed: ParsedReply
    message: int | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def is_in(self, cache_tokens: Sequence[int]) -> bool:
        return tuple(cache_tokens[self.start : self.end]) == self.tokens


@dataclass(slots=True)
class DocumentPrompt:
    """The tokens of a whole conversation, and the generated replies spliced into them."""

    tokens: list[int]
    replies: list[CachedReply]
    spliced: dict[int, CachedReply] = field(default_factory=dict)
    """Index of each message that was replaced by a reply's tokens -> that reply."""


def generated_reply(
    renderer: ChatRenderer,
    prompt_tail: Sequence[int],
    prompt_length: int,
    token_ids: Sequence[int],
    parsed: ParsedReply,
    message: int | None,
) -> CachedReply:
    """The reply just generated after a prompt of ``prompt_length`` tokens (ending with
    ``prompt_tail``), as spliced back into the conversations that resend it: with the end of
    the generation prompt the template leaves out of the history (``reply_opener``), which
    the model saw before it."""
    opener = renderer.reply_opener()
    n = len(opener)
    if n and n <= prompt_length and list(prompt_tail[-n:]) == opener:
        return CachedReply(prompt_length - n, (*opener, *token_ids), parsed, message)
    return CachedReply(prompt_length, tuple(token_ids), parsed, message)


def tool_calls_of(message: Message) -> list[ToolCall]:
    """The tool calls of a template message (``tool_calls`` in the OpenAI shape)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        calls.append(ToolCall(function["name"], function.get("arguments") or {}))
    return calls


def render_document(
    renderer: ChatRenderer,
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None,
    replies: Sequence[CachedReply],
) -> DocumentPrompt:
    """Tokens of ``messages`` ready for the assistant's answer, with ``replies`` spliced in.

    Args:
        renderer: the model's chat template.
        messages: the whole conversation, system messages included.
        tools: tool definitions for the template (None: no tools).
        replies: replies the agent's cache holds, in conversation order.
    """
    probe, spliced, at, j = [], [], [], 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            calls = tool_calls_of(message)
            for k in range(j, len(replies)):
                place = replies[k].message
                if place is not None and place > i:
                    break  # the next reply is a later message's
                if place not in (None, i):
                    continue  # its own message was dropped or rewritten
                if replies[k].parsed.same_as(message.get("content") or "", calls):
                    # Its calls are in the tokens (harmony names the tool results' authors by them).
                    kept = (
                        {"tool_calls": message["tool_calls"]} if renderer.harmony and calls else {}
                    )
                    message = {"role": "assistant", "content": "", **kept}
                    spliced.append(replies[k])
                    at.append(i)
                    j = k + 1
                    break
        probe.append(message)
    rendered = renderer.render(probe, add_generation_prompt=True, tools=tools, placeholders=at)
    where = placeholder_at(rendered, len(spliced))
    if where is None:
        # The template moved or dropped a reply's content: no splicing, plain tokens.
        return DocumentPrompt(renderer.full_prompt(messages, tools), [])
    tokens: list[int] = []
    placed: list[CachedReply] = []
    start = 0
    bounds = [0, *(i + 1 for i in at), len(messages)]  # each piece's messages, images and all
    for k, (end, reply) in enumerate(zip([*where, len(rendered)], [*spliced, None], strict=True)):
        shown = images_of(messages[bounds[k] : bounds[k + 1]])
        tokens += renderer.encode(rendered[start:end], shown)
        if reply is None:
            break
        placed.append(CachedReply(len(tokens), reply.tokens, reply.parsed, at[len(placed)]))
        tokens += reply.tokens
        start = end + PLACEHOLDER_CHARS
        # A reply that ended on an end-of-turn token already holds what the template closes with.
        last = reply.tokens[-1] if reply.tokens else None
        if last in renderer.eos_token_ids:
            eos_text = renderer.tokenizer.decode([last])
            if rendered.startswith(eos_text, start):
                start += len(eos_text)
    return DocumentPrompt(tokens, placed, dict(zip(at, placed, strict=True)))


def recover_replies(
    renderer: ChatRenderer,
    parse: Callable[[str, bool], ParsedReply],
    stored: Callable[[ParsedReply], str],
    cache_tokens: Sequence[int],
    transcript: Sequence[tuple[str, str, int | None]],
    first: int = 0,
) -> list[CachedReply]:
    """Find a transcript's generated replies in its cache's tokens (after a restart, when the
    spans kept in memory are gone).

    A reply starts right after the template's generation prompt and is as many tokens long as
    the transcript recorded; a candidate counts only if its decoded text is the stored reply.

    Args:
        renderer: the model's chat template.
        parse: splits a reply's text into text and tool calls (and whether the reply was
            cut short: it did not end with an end-of-turn token).
        stored: a parsed reply as transcripts store it.
        cache_tokens: the tokens the agent's cache holds.
        transcript: (role, stored content, token count) of each message.
        first: the conversation's index of the transcript's first message (1 after a system
            prompt, which transcripts keep apart).
    """
    probe = [{"role": "user", "content": "x"}]
    opened = renderer.render(probe, add_generation_prompt=True)
    closed = renderer.render(probe, add_generation_prompt=False)
    if not opened.startswith(closed) or opened == closed:
        return []
    marker = renderer.encode(opened[len(closed) :])
    # Replies were recorded with the generation prompt's end the history leaves out.
    opener = renderer.reply_opener()
    back = len(opener) if marker[len(marker) - len(opener) :] == opener else 0
    starts = [
        i + len(marker) - back
        for i in range(len(cache_tokens) - len(marker) + 1)
        if list(cache_tokens[i : i + len(marker)]) == marker
    ]
    replies: list[CachedReply] = []
    at = 0
    for t, (role, content, count) in enumerate(transcript):
        if role != "assistant" or not count:
            continue
        for k in range(at, len(starts)):
            tokens = tuple(cache_tokens[starts[k] : starts[k] + count])
            if len(tokens) < count:
                break
            ended = tokens[-1] in renderer.eos_token_ids
            parsed = parse(
                renderer.tokenizer.decode(list(tokens[:-1] if ended else tokens)), not ended
            )
            if stored(parsed).strip() == content.strip():
                replies.append(CachedReply(starts[k], tokens, parsed, first + t))
                at = k + 1
                break
    return replies
