"""The Anthropic Messages and count_tokens request bodies (every field of the official SDK,
each honoured, accepted or refused by name) and the turn a Messages request asks for."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from agentkv.prompt import Message
from agentkv.server.api.anthropic_content import is_plain, template_messages, template_tools
from agentkv.server.api.image_blocks import merged
from agentkv.server.bodies import FieldPolicy
from agentkv.server.conversation import (
    TEXT_JOINER,
    ChatMessage,
    StopString,
    TurnRequest,
    sampling_from,
    split_turn,
    template_kwargs,
    text_of,
)
from agentkv.server.errors import APIError
from agentkv.server.limits import MAX_STOP_SEQUENCES
from agentkv.server.sessions import named_agent, session_of, without_volatile_lines

Content = str | list[dict[str, Any]]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant", "system"]
    content: Content


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = None


_NO_EFFECT = {
    "context_management": "Claude Code's context editing: the conversation is answered as sent",
    "cache_control": "caching is automatic here",
    "service_tier": "there is one tier here",
    "speed": "there is one speed here",
    "user_profile_id": "Anthropic's attribution",
    "workspace_id": "there is one workspace here",
}
COUNT_FIELDS = FieldPolicy(
    "Anthropic count_tokens",
    honoured=frozenset({"model", "messages", "system", "tools", "tool_choice"}),
    accepted={
        **_NO_EFFECT,
        "output_config": "a reply's format does not change its prompt",
        "thinking": "the prompt is counted as the template renders it by default",
    },
)
MESSAGES_FIELDS = FieldPolicy(
    "Anthropic Messages",
    honoured=frozenset(
        {
            *("model", "messages", "system", "tools", "tool_choice", "max_tokens"),
            *("temperature", "top_p", "top_k", "stop_sequences", "metadata", "stream"),
            *("output_config", "output_format", "thinking"),
        }
    ),
    accepted={
        **_NO_EFFECT,
        "inference_geo": "inference runs here",
        "diagnostics": "no cache-miss diagnostics come back (see x-agent-id and the logs)",
    },
    refused={"container": "code execution containers are not run here"},
)


class CountTokensRequest(BaseModel):
    """Fields are honoured, accepted without effect or refused (``COUNT_FIELDS``,
    ``MESSAGES_FIELDS``: ``output_config.format`` is honoured, its ``effort`` has no effect);
    any other field is logged once by name and not used."""

    model_config = ConfigDict(extra="allow")
    FIELDS: ClassVar[FieldPolicy] = COUNT_FIELDS

    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    output_config: dict[str, Any] | None = None

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Content | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None

    def conversation(
        self, keep_volatile: bool = False
    ) -> tuple[str, list[Message], list[dict[str, Any]] | None]:
        """(system prompt, messages in chat-template shape, tools). The system prompt loses
        its per-request metadata lines (``agentkv.server.sessions.VOLATILE_LINES``) unless
        ``keep_volatile``. Raises APIError (400)."""
        self.FIELDS.check(self)
        system = self.system if keep_volatile else without_volatile_lines(self.system)
        system = "" if system is None else text_of(system, "system")
        messages: list[Message] = []
        for i, m in enumerate(self.messages):
            for message in template_messages(m.role, m.content, f"messages.{i}"):
                last = messages[-1] if messages else None
                if (  # as Anthropic does: consecutive user (or system) text is one turn
                    last is not None
                    and last["role"] == message["role"] != "assistant"
                    and message["role"] != "tool"
                ):
                    last["content"] = merged(last["content"], message["content"], TEXT_JOINER)
                else:
                    messages.append(message)
        return system, messages, template_tools(self.tools, self.tool_choice)


def forced_tool(choice: dict[str, Any] | None) -> str | dict[str, str] | None:
    """Anthropic's ``tool_choice`` as ``AgentRuntime.respond`` takes it: ``{"type": "any"}``
    is ``"required"``, ``{"type": "tool", "name": ...}`` that tool; ``auto`` and ``none``
    leave the model free (``none`` renders no tools)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None or kind in ("auto", "none"):
        return None
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str) and choice["name"]:
        return {"name": choice["name"]}
    raise APIError.invalid(
        "tool_choice: must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
        "tool_choice",
    )


class MessagesRequest(CountTokensRequest):
    FIELDS: ClassVar[FieldPolicy] = MESSAGES_FIELDS

    max_tokens: StrictInt = Field(ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(default=None, ge=0)
    stop_sequences: list[StopString] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    metadata: Metadata | None = None
    stream: StrictBool = False
    output_format: dict[str, Any] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    container: Any = None

    @property
    def response_format(self) -> dict[str, Any] | None:
        """Structured outputs (``output_config.format``, or the older ``output_format``:
        ``{"type": "json_schema", "schema": ...}``) in the chat shape ``agentkv.formats``
        reads; None: free text."""
        fmt = (self.output_config or {}).get("format") or self.output_format
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            return fmt
        return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}

    def reasoning(self, thinks: bool) -> tuple[bool | None, int | None]:
        """``thinking`` as (``enable_thinking`` for the template, or None: the template's
        default; a cap on reasoning tokens, or None): ``enabled`` (with ``budget_tokens``, the
        cap, on a model whose reasoning can be capped: ``thinks``), ``adaptive`` (the
        model's own length) or ``disabled``."""
        thinking = self.thinking
        if thinking is None:
            return None, None
        kind = thinking.get("type")
        if kind == "disabled":
            return False, None
        if kind == "adaptive":
            return True, None
        budget = thinking.get("budget_tokens")
        if kind != "enabled" or type(budget) is not int or budget < 1:
            raise APIError.invalid(
                "thinking: expected {'type': 'enabled', 'budget_tokens': <positive integer>}, "
                "{'type': 'adaptive'} or {'type': 'disabled'}",
                "thinking",
            )
        return True, budget if thinks else None

    def turn(
        self,
        agent_header: str | None,
        session_header: str | None,
        keep_volatile: bool = False,
        thinks: bool = False,
    ) -> TurnRequest:
        system, messages, tools = self.conversation(keep_volatile)
        enable_thinking, budget = self.reasoning(thinks)
        user_id = self.metadata.user_id if self.metadata else None
        session = session_header or session_of(user_id)
        request = TurnRequest(
            agent_id=agent_header or (named_agent(user_id) if session is None else None),
            system=system,
            history=[],
            message="",
            max_tokens=self.max_tokens,
            sampling=sampling_from(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
            ),
            stop=list(self.stop_sequences or []),
            session=session,
            tools=tools,
            response_format=self.response_format,
            tool_choice=forced_tool(self.tool_choice) if tools else None,
            format_field="output_config.format"
            if (self.output_config or {}).get("format") is not None
            else "output_format",
            template_kwargs=template_kwargs(None, enable_thinking),
            reasoning_budget=budget,
        )
        if session is None and tools is None and is_plain(messages):
            chat = [ChatMessage(m["role"], m["content"]) for m in messages]
            request.history, request.message = split_turn(chat)
        else:
            if not messages or messages[-1]["role"] == "assistant":
                split_turn([ChatMessage(m["role"], "") for m in messages])  # the plain path's 400
            system_message = [{"role": "system", "content": system}] if system else []
            request.document = [*system_message, *messages]
        return request
