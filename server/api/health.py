"""Liveness and readiness, for routers and orchestrators; neither needs the API key.

GET /live    200 {"status": "live", "worker"} while the process answers HTTP
GET /ready   200 {"status": "ready", "worker", "model"} when the runtime is open, the registry
             answers a query (within ``READY_QUERY_TIMEOUT_S``) and the worker is not
             draining; else 503 {"status": "not_ready", "worker", "reason"}. While draining
             the status is ``?draining=`` (400-599; default 503): HAProxy checks with
             ``?draining=404`` for its ``http-check disable-on-404`` (take no new requests,
             let those in flight finish; see ``agentkv.server.worker``)
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from agentkv.server.state import ServerState
from agentkv.server.worker import Drain

router = APIRouter()
READY_QUERY_TIMEOUT_S = 2.0
"""A registry slower than this to list one agent makes the worker not ready."""


def _body(request: Request, status: str, **fields: Any) -> dict[str, Any]:
    return {"status": status, "worker": request.app.state.worker, **fields}


@router.get("/live")
async def live(request: Request) -> dict[str, Any]:
    return _body(request, "live")


@router.get("/ready")
async def ready(
    request: Request, draining: Annotated[int, Query(ge=400, le=599)] = 503
) -> JSONResponse:
    drain: Drain = request.app.state.drain
    state: ServerState | None = getattr(request.app.state, "server", None)
    if drain.is_draining:
        reason = f"draining (SIGTERM); requests in flight: {drain.in_flight}"
        return JSONResponse(_body(request, "not_ready", reason=reason), status_code=draining)
    if state is None or drain.stopping:
        reason = "the runtime is not open (starting or shutting down)"
        return JSONResponse(_body(request, "not_ready", reason=reason), status_code=503)
    try:
        await asyncio.wait_for(state.runtime.list_agents(limit=1), READY_QUERY_TIMEOUT_S)
    except TimeoutError:
        reason = f"the registry did not answer within {READY_QUERY_TIMEOUT_S:g} s"
        return JSONResponse(_body(request, "not_ready", reason=reason), status_code=503)
    except Exception as exc:
        reason = f"the registry does not answer: {type(exc).__name__}: {exc}"
        return JSONResponse(_body(request, "not_ready", reason=reason), status_code=503)
    return JSONResponse(_body(request, "ready", model=state.model.spec))
