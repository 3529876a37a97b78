"""The Responses API's output: the response object and its output items (reasoning, message,
function calls), as the API returns them whole and as its stream's events carry them."""

from __future__ import annotations

import uuid
from typing import Any

from agentkv import Reply
from agentkv.server.api.responses_request import ResponsesRequest
from agentkv.tool_calls import ToolCall


class Ids:
    """The ids of one response and its output items."""

    def __init__(self) -> None:
        self.response = f"resp_{uuid.uuid4().hex}"
        self.message = f"msg_{uuid.uuid4().hex}"
        self.reasoning = f"rs_{uuid.uuid4().hex}"


def offered_calls(body: ResponsesRequest, reply: Reply) -> list[ToolCall]:
    calls = list(reply.content.tool_calls)
    if body.parallel_tool_calls is False:
        calls = calls[:1]
    if body.max_tool_calls is not None:
        calls = calls[: body.max_tool_calls]
    return calls


def message_item(
    ids: Ids, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if status == "in_progress" else [text_part(text, logprobs)]
    return {
        "type": "message",
        "id": ids.message,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_item(ids: Ids, text: str, status: str, summary: bool) -> dict[str, Any]:
    """A reasoning model's thinking, whole; with ``summary`` asked for, also as its summary
    (no summarizer runs here)."""
    done = status != "in_progress"
    return {
        "type": "reasoning",
        "id": ids.reasoning,
        "status": status,
        "summary": [{"type": "summary_text", "text": text}] if summary and done else [],
        "content": [{"type": "reasoning_text", "text": text}] if done else [],
    }


def wants_summary(body: ResponsesRequest) -> bool:
    """Whether the request asks for reasoning summaries (``reasoning.summary``)."""
    return (body.reasoning or {}).get("summary") not in (None, "none")


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` part (``logprobs``: its tokens' entries, when asked for)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(
    body: ResponsesRequest, call: ToolCall, status: str, arguments: str | None = None
) -> dict[str, Any]:
    item = {
        "type": "function_call",
        "id": f"fc_{call.id.removeprefix('call_')}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments_json if arguments is None else arguments,
        "status": status,
    }
    if (namespace := body.read.namespaces.get(call.name)) is not None:
        item["namespace"] = namespace
    return item


def output_items(
    body: ResponsesRequest, ids: Ids, reply: Reply, logprobs: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    calls = offered_calls(body, reply)
    items = []
    if reply.reasoning:
        items.append(reasoning_item(ids, reply.reasoning, "completed", wants_summary(body)))
    if reply.content.text or not calls:
        items.append(message_item(ids, reply.content.text, item_status(reply), logprobs))
    items += [call_item(body, call, call_status(call)) for call in calls]
    return items


def call_status(call: ToolCall) -> str:
    """A function_call item's status: ``incomplete`` when the reply was cut in it."""
    return "incomplete" if call.cut else "completed"


def item_status(reply: Reply) -> str:
    """A message item's status: ``incomplete`` when max_output_tokens cut it."""
    return "incomplete" if reply.finish_reason == "length" else "completed"


def usage(reply: Reply) -> dict[str, Any]:
    u = reply.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def response_object(
    body: ResponsesRequest,
    ids: Ids,
    created: int,
    reply: Reply | None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The response object: in progress (no reply yet), completed or incomplete
    (``logprobs``: the reply's tokens' entries, when asked for)."""
    status, incomplete = "in_progress", None
    if reply is not None:
        status = "incomplete" if reply.finish_reason == "length" else "completed"
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
    return {
        "id": ids.response,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": body.model,
        "instructions": body.instructions,
        "output": output_items(body, ids, reply, logprobs) if reply is not None else [],
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.store is not False,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "usage": usage(reply) if reply is not None else None,
    }
