"""Chat messages before they are rendered: checked (usable text, template variables a request
may set), digested (what a cache was made from), read from a transcript, and checked off the
event loop when there are thousands of them."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from agentkv.errors import ChatTemplateError, InvalidMessageError, check_text
from agentkv.store import AgentRecord, MessageRecord

Message = dict[str, Any]
"""A chat message as templates read it: ``role``, ``content`` and, for tool calling,
``tool_calls`` (assistant) or role ``tool``; a reasoning model's ``reasoning_content``."""
OFF_LOOP_MESSAGES = 256
"""Conversations at least this long are checked in a worker thread (see :func:`off_loop`)."""

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "conversation"}
)
"""Template variables the renderer sets itself: a request's ``chat_template_kwargs`` may not."""


def checked_template_kwargs(template_kwargs: Any) -> dict[str, Any]:
    """A request's ``chat_template_kwargs``, checked. Raises ChatTemplateError for a name the
    renderer sets itself or a value that is not JSON."""
    if not isinstance(template_kwargs, dict):
        raise ChatTemplateError(
            f"chat_template_kwargs must be an object, got {type(template_kwargs).__name__}"
        )
    for name, value in template_kwargs.items():
        if name in RESERVED_TEMPLATE_KWARGS:
            raise ChatTemplateError(
                f"chat_template_kwargs: {name!r} is set by the server, not the request"
            )
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ChatTemplateError(f"chat_template_kwargs: {name!r} is not a JSON value") from None
    return template_kwargs


def conversation_digest(
    messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
) -> str:
    """A digest of messages' roles and text content (and of the tools they were rendered
    with): stored with a cache covering them, so that a cache is used only for the
    conversation it was made from."""
    digest = hashlib.blake2b(digest_size=16)
    if tools:
        digest.update(b"tools\0%s\0" % json.dumps(tools, sort_keys=True, default=str).encode())
    for m in messages:
        data = str(m["content"]).encode("utf-8", "surrogatepass")
        digest.update(b"%s\0%d\0%s" % (str(m["role"]).encode(), len(data), data))
    return digest.hexdigest()


def checked_texts(messages: Sequence[Message]) -> list[Message]:
    """Chat-template messages whose text content UTF-8 can encode (else InvalidMessageError
    naming the message)."""
    for i, m in enumerate(messages):
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str):
                check_text(m[key], f"messages[{i}].{key}")
        if isinstance(m.get("content"), list):  # content parts: text and images
            for j, part in enumerate(m["content"]):
                if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                    raise InvalidMessageError(
                        f"messages[{i}].content[{j}]: a part is a text or an image"
                    )
                if part["type"] == "text":
                    check_text(part.get("text"), f"messages[{i}].content[{j}].text")
    return list(messages)


def checked_history(messages: Sequence[Message]) -> list[Message]:
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


def checked_appended(messages: Sequence[Message]) -> list[Message]:
    """:func:`checked_history`, where a user message's content may also be a list of text
    parts and image parts holding their bytes (``{"type": "image", "data": <bytes>}``)."""
    texts = [{**m, "content": ""} if isinstance(m.get("content"), list) else m for m in messages]
    checked = checked_history(texts)
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), list):
            continue
        if m["role"] != "user":
            raise InvalidMessageError(f"messages[{i}]: only a user message shows images")
        checked_texts([m])  # (each part a text or an image)
        for j, part in enumerate(m["content"]):
            if part["type"] == "image" and not isinstance(part.get("data"), bytes | bytearray):
                raise InvalidMessageError(
                    f"messages[{i}].content[{j}]: an image part holds its bytes as 'data'"
                )
        checked[i]["content"] = list(m["content"])
    return checked


def transcript_messages(agent: AgentRecord, transcript: list[MessageRecord]) -> list[Message]:
    """The agent's system prompt and stored messages, as chat-template messages."""
    system = [{"role": "system", "content": agent.system_prompt}] if agent.system_prompt else []
    return system + [
        {"role": str(m.role), "content": m.content if m.parts is None else list(m.parts)}
        for m in transcript
    ]


async def off_loop(
    check: Callable[[Sequence[Message]], list[Message]], messages: Sequence[Message]
) -> list[Message]:
    """``check(messages)``, in a worker thread for a long list (thousands of messages): it
    grows with the list, and other turns' clients wait while the event loop runs it."""
    if len(messages) < OFF_LOOP_MESSAGES:
        return check(messages)
    return await asyncio.to_thread(check, messages)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def text_chars(value: Any) -> int:
    """Characters of the text in ``value`` (text, or lists and dicts of it)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_chars(v) for v in value)
    return 0
