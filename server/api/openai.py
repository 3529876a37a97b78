"""OpenAI Chat Completions: ``POST /v1/chat/completions``, plain and streamed.

``usage.prompt_tokens`` counts every prompt token, ``prompt_tokens_details.cached_tokens``
those resumed from the agent's KV cache. Leading system (and developer) messages are joined
into the system prompt; later ones are rendered where they are. ``tools`` (function tools),
assistant ``tool_calls`` and role ``tool`` messages make the request a whole conversation
(``AgentRuntime.respond``); tool calls the model makes come back as ``tool_calls`` with
``finish_reason: "tool_calls"``. Sampling: a request with none of ``temperature``,
``top_p``, ``seed``, the penalties and ``logit_bias`` uses the agent's defaults (greedy unless
the agent was created otherwise); one with ``temperature``, ``top_p`` or ``seed`` gets
temperature 1.0 (OpenAI's default) for an unset temperature; penalties or a bias alone keep
greedy decoding.

Bodies are parsed off the event loop (``agentkv.server.bodies``). Numbers and flags are strict
(``true`` is no ``max_tokens``, ``"yes"`` no ``stream``; no NaN or infinities). A ``tool`` message
must answer a call of the assistant message before it (by ``tool_call_id``). A user message needs
content; so does an assistant message without ``tool_calls``, though ``""`` will do (an empty
reply comes back as ``""``, from this server too, and clients replay it). At most
``MAX_STOP_SEQUENCES`` stop strings of at most ``MAX_STOP_CHARS`` characters each (OpenAI's API
takes 4).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from agentkv import AgentRuntime, ReasoningDelta, Reply
from agentkv.call_stream import CallDelta
from agentkv.server.api.openai_request import (
    ChatCompletionRequest,
)
from agentkv.server.bodies import parse_off_loop
from agentkv.server.errors import Dialect, api_error
from agentkv.server.logprobs import logprob_content
from agentkv.server.state import State
from agentkv.server.turns import (
    AgentHeader,
    TurnStream,
    TurnStreamingResponse,
    reply_headers,
    run_turn,
)
from agentkv.tool_calls import ToolFormat

router = APIRouter()


def usage(reply: Reply) -> dict[str, Any]:
    u = reply.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": u.reasoning_tokens,
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
        },
    }


def finish_reason(reply: Reply) -> str:
    if reply.finish_reason == "stop" and reply.content.tool_calls:
        return "tool_calls"
    return reply.finish_reason


def tool_calls(
    body: ChatCompletionRequest, reply: Reply, streaming: bool = False
) -> list[dict[str, Any]]:
    """The reply's calls (the first only with ``parallel_tool_calls: false``)."""
    calls = reply.content.tool_calls
    if body.parallel_tool_calls is False:
        calls = calls[:1]
    return [
        {
            **({"index": i} if streaming else {}),
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json},
        }
        for i, call in enumerate(calls)
    ]


def completion(
    body: ChatCompletionRequest, reply: Reply, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The completion object (``logprobs``: its tokens' entries, when asked for)."""
    parsed = reply.content
    message: dict[str, Any] = {"role": "assistant", "content": parsed.text, "refusal": None}
    if reply.reasoning:  # as local servers name it (vLLM, llama.cpp), and as mlx_lm.server does
        message |= {"reasoning_content": reply.reasoning, "reasoning": reply.reasoning}
    if parsed.tool_calls:
        message |= {"content": parsed.text or None, "tool_calls": tool_calls(body, reply)}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": finish_reason(reply),
            }
        ],
        "usage": usage(reply),
        "system_fingerprint": None,
    }


async def _chunks(
    body: ChatCompletionRequest,
    turn: TurnStream,
    tool_format: ToolFormat | None,
    runtime: AgentRuntime,
) -> AsyncIterator[str]:
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
        "system_fingerprint": None,
    }
    tail = {"usage": None} if body.include_usage else {}

    async def chunk(
        delta: dict[str, Any], finish_reason: str | None = None, reply: Reply | None = None
    ) -> str:
        """A chunk; with logprobs asked for, those of the tokens since the last chunk (with
        the ``reply``: all of its tokens not sent yet)."""
        entries = None
        if body.logprobs:
            unsent = turn.unsent_logprobs(reply)
            entries = {"content": await logprob_content(runtime, unsent), "refusal": None}
        choice = {"index": 0, "delta": delta, "logprobs": entries, "finish_reason": finish_reason}
        return f"data: {json.dumps({**head, 'choices': [choice], **tail})}\n\n"

    yield await chunk({"role": "assistant", "content": ""})
    reply, shown = None, 0
    try:
        async for piece in turn.visible_text(tool_format):
            if isinstance(piece, str):
                yield await chunk({"content": piece})
                shown += len(piece)
            elif isinstance(piece, ReasoningDelta):
                yield await chunk({"reasoning_content": piece.text, "reasoning": piece.text})
            elif isinstance(piece, CallDelta):
                if body.parallel_tool_calls is False and piece.index > 0:
                    continue
                call: dict[str, Any] = {"index": piece.index}
                if piece.first:
                    call |= {"id": piece.id, "type": "function"}
                    call["function"] = {"name": piece.name, "arguments": piece.arguments}
                else:
                    call["function"] = {"arguments": piece.arguments}
                yield await chunk({"tool_calls": [call]})
            else:
                reply = piece
    except Exception as exc:  # the turn failed after it started: tell the client in-stream
        yield f"data: {json.dumps(api_error(exc).body(Dialect.OPENAI))}\n\n"
        return
    assert reply is not None
    if len(reply.content.text) > shown:
        yield await chunk({"content": reply.content.text[shown:]}, reply=reply)
    if unsent := tool_calls(body, reply, streaming=True)[turn.streamed_calls :]:
        yield await chunk({"tool_calls": unsent}, reply=reply)
    yield await chunk({}, finish_reason(reply), reply=reply)
    if body.include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(reply)})}\n\n"
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions")
async def create_chat_completion(
    http: Request,
    state: State,
    x_agent_id: AgentHeader = None,
) -> Response:
    body, request = await parse_off_loop(
        http, ChatCompletionRequest, state.max_messages, lambda body: body.turn(x_agent_id)
    )
    if body.stream:
        turn = await TurnStream(state, request).start()
        tool_format = state.runtime.tool_format if request.tools else None
        chunks = _chunks(body, turn, tool_format, state.runtime)
        return TurnStreamingResponse(chunks, turn)
    reply = await run_turn(state, request, http)
    logprobs = None
    if reply.logprobs is not None:
        logprobs = await logprob_content(state.runtime, reply.logprobs)
    return JSONResponse(completion(body, reply, logprobs), headers=reply_headers(reply))
