"""Request bodies, parsed and validated off the event loop.

FastAPI parses and validates a route's body model on the event loop, where a history of tens
of thousands of messages takes a good part of a second in which no other client is answered.
The chat routes read their body's bytes instead and hand them to :func:`parse_off_loop`. A
body over :data:`INLINE_BYTES` is parsed in a worker thread, where:

- a ``messages`` list longer than the server's limit is refused (413) before any of it is
  validated;
- the messages are validated :data:`CHUNK` at a time: one pydantic call holds the GIL until it
  returns, so short calls let the event loop's thread run between them;
- the route's own conversion of the request (its messages into a turn) runs next, in the same
  thread.

Smaller bodies take the same steps on the event loop, where they cost less than a thread hop.
Other bodies that may be large (the agents API's, a system prompt of megabytes) take the same
path without messages (:func:`model_off_loop`). Errors read as FastAPI's own: a field path and
what is wrong with it. A client that leaves before its body has arrived raises Starlette's
``ClientDisconnect`` here, answered as 499 (``agentkv.server.errors``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import from_json

from agentkv.server.errors import TOO_LARGE, APIError
from agentkv.server.limits import too_many_messages_message

log = logging.getLogger(__name__)

INLINE_BYTES = 64 * 1024
CHUNK = 256
MAX_DEPTH = 64
"""Lists and objects nest at most this deep in a chat body (tool schemas included)."""

Body = TypeVar("Body", bound=BaseModel)
Result = TypeVar("Result")


async def parse_off_loop(
    http: Request,
    model: type[Body],
    max_messages: int,
    then: Callable[[Body], Result],
) -> tuple[Body, Result]:
    """Read the request's body, parse it as ``model`` and apply ``then`` to it.

    Args:
        http: the request; its body is read here.
        model: a pydantic model with a ``messages`` (or, Responses API, ``input``) list field
            (or neither: see :func:`model_off_loop`).
        max_messages: more messages (input items) than this are refused with 413.
        then: the route's conversion of the parsed body (errors it raises pass through).

    Returns:
        The parsed body and what ``then`` made of it.

    Raises:
        APIError: the body is not JSON (400) or has too many messages (413).
        RequestValidationError: a field is invalid (400, naming the field).
    """
    raw = await http.body()

    def parse_then() -> tuple[Body, Result]:
        body = parse(raw, model, max_messages)
        return body, then(body)

    if len(raw) <= INLINE_BYTES:
        return parse_then()
    return await asyncio.to_thread(parse_then)


async def model_off_loop(http: Request, model: type[Body]) -> Body:
    """Read the request's body and parse it as ``model`` (one without a list of messages), in
    a worker thread when it is over :data:`INLINE_BYTES`. Raises as :func:`parse_off_loop`."""
    body, _ = await parse_off_loop(http, model, 0, lambda body: None)
    return body


def parse(raw: bytes, model: type[Body], max_messages: int) -> Body:
    """``raw`` JSON as ``model``, its messages validated in chunks (see the module docstring)."""
    try:
        text = raw.decode("utf-8")  # JSON is UTF-8 (RFC 8259); json.loads would guess
    except UnicodeDecodeError as exc:
        raise APIError.invalid(f"body: not valid UTF-8 at byte {exc.start}") from None
    try:
        data = json_value(text)
    except ValueError as exc:
        raise APIError.invalid(f"body: {exc}") from None
    if not isinstance(data, dict):
        raise APIError.invalid(f"body: must be a JSON object, not {type(data).__name__}")
    key = "messages" if "messages" in model.model_fields else "input"  # (Responses API)
    messages = data.get(key) if key in model.model_fields else None
    if isinstance(messages, list):
        if len(messages) > max_messages:
            message = too_many_messages_message(len(messages), max_messages, key)
            raise APIError(TOO_LARGE, message, key)
        data[key] = _validated_messages(model, key, messages)
    try:
        return model.model_validate(data)  # validated messages pass through as they are
    except ValidationError as exc:
        raise RequestValidationError(_located(exc, ("body",))) from None


def _dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def json_value(text: str | bytes) -> Any:
    """Parsed JSON text, lists and objects nested at most :data:`MAX_DEPTH` deep (what reads
    it later recurses). Raises ValueError saying what is wrong."""
    try:
        # A Python hook runs between objects, where the interpreter can hand the GIL over:
        # a body of many small objects does not hold it for the whole parse.
        data = json.loads(text, object_pairs_hook=_dict)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    except RecursionError:
        data = _TOO_DEEP
    if data is _TOO_DEEP or _deeper_than(data, MAX_DEPTH):
        raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep")
    return data


def arguments_value(text: str) -> Any:
    """A tool call's arguments text: JSON, or an object's JSON cut short (this server returns
    a call the reply was cut in so, see ``agentkv.cut_calls``), read as the object it holds so
    far. Raises ValueError saying what is wrong."""
    try:
        return json_value(text)
    except ValueError as exc:
        if not text.lstrip().startswith("{"):
            raise
        try:
            data = from_json(text, allow_partial=True)
        except ValueError:
            raise exc from None
        if _deeper_than(data, MAX_DEPTH):
            raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep") from None
        return data


_TOO_DEEP = object()


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether JSON ``data`` nests lists and objects more than ``limit`` levels deep (what
    reads it later recurses: a deeper body would fail there)."""
    level: list[Any] = [data] if isinstance(data, dict | list) else []
    for _ in range(limit):
        level = [
            child
            for value in level
            for child in (value.values() if isinstance(value, dict) else value)
            if isinstance(child, dict | list)
        ]
        if not level:
            return False
    return True


@functools.cache
def _messages_adapter(model: type[BaseModel], key: str) -> TypeAdapter:
    return TypeAdapter(model.model_fields[key].annotation)


def _validated_messages(model: type[BaseModel], key: str, messages: list[Any]) -> list[Any]:
    adapter = _messages_adapter(model, key)
    validated: list[Any] = []
    for start in range(0, len(messages), CHUNK):
        try:
            validated += adapter.validate_python(messages[start : start + CHUNK])
        except ValidationError as exc:
            raise RequestValidationError(_located(exc, ("body", key), start)) from None
    return validated


def _located(exc: ValidationError, prefix: tuple[Any, ...], offset: int = 0) -> list[dict]:
    """The errors with their locations under ``prefix``, the first index shifted by ``offset``
    (a chunk's position in the whole list)."""
    errors = []
    for error in exc.errors(include_url=False, include_input=False):
        loc = tuple(error["loc"])
        if offset and loc and isinstance(loc[0], int):
            loc = (loc[0] + offset, *loc[1:])
        errors.append({**error, "loc": (*prefix, *loc)})
    return errors


_noted: set[tuple[str, str]] = set()  # (API, field) already logged


@dataclass(frozen=True, slots=True)
class FieldPolicy:
    """What a request model does with each field it declares (every field of the API's
    official SDK is declared): ``honoured``, ``accepted`` without effect (field -> why), or
    ``refused`` with a 400 naming it when set to anything but null or false (field -> why).
    Fields a model does not declare are logged once by name (:func:`note_unknown_fields`)."""

    api: str
    honoured: frozenset[str]
    accepted: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)

    def check(self, body: BaseModel) -> None:
        """Refuse ``body``'s refused fields that are set; log its unknown ones.
        Raises APIError (400)."""
        for name, why in self.refused.items():
            if getattr(body, name) not in (None, False):
                raise APIError.invalid(f"{name}: not supported: {why}", name)
        note_unknown_fields(body, self.api)


def note_unknown_fields(body: BaseModel, api: str) -> None:
    """Log, once per API and name, the fields of ``body`` its model does not declare (models
    with ``extra="allow"``): a client's field this server does not use is never dropped
    without a word."""
    for name in sorted(body.model_extra or ()):
        if (api, name) not in _noted:
            _noted.add((api, name))
            log.info("%s: field %r is not known to this server: not used", api, name)
