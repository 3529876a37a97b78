"""What the routes share: the runtime, the identity resolver, the metrics, the model's facts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from agentkv import AgentRuntime, Reply
from agentkv.server.identity import Identity
from agentkv.server.limits import DEFAULT_MAX_MESSAGES
from agentkv.server.metrics import ServerMetrics


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """Facts about the loaded model that replies need."""

    spec: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, runtime: AgentRuntime) -> ModelInfo:
        return cls(runtime.config.model)

    @staticmethod
    def stop_reason(reply: Reply) -> tuple[str, str | None]:
        """Anthropic's (stop_reason, stop_sequence) of a reply."""
        if reply.finish_reason == "length":
            return "max_tokens", None
        if reply.content.tool_calls:
            return "tool_use", None
        if reply.stop_sequence is not None:
            return "stop_sequence", reply.stop_sequence
        return "end_turn", None


@dataclass(slots=True)
class ServerState:
    runtime: AgentRuntime
    identity: Identity
    metrics: ServerMetrics
    model: ModelInfo
    max_messages: int = DEFAULT_MAX_MESSAGES  # a chat request's limit (413 beyond it)
    keep_volatile: bool = False  # keep per-request metadata lines in system prompts


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the state the app's lifespan opened. A coroutine: FastAPI runs a
    plain function dependency in its thread pool, a hop there and back on every request."""
    return request.app.state.server


State = Annotated[ServerState, Depends(get_state)]
"""Route parameter type: the server's state."""
