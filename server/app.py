"""The FastAPI app: Anthropic and OpenAI chat APIs, the agents API and metrics over one runtime.

Routes::

    HEAD   /, /api/hello                200 (clients' connectivity checks)
    POST   /v1/messages                 Anthropic Messages (stream: SSE)
    POST   /v1/messages/count_tokens    Anthropic token counting
    POST   /v1/chat/completions         OpenAI Chat Completions (stream: SSE)
    POST   /v1/responses                OpenAI Responses (stream: SSE; see server.api.responses)
    GET    /v1/responses/{id}           a stored response (DELETE: delete it)
    POST   /v1/responses/input_tokens   its token counting
    GET    /v1/models, /v1/models/{id}  the loaded model, readable by both SDKs
    *      /v1/agents...                agents REST (see server.api.agents)
    GET    /metrics                     Prometheus text format
    GET    /live, /ready                liveness and readiness (see server.api.health)

When an API key is set, every route but /live and /ready needs it, as ``x-api-key: KEY``
(Anthropic SDK) or ``Authorization: Bearer KEY`` (OpenAI SDK). Which agent answers a chat
request is decided by :mod:`agentkv.server.identity`; the agent's id comes back in the
``x-agent-id`` response header, and every response names the worker that answered in
``x-agentkv-worker`` (see :mod:`agentkv.server.worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from sqlalchemy import make_url

from agentkv import AgentKVError, AgentRuntime, RuntimeConfig
from agentkv.server.api import agents as agents_api
from agentkv.server.api import anthropic as anthropic_api
from agentkv.server.api import health as health_api
from agentkv.server.api import openai as openai_api
from agentkv.server.api import responses as responses_api
from agentkv.server.api import stored_responses as stored_responses_api
from agentkv.server.errors import AUTHENTICATION, NOT_FOUND, APIError, install_error_handlers
from agentkv.server.hosts import HostCheck
from agentkv.server.identity import Identity
from agentkv.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES, BodySizeLimit
from agentkv.server.metrics import RequestMetricsMiddleware, ServerMetrics
from agentkv.server.state import ModelInfo, ServerState, State
from agentkv.server.stateless import DEFAULT_MAX_STATELESS_AGENTS, DEFAULT_STATELESS_TTL_S
from agentkv.server.worker import HEALTH_PATHS, WORKER_HEADER, Drain, WorkerMiddleware

log = logging.getLogger(__name__)

DEFAULT_RESPONSES_TTL_S = 30 * 24 * 3600
"""How long stored Responses API responses are kept (OpenAI keeps them 30 days)."""
PREFLIGHTS = frozenset({"/", "/api/hello"})
"""Paths whose HEAD answers 200 without a key: clients' connectivity checks."""
SWITCH_INTERVAL_S = 0.001
"""The interpreter's switch interval while an app serves (Python's default is 5 ms): how long
a thread asking for the GIL waits before the thread running Python must hand it over. The event
loop's thread gives the GIL up at every socket call and takes it back after; while a worker
thread parses, renders or tokenizes a large request, each of those waits costs up to this
interval, several times for every other client's request (``benchmarks/bench_event_loop.py``).
"""


class _SwitchInterval:
    """:data:`SWITCH_INTERVAL_S` while any app of this process serves (the interval is the
    process's: apps in threads of one process share it), the interval before once none does."""

    _lock = threading.Lock()
    _serving = 0
    _before = 0.0

    @classmethod
    @contextlib.contextmanager
    def short(cls) -> Iterator[None]:
        with cls._lock:
            if cls._serving == 0:
                cls._before = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL_S)
            cls._serving += 1
        try:
            yield
        finally:
            with cls._lock:
                cls._serving -= 1
                if cls._serving == 0:
                    sys.setswitchinterval(cls._before)


async def _expire_forever(
    runtime: AgentRuntime, identity: Identity, every_s: float, responses_ttl_s: int | None
) -> None:
    """Every ``every_s`` seconds, delete expired agents and stored responses older than
    ``responses_ttl_s``."""
    while True:
        await asyncio.sleep(every_s)
        try:
            for agent_id in await runtime.expire_agents():
                identity.deleted(agent_id)
            if responses_ttl_s is not None:
                before = datetime.now(UTC) - timedelta(seconds=responses_ttl_s)
                if expired := await runtime.responses.expire(before):
                    log.info("expired %d stored responses", expired)
        except Exception:  # a full disk, say: try again next round, keep serving
            log.exception("expiring idle agents and old responses failed")


def _given_key(request: Request) -> str | None:
    if key := request.headers.get("x-api-key"):
        return key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _model_body(model: ModelInfo) -> dict[str, Any]:
    # The fields of both SDKs' Model types: OpenAI's (object, created, owned_by) and
    # Anthropic's (type, display_name, created_at).
    return {
        "id": model.spec,
        "object": "model",
        "created": model.created,
        "owned_by": "agentkv",
        "type": "model",
        "display_name": model.spec,
        "created_at": datetime.fromtimestamp(model.created, UTC).isoformat(),
    }


def create_app(
    config: RuntimeConfig,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_messages: int = DEFAULT_MAX_MESSAGES,
    stateless_ttl_s: int | None = DEFAULT_STATELESS_TTL_S,
    allowed_hosts: frozenset[str] | None = None,
    max_stateless_agents: int | None = DEFAULT_MAX_STATELESS_AGENTS,
    keep_volatile: bool = False,
    responses_ttl_s: int | None = DEFAULT_RESPONSES_TTL_S,
) -> FastAPI:
    """An app that opens an AgentRuntime for ``config`` on startup and closes it on shutdown.

    ``app.state.worker`` is the worker's id (claimed when the runtime opens), named on every
    response; ``app.state.drain`` is its :class:`agentkv.server.worker.Drain`, which
    ``/ready`` reports.

    Args:
        config: the runtime to serve.
        api_key: when set, every request must carry it (``x-api-key`` or a bearer token).
        max_body_bytes: larger request bodies are refused with 413.
        max_messages: chat requests with more messages are refused with 413.
        stateless_ttl_s: agents created for requests that name no agent are deleted after this
            many seconds without a turn (None: kept). Named agents never expire.
        allowed_hosts: the Host names requests may carry (any port), others get 421; None:
            any (see ``agentkv.server.hosts``: ``agentkv serve`` and ``serve_in_thread`` pass the
            loopback names when bound to loopback).
        max_stateless_agents: when creating an agent for a request that names none makes more
            such agents, the idle ones used least recently are deleted (None: no cap).
        keep_volatile: keep the per-request metadata lines clients put in system prompts
            (``agentkv.server.sessions.VOLATILE_LINES``: Claude Code's billing line), which are
            otherwise dropped so that the prompt's prefix stays cached across requests.
        responses_ttl_s: stored Responses API responses are deleted this many seconds after
            they were made (None: kept until deleted).
    """
    if max_messages < 1:
        raise ValueError(f"max_messages must be positive, got {max_messages}")
    metrics = ServerMetrics()
    drain = Drain()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            runtime = await AgentRuntime.open(config)
        except (AgentKVError, ValueError) as exc:  # bad configuration (a budget too small, a
            app.state.startup_error = exc  # database URL of no supported kind...): say so
            raise
        app.state.worker = runtime.leases.worker_id
        log.info("worker %s, registry %s", app.state.worker, shown_url(config.database))
        log.info(
            "model %s from %s (fingerprint %s)",
            config.model,
            runtime.model_path,
            runtime.model_fingerprint[:16],
        )
        expiry = None
        try:
            identity = Identity(runtime, stateless_ttl_s, max_stateless_agents)
            await identity.load()
            app.state.server = ServerState(
                runtime, identity, metrics, ModelInfo.of(runtime), max_messages, keep_volatile
            )
            ttls = [t for t in (stateless_ttl_s, responses_ttl_s) if t is not None]
            if ttls:
                every_s = min(60.0, min(ttls) / 10)
                expiry = asyncio.create_task(
                    _expire_forever(runtime, identity, every_s, responses_ttl_s)
                )
            # What start-up made (the model, its tokenizer) lives as long as the server: full
            # collections skip it. Each would hold the GIL ~100 ms, stalling every client.
            gc.collect()
            gc.freeze()
            with _SwitchInterval.short():
                yield
        finally:
            drain.stopping = True
            gc.unfreeze()
            if expiry is not None:
                expiry.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await expiry
            await runtime.close()  # flushes pending cache writes

    async def require_api_key(request: Request) -> None:
        if api_key is None or (request.method == "HEAD" and request.url.path in PREFLIGHTS):
            return  # the preflight carries no key
        if request.url.path in HEALTH_PATHS:
            return  # routers' health checks carry none either
        given = _given_key(request)
        if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(
                AUTHENTICATION,
                "invalid API key: send it as 'x-api-key: KEY' or 'Authorization: Bearer KEY'",
            )

    app = FastAPI(
        title="agentkv",
        lifespan=lifespan,
        dependencies=[Depends(require_api_key)],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.worker, app.state.drain = config.worker_id, drain  # (the id claimed, once open)
    install_error_handlers(app, headers=lambda: {WORKER_HEADER: app.state.worker or ""})
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, hosts=allowed_hosts, open_paths=HEALTH_PATHS)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.add_middleware(WorkerMiddleware, state=app.state)  # outermost: every reply
    app.include_router(health_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(stored_responses_api.router)
    app.include_router(agents_api.router)

    @app.head("/", include_in_schema=False)
    @app.head("/api/hello", include_in_schema=False)
    async def preflight() -> Response:
        # Claude Code checks that its base URL answers: HEAD / before the first request, and
        # HEAD /api/hello when an interactive session starts.
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models(state: State) -> dict[str, Any]:
        model = _model_body(state.model)
        return {
            "object": "list",
            "data": [model],
            "has_more": False,
            "first_id": model["id"],
            "last_id": model["id"],
        }

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, state: State) -> dict[str, Any]:
        if model_id != state.model.spec:
            raise APIError(
                NOT_FOUND,
                f"model {model_id!r} is not loaded; this server serves {state.model.spec!r}",
                param="model",
            )
        return _model_body(state.model)

    @app.get("/metrics")
    async def metrics_text(state: State) -> Response:
        body = metrics.render(state.runtime.stats())
        return Response(body, media_type=metrics.content_type)

    return app


def shown_url(database: str) -> str:
    """A database URL or path as it can be logged: without a password."""
    if "://" not in database:
        return database
    return make_url(database).render_as_string(hide_password=True)
