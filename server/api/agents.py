"""Agents REST API: list, create, inspect, delete agents and read their transcripts.

GET    /v1/agents?limit=&after_id=    one page, oldest first: {"object": "list",
                                   "data": [agent, ...], "has_more", "first_id", "last_id"};
                                   the next page is ?after_id=<last_id>
POST   /v1/agents                  {id?, name?, system_prompt?} -> 201 agent (409: id taken;
                                   400: an id off the rule of ``agentkv.store.ids``, a name over
                                   256 characters)
GET    /v1/agents/{id}             agent, with "message_count" (404: no such agent)
DELETE /v1/agents/{id}             {"id", "object": "agent.deleted", "deleted": true}
POST   /v1/agents/{id}/fork        {id?, name?} -> 201 a new agent continuing this one's
                                   conversation from the same cache (404, 409)
GET    /v1/agents/{id}/messages?limit=&after_position=
                                   one page of the transcript, in order, same list shape

A body that carries much text (a system prompt of megabytes, a page of long messages) is
parsed and written in a worker thread, not on the event loop (``agentkv.server.bodies``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from agentkv import AgentRecord, MessageRecord
from agentkv.server.bodies import INLINE_BYTES, model_off_loop
from agentkv.server.conversation import UTF8
from agentkv.server.state import State
from agentkv.store import MAX_NAME_CHARS

router = APIRouter(prefix="/v1/agents")
DEFAULT_PAGE, MAX_PAGE = 20, 1000
MAX_MESSAGES_PAGE = 1000
AgentName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS), UTF8]


class NewAgent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, min_length=1)
    name: AgentName | None = None
    system_prompt: str | None = None


def agent_body(agent: AgentRecord, **extra: Any) -> dict[str, Any]:
    return {
        "id": agent.id,
        "object": "agent",
        "name": agent.name,
        "system_prompt": agent.system_prompt,
        "sampling": agent.sampling,
        "model_fingerprint": agent.model_fingerprint,
        "idle_ttl_s": agent.idle_ttl_s,
        "created_at": agent.created_at.isoformat(),
        "updated_at": agent.updated_at.isoformat(),
        **extra,
    }


def message_body(message: MessageRecord) -> dict[str, Any]:
    body = {
        "position": message.position,
        "role": str(message.role),
        "content": message.content,
        "token_count": message.token_count,
        "created_at": message.created_at.isoformat(),
    }
    if message.parts is not None:  # its text and images in order (images by SHA-256 and size)
        body["parts"] = [{k: v for k, v in part.items() if k != "image"} for part in message.parts]
    return body


def page(data: list[dict[str, Any]], limit: int, key: str) -> dict[str, Any]:
    """A list response from up to ``limit + 1`` items (the extra one only says there is more)."""
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "has_more": len(data) > limit,
        "first_id": shown[0][key] if shown else None,
        "last_id": shown[-1][key] if shown else None,
    }


async def json_response(content: dict[str, Any], text_chars: int, status: int = 200) -> Response:
    """``content`` as JSON, encoded in a worker thread when its text (``text_chars``
    characters) is over :data:`agentkv.server.bodies.INLINE_BYTES`."""
    if text_chars <= INLINE_BYTES:
        return JSONResponse(content, status)
    return await asyncio.to_thread(JSONResponse, content, status)


def _prompt_chars(agents: list[AgentRecord]) -> int:
    return sum(len(a.system_prompt or "") for a in agents)


@router.get("")
async def list_agents(
    state: State,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
    after_id: str | None = None,
) -> Response:
    agents = await state.runtime.list_agents(limit=limit + 1, after_id=after_id)
    return await json_response(
        page([agent_body(a) for a in agents], limit, "id"), _prompt_chars(agents)
    )


@router.post("", status_code=201)
async def create_agent(http: Request, state: State) -> Response:
    body = await model_off_loop(http, NewAgent)
    agent = await state.runtime.create_agent(
        body.id, name=body.name, system_prompt=body.system_prompt
    )
    return await json_response(agent_body(agent, message_count=0), _prompt_chars([agent]), 201)


class Fork(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, min_length=1)
    name: AgentName | None = None


@router.post("/{agent_id}/fork", status_code=201)
async def fork_agent(agent_id: str, http: Request, state: State) -> Response:
    body = await model_off_loop(http, Fork)
    agent = await state.runtime.fork(agent_id, body.id, name=body.name)
    count = await state.runtime.message_count(agent.id)
    return await json_response(agent_body(agent, message_count=count), _prompt_chars([agent]), 201)


@router.get("/{agent_id}")
async def get_agent(agent_id: str, state: State) -> Response:
    agent = await state.runtime.get_agent(agent_id)
    count = await state.runtime.message_count(agent_id)
    return await json_response(agent_body(agent, message_count=count), _prompt_chars([agent]))


@router.delete("/{agent_id}")
async def delete_agent(agent_id: str, state: State) -> dict[str, Any]:
    await state.runtime.delete_agent(agent_id)
    state.identity.deleted(agent_id)
    return {"id": agent_id, "object": "agent.deleted", "deleted": True}


@router.get("/{agent_id}/messages")
async def list_messages(
    agent_id: str,
    state: State,
    limit: Annotated[int, Query(ge=1, le=MAX_MESSAGES_PAGE)] = MAX_MESSAGES_PAGE,
    after_position: Annotated[int, Query(ge=-1)] = -1,
) -> Response:
    messages = await state.runtime.transcript(agent_id, start=after_position + 1, limit=limit + 1)
    chars = sum(len(m.content) for m in messages)
    return await json_response(page([message_body(m) for m in messages], limit, "position"), chars)
