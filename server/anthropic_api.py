"""Anthropic Messages API: ``POST /v1/messages`` (plain and SSE) and ``/v1/messages/count_tokens``.

Usage follows Anthropic's convention, where the input counts are disjoint: ``input_tokens`` is
what was prefilled this turn, ``cache_read_input_tokens`` what was resumed from the agent's KV
cache; ``cache_creation_input_tokens`` is 0 (every turn's tokens are cached, for free, and counted
once as input). A streamed message starts with zero usage; its ``message_delta`` carries the
turn's full usage (the runtime knows the cached part only when the turn ends).

Consecutive messages of one role are joined into one turn, as Anthropic's API does.

Sampling: a request with none of ``temperature``/``top_p``/``top_k`` uses the agent's defaults
(greedy unless the agent was created otherwise); one with any of them gets temperature 1.0
(Anthropic's default) for an unset temperature.
"""

from __future__ import annotations

import json
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
from server.state import ServerState, State
from server.turns import AGENT_HEADER, AgentHeader, TurnStream, TurnStreamingResponse, run_turn

router = APIRouter()

Content = str | list[dict[str, Any]]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: Content


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Content | None = None
    tools: list[Any] | None = None

    def conversation(self) -> tuple[str, list[ChatMessage]]:
        if self.tools:
            raise APIError.invalid("tools are not supported", param="tools")
        system = "" if self.system is None else text_of(self.system, "system")
        messages: list[ChatMessage] = []
        for i, m in enumerate(self.messages):
            text = text_of(m.content, f"messages.{i}")
            if messages and messages[-1].role == m.role:  # as Anthropic does: one turn
                text = TEXT_JOINER.join((messages.pop().content, text))
            messages.append(ChatMessage(m.role, text))
        return system, messages


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    stream: bool = False

    def turn(self, agent_header: str | None) -> TurnRequest:
        system, messages = self.conversation()
        history, message = split_turn(messages)
        user_id = self.metadata.user_id if self.metadata else None
        return TurnRequest(
            agent_id=agent_header or user_id,
            system=system,
            history=history,
            message=message,
            max_tokens=self.max_tokens,
            sampling=sampling_from(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
            ),
            stop=list(self.stop_sequences or []),
        )


def usage(reply: Reply | None) -> dict[str, int]:
    u = reply.usage if reply else None
    return {
        "input_tokens": u.prefilled_tokens if u else 0,
        "output_tokens": u.completion_tokens if u else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens if u else 0,
    }


def message(
    body: MessagesRequest, msg_id: str, reply: Reply | None, state: ServerState
) -> dict[str, Any]:
    """The Message object; with no reply yet, the empty one that opens a stream."""
    stop_reason, stop_sequence = state.model.stop_reason(reply) if reply else (None, None)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": reply.text}] if reply else [],
        "model": body.model,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(reply),
    }


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"


async def _events(
    body: MessagesRequest, turn: TurnStream, state: ServerState
) -> AsyncIterator[str]:
    msg_id = f"msg_{uuid.uuid4().hex}"
    yield _sse("message_start", {"message": message(body, msg_id, None, state)})
    yield _sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield _sse("ping", {})
    reply = None
    try:
        async for event in turn.events():
            if isinstance(event, TextDelta):
                delta = {"type": "text_delta", "text": event.text}
                yield _sse("content_block_delta", {"index": 0, "delta": delta})
            else:
                reply = event
    except Exception as exc:  # the turn failed after it started: tell the client in-stream
        yield _sse("error", {"error": api_error(exc).body(Dialect.ANTHROPIC)["error"]})
        return
    assert reply is not None
    yield _sse("content_block_stop", {"index": 0})
    final = message(body, msg_id, reply, state)
    delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
    yield _sse("message_delta", {"delta": delta, "usage": final["usage"]})
    yield _sse("message_stop", {})


@router.post("/v1/messages")
async def create_message(
    http: Request,
    body: MessagesRequest,
    state: State,
    x_agent_id: AgentHeader = None,
) -> Response:
    request = body.turn(x_agent_id)
    if body.stream:
        turn = await TurnStream(state, request).start()
        return TurnStreamingResponse(_events(body, turn, state), turn)
    reply = await run_turn(state, request, http)
    msg = message(body, f"msg_{uuid.uuid4().hex}", reply, state)
    return JSONResponse(msg, headers={AGENT_HEADER: reply.agent_id})


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: State) -> dict[str, int]:
    system, messages = body.conversation()
    count = await state.runtime.count_tokens([m.as_dict() for m in messages], system or None)
    return {"input_tokens": count}
