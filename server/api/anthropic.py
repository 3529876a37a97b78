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
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from agentkv import ReasoningDelta, Reply
from agentkv.call_stream import CallDelta
from agentkv.server.api.anthropic_content import tool_input_json
from agentkv.server.api.anthropic_request import CountTokensRequest, MessagesRequest
from agentkv.server.bodies import parse_off_loop
from agentkv.server.errors import Dialect, api_error
from agentkv.server.state import ServerState, State
from agentkv.server.turns import (
    AgentHeader,
    SessionHeader,
    TurnStream,
    TurnStreamingResponse,
    reply_headers,
    run_turn,
)
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


class Blocks:
    """A streamed message's thinking and text blocks, each opened by its first delta and
    closed when the next one opens (``kind``: the open one's; ``index``: its index)."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.index = -1

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

    def tool_use(self, piece: CallDelta) -> list[str]:
        """A streamed call's piece: its tool_use block opened at its first, then the
        arguments' text as ``input_json_delta``."""
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


async def _events(
    model: str, turn: TurnStream, state: ServerState, tools: bool
) -> AsyncIterator[str]:
    msg_id = f"msg_{uuid.uuid4().hex}"
    yield _sse("message_start", {"message": message(model, msg_id, None, state)})
    blocks = Blocks()
    if state.runtime.reasoning is None:  # the text block at once (else its first piece says)
        for event in blocks.delta("text", ""):
            yield event
    yield _sse("ping", {})
    reply, shown = None, 0
    try:
        async for piece in turn.visible_text(state.runtime.tool_format if tools else None):
            if isinstance(piece, str):
                for event in blocks.delta("text", piece):
                    yield event
                shown += len(piece)
            elif isinstance(piece, ReasoningDelta):
                for event in blocks.delta("thinking", piece.text):
                    yield event
            elif isinstance(piece, CallDelta):
                for event in blocks.tool_use(piece):
                    yield event
            else:
                reply = piece
    except Exception as exc:  # the turn failed after it started: tell the client in-stream
        yield _sse("error", {"error": api_error(exc).body(Dialect.ANTHROPIC)["error"]})
        return
    assert reply is not None
    parsed = reply.content
    # A text block, empty or not (after thinking, only where no tool call follows).
    if len(parsed.text) > shown or blocks.kind is None or not parsed.tool_calls:
        for event in blocks.delta("text", parsed.text[shown:]):
            yield event
    for event in blocks.close():
        yield event
    unsent = parsed.tool_calls[turn.streamed_calls :]
    for index, call in enumerate(unsent, start=blocks.index + 1):
        block = tool_use_block(call) | {"input": {}}
        yield _sse("content_block_start", {"index": index, "content_block": block})
        delta = {"type": "input_json_delta", "partial_json": tool_input_json(call.arguments)}
        yield _sse("content_block_delta", {"index": index, "delta": delta})
        yield _sse("content_block_stop", {"index": index})
    final = message(model, msg_id, reply, state)
    delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
    yield _sse("message_delta", {"delta": delta, "usage": final["usage"]})
    yield _sse("message_stop", {})


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
            state.runtime.engine.reasoning is not None,
        ),
    )
    model = echoed_model(body.model, anthropic_beta)
    if body.stream:
        turn = await TurnStream(state, request).start()
        return TurnStreamingResponse(_events(model, turn, state, bool(request.tools)), turn)
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
