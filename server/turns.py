"""One turn over HTTP: resolve the agent, run or stream the turn, record it.

Streaming turns are started before the response is: the agent is resolved and the runtime's
stream is read up to its first event, so overload, unknown agents or a too long context still
answer with a status code. After that the response owns the stream; whatever ends the
response (the last event, an error, or the client going away, which Starlette turns into a
cancellation) closes the runtime's stream, and a turn that had not finished is rolled back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Annotated, Any

from fastapi import Header, Request
from pydantic import AfterValidator

from agentkv import (
    AgentNotFoundError,
    InvalidResponseFormatError,
    ReasoningDelta,
    Reply,
    TextDelta,
    TokenLogprob,
)
from agentkv.call_stream import CallDelta, CallStream
from agentkv.server.claims import Claim
from agentkv.server.conversation import TurnRequest
from agentkv.server.errors import ClientDisconnectedError
from agentkv.server.identity import FIRST_USE_TRIES
from agentkv.server.state import ServerState


def _utf8(value: str | None) -> str | None:
    """A header's text: HTTP hands its bytes over as Latin-1; clients send UTF-8."""
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


HeaderText = AfterValidator(_utf8)
"""Route parameter metadata: a header's value read as UTF-8."""
AGENT_HEADER = "x-agent-id"
AgentHeader = Annotated[str | None, Header(alias=AGENT_HEADER), HeaderText]
"""Route parameter type: the agent id a request names in its header."""
CACHE_SOURCE_HEADER = "x-agentkv-cache-source"
"""Response header of a whole (not streamed) turn: where its cache came from (``Reply.
cache_source``: hot, disk, prefix, rebuilt or none)."""
SESSION_HEADER = "x-claude-code-session-id"
SessionHeader = Annotated[str | None, Header(alias=SESSION_HEADER), HeaderText]
"""Route parameter type: the Claude Code session a request belongs to."""


def reply_headers(reply: Reply) -> dict[str, str]:
    """The headers of a whole turn's response: its agent and its cache source."""
    return {AGENT_HEADER: reply.agent_id, CACHE_SOURCE_HEADER: reply.cache_source}


def _events(state: ServerState, claim: Claim, request: TurnRequest) -> AsyncIterator[Any]:
    """The runtime's stream for the request: a whole-conversation turn or a next user turn."""
    if claim.document is not None:
        return state.runtime.respond(
            claim.agent_id,
            claim.document,
            tools=request.tools,
            tool_choice=request.tool_choice,
            **request.options,
        )
    return state.runtime.stream(
        claim.agent_id, request.message, history=claim.history_dicts, **request.options
    )


async def run_turn(state: ServerState, request: TurnRequest, http: Request) -> Reply:
    """Run a whole turn and return its reply.

    A client that disconnects before the reply is ready cancels the turn (rolled back, its
    engine slot freed) instead of leaving it to generate for nobody.
    """
    turn = asyncio.ensure_future(_whole_turn(state, request))
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait((turn, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not turn.done():  # the client left, or this handler itself was cancelled
            turn.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await turn
    if turn.cancelled():
        raise ClientDisconnectedError("the client disconnected; its turn was cancelled")
    return turn.result()


async def _disconnected(http: Request) -> None:
    """Returns when the client goes away (the request body was already read)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _whole_turn(state: ServerState, request: TurnRequest) -> Reply:
    try:
        return await _claimed_turn(state, request)
    except InvalidResponseFormatError as exc:
        raise request.format_error(exc) from None


async def _claimed_turn(state: ServerState, request: TurnRequest) -> Reply:
    for attempt in range(1, FIRST_USE_TRIES + 1):
        claim = None
        try:
            async with state.identity.claim(request) as claim:
                reply = None
                async with contextlib.aclosing(_events(state, claim, request)) as events:
                    async for event in events:
                        if isinstance(event, Reply):
                            reply = event
                            claim.commit(reply)
                assert reply is not None
            break
        except AgentNotFoundError:
            if not _gone_on_first_use(claim) or attempt == FIRST_USE_TRIES:
                raise
    state.metrics.observe_turn(reply)
    return reply


def _gone_on_first_use(claim: Claim | None) -> bool:
    """Whether a turn that found no agent runs again: its request creates the agent on first
    use, and another request that had created it discarded it (its own turn failed)."""
    return claim is not None and claim.on_first_use and not claim.committed


class TurnStream:
    """A started streaming turn: iterate it for TextDelta pieces and then the Reply."""

    def __init__(self, state: ServerState, request: TurnRequest):
        self._state = state
        self._request = request
        self._stack = AsyncExitStack()
        self._claim: Claim | None = None
        self._events: AsyncIterator[TextDelta | Reply] | None = None
        self._first: TextDelta | Reply | None = None
        self._logprobs: list[TokenLogprob] = []  # of the tokens generated so far, if asked
        self._logprobs_sent = 0
        self.streamed_calls = 0  # the reply's calls streamed as CallDelta pieces

    @property
    def agent_id(self) -> str:
        assert self._claim is not None
        return self._claim.agent_id

    async def start(self) -> TurnStream:
        """Resolve the agent and wait for the first event; raises what the turn raises."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self._claim = await self._stack.enter_async_context(
                    self._state.identity.claim(self._request)
                )
                events = _events(self._state, self._claim, self._request)
                self._stack.push_async_callback(events.aclose)  # type: ignore[attr-defined]
                self._events = events
                self._first = await self._next()
                return self
            except BaseException as exc:
                claim, self._claim, self._events = self._claim, None, None
                await self.aclose()
                if isinstance(exc, InvalidResponseFormatError):
                    raise self._request.format_error(exc) from None
                again = isinstance(exc, AgentNotFoundError) and _gone_on_first_use(claim)
                if not again or attempt == FIRST_USE_TRIES:
                    raise
                self._stack = AsyncExitStack()

    def events(self) -> AsyncIterator[TextDelta | Reply]:
        """The turn's events, the first one included, ending with the Reply."""
        events = self._iterate()
        self._stack.push_async_callback(events.aclose)  # type: ignore[attr-defined]
        return events

    async def pieces(self) -> AsyncIterator[str | ReasoningDelta | CallDelta | Reply]:
        """The reply's text in pieces as it is generated (a reasoning model's thinking as
        ReasoningDelta pieces, before), then the Reply. For a request with tools, text from a
        tool call's start marker (the runtime's ``tool_format``'s) on is held back: it is the
        call, its arguments streamed as CallDelta pieces where the format allows
        (``agentkv.call_stream``), else sent whole once the Reply has parsed it. The Reply's
        calls that were streamed carry the ids their pieces did (``streamed_calls``: how many
        calls were streamed)."""
        text, shown, unfed = "", 0, None
        tool_format = self._state.runtime.tool_format if self._request.tools else None
        calls = tool_format.call_stream() if tool_format else None
        async for event in self.events():
            if isinstance(event, ReasoningDelta):
                self._logprobs += event.logprobs
                yield event
            elif isinstance(event, TextDelta):
                self._logprobs += event.logprobs
                text += event.text
                upto = tool_format.streaming_split(text) if tool_format else len(text)
                if upto > shown:
                    yield text[shown:upto]
                    shown = upto
                if calls is not None and unfed is None:  # from the first call's start on
                    unfed = at if (at := text.find(tool_format.start)) >= 0 else None
                if calls is not None and unfed is not None:
                    for piece in calls.feed(text[unfed:]):
                        yield piece
                    unfed = len(text)
            else:
                if calls is not None and calls.calls:
                    event = self._streamed(event, calls)
                yield event

    def _streamed(self, reply: Reply, calls: CallStream) -> Reply:
        """The Reply, its calls that were streamed with their streamed ids (each that is the
        call its pieces spelled: the same function, the same arguments)."""
        self.streamed_calls = len(calls.calls)
        parsed = list(reply.content.tool_calls)
        for i, streamed in enumerate(calls.calls[: len(parsed)]):
            if parsed[i].cut:  # as far as it was written
                same = streamed.arguments == parsed[i].written
            else:
                try:
                    same = json.loads(streamed.arguments) == parsed[i].arguments
                except ValueError:
                    same = False
            if not same or streamed.name != parsed[i].name:
                break
            parsed[i] = dataclasses.replace(parsed[i], id=streamed.id, written=streamed.arguments)
        content = dataclasses.replace(reply.content, tool_calls=tuple(parsed))
        return dataclasses.replace(reply, parsed=content)

    def unsent_logprobs(self, reply: Reply | None = None) -> list[TokenLogprob]:
        """The logprobs of the tokens generated since the previous call (with the ``reply``:
        of all its tokens not handed out yet, those held back with a tool call and the end's
        included), marked as handed out."""
        every = self._logprobs if reply is None else (reply.logprobs or [])
        unsent = every[self._logprobs_sent :]
        self._logprobs_sent += len(unsent)
        return unsent

    async def _iterate(self) -> AsyncIterator[TextDelta | Reply]:
        event, self._first = self._first, None
        while event is not None:
            yield event
            event = await self._next()  # after the Reply: lets the runtime's stream finish

    async def _next(self) -> TextDelta | Reply | None:
        """The runtime's next event; a Reply is recorded at once (the turn is stored)."""
        assert self._events is not None and self._claim is not None
        event = await anext(self._events, None)
        if isinstance(event, Reply):
            self._claim.commit(event)
            self._state.metrics.observe_turn(event)
        return event

    async def aclose(self) -> None:
        """Close the runtime's stream (rolling an unfinished turn back) and free the agent."""
        await self._stack.aclose()
