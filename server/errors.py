"""Errors as each API spells them, and the status code of every runtime error.

Each route answers errors in one dialect:

- ``/v1/messages*``: Anthropic, ``{"type": "error", "error": {"type", "message"}}``;
- ``/v1/chat/completions``: OpenAI, ``{"error": {"message", "type", "param", "code"}}``;
- every other route (``/v1/models``, ``/v1/agents*``, ``/metrics``): Anthropic when the request
  carries an ``anthropic-version`` header (the Anthropic SDK always sends one), else OpenAI.

Status codes::

    400 invalid input: request validation (FastAPI's 422 is turned into 400, which both SDKs
        raise as BadRequestError), empty message, bad agent id, context too long, ValueError
    401 missing or wrong API key
    404 unknown agent or route
    409 agent id already taken; the agent changed while the turn ran (another worker stored
        a turn of it first: nothing of this one was stored)
    413 request body over the server's limit; a turn whose history and prompt can never fit
        the engine's KV memory budget (code ``kv_budget_exceeded``, param ``messages``)
    429 (OpenAI) / 529 (Anthropic overloaded_error): the engine's admission queue is full
    499 (nginx's "client closed request"; nobody reads it) the client went away before its
        request was read or its reply was ready: nothing of it was stored, nothing is logged
    500 a failed turn (rolled back)
    503 the runtime is shutting down, or the registry cannot be written (read-only, locked)
    507 the registry's disk is full (nothing of the request was stored)
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from agentkv import (
    AgentChangedError,
    AgentExistsError,
    AgentKVError,
    AgentNotFoundError,
    ContextLengthError,
    EngineOverloadedError,
    KVBudgetError,
    RegistryStorageError,
    RuntimeClosedError,
)

log = logging.getLogger(__name__)


class Dialect(enum.Enum):
    ANTHROPIC = "anthropic"
    OPENAI = "openai"

    @classmethod
    def of(cls, request: Request) -> Dialect:
        path = request.url.path
        if path.startswith("/v1/messages"):
            return cls.ANTHROPIC
        if path.startswith("/v1/chat/"):
            return cls.OPENAI
        return cls.ANTHROPIC if "anthropic-version" in request.headers else cls.OPENAI


@dataclass(slots=True, frozen=True)
class ErrorKind:
    """One kind of error: its status and type in each dialect (OpenAI also has a code)."""

    status: int
    anthropic_type: str
    openai_type: str
    openai_code: str | None = None
    anthropic_status: int | None = None  # when it differs from ``status``

    def status_in(self, dialect: Dialect) -> int:
        if dialect is Dialect.ANTHROPIC and self.anthropic_status is not None:
            return self.anthropic_status
        return self.status


INVALID_REQUEST = ErrorKind(400, "invalid_request_error", "invalid_request_error")
CONTEXT_LENGTH = ErrorKind(
    400, "invalid_request_error", "invalid_request_error", "context_length_exceeded"
)
AUTHENTICATION = ErrorKind(401, "authentication_error", "invalid_request_error", "invalid_api_key")
NOT_FOUND = ErrorKind(404, "not_found_error", "invalid_request_error", "not_found")
CONFLICT = ErrorKind(409, "invalid_request_error", "invalid_request_error", "conflict")
MISDIRECTED = ErrorKind(421, "invalid_request_error", "invalid_request_error", "host_not_allowed")
TOO_LARGE = ErrorKind(413, "request_too_large", "invalid_request_error", "request_too_large")
KV_BUDGET = ErrorKind(413, "request_too_large", "invalid_request_error", "kv_budget_exceeded")
OVERLOADED = ErrorKind(429, "overloaded_error", "rate_limit_error", "overloaded", 529)
INTERNAL = ErrorKind(500, "api_error", "server_error")
UNAVAILABLE = ErrorKind(503, "api_error", "server_error", "unavailable")
CLIENT_CLOSED = ErrorKind(499, "api_error", "invalid_request_error", "client_closed_request")
STORAGE_FULL = ErrorKind(507, "api_error", "server_error", "insufficient_storage")


class ClientDisconnectedError(Exception):
    """The client went away before its reply was ready; nobody reads the answer."""


class APIError(Exception):
    """An error to answer with; rendered in the dialect of the route that raised it."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> APIError:
        return cls(INVALID_REQUEST, message, param)

    def body(self, dialect: Dialect) -> dict:
        if dialect is Dialect.ANTHROPIC:
            return {
                "type": "error",
                "error": {"type": self.kind.anthropic_type, "message": self.message},
            }
        return {
            "error": {
                "message": self.message,
                "type": self.kind.openai_type,
                "param": self.param,
                "code": self.kind.openai_code,
            }
        }

    def response(self, dialect: Dialect) -> JSONResponse:
        headers = {"retry-after": "1"} if self.kind is OVERLOADED else None
        return JSONResponse(self.body(dialect), self.kind.status_in(dialect), headers=headers)


def api_error(exc: BaseException) -> APIError:
    """The APIError a runtime (or request) exception answers as."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(OVERLOADED, f"{exc}; retry in a moment")
    if isinstance(exc, AgentNotFoundError):
        return APIError(NOT_FOUND, str(exc))
    if isinstance(exc, AgentExistsError | AgentChangedError):
        return APIError(CONFLICT, str(exc))
    if isinstance(exc, ContextLengthError):
        return APIError(CONTEXT_LENGTH, str(exc), "max_tokens")
    if isinstance(exc, KVBudgetError):
        return APIError(KV_BUDGET, str(exc), "messages")
    if isinstance(exc, ValueError | jinja2.TemplateError):  # bad ids, empty turns, sampling
        return APIError(INVALID_REQUEST, str(exc))
    if isinstance(exc, RuntimeClosedError):
        return APIError(UNAVAILABLE, "the server is shutting down; retry on a new connection")
    if isinstance(exc, RegistryStorageError):
        return APIError(STORAGE_FULL if exc.is_full else UNAVAILABLE, str(exc))
    if isinstance(exc, AgentKVError):
        return APIError(INTERNAL, str(exc))
    if isinstance(exc, ClientDisconnectedError):
        return APIError(CLIENT_CLOSED, str(exc))
    if isinstance(exc, ClientDisconnect):  # (Starlette's: while the body was being read)
        return APIError(CLIENT_CLOSED, "the client disconnected before its request was read")
    return APIError(INTERNAL, f"internal error: {type(exc).__name__}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for error in errors[:3]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        param = param or ".".join(loc) or None
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, param


def install_error_handlers(
    app: FastAPI, headers: Callable[[], dict[str, str]] | None = None
) -> None:
    """Answer every error in the dialect of the route it happened on.

    ``headers()`` go on the answers to unexpected exceptions, which Starlette sends from
    outside every middleware (the others get them from the middleware that adds them).
    """

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        error = api_error(exc)
        if error.kind is INTERNAL:
            log.error("request %s failed", request.url.path, exc_info=exc)
        return error.response(Dialect.of(request))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises these after answering, and uvicorn logs the traceback.
        response = api_error(exc).response(Dialect.of(request))
        response.headers.update(headers() if headers else {})
        return response

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        message, param = _validation_message(exc)  # type: ignore[arg-type]
        return APIError.invalid(message, param).response(Dialect.of(request))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        known = {404: NOT_FOUND, 413: TOO_LARGE}
        kind = known.get(status) or ErrorKind(status, *["invalid_request_error"] * 2)
        return APIError(kind, str(getattr(exc, "detail", exc))).response(Dialect.of(request))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    handled = (APIError, AgentKVError, ClientDisconnectedError, ClientDisconnect, ValueError)
    for cls in (*handled, jinja2.TemplateError):
        app.add_exception_handler(cls, on_error)
    app.add_exception_handler(Exception, on_unexpected)
