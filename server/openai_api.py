"""OpenAI Chat Completions: ``POST /v1/chat/completions``, plain and streamed.

``usage.prompt_tokens`` counts every prompt token, ``prompt_tokens_details.cached_tokens``
those resumed from the agent's KV cache. System (and developer) messages must come first; they
are joined into the agent's system prompt. Sampling: a request with none of ``temperature``,
``top_p``, ``seed`` uses the agent's defaults (greedy unless the agent was created otherwise);
one with any of them gets temperature 1.0 (OpenAI's default) for an unset temperature.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from agents import Reply, TextDelta
from server.conversation import (
    TEXT_JOINER,
    ChatMessage,
    TurnRequest,
    sampling_from,
    split_turn,
    text_of,
)
from server.errors import APIError, Dialect, api_error
from server.state import State
from server.turns import AGENT_HEADER, AgentHeader, TurnStream, TurnStreamingResponse, run_turn

router = APIRouter()


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    user: str | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[Any] | None = None

    def turn(self, agent_header: str | None) -> TurnRequest:
        if self.tools:
            raise APIError.invalid("tools are not supported", param="tools")
        systems: list[str] = []
        messages: list[ChatMessage] = []
        for i, m in enumerate(self.messages):
            text = text_of(m.content, f"messages.{i}")
            if m.role in ("system", "developer"):
                if messages:
                    raise APIError.invalid(
                        f"messages.{i}: system messages must come before the conversation",
                        param="messages",
                    )
                systems.append(text)
            else:
                messages.append(ChatMessage(m.role, text))
        history, message = split_turn(messages)
        return TurnRequest(
            agent_id=agent_header or self.user,
            system=TEXT_JOINER.join(systems),
            history=history,
            message=message,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            sampling=sampling_from(temperature=self.temperature, top_p=self.top_p, seed=self.seed),
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def usage(reply: Reply) -> dict[str, Any]:
    u = reply.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def completion(body: ChatCompletionRequest, reply: Reply) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.text, "refusal": None},
                "logprobs": None,
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": usage(reply),
        "system_fingerprint": None,
    }


async def _chunks(body: ChatCompletionRequest, turn: TurnStream) -> AsyncIterator[str]:
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
        "system_fingerprint": None,
    }
    tail = {"usage": None} if body.include_usage else {}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return f"data: {json.dumps({**head, 'choices': [choice], **tail})}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    reply = None
    try:
        async for event in turn.events():
            if isinstance(event, TextDelta):
                yield chunk({"content": event.text})
            else:
                reply = event
    except Exception as exc:  # the turn failed after it started: tell the client in-stream
        yield f"data: {json.dumps(api_error(exc).body(Dialect.OPENAI))}\n\n"
        return
    assert reply is not None
    yield chunk({}, reply.finish_reason)
    if body.include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(reply)})}\n\n"
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions")
async def create_chat_completion(
    http: Request,
    body: ChatCompletionRequest,
    state: State,
    x_agent_id: AgentHeader = None,
) -> Response:
    request = body.turn(x_agent_id)
    if body.stream:
        turn = await TurnStream(state, request).start()
        return TurnStreamingResponse(_chunks(body, turn), turn)
    reply = await run_turn(state, request, http)
    return JSONResponse(completion(body, reply), headers={AGENT_HEADER: reply.agent_id})
