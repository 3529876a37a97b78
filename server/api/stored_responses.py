"""Stored Responses API responses over HTTP: what ``previous_response_id`` continues, and
``GET`` / ``DELETE /v1/responses/{id}``.

A response is kept (``agentkv.store.responses``) unless its request said ``store: false``: the input
items the request sent itself, the response object as returned, and the agent and reply
message that answered. ``DELETE`` removes the response; the responses that continue it keep
its items, and the agent that answered keeps its transcript (delete the agent for that).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from sqlalchemy.exc import SQLAlchemyError

from agentkv import Reply
from agentkv.server.errors import NOT_FOUND, APIError, ErrorKind
from agentkv.server.state import ServerState, State
from agentkv.store import NewResponse, ResponseNotFoundError, ResponseRecord, StoreError

log = logging.getLogger(__name__)
router = APIRouter()

PREVIOUS_NOT_FOUND = ErrorKind(
    400, "invalid_request_error", "invalid_request_error", "previous_response_not_found"
)
KEPT = "responses are kept unless store is false, until deleted or expired"


async def continued(state: ServerState, previous_id: str | None) -> list[ResponseRecord]:
    """The stored responses ``previous_id`` continues and itself, oldest first (none for
    None). Raises APIError (400) when it names no stored response."""
    if previous_id is None:
        return []
    try:
        return await state.runtime.responses.chain(previous_id)
    except ResponseNotFoundError as exc:
        raise APIError(
            PREVIOUS_NOT_FOUND,
            f"previous_response_id: no stored response with id {exc.response_id!r} ({KEPT})",
            "previous_response_id",
        ) from None


def items_of(responses: list[ResponseRecord]) -> list[Any]:
    """The conversation a chain of responses holds: each one's input items, then its output."""
    return [item for r in responses for item in (*r.input, *r.output)]


async def store_response(
    state: ServerState,
    input_: str | list[Any],
    previous_id: str | None,
    response: dict[str, Any],
    reply: Reply,
) -> None:
    """Keep ``response`` (its request's own ``input_`` with it). The turn is stored already:
    if the response cannot be, it is returned with ``store: false`` and the reason logged."""
    own = input_
    if isinstance(own, str):
        own = [{"type": "message", "role": "user", "content": own}]
    stored = NewResponse(
        response["id"], reply.agent_id, reply.message_id, previous_id, own, response
    )
    try:
        await state.runtime.responses.put(stored)
    except (StoreError, SQLAlchemyError):  # the response it continues or its agent is gone
        log.warning(
            "response %s was answered but could not be stored", response["id"], exc_info=True
        )
        response["store"] = False


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: State) -> Response:
    """A stored response, as it was returned (its JSON text, not decoded here)."""
    try:
        text = await state.runtime.responses.get_json(response_id)
    except ResponseNotFoundError:
        raise _not_found(response_id) from None
    return Response(text, media_type="application/json")


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State) -> dict[str, Any]:
    """Delete a stored response (the responses that continue it keep its items)."""
    try:
        await state.runtime.responses.delete(response_id)
    except ResponseNotFoundError:
        raise _not_found(response_id) from None
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(
        NOT_FOUND, f"no stored response with id {response_id!r} ({KEPT})", "response_id"
    )
