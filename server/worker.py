"""This process as one of many workers behind a router: its id on every response, and the
drain on SIGTERM.

Workers that share one registry and one cache directory sit behind a router that
health-checks ``GET /ready`` (``agentkv.server.api.health``; README "Scale out"). On SIGTERM a
worker
drains:

1. ``/ready`` answers 503 at once (404 when the check asks ``?draining=404``: HAProxy's
   ``http-check disable-on-404`` takes a 404 as "send nothing new, let what runs finish",
   where a failed check would mark the worker down and cut its sessions);
2. it goes on answering, for at least ``grace_s`` (time for the router to notice) and until
   no request is in flight: turns in flight finish and are stored;
3. then uvicorn's own shutdown runs: it stops accepting, closes idle connections, and the
   app's lifespan closes the runtime (cache writes flushed, leases released). The process
   exits 0.

A second SIGTERM ends step 2 at once (uvicorn still waits for the requests in flight); a
SIGINT is uvicorn's as ever (a second one quits without waiting).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

WORKER_HEADER = "x-agentkv-worker"
"""Response header naming the worker that answered (``RuntimeConfig.worker``)."""
HEALTH_PATHS = frozenset({"/live", "/ready"})
"""Routes for routers and orchestrators: no API key, no Host check, not counted in flight."""


@dataclass(slots=True)
class Drain:
    """Whether this worker is draining, and how many requests it is still answering.

    Attributes:
        since: ``time.monotonic()`` when the drain began; None: not draining.
        in_flight: requests being answered (health checks aside), streamed bodies included.
        stopping: the app's lifespan is closing the runtime.
    """

    since: float | None = None
    in_flight: int = 0
    stopping: bool = False

    @property
    def is_draining(self) -> bool:
        return self.since is not None

    @property
    def is_idle(self) -> bool:
        return self.in_flight == 0

    @property
    def draining_s(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def start(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.info("draining: /ready answers 503; requests in flight: %d", self.in_flight)

    def can_stop(self, grace_s: float) -> bool:
        """Draining for at least ``grace_s`` seconds, with nothing in flight."""
        return self.is_draining and self.is_idle and self.draining_s >= grace_s


class WorkerMiddleware:
    """ASGI middleware: names the worker on every response and counts requests in flight."""

    def __init__(self, app: ASGIApp, state: Any):
        """``state``: the app's state: its ``worker`` (the id, once the runtime has claimed
        it) and ``drain``."""
        self.app = app
        self.state = state
        self.drain: Drain = state.drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                header = (WORKER_HEADER.encode(), (self.state.worker or "").encode())
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        if scope["path"] in HEALTH_PATHS:
            await self.app(scope, receive, send_named)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send_named)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM (see the module docstring) and exiting 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float = 0.0):
        """
        Args:
            config: uvicorn's configuration (its app made by ``agentkv.server.app.create_app``).
            drain: the app's drain (``app.state.drain``).
            grace_s: after SIGTERM, go on accepting requests at least this long, so that the
                router's health checks take the worker out before its port closes.
        """
        if grace_s < 0:
            raise ValueError(f"grace_s must be 0 or more, got {grace_s}")
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif not self.drain.is_draining:
            self.drain.start()
        elif not self.should_exit:
            log.info(
                "second SIGTERM: closing the port; requests in flight: %d", self.drain.in_flight
            )
            self.should_exit = True
        # Never force_exit on SIGTERM: it would skip the lifespan's shutdown, which flushes
        # the cache writes and gives the leases back (SIGINT twice still forces).
        # uvicorn re-raises the signals it caught once it has shut down (the process then
        # dies of it); a drained SIGTERM is a clean exit instead, so it is not recorded.

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.drain.can_stop(self.grace_s):
            log.info("drained after %.1f s: shutting down", self.drain.draining_s)
            self.should_exit = True
        return await super().on_tick(counter)
