"""What both APIs' chat requests reduce to: one new user turn plus the history before it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BeforeValidator, StringConstraints
from pydantic_core import PydanticCustomError

from agentkv import InvalidMessageError, InvalidResponseFormatError, SamplingParams
from agentkv.errors import check_text
from agentkv.prompt import Message
from agentkv.server.errors import APIError
from agentkv.server.limits import MAX_STOP_CHARS
from agentkv.server.sessions import SESSION_PREFIX

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
            None to find the agent by the conversation itself (see :mod:`agentkv.server.identity`).
        system: the system prompt, "" when there is none.
        history: every message before the new turn (for a whole-conversation turn: every
            message but the last, as transcripts store them).
        message: the new user turn (for a whole-conversation turn: the last message as stored).
        max_tokens: None means the runtime's default.
        sampling: None means the agent's own defaults.
        stop: stop strings.
        session: a client session (Claude Code's session id, a Responses API client's
            ``prompt_cache_key``): it has an agent of its own, named with ``session_prefix``.
        document: set for a whole-conversation turn (tools, tool calls and results, system
            messages anywhere): the conversation in chat-template shape, system prompt first,
            answered by ``AgentRuntime.respond``.
        tools: tool definitions for the chat template (OpenAI shape).
        response_format: the reply's shape, OpenAI's chat ``response_format`` (see
            ``agentkv.formats``); None: free text.
    """

    agent_id: str | None
    system: str
    history: list[ChatMessage]
    message: str
    max_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop: list[str] = field(default_factory=list)
    session: str | None = None
    session_prefix: str = SESSION_PREFIX
    document: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """A forced call (whole conversations only): ``"required"`` or ``{"name": ...}``."""
    logprobs: int | None = None
    """Report tokens' logprobs with this many alternatives (None: no logprobs)."""
    continues: tuple[str, int] | None = None
    """(agent, message id): the agent answers if that is still its last message (a
    Responses API ``previous_response_id``); else the request is matched as any other."""
    format_field: str = "response_format"
    """What the API calls ``response_format`` (its ``json_schema`` object is flattened into it
    on the APIs that call it otherwise)."""
    template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template (``chat_template_kwargs``, ``enable_thinking`` from the
    API's reasoning switch)."""
    reasoning_budget: int | None = None
    """The most tokens a reasoning model thinks for (Anthropic's ``thinking.budget_tokens``)."""
    prediction: str | None = None
    """Text the reply is expected to restate (Chat Completions' ``prediction``)."""

    def format_error(self, exc: InvalidResponseFormatError) -> APIError:
        """``exc`` as a 400 naming the field as this request's API calls it."""
        field, _, reason = str(exc).partition(": ")
        if self.format_field != "response_format" and field.startswith("response_format"):
            rest = field.removeprefix("response_format").removeprefix(".json_schema")
            field = self.format_field + rest
        return APIError.invalid(f"{field}: {reason}", field)

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``AgentRuntime.chat`` / ``stream``."""
        return {
            "max_tokens": self.max_tokens,
            "sampling": self.sampling,
            "stop": self.stop,
            "response_format": self.response_format,
            "logprobs": self.logprobs,
            "template_kwargs": self.template_kwargs,
            "reasoning_budget": self.reasoning_budget,
            "prediction": self.prediction,
        }


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
        at = f"{where}.content.{i}"
        if block.get("type") != "text":
            raise APIError.invalid(
                f"{at}: only text blocks are supported, got type {block.get('type')!r}", at
            )
        texts.append(text_field(block.get("text"), f"{at}.text"))
    return TEXT_JOINER.join(texts)


def content_of(content: str | list[dict[str, Any]] | None, where: str) -> str | list[dict]:
    """A user message's content given as a string or a list of text and ``image_url`` parts:
    its text, or its parts where it holds an image (``agentkv.server.api.image_blocks``)."""
    from agentkv.server.api.image_blocks import joined, openai_image

    if not isinstance(content, list):
        return text_of(content, where)
    parts = []
    for i, block in enumerate(content):
        at = f"{where}.content.{i}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image_url":
            parts.append(openai_image(block, at))
        elif kind == "text":
            parts.append({"type": "text", "text": text_field(block.get("text"), f"{at}.text")})
        else:
            raise APIError.invalid(
                f"{at}: only text and image_url parts are supported, got type {kind!r}", at
            )
    return joined(parts, TEXT_JOINER)


def text_field(text: object, where: str) -> str:
    """A text block's ``text``: a 400 naming ``where`` unless it is a string UTF-8 can encode."""
    if not isinstance(text, str):
        raise APIError.invalid(f"{where}: must be a string, got {_json_type(text)}", where)
    return checked_text(text, where)


def _json_type(value: object) -> str:
    names = {bool: "boolean", int: "number", float: "number", dict: "object", list: "array"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


_NEEDS = {
    "user": "a user message needs text",
    "assistant": "an assistant message needs text or tool calls",
}


def refuse_empty(role: str, content: object, where: str) -> None:
    """A 400 naming ``where`` for a user or assistant message with nothing in it (None, ``""``
    or ``[]``), as Anthropic's API does; callers pass no assistant message with tool calls."""
    if role in _NEEDS and content in (None, "", []):
        raise APIError.invalid(f"{where}.content: is empty; {_NEEDS[role]}", where)


def _encodable(value: object) -> object:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(
                "string_unicode",
                "not valid Unicode text: a lone surrogate {char} at character {at}; send UTF-8 "
                "text (pair or drop the surrogate)",
                {"char": repr(value[exc.start]), "at": exc.start},
            ) from None
    return value


UTF8 = BeforeValidator(_encodable)
"""Refuses a string field UTF-8 cannot encode (a lone surrogate), naming the field; pydantic's
own message for it, on a field with constraints, says only that it is not a valid string."""
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS), UTF8]
"""A stop string as a request field: UTF-8 text of at most ``MAX_STOP_CHARS`` characters."""


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


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""OpenAI's ``reasoning_effort`` values: the first two switch a reasoning model's thinking off
(``enable_thinking=False``), the others leave it on (its length is the model's own)."""


def thinking_of(effort: object, where: str) -> bool | None:
    """Whether an OpenAI ``reasoning_effort`` asks for thinking (None: not set)."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise APIError.invalid(
            f"{where}: {effort!r} is not one of {', '.join(REASONING_EFFORTS)}", where
        )
    return effort not in ("none", "minimal")


def template_kwargs(
    given: dict[str, Any] | None, thinking: bool | None, effort: str | None = None
) -> dict[str, Any] | None:
    """A request's chat template variables: its ``chat_template_kwargs``, with
    ``enable_thinking`` from the API's reasoning switch and ``reasoning_effort`` from an
    OpenAI effort that sets a level (``low`` … ``high``, ``xhigh`` as ``high``: gpt-oss's
    template and harmony read it) unless they set them themselves."""
    kwargs = dict(given or {})
    if thinking is not None:
        kwargs.setdefault("enable_thinking", thinking)
    if effort in ("low", "medium", "high", "xhigh"):
        kwargs.setdefault("reasoning_effort", "high" if effort == "xhigh" else effort)
    return kwargs or None


def sampling_from(**given: Any) -> SamplingParams | None:
    """SamplingParams from the sampling fields a request set, or None when it set none.

    A request that sets any of ``temperature``, ``top_p``, ``top_k``, ``seed`` gets both
    APIs' default temperature (1.0) for an unset one; penalties and ``logit_bias`` alone keep
    greedy decoding.
    """
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    sampled = given.keys() & {"temperature", "top_p", "top_k", "seed"}
    return SamplingParams(**{"temperature": 1.0 if sampled else 0.0, **given})
