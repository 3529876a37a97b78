"""OpenAI Responses API: ``POST /v1/responses`` (plain and streamed),
``GET`` / ``DELETE /v1/responses/{id}`` and ``POST /v1/responses/input_tokens``.

A request is a whole conversation (``input`` and ``instructions``, see
:mod:`agentkv.server.api.responses_input`), answered by ``AgentRuntime.respond``: the agent's cache
is reused up to the longest common token prefix. With ``previous_response_id`` the
conversation is that response's (its chain of stored responses: each one's input, then its
output) followed by the new ``input``. A response is stored unless ``store`` is false (Codex
sends false), in the registry (``agentkv.store.responses``), for 30 days by default
(``--responses-ttl``); ``DELETE`` removes it (the responses continuing it keep its items, and
the agent that answered keeps its transcript).

Which agent answers: the ``x-agent-id`` header; else a session, named by
``prompt_cache_key`` or the ``session-id`` header (Codex sends its session id in both), which
has an agent of its own (``session-<id>-<tool set>``, expiring like stateless agents); else the
agent that answered ``previous_response_id``, when that reply is still its last message (a
stateless agent is found by its transcript, as any conversation is); else the stateless agent
whose transcript the conversation extends, or a new one (see :mod:`agentkv.server.identity`), which
resumes from the longest cached token prefix: an earlier response continued twice is a branch.

Fields are read, honoured, or refused, never dropped unread:

- honoured: ``model`` (echoed), ``input``, ``instructions``, ``tools``, ``tool_choice``
  (``"auto"``, ``"none"``, ``"required"``, a named function: a forced call is held to the
  tool's schema by constrained decoding), ``parallel_tool_calls`` (false: at most one call
  per turn),
  ``max_output_tokens``, ``max_tool_calls``, ``temperature``, ``top_p``, ``stream``,
  ``store``, ``previous_response_id``, ``include: ["message.output_text.logprobs"]`` and
  ``top_logprobs`` (each output text's tokens with their log probabilities),
  ``prompt_cache_key``, ``metadata`` (echoed), ``text.format`` (``text``, ``json_object``,
  ``json_schema``: the reply is held to the schema, see ``agentkv.engine.grammar``),
  ``truncation`` ``"disabled"`` (a conversation over the context is refused, as OpenAI does);
- ``reasoning.effort``: ``none`` and ``minimal`` switch a reasoning model's thinking off
  (``enable_thinking=False`` for its template), the others leave it on; its thinking comes
  back whole as a ``reasoning`` item (``reasoning_text`` content) before the message,
  streamed as ``response.reasoning_text.delta`` events; with ``reasoning.summary`` asked for,
  the reasoning is also its summary, whole (no summarizer runs here; Codex shows summaries),
  streamed as ``response.reasoning_summary_text.delta`` events;
- accepted, without effect:
  ``include: ["reasoning.encrypted_content"]`` (there is none to include), ``user``,
  ``safety_identifier``, ``service_tier``, ``client_metadata``, ``stream_options``;
- refused with a 400 naming the field: ``conversation`` (the Conversations API: use
  ``previous_response_id``, or name an agent), other ``include`` values,
  ``background``, ``truncation: "auto"``, ``prompt`` templates;
- any other field: logged once by name and not used.

Usage counts every input token; ``input_tokens_details.cached_tokens`` those resumed from a
cache. A reply cut by ``max_output_tokens`` comes back ``incomplete``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from agentkv import AgentRuntime, ReasoningDelta, Reply
from agentkv.call_stream import CallDelta
from agentkv.server.api.responses_input import conversation
from agentkv.server.api.responses_output import (
    Ids,
    call_item,
    call_status,
    item_status,
    message_item,
    offered_calls,
    reasoning_item,
    response_object,
    text_part,
    wants_summary,
)
from agentkv.server.api.responses_request import (
    ResponsesRequest,
)
from agentkv.server.api.stored_responses import continued, items_of, store_response
from agentkv.server.bodies import parse_off_loop
from agentkv.server.errors import APIError, Dialect, api_error
from agentkv.server.logprobs import logprob_content
from agentkv.server.state import State
from agentkv.server.turns import (
    AgentHeader,
    HeaderText,
    TurnStream,
    TurnStreamingResponse,
    reply_headers,
    run_turn,
)
from agentkv.tool_calls import ToolCall, ToolFormat

router = APIRouter()

SessionId = Annotated[str | None, Header(alias="session-id"), HeaderText]
"""Route parameter type: Codex's session id header."""


@dataclass(slots=True)
class StreamedItem:
    """A function_call item streamed as its call is written."""

    item: dict[str, Any]
    index: int
    arguments: str = ""
    open: bool = True


async def _events(
    body: ResponsesRequest,
    turn: TurnStream,
    tool_format: ToolFormat | None,
    ids: Ids,
    created: int,
    remember: Callable[[dict[str, Any], Reply], Awaitable[None]],
    runtime: AgentRuntime,
) -> AsyncIterator[str]:
    """The response as server-sent events, in the order the OpenAI SDKs and Codex read."""
    sequence, asked = 0, body.wants_logprobs

    async def entries(reply: Reply | None = None) -> list[dict[str, Any]]:
        """With logprobs asked for, the entries of the tokens since the last ones sent (with
        the ``reply``: of all its tokens not sent yet)."""
        return await logprob_content(runtime, turn.unsent_logprobs(reply)) if asked else []

    def event(kind: str, **data: Any) -> str:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **data}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    text_at = {"item_id": ids.message, "output_index": 0, "content_index": 0}
    thought_at = {"item_id": ids.reasoning, "output_index": 0, "content_index": 0}
    summary_at = {"item_id": ids.reasoning, "output_index": 0, "summary_index": 0}
    summarized = wants_summary(body)
    thought = ""

    def open_message() -> list[str]:
        item = message_item(ids, "", "in_progress")
        lines = close_reasoning()
        if thought:  # the message follows the reasoning item
            text_at["output_index"] = 1
        index = text_at["output_index"]
        return [
            *lines,
            event("response.output_item.added", output_index=index, item=item),
            event("response.content_part.added", **text_at, part=text_part("")),
        ]

    reasoning_open = False

    def close_reasoning() -> list[str]:
        nonlocal reasoning_open
        if not reasoning_open:
            return []
        reasoning_open = False
        done = reasoning_item(ids, thought, "completed", summarized)
        lines = [event("response.reasoning_text.done", **thought_at, text=thought)]
        if summarized:
            part = {"type": "summary_text", "text": thought}
            lines += [
                event("response.reasoning_summary_text.done", **summary_at, text=thought),
                event("response.reasoning_summary_part.done", **summary_at, part=part),
            ]
        return [*lines, event("response.output_item.done", output_index=0, item=done)]

    def delta(piece: str, logprobs: list[dict[str, Any]]) -> str:
        return event("response.output_text.delta", **text_at, delta=piece, logprobs=logprobs)

    def close_message(final: str, every: list[dict[str, Any]] | None) -> list[str]:
        return [
            event("response.output_text.done", **text_at, text=final, logprobs=every or []),
            event("response.content_part.done", **text_at, part=text_part(final, every)),
            event(
                "response.output_item.done",
                output_index=text_at["output_index"],
                item=message_item(ids, final, "completed", every),
            ),
        ]

    streamed: list[StreamedItem] = []  # the calls streamed so far
    limit = 1 if body.parallel_tool_calls is False else body.max_tool_calls

    def call_piece(piece: CallDelta) -> list[str]:
        """A streamed call's piece: its item opened at its first (the reasoning and the text
        before it done), then its arguments' text."""
        nonlocal opened
        lines = []
        if piece.first:
            lines += [*close_reasoning(), *close_call()]
            if opened:  # the text before the call is all there is
                lines += close_message(text, None)
                opened = False
            index = (1 if thought else 0) + int(bool(text)) + len(streamed)
            item = call_item(body, ToolCall(piece.name, {}, id=piece.id), "in_progress", "")
            streamed.append(StreamedItem(item, index))
            lines.append(event("response.output_item.added", output_index=index, item=item))
        call = streamed[-1]
        call.arguments += piece.arguments
        if piece.arguments:
            at = {"item_id": call.item["id"], "output_index": call.index}
            lines.append(
                event("response.function_call_arguments.delta", **at, delta=piece.arguments)
            )
        return lines

    def close_call(status: str = "completed") -> list[str]:
        if not streamed or not streamed[-1].open:
            return []
        call = streamed[-1]
        call.open = False
        at = {"item_id": call.item["id"], "output_index": call.index}
        done = call.item | {"arguments": call.arguments, "status": status}
        return [
            event("response.function_call_arguments.done", **at, arguments=call.arguments),
            event("response.output_item.done", output_index=call.index, item=done),
        ]

    yield event("response.created", response=response_object(body, ids, created, None))
    yield event("response.in_progress", response=response_object(body, ids, created, None))
    opened, text, reply = False, "", None
    try:
        async for piece in turn.visible_text(tool_format):
            if isinstance(piece, Reply):
                reply = piece
                continue
            if isinstance(piece, CallDelta):
                if limit is None or piece.index < limit:
                    for line in call_piece(piece):
                        yield line
                continue
            if isinstance(piece, ReasoningDelta):
                if not reasoning_open and not thought:
                    item = reasoning_item(ids, "", "in_progress", summarized)
                    yield event("response.output_item.added", output_index=0, item=item)
                    if summarized:
                        part = {"type": "summary_text", "text": ""}
                        yield event(
                            "response.reasoning_summary_part.added", **summary_at, part=part
                        )
                    reasoning_open = True
                thought += piece.text
                yield event("response.reasoning_text.delta", **thought_at, delta=piece.text)
                if summarized:
                    yield event(
                        "response.reasoning_summary_text.delta", **summary_at, delta=piece.text
                    )
                continue
            if not opened:
                for line in open_message():
                    yield line
                opened = True
            text += piece
            yield delta(piece, await entries())
    except Exception as exc:  # the turn failed after it started: tell the client in-stream
        error = api_error(exc).body(Dialect.OPENAI)["error"]
        code = error.get("code") or error.get("type")
        yield event("error", code=code, message=error["message"], param=error.get("param"))
        failed = response_object(body, ids, created, None) | {"status": "failed", "error": error}
        yield event("response.failed", response=failed)
        return
    assert reply is not None
    calls, final = offered_calls(body, reply), reply.content.text
    last = calls[len(streamed) - 1] if 0 < len(streamed) <= len(calls) else None
    for line in [*close_reasoning(), *close_call(call_status(last) if last else "completed")]:
        yield line
    index = (1 if thought else 0) + len(streamed)
    every = await logprob_content(runtime, reply.logprobs) if asked and reply.logprobs else None
    if not streamed and (opened or final or not calls):
        if not opened:
            for line in open_message():
                yield line
        rest = await entries(reply)
        if len(final) > len(text):
            yield delta(final[len(text) :], rest)
        yield event("response.output_text.done", **text_at, text=final, logprobs=every or [])
        part = text_part(final, every)
        yield event("response.content_part.done", **text_at, part=part)
        done = message_item(ids, final, item_status(reply), every)
        yield event("response.output_item.done", output_index=index, item=done)
        index += 1
    elif streamed and text:
        index += 1  # the message, done before the first call
    for call in calls[turn.streamed_calls :]:
        item, arguments = call_item(body, call, "in_progress", ""), call.arguments_json
        at = {"item_id": item["id"], "output_index": index}
        yield event("response.output_item.added", output_index=index, item=item)
        yield event("response.function_call_arguments.delta", **at, delta=arguments)
        yield event("response.function_call_arguments.done", **at, arguments=arguments)
        done = call_item(body, call, call_status(call))
        yield event("response.output_item.done", output_index=index, item=done)
        index += 1
    finished = response_object(body, ids, created, reply, every)
    await remember(finished, reply)
    kind = "response.incomplete" if finished["status"] == "incomplete" else "response.completed"
    yield event(kind, response=finished)


@router.post("/v1/responses")
async def create_response(
    http: Request, state: State, x_agent_id: AgentHeader = None, session_id: SessionId = None
) -> Response:
    body, _ = await parse_off_loop(http, ResponsesRequest, state.max_messages, lambda b: None)
    earlier = await continued(state, body.previous_response_id)
    request = await asyncio.to_thread(body.turn, x_agent_id, session_id, earlier)
    ids, created = Ids(), int(time.time())

    async def remember(response: dict[str, Any], reply: Reply) -> None:
        if body.store is not False:
            await store_response(state, body.input, body.previous_response_id, response, reply)

    if body.stream:
        turn = await TurnStream(state, request).start()
        tool_format = state.runtime.tool_format if request.tools else None
        events = _events(body, turn, tool_format, ids, created, remember, state.runtime)
        return TurnStreamingResponse(events, turn)
    reply = await run_turn(state, request, http)
    logprobs = None
    if body.wants_logprobs and reply.logprobs is not None:
        logprobs = await logprob_content(state.runtime, reply.logprobs)
    response = response_object(body, ids, created, reply, logprobs)
    await remember(response, reply)
    return JSONResponse(response, headers=reply_headers(reply))


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(http: Request, state: State) -> dict[str, Any]:
    """Tokens of the request's input as it would be prompted (tools, instructions and the
    responses ``previous_response_id`` continues too)."""
    body, _ = await parse_off_loop(http, ResponsesRequest, state.max_messages, lambda b: None)
    earlier = await continued(state, body.previous_response_id)
    read = await asyncio.to_thread(
        conversation, body.input, body.instructions, body.tools, items_of(earlier)
    )
    if not read.messages:
        raise APIError.invalid("input: holds no message to count", "input")
    count = await state.runtime.count_tokens(read.messages, read.system or None, read.tools)
    return {"object": "response.input_tokens", "input_tokens": count}
