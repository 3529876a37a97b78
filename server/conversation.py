"""What both APIs' chat requests reduce to: one new user turn plus the history before it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agents import InvalidMessageError, SamplingParams
from agents.errors import check_text
from agents.prompt import Message
from server.errors import APIError

TEXT_JOINER = "\n"
"""Joins the text blocks of one message (or of a system prompt given as blocks)."""


@dataclass(slots=True, frozen=True)
class ChatMessage:
    """One message of a request's history: ``role`` is "user" or "assistant"."""

    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(slots=True)
class TurnRequest:
    """A request, normalized.

    Attributes:
        agent_id: the agent named by the request (header, ``metadata.user_id`` or ``user``), or
            None to find the agent by the conversation itself (see :mod:`server.identity`).
        system: the system prompt, "" when there is none.
        history: every message before the new turn (for a whole-conversation turn: every
            message but the last, as transcripts store them).
        message: the new user turn (for a whole-conversation turn: the last message as stored).
        max_tokens: None means the runtime's default.
        sampling: None means the agent's own defaults.
        stop: stop strings.
        session: a client session (Claude Code's session id): it has an agent of its own.
        document: set for a whole-conversation turn (tools, tool calls and results, system
            messages anywhere): the conversation in chat-template shape, system prompt first,
            answered by ``AgentRuntime.respond``.
        tools: tool definitions for the chat template (OpenAI shape).
    """

    agent_id: str | None
    system: str
    history: list[ChatMessage]
    message: str
    max_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop: list[str] = field(default_factory=list)
    session: str | None = None
    document: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``AgentRuntime.chat`` / ``stream``."""
        return {"max_tokens": self.max_tokens, "sampling": self.sampling, "stop": self.stop}


def text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """The text of a message given as a string or as a list of text blocks.

    Raises:
        APIError: a block that is not text (images, tool calls are not supported).
    """
    if content is None:
        raise APIError.invalid(f"{where}: content is required", param=where)
    if isinstance(content, str):
        return checked_text(content, where)
    texts = []
    for i, block in enumerate(content):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError.invalid(
                f"{where}.content.{i}: only text blocks are supported, got type "
                f"{block.get('type')!r}",
                param=f"{where}.content",
            )
        texts.append(checked_text(block["text"], f"{where}.content.{i}.text"))
    return TEXT_JOINER.join(texts)


def checked_text(text: str, where: str) -> str:
    """``text``, or a 400 naming ``where`` when UTF-8 cannot encode it (lone surrogates)."""
    try:
        return check_text(text, where)
    except InvalidMessageError as exc:
        raise APIError.invalid(str(exc), param=where) from None


def split_turn(messages: list[ChatMessage]) -> tuple[list[ChatMessage], str]:
    """(history, new user message) of a request's messages; the last one must be a user turn."""
    if not messages:
        raise APIError.invalid("messages: at least one message is required", param="messages")
    last = messages[-1]
    if last.role != "user":
        raise APIError.invalid(
            f"messages: the last message must be a user message (got {last.role!r}); "
            "continuing a partial assistant message is not supported",
            param="messages",
        )
    return messages[:-1], last.content


def sampling_from(**given: Any) -> SamplingParams | None:
    """SamplingParams from the sampling fields a request set, or None when it set none.

    A request that sets any of them gets both APIs' default temperature (1.0) for the rest.
    """
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    return SamplingParams(**{"temperature": 1.0, **given})
