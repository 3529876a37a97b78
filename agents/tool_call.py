"""A tool call the model made, and a reply split into its text and its calls."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}", compare=False)
    written: str | None = field(default=None, compare=False)
    """The arguments' JSON text as the model wrote it, when it was streamed so (a cut call's:
    as far as it was written, see ``agentkv.cut_calls``)."""
    cut: bool = field(default=False, compare=False)
    """The reply was cut short (max_tokens, the context) while the model wrote this call."""

    @property
    def arguments_json(self) -> str:
        """The arguments as JSON text: as streamed, else serialized."""
        return self.written if self.written is not None else json.dumps(self.arguments)

    def as_template(self) -> dict[str, Any]:
        """The OpenAI/Hugging Face shape chat templates read (``message["tool_calls"]``)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True, frozen=True)
class ParsedReply:
    """A reply split into its plain text and its tool calls (the last one cut short when the
    reply was, see ``agentkv.cut_calls``)."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()

    def as_message(self) -> dict[str, Any]:
        """The reply as a chat-template assistant message."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.as_template() for call in self.tool_calls]
        return message

    def same_as(self, text: str, tool_calls: list[ToolCall]) -> bool:
        """Whether a client's copy of this reply says the same (ids and outer spaces aside)."""
        return self.text.strip() == text.strip() and list(self.tool_calls) == tool_calls
