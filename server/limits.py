"""Limits on what one request may hold: its body's size, its messages, its stop strings.

The body's size is capped before a byte of an oversized body is buffered: a body announced
larger than the cap (``Content-Length``) is refused at once; a chunked body is counted as it
arrives and refused as soon as it passes the cap. Either way the client gets 413 in its API's
error shape and nothing reaches the routes. The number of messages is checked as soon as the
body is parsed, before any message is validated (413 too, see ``agentkv.server.bodies``); stop
strings are checked with the rest of the request (400).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv.server.errors import TOO_LARGE, APIError, Dialect

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_MESSAGES = 10_000
"""Room for long agent sessions (each tool call and its result are two messages); a longer
history is refused before it costs the server more than parsing."""
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
"""Stop strings are matched against every generated token's text: their number and length
bound that work (and the text held back while a stop string may be starting)."""


def too_large_message(limit: int) -> str:
    return (
        f"request body is larger than this server's limit of {limit} bytes; send a shorter "
        "conversation or raise the limit (agentkv serve --max-body-bytes)"
    )


def too_many_messages_message(count: int, limit: int, field: str = "messages") -> str:
    return (
        f"{field}: {count} messages are more than this server's limit of {limit}; send a "
        "shorter conversation (compact it) or raise the limit (agentkv serve --max-messages)"
    )


class BodySizeLimit:
    """ASGI middleware answering 413 for request bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = APIError(TOO_LARGE, too_large_message(self.max_bytes))
            await error.response(Dialect.of(Request(scope)))(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read; the error handlers render it.
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        await self.app(scope, counted, send)
