"""Agents REST API: list, create, inspect, delete agents and read their transcripts.

GET    /v1/agents                  {"object": "list", "data": [agent, ...]}
POST   /v1/agents                  {id?, name?, system_prompt?} -> 201 agent (409: id taken)
GET    /v1/agents/{id}             agent, with "message_count" (404: no such agent)
DELETE /v1/agents/{id}             {"id", "object": "agent.deleted", "deleted": true}
GET    /v1/agents/{id}/messages    {"object": "list", "data": [message, ...]}
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agents import AgentRecord, MessageRecord
from server.state import State

router = APIRouter(prefix="/v1/agents")


class NewAgent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, min_length=1)
    name: str | None = None
    system_prompt: str | None = None


def agent_body(agent: AgentRecord, **extra: Any) -> dict[str, Any]:
    return {
        "id": agent.id,
        "object": "agent",
        "name": agent.name,
        "system_prompt": agent.system_prompt,
        "sampling": agent.sampling,
        "model_fingerprint": agent.model_fingerprint,
        "created_at": agent.created_at.isoformat(),
        "updated_at": agent.updated_at.isoformat(),
        **extra,
    }


def message_body(message: MessageRecord) -> dict[str, Any]:
    return {
        "position": message.position,
        "role": str(message.role),
        "content": message.content,
        "token_count": message.token_count,
        "created_at": message.created_at.isoformat(),
    }


@router.get("")
async def list_agents(state: State) -> dict[str, Any]:
    agents = await state.runtime.list_agents()
    return {"object": "list", "data": [agent_body(a) for a in agents]}


@router.post("", status_code=201)
async def create_agent(body: NewAgent, state: State) -> JSONResponse:
    agent = await state.runtime.create_agent(
        body.id, name=body.name, system_prompt=body.system_prompt
    )
    state.identity.created(agent)
    return JSONResponse(agent_body(agent, message_count=0), status_code=201)


@router.get("/{agent_id}")
async def get_agent(agent_id: str, state: State) -> dict[str, Any]:
    agent = await state.runtime.get_agent(agent_id)
    transcript = await state.runtime.transcript(agent_id)
    return agent_body(agent, message_count=len(transcript))


@router.delete("/{agent_id}")
async def delete_agent(agent_id: str, state: State) -> dict[str, Any]:
    await state.runtime.delete_agent(agent_id)
    state.identity.deleted(agent_id)
    return {"id": agent_id, "object": "agent.deleted", "deleted": True}


@router.get("/{agent_id}/messages")
async def list_messages(agent_id: str, state: State) -> dict[str, Any]:
    transcript = await state.runtime.transcript(agent_id)
    return {"object": "list", "data": [message_body(m) for m in transcript]}
