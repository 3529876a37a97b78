"""Run the server on a free loopback port in a background thread (demo, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from agentkv import RuntimeConfig
from agentkv.server.app import create_app
from agentkv.server.hosts import allowed_hosts


@contextlib.contextmanager
def serve_in_thread(
    config: RuntimeConfig,
    api_key: str | None = None,
    start_timeout_s: float = 120,
    **app_options: Any,
) -> Iterator[str]:
    """Start uvicorn with agentkv's app on 127.0.0.1; yields the base URL; stops on exit.

    ``app_options`` go to :func:`agentkv.server.app.create_app` (e.g. ``max_body_bytes``); requests
    must name a loopback host unless ``allowed_hosts`` says otherwise (see
    ``agentkv.server.hosts``).

    Stopping is graceful: the app's lifespan closes the runtime, which flushes cache writes.
    """
    app_options.setdefault("allowed_hosts", allowed_hosts("127.0.0.1"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config, api_key, **app_options),
            log_level="warning",
            http="h11",
            ws="none",
            lifespan="on",
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agentkv server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
