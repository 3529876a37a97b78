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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from agentkv import AgentRuntime, Reply
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
from agentkv.server.streams import Encoder, TurnStreamingResponse
from agentkv.server.turns import AgentHeader, HeaderText, TurnStream, reply_headers, run_turn
from agentkv.tool_calls import ToolCall

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


class ResponseEvents(Encoder):
    """The response as server-sent events, in the order the OpenAI SDKs and Codex read: its
    reasoning item (a reasoning model's), its message, its function_call items, each opened
    by its first piece and done before the next one opens; the stored response at the end."""

    def __init__(
        self,
        body: ResponsesRequest,
        turn: TurnStream,
        ids: Ids,
        created: int,
        remember: Callable[[dict[str, Any], Reply], Awaitable[None]],
        runtime: AgentRuntime,
    ):
        self.body, self.turn, self.ids, self.created = body, turn, ids, created
        self.remember, self.runtime = remember, runtime
        self.call_limit = 1 if body.parallel_tool_calls is False else body.max_tool_calls
        self.sequence = 0
        self.text_at = {"item_id": ids.message, "output_index": 0, "content_index": 0}
        self.thought_at = {"item_id": ids.reasoning, "output_index": 0, "content_index": 0}
        self.summary_at = {"item_id": ids.reasoning, "output_index": 0, "summary_index": 0}
        self.summarized = wants_summary(body)
        self.thought, self.reasoning_open = "", False
        self.shown, self.message_open = "", False
        self.streamed: list[StreamedItem] = []  # the calls streamed so far
        self.every: list[dict[str, Any]] | None = None  # every token's logprobs, at the end

    def event(self, kind: str, **data: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    async def entries(self, reply: Reply | None = None) -> list[dict[str, Any]]:
        """With logprobs asked for, the entries of the tokens since the last ones sent (with
        the ``reply``: of all its tokens not sent yet)."""
        if not self.body.wants_logprobs:
            return []
        return await logprob_content(self.runtime, self.turn.unsent_logprobs(reply))

    async def start(self) -> list[str]:
        opening = response_object(self.body, self.ids, self.created, None)
        return [
            self.event("response.created", response=opening),
            self.event("response.in_progress", response=opening),
        ]

    async def reasoning(self, text: str) -> list[str]:
        lines = []
        if not self.reasoning_open and not self.thought:
            item = reasoning_item(self.ids, "", "in_progress", self.summarized)
            lines.append(self.event("response.output_item.added", output_index=0, item=item))
            if self.summarized:
                part = {"type": "summary_text", "text": ""}
                kind = "response.reasoning_summary_part.added"
                lines.append(self.event(kind, **self.summary_at, part=part))
            self.reasoning_open = True
        self.thought += text
        lines.append(self.event("response.reasoning_text.delta", **self.thought_at, delta=text))
        if self.summarized:
            kind = "response.reasoning_summary_text.delta"
            lines.append(self.event(kind, **self.summary_at, delta=text))
        return lines

    def close_reasoning(self) -> list[str]:
        if not self.reasoning_open:
            return []
        self.reasoning_open = False
        thought = self.thought
        done = reasoning_item(self.ids, thought, "completed", self.summarized)
        lines = [self.event("response.reasoning_text.done", **self.thought_at, text=thought)]
        if self.summarized:
            part = {"type": "summary_text", "text": thought}
            lines += [
                self.event("response.reasoning_summary_text.done", **self.summary_at, text=thought),
                self.event("response.reasoning_summary_part.done", **self.summary_at, part=part),
            ]
        return [*lines, self.event("response.output_item.done", output_index=0, item=done)]

    def open_message(self) -> list[str]:
        item = message_item(self.ids, "", "in_progress")
        lines = self.close_reasoning()
        if self.thought:  # the message follows the reasoning item
            self.text_at["output_index"] = 1
        self.message_open = True
        return [
            *lines,
            self.event(
                "response.output_item.added", output_index=self.text_at["output_index"], item=item
            ),
            self.event("response.content_part.added", **self.text_at, part=text_part("")),
        ]

    def delta(self, piece: str, logprobs: list[dict[str, Any]]) -> str:
        kind = "response.output_text.delta"
        return self.event(kind, **self.text_at, delta=piece, logprobs=logprobs)

    async def text(self, piece: str) -> list[str]:
        lines = [] if self.message_open else self.open_message()
        self.shown += piece
        return [*lines, self.delta(piece, await self.entries())]

    def close_message(
        self, final: str, every: list[dict[str, Any]] | None, status: str
    ) -> list[str]:
        done = message_item(self.ids, final, status, every)
        return [
            self.event(
                "response.output_text.done", **self.text_at, text=final, logprobs=every or []
            ),
            self.event("response.content_part.done", **self.text_at, part=text_part(final, every)),
            self.event(
                "response.output_item.done", output_index=self.text_at["output_index"], item=done
            ),
        ]

    async def call(self, piece: CallDelta) -> list[str]:
        """Its item opened at its first piece (the reasoning and the text before it done),
        then its arguments' text."""
        lines = []
        if piece.first:
            lines += [*self.close_reasoning(), *self.close_call()]
            if self.message_open:  # the text before the call is all there is
                lines += self.close_message(self.shown, None, "completed")
                self.message_open = False
            index = (1 if self.thought else 0) + int(bool(self.shown)) + len(self.streamed)
            call = ToolCall(piece.name, {}, id=piece.id)
            item = call_item(self.body, call, "in_progress", "")
            self.streamed.append(StreamedItem(item, index))
            lines.append(self.event("response.output_item.added", output_index=index, item=item))
        call = self.streamed[-1]
        call.arguments += piece.arguments
        if piece.arguments:
            at = {"item_id": call.item["id"], "output_index": call.index}
            kind = "response.function_call_arguments.delta"
            lines.append(self.event(kind, **at, delta=piece.arguments))
        return lines

    def close_call(self, status: str = "completed") -> list[str]:
        if not self.streamed or not self.streamed[-1].open:
            return []
        call = self.streamed[-1]
        call.open = False
        at = {"item_id": call.item["id"], "output_index": call.index}
        done = call.item | {"arguments": call.arguments, "status": status}
        return [
            self.event("response.function_call_arguments.done", **at, arguments=call.arguments),
            self.event("response.output_item.done", output_index=call.index, item=done),
        ]

    async def end(self, reply: Reply, rest: str, streamed_calls: int) -> list[str]:
        body, streamed = self.body, self.streamed
        calls, final = offered_calls(body, reply), reply.content.text
        last = calls[len(streamed) - 1] if 0 < len(streamed) <= len(calls) else None
        lines = [
            *self.close_reasoning(),
            *self.close_call(call_status(last) if last else "completed"),
        ]
        index = (1 if self.thought else 0) + len(streamed)
        every = None
        if body.wants_logprobs and reply.logprobs:
            every = await logprob_content(self.runtime, reply.logprobs)
        if not streamed and (self.message_open or final or not calls):
            if not self.message_open:
                lines += self.open_message()
            unsent = await self.entries(reply)
            if rest:
                lines.append(self.delta(rest, unsent))
            lines += self.close_message(final, every, item_status(reply))
            index += 1
        elif streamed and self.shown:
            index += 1  # the message, done before the first call
        for call in calls[streamed_calls:]:
            item, arguments = call_item(body, call, "in_progress", ""), call.arguments_json
            at = {"item_id": item["id"], "output_index": index}
            lines += [
                self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.function_call_arguments.delta", **at, delta=arguments),
                self.event("response.function_call_arguments.done", **at, arguments=arguments),
                self.event(
                    "response.output_item.done",
                    output_index=index,
                    item=call_item(body, call, call_status(call)),
                ),
            ]
            index += 1
        self.every = every
        return lines

    async def last(self, reply: Reply) -> list[str]:
        """The response, stored, then its completed (or incomplete) event."""
        finished = response_object(self.body, self.ids, self.created, reply, self.every)
        await self.remember(finished, reply)
        kind = "response.incomplete" if finished["status"] == "incomplete" else "response.completed"
        return [self.event(kind, response=finished)]

    def error(self, exc: Exception) -> list[str]:
        error = api_error(exc).body(Dialect.OPENAI)["error"]
        code = error.get("code") or error.get("type")
        failed = response_object(self.body, self.ids, self.created, None)
        return [
            self.event("error", code=code, message=error["message"], param=error.get("param")),
            self.event("response.failed", response=failed | {"status": "failed", "error": error}),
        ]


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
        encoder = ResponseEvents(body, turn, ids, created, remember, state.runtime)
        return TurnStreamingResponse(turn, encoder)
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
