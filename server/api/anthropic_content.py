"""Anthropic request content → chat-template messages and tools.

Blocks: ``text`` is rendered; ``tool_use`` (assistant) becomes a tool call and ``tool_result``
(user) a ``tool`` message, in the order they come; an assistant's ``thinking`` blocks become
its ``reasoning_content`` (the chat template renders it where it keeps earlier reasoning: a
reasoning model's own thinking, sent back), ``redacted_thinking`` (encrypted) is dropped;
``cache_control`` and other block fields are ignored. ``image`` blocks (base64) in user
messages and tool results become image parts for a vision-language model
(``agentkv.server.api.image_blocks``); ``document`` blocks are refused.
``role: "system"`` messages may appear anywhere, the last place included: Anthropic's API has
no such role, but Claude Code sends one (its list of agent types) after the first user message.
A user or assistant message with empty content (``""``, ``[]``) is refused, as Anthropic does.
"""

from __future__ import annotations

import json
from typing import Any

from agentkv.prompt import Message
from agentkv.server.api.image_blocks import anthropic_image, joined
from agentkv.server.conversation import TEXT_JOINER, checked_text, refuse_empty, text_field
from agentkv.server.errors import APIError

UNREADABLE_BLOCKS = ("document", "search_result", "container_upload")
DROPPED_BLOCKS = ("redacted_thinking",)  # encrypted by Anthropic: nothing to read


def _refuse(where: str, block_type: object) -> APIError:
    if block_type in UNREADABLE_BLOCKS:
        return APIError.invalid(
            f"{where}: {block_type} blocks are not supported: this server's models read text "
            "only; send the content as text",
            param=where,
        )
    return APIError.invalid(f"{where}: unsupported content block type {block_type!r}", where)


def _text(block: dict[str, Any], where: str) -> str:
    return text_field(block.get("text"), f"{where}.text")


def _result_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return checked_text(content, f"{where}.content")
    if not isinstance(content, list):
        raise APIError.invalid(f"{where}.content: must be a string or a list of blocks", where)
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, f"{where}.content.{i}")})
        elif kind == "image":
            parts.append(anthropic_image(block, f"{where}.content.{i}"))
        else:
            raise _refuse(f"{where}.content.{i}", kind)
    return joined(parts, TEXT_JOINER)


def template_messages(role: str, content: str | list[dict[str, Any]], where: str) -> list[Message]:
    """One Anthropic message as chat-template messages (a user message with tool results
    becomes ``tool`` messages and a user message)."""
    refuse_empty(role, content, where)
    if isinstance(content, str):
        return [{"role": role, "content": checked_text(content, where)}]
    out: list[Message] = []
    parts: list[dict[str, Any]] = []  # text (and a user's images)
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []

    def flush_text() -> None:
        if parts:
            out.append({"role": role, "content": joined(parts, TEXT_JOINER)})
            parts.clear()

    for i, block in enumerate(content):
        at = f"{where}.content.{i}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image" and role == "user":
            parts.append(anthropic_image(block, at))
        elif kind in DROPPED_BLOCKS:
            continue
        elif kind == "thinking" and role == "assistant":
            thoughts.append(text_field(block.get("thinking"), f"{at}.thinking"))
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input")
            if not isinstance(block.get("name"), str) or not isinstance(arguments, dict):
                raise APIError.invalid(f"{at}: tool_use needs a 'name' and an 'input' object", at)
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            flush_text()
            out.append(
                {
                    "role": "tool",
                    "content": _result_content(block.get("content"), at),
                    "tool_call_id": str(block.get("tool_use_id", "")),
                }
            )
        else:
            raise _refuse(at, kind)
    if role == "assistant":
        message: Message = {"role": "assistant", "content": joined(parts, TEXT_JOINER)}
        if calls:
            message["tool_calls"] = calls
        if thoughts:  # the template renders it where it keeps it (Qwen3: within a tool loop)
            message["reasoning_content"] = "\n".join(thoughts)
        return [message]
    flush_text()
    return out


def is_plain(messages: list[Message]) -> bool:
    """Whether a conversation is only user and assistant text (the transcript-document path)."""
    return all(
        m["role"] in ("user", "assistant")
        and "tool_calls" not in m
        and isinstance(m["content"], str)
        for m in messages
    )


def template_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict] | None:
    """Anthropic tool definitions in the OpenAI shape chat templates render.

    ``tool_choice: {"type": "none"}`` renders no tools; the others render all of them (a
    forced call is enforced while decoding, see ``MessagesRequest.turn``).
    """
    if not tools or (isinstance(tool_choice, dict) and tool_choice.get("type") == "none"):
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise APIError.invalid(f"tools.{i}: a tool needs a 'name'", param=f"tools.{i}")
        function = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object"}
        out.append({"type": "function", "function": function})
    return out


def tool_input_json(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)
