"""The Chat Completions request body (every field of the official SDK, each honoured, accepted
or refused by name) and the turn it asks for."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
)

from agentkv.prompt import Message
from agentkv.server.api.anthropic_content import is_plain
from agentkv.server.bodies import FieldPolicy, arguments_value
from agentkv.server.conversation import (
    TEXT_JOINER,
    ChatMessage,
    StopString,
    TurnRequest,
    checked_text,
    content_of,
    refuse_empty,
    sampling_from,
    split_turn,
    template_kwargs,
    text_of,
    thinking_of,
)
from agentkv.server.errors import APIError
from agentkv.server.limits import MAX_STOP_SEQUENCES
from agentkv.server.logprobs import top_logprobs
from agentkv.server.sessions import RESPONSES_SESSION_PREFIX, named_agent


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking, sent back
    reasoning: str | None = None  # (as mlx_lm.server names it)

    def template_message(self, where: str) -> Message:
        """This message in chat-template shape (tool call arguments decoded)."""
        role = "system" if self.role == "developer" else self.role
        calls = self.tool_calls if role == "assistant" else None
        if calls and self.content is None:
            message: Message = {"role": role, "content": ""}
        else:
            if not calls and not (role == "assistant" and self.content == ""):
                refuse_empty(role, self.content, where)  # "": an empty reply, as clients replay it
            read = content_of if role == "user" else text_of
            message = {"role": role, "content": read(self.content, where)}
        if role == "tool":
            if not self.tool_call_id:
                raise APIError.invalid(
                    f"{where}.tool_call_id: required: a tool message answers a tool call by its id",
                    f"{where}.tool_call_id",
                )
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls and role == "assistant":
            message["tool_calls"] = [
                _template_call(call, f"{where}.tool_calls.{i}")
                for i, call in enumerate(self.tool_calls)
            ]
        thinking = self.reasoning_content or self.reasoning
        if thinking and role == "assistant":  # the template renders it where it keeps it
            message["reasoning_content"] = checked_text(thinking, f"{where}.reasoning_content")
        return message


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        arguments = arguments_value(arguments) if isinstance(arguments, str) else arguments
    except ValueError as exc:
        raise APIError.invalid(f"{where}.function.arguments: {exc}", where) from None
    if not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
        raise APIError.invalid(
            f"{where}: a tool call needs a name and JSON-object arguments", where
        )
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


CHAT_FIELDS = FieldPolicy(
    "Chat Completions",
    honoured=frozenset(
        {
            *("model", "messages", "max_tokens", "max_completion_tokens", "temperature"),
            *("top_p", "seed", "stop", "user", "n", "stream", "stream_options", "tools"),
            *("tool_choice", "response_format", "parallel_tool_calls", "presence_penalty"),
            *("frequency_penalty", "logit_bias", "logprobs", "top_logprobs"),
            *("prompt_cache_key", "modalities", "reasoning_effort", "chat_template_kwargs"),
            "prediction",
        }
    ),
    accepted={
        "metadata": "OpenAI's dashboards read it; nothing here does",
        "store": "the conversation is the agent's transcript either way",
        "service_tier": "there is one tier here",
        "safety_identifier": "OpenAI's abuse monitoring",
        "prompt_cache_options": "caches are kept by agentkv's own tiers",
        "prompt_cache_retention": "caches are kept by agentkv's own tiers",
        "verbosity": "a hint to OpenAI's models; the reply's length is the model's own",
    },
    refused={
        "audio": "audio output (text only)",
        "functions": "deprecated: use tools",
        "function_call": "deprecated: use tool_choice",
        "moderation": "moderation is not run here",
        "web_search_options": "web search is not run here",
    },
)


class ChatCompletionRequest(BaseModel):
    """Fields are honoured, accepted without effect or refused (``CHAT_FIELDS``); values a
    field cannot take are refused (``n`` above 1, modalities other than text); any other
    field is logged once."""

    model_config = ConfigDict(extra="allow")
    FIELDS: ClassVar[FieldPolicy] = CHAT_FIELDS

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    stop: list[StopString] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    user: str | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    verbosity: str | None = None
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    web_search_options: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, stop: Any) -> Any:
        return [stop] if isinstance(stop, str) else stop

    def _checked(self) -> None:
        """Refuse what cannot be honoured; log fields this server does not know (once)."""
        self.FIELDS.check(self)
        if self.modalities not in (None, ["text"]):
            raise APIError.invalid("modalities: only ['text'] is supported", "modalities")

    def _bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its token ids (JSON object keys are strings) as integers."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise APIError.invalid(
                    f"logit_bias: {key!r} is not a token id (a non-negative integer)",
                    "logit_bias",
                )
            bias[int(key)] = float(value)
        return bias

    def turn(self, agent_header: str | None) -> TurnRequest:
        self._checked()
        systems: list[str] = []
        messages: list[Message] = []
        calls: set[str] = set()  # the ids of the last assistant message's tool calls
        for i, m in enumerate(self.messages):
            message = m.template_message(f"messages.{i}")
            if message["role"] == "assistant":
                calls = {call["id"] for call in message.get("tool_calls", ())}
            elif message["role"] == "tool" and message["tool_call_id"] not in calls:
                raise APIError.invalid(
                    f"messages.{i}.tool_call_id: {message['tool_call_id']!r} names no tool call "
                    "of the assistant message before it",
                    f"messages.{i}.tool_call_id",
                )
            if message["role"] == "system" and not messages:
                systems.append(message["content"])
            else:
                messages.append(message)
        tools = self.tools if self.tools and self.tool_choice != "none" else None
        request = TurnRequest(
            agent_id=agent_header or (None if self.prompt_cache_key else named_agent(self.user)),
            session=None if agent_header else self.prompt_cache_key,
            session_prefix=RESPONSES_SESSION_PREFIX,
            system=TEXT_JOINER.join(systems),
            history=[],
            message="",
            max_tokens=self.max_completion_tokens or self.max_tokens,
            sampling=sampling_from(
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                logit_bias=self._bias(),
            ),
            stop=list(self.stop or []),
            tools=tools,
            response_format=self.response_format,
            tool_choice=forced_choice(self.tool_choice, "tool_choice") if tools else None,
            logprobs=top_logprobs(self.logprobs, self.top_logprobs),
            prediction=prediction_text(self.prediction),
            template_kwargs=template_kwargs(
                self.chat_template_kwargs,
                thinking_of(self.reasoning_effort, "reasoning_effort"),
                self.reasoning_effort,
            ),
        )
        plain = request.tool_choice is None and request.session is None
        if tools is None and is_plain(messages) and plain:
            chat = [ChatMessage(m["role"], m["content"]) for m in messages]
            request.history, request.message = split_turn(chat)
        else:
            if not messages or messages[-1]["role"] == "assistant":
                split_turn([ChatMessage(m["role"], "") for m in messages])  # the plain path's 400
            system = [{"role": "system", "content": request.system}] if systems else []
            request.document = [*system, *messages]
        return request

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def forced_choice(choice: Any, where: str) -> str | dict[str, str] | None:
    """An OpenAI ``tool_choice`` as ``AgentRuntime.respond`` takes it: None (``"auto"``, the
    model decides), ``"required"``, or ``{"name": ...}`` for a named function."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return "required"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or choice).get("name")
        if isinstance(name, str) and name:
            return {"name": name}
    raise APIError.invalid(
        f"{where}: {choice!r} is not 'auto', 'none', 'required' or a named function", where
    )


def prediction_text(prediction: dict[str, Any] | None) -> str | None:
    """The text of a ``prediction`` (Predicted Outputs: ``{"type": "content", "content":
    text or text parts}``), drafted from by speculative decoding; None for none."""
    if prediction is None:
        return None
    kind = prediction.get("type")
    if kind != "content":
        raise APIError.invalid(
            f"prediction.type: must be 'content', got {kind!r}", "prediction.type"
        )
    content = prediction.get("content")
    parts = isinstance(content, list) and all(isinstance(part, dict) for part in content)
    if not isinstance(content, str) and not parts:
        raise APIError.invalid(
            "prediction.content: must be a string or a list of text parts", "prediction.content"
        )
    return text_of(content, "prediction")
