"""Anthropic Messages API: ``POST /v1/messages`` (plain and SSE) and ``/v1/messages/count_tokens``.

Usage follows Anthropic's convention, where the input counts are disjoint: ``input_tokens`` is
what was prefilled this turn, ``cache_read_input_tokens`` what was resumed from the agent's KV
cache; ``cache_creation_input_tokens`` is 0 (every turn's tokens are cached, for free, and counted
once as input). A streamed message starts with zero usage; its ``message_delta`` carries the
turn's full usage (the runtime knows the cached part only when the turn ends).

Consecutive messages of one role are joined into one turn, as Anthropic's API does. Content
blocks and tools: see :mod:`agentkv.server.api.anthropic_content`; a request with tools, tool
blocks or system messages among its messages, or from a Claude Code session, is a whole conversation
(``AgentRuntime.respond``). Tool calls the model makes come back as ``tool_use`` blocks with
``stop_reason: "tool_use"``; streamed, each is a block after the text block (text from a tool
call's start marker on is held back), its arguments in ``input_json_delta`` pieces as they are
written where the format allows (``agentkv.call_stream``), else in one.

A reasoning model's thinking comes back as a ``thinking`` block before the text (streamed as
``thinking_delta`` events, closed by an empty ``signature_delta``). ``thinking``: ``enabled``
turns the template's thinking on (``enable_thinking``) and caps it at ``budget_tokens``
(the end marker is forced then), ``adaptive`` turns it on uncapped, ``disabled`` off.
``thinking`` blocks sent back in history become the turn's reasoning for the template
(:mod:`agentkv.server.api.anthropic_content`).

Sampling: a request with none of ``temperature``/``top_p``/``top_k`` uses the agent's defaults
(greedy unless the agent was created otherwise); one with any of them gets temperature 1.0
(Anthropic's default) for an unset temperature.

Bodies are parsed off the event loop (``agentkv.server.bodies``). Numbers and flags are strict:
``true`` is no ``max_tokens`` and ``"yes"`` no ``stream``; NaN and infinities are refused. At most
``MAX_STOP_SEQUENCES`` stop sequences of at most ``MAX_STOP_CHARS`` characters each.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from agentkv import Reply
from agentkv.call_stream import CallDelta
from agentkv.server.api.anthropic_content import tool_input_json
from agentkv.server.api.anthropic_request import CountTokensRequest, MessagesRequest
from agentkv.server.bodies import parse_off_loop
from agentkv.server.errors import Dialect, api_error
from agentkv.server.state import ServerState, State
from agentkv.server.streams import Encoder, TurnStreamingResponse
from agentkv.server.turns import AgentHeader, SessionHeader, TurnStream, reply_headers, run_turn
from agentkv.tool_calls import ToolCall

router = APIRouter()


def echoed_model(model: str, betas: str | None) -> str:
    """The ``model`` a reply names: the request's, marked ``[1m]`` when the client asked for
    the 1M-context variant (the ``context-1m-*`` beta). Claude Code restores a session's model
    from its replies, so ``--continue`` then keeps the same system prompt (it names the
    variant) and resumes from the cache instead of re-prefilling."""
    asked = any(b.strip().startswith("context-1m-") for b in (betas or "").split(","))
    return f"{model}[1m]" if asked and not model.endswith("[1m]") else model


def usage(reply: Reply | None) -> dict[str, int]:
    u = reply.usage if reply else None
    return {
        "input_tokens": u.prefilled_tokens if u else 0,
        "output_tokens": u.completion_tokens if u else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens if u else 0,
    }


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name}


def thinking_block(text: str) -> dict[str, Any]:
    """A reasoning model's thinking as a ``thinking`` block (no signature: nothing here
    verifies thinking blocks sent back, which are dropped from the prompt)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    """The reply's thinking block (a reasoning model's), its text block (left out when empty
    beside tool calls) and tool_use blocks."""
    parsed = reply.content
    thinking = [thinking_block(reply.reasoning)] if reply.reasoning else []
    text = [{"type": "text", "text": parsed.text}] if parsed.text or not parsed.tool_calls else []
    return thinking + text + [tool_use_block(c) | {"input": c.arguments} for c in parsed.tool_calls]


def message(model: str, msg_id: str, reply: Reply | None, state: ServerState) -> dict[str, Any]:
    """The Message object; with no reply yet, the empty one that opens a stream."""
    stop_reason, stop_sequence = state.model.stop_reason(reply) if reply else (None, None)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "content": content_blocks(reply) if reply else [],
        "model": model,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(reply),
    }


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"


class MessageEvents(Encoder):
    """A streamed message's events: ``message_start``, then its thinking, text and tool_use
    blocks, each opened by its first piece and closed when the next one opens, then
    ``message_delta`` (the stop reason and the turn's usage) and ``message_stop``."""

    def __init__(self, model: str, state: ServerState):
        self.model, self.state, self.msg_id = model, state, f"msg_{uuid.uuid4().hex}"
        self.kind: str | None = None  # the open block's
        self.index = -1  # the open block's

    async def start(self) -> list[str]:
        events = [
            _sse("message_start", {"message": message(self.model, self.msg_id, None, self.state)})
        ]
        if (
            self.state.runtime.reasoning is None
        ):  # the text block at once (else its first piece says)
            events += self.delta("text", "")
        return [*events, _sse("ping", {})]

    async def reasoning(self, text: str) -> list[str]:
        return self.delta("thinking", text)

    async def text(self, piece: str) -> list[str]:
        return self.delta("text", piece)

    def delta(self, kind: str, text: str) -> list[str]:
        events = []
        if kind != self.kind:
            events += self.close()
            self.kind, self.index = kind, self.index + 1
            block = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            events.append(
                _sse("content_block_start", {"index": self.index, "content_block": block})
            )
        if text:
            delta = {"type": f"{kind}_delta", kind: text}
            events.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        return events

    async def call(self, piece: CallDelta) -> list[str]:
        """Its tool_use block opened at its first piece, then the arguments' text as
        ``input_json_delta``."""
        events = []
        if piece.first:
            events += self.close()
            self.kind, self.index = "tool_use", self.index + 1
            block = tool_use_block(ToolCall(piece.name, {}, id=piece.id)) | {"input": {}}
            events.append(
                _sse("content_block_start", {"index": self.index, "content_block": block})
            )
        if piece.arguments:
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            events.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            events.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        events.append(_sse("content_block_stop", {"index": self.index}))
        self.kind = None
        return events

    async def end(self, reply: Reply, rest: str, streamed_calls: int) -> list[str]:
        events, calls = [], reply.content.tool_calls
        # A text block, empty or not (after thinking, only where no tool call follows).
        if rest or self.kind is None or not calls:
            events += self.delta("text", rest)
        events += self.close()
        for index, call in enumerate(calls[streamed_calls:], start=self.index + 1):
            block = tool_use_block(call) | {"input": {}}
            delta = {"type": "input_json_delta", "partial_json": tool_input_json(call.arguments)}
            events += [
                _sse("content_block_start", {"index": index, "content_block": block}),
                _sse("content_block_delta", {"index": index, "delta": delta}),
                _sse("content_block_stop", {"index": index}),
            ]
        final = message(self.model, self.msg_id, reply, self.state)
        delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
        return [
            *events,
            _sse("message_delta", {"delta": delta, "usage": final["usage"]}),
            _sse("message_stop", {}),
        ]

    def error(self, exc: Exception) -> list[str]:
        return [_sse("error", {"error": api_error(exc).body(Dialect.ANTHROPIC)["error"]})]


@router.post("/v1/messages")
async def create_message(
    http: Request,
    state: State,
    x_agent_id: AgentHeader = None,
    x_claude_code_session_id: SessionHeader = None,
    anthropic_beta: Annotated[str | None, Header()] = None,
) -> Response:
    body, request = await parse_off_loop(
        http,
        MessagesRequest,
        state.max_messages,
        lambda body: body.turn(
            x_agent_id,
            x_claude_code_session_id,
            state.keep_volatile,
            state.runtime.caps_reasoning,
        ),
    )
    model = echoed_model(body.model, anthropic_beta)
    if body.stream:
        turn = await TurnStream(state, request).start()
        return TurnStreamingResponse(turn, MessageEvents(model, state))
    reply = await run_turn(state, request, http)
    msg = message(model, f"msg_{uuid.uuid4().hex}", reply, state)
    return JSONResponse(msg, headers=reply_headers(reply))


@router.post("/v1/messages/count_tokens")
async def count_tokens(http: Request, state: State) -> dict[str, int]:
    _, (system, messages, tools) = await parse_off_loop(
        http,
        CountTokensRequest,
        state.max_messages,
        lambda body: body.conversation(state.keep_volatile),
    )
    count = await state.runtime.count_tokens(messages, system or None, tools)
    return {"input_tokens": count}
