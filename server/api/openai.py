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
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from agentkv import AgentRuntime, Reply
from agentkv.call_stream import CallDelta
from agentkv.server.api.openai_request import (
    ChatCompletionRequest,
)
from agentkv.server.bodies import parse_off_loop
from agentkv.server.errors import Dialect, api_error
from agentkv.server.logprobs import logprob_content
from agentkv.server.state import State
from agentkv.server.streams import Encoder, TurnStreamingResponse
from agentkv.server.turns import AgentHeader, TurnStream, reply_headers, run_turn

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


def timings(reply: Reply) -> dict[str, float]:
    """Where the turn's time went, in seconds (beside ``usage``, as llama.cpp's server sends
    its ``timings``): finding its cache, waiting to join the batch, prefill, first token,
    decode."""
    t = reply.timings
    return {
        "cache_load_s": t.cache_load_s,
        "queue_s": t.queue_s,
        "prefill_s": t.prefill_s,
        "ttft_s": t.ttft_s,
        "decode_s": t.decode_s,
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
        "timings": timings(reply),
        "system_fingerprint": None,
    }


class ChatChunks(Encoder):
    """A streamed completion's chunks: the assistant's role first, then a chunk a piece (with
    logprobs asked for, each carries those of the tokens since the last), the text and calls
    the pieces did not send, the finish reason, the usage when asked for, ``[DONE]``."""

    def __init__(self, body: ChatCompletionRequest, turn: TurnStream, runtime: AgentRuntime):
        self.body, self.turn, self.runtime = body, turn, runtime
        self.call_limit = 1 if body.parallel_tool_calls is False else None
        self.head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": None,
        }
        self.tail = {"usage": None} if body.include_usage else {}

    async def chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, reply: Reply | None = None
    ) -> str:
        """A chunk (with the ``reply``: the logprobs of all its tokens not sent yet)."""
        entries = None
        if self.body.logprobs:
            unsent = self.turn.unsent_logprobs(reply)
            entries = {"content": await logprob_content(self.runtime, unsent), "refusal": None}
        choice = {"index": 0, "delta": delta, "logprobs": entries, "finish_reason": finish_reason}
        return f"data: {json.dumps({**self.head, 'choices': [choice], **self.tail})}\n\n"

    async def start(self) -> list[str]:
        return [await self.chunk({"role": "assistant", "content": ""})]

    async def reasoning(self, text: str) -> list[str]:
        return [await self.chunk({"reasoning_content": text, "reasoning": text})]

    async def text(self, piece: str) -> list[str]:
        return [await self.chunk({"content": piece})]

    async def call(self, piece: CallDelta) -> list[str]:
        call: dict[str, Any] = {"index": piece.index}
        if piece.first:
            call |= {"id": piece.id, "type": "function"}
            call["function"] = {"name": piece.name, "arguments": piece.arguments}
        else:
            call["function"] = {"arguments": piece.arguments}
        return [await self.chunk({"tool_calls": [call]})]

    async def end(self, reply: Reply, rest: str, streamed_calls: int) -> list[str]:
        lines = []
        if rest:
            lines.append(await self.chunk({"content": rest}, reply=reply))
        if unsent := tool_calls(self.body, reply, streaming=True)[streamed_calls:]:
            lines.append(await self.chunk({"tool_calls": unsent}, reply=reply))
        lines.append(await self.chunk({}, finish_reason(reply), reply=reply))
        if self.body.include_usage:
            last = {**self.head, "choices": [], "usage": usage(reply), "timings": timings(reply)}
            lines.append(f"data: {json.dumps(last)}\n\n")
        return [*lines, "data: [DONE]\n\n"]

    def error(self, exc: Exception) -> list[str]:
        return [f"data: {json.dumps(api_error(exc).body(Dialect.OPENAI))}\n\n"]


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
        return TurnStreamingResponse(turn, ChatChunks(body, turn, state.runtime))
    reply = await run_turn(state, request, http)
    logprobs = None
    if reply.logprobs is not None:
        logprobs = await logprob_content(state.runtime, reply.logprobs)
    return JSONResponse(completion(body, reply, logprobs), headers=reply_headers(reply))
