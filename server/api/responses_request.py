"""The Responses API's request body (every field of the official SDK, each honoured, accepted
or refused by name) and the turn it asks for."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
)

from agentkv.server.api.openai_request import forced_choice
from agentkv.server.api.responses_input import Conversation, conversation
from agentkv.server.api.stored_responses import items_of
from agentkv.server.bodies import FieldPolicy
from agentkv.server.conversation import TurnRequest, sampling_from, template_kwargs, thinking_of
from agentkv.server.errors import APIError
from agentkv.server.logprobs import top_logprobs
from agentkv.server.sessions import RESPONSES_SESSION_PREFIX, STATELESS_PREFIX
from agentkv.store import ResponseRecord

LOGPROBS_INCLUDE = "message.output_text.logprobs"


ACCEPTED_INCLUDES = frozenset({"reasoning.encrypted_content", LOGPROBS_INCLUDE})


RESPONSES_FIELDS = FieldPolicy(
    "Responses API",
    honoured=frozenset(
        {
            *("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls"),
            *("max_output_tokens", "max_tool_calls", "temperature", "top_p", "stream", "store"),
            *("prompt_cache_key", "metadata", "text", "truncation", "include", "top_logprobs"),
            *("previous_response_id", "reasoning"),
        }
    ),
    accepted={
        "user": "OpenAI's abuse monitoring",
        "safety_identifier": "OpenAI's abuse monitoring",
        "service_tier": "there is one tier here",
        "client_metadata": "Codex's own bookkeeping",
        "stream_options": "the stream's events are always the same",
        "prompt_cache_options": "caches are kept by agentkv's own tiers",
        "prompt_cache_retention": "caches are kept by agentkv's own tiers",
        "context_management": "a conversation over the context is refused (400), not compacted",
        "image": "no images are generated here",
    },
    refused={
        "conversation": "continue a stored response with previous_response_id, or send the "
        "whole conversation as input",
        "background": "responses run in the request",
        "background_options": "responses run in the request",
        "prompt": "prompt templates are stored by OpenAI",
        "moderation": "moderation is not run here",
        "access_programs": "OpenAI's access programs",
    },
)


class ResponsesRequest(BaseModel):
    """Fields are honoured, accepted without effect or refused (``RESPONSES_FIELDS``; see the
    module docstring); any other field is logged once."""

    model_config = ConfigDict(extra="allow")
    FIELDS: ClassVar[FieldPolicy] = RESPONSES_FIELDS

    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    max_tool_calls: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: StrictBool = False
    store: StrictBool | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    prompt: Any = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    context_management: Any = None
    image: Any = None
    background_options: Any = None
    moderation: Any = None
    access_programs: Any = None
    _read: Conversation | None = PrivateAttr(default=None)

    def turn(
        self,
        agent_header: str | None,
        session_header: str | None,
        earlier: list[ResponseRecord],
    ) -> TurnRequest:
        """The turn this request asks for, after the ``earlier`` responses it continues.
        Raises APIError (400) for what it cannot honour."""
        self._refuse_unsupported()
        read = conversation(self.input, self.instructions, self.tools, items_of(earlier))
        if not read.messages or read.messages[-1]["role"] == "assistant":
            raise APIError.invalid(
                "input: the conversation must end with a user message or a function_call_output "
                "(continuing an assistant message is not supported)",
                "input",
            )
        self._read = read
        session = None if agent_header else (self.prompt_cache_key or session_header)
        last, continues = earlier[-1] if earlier else None, None
        if last is not None and last.latest and last.message_id is not None:
            assert last.agent_id is not None
            if not last.agent_id.startswith(STATELESS_PREFIX):  # those: found by transcript
                continues = (last.agent_id, last.message_id)
        return TurnRequest(
            agent_id=agent_header,
            continues=continues,
            system=read.system,
            history=[],
            message="",
            max_tokens=self.max_output_tokens,
            sampling=sampling_from(temperature=self.temperature, top_p=self.top_p),
            session=session,
            session_prefix=RESPONSES_SESSION_PREFIX,
            document=read.document,
            tools=read.tools if self.tool_choice != "none" else None,
            response_format=self.response_format,
            tool_choice=forced_choice(self.tool_choice, "tool_choice"),
            logprobs=top_logprobs(self.wants_logprobs, self.top_logprobs),
            format_field="text.format",
            template_kwargs=template_kwargs(
                None,
                thinking_of(effort := (self.reasoning or {}).get("effort"), "reasoning.effort"),
                effort,
            ),
        )

    @property
    def wants_logprobs(self) -> bool:
        """Logprobs asked for: ``include`` names them, or ``top_logprobs`` is set."""
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None

    def _refuse_unsupported(self) -> None:
        def refuse(field: str, why: str) -> None:
            raise APIError.invalid(f"{field}: {why}", field)

        self.FIELDS.check(self)
        for value in self.include or []:
            if value not in ACCEPTED_INCLUDES:
                refuse("include", f"{value!r} is not supported")
        if self.truncation == "auto":
            refuse(
                "truncation",
                "'auto' is not supported: a conversation over the context is refused, not cut",
            )

    @property
    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` in the chat shape ``agentkv.formats`` reads (None: plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is None or not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            return fmt
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}

    @property
    def read(self) -> Conversation:
        """The conversation :meth:`turn` read."""
        assert self._read is not None
        return self._read
