"""One event-to-wire stream builder, which every API's encoder feeds.

:func:`wire` reads a started streaming turn (``TurnStream.pieces``: a reasoning model's thinking,
the reply's text, its tool calls' pieces, then the Reply) and hands each piece to the API's
:class:`Encoder`, which returns the server-sent events it makes of it. The builder owns what
every API shares: the order, the calls past the encoder's ``call_limit`` (not streamed), the
reply's text the pieces did not show (held back with a tool call or by a stop string: handed to
the end), and a turn that fails after it started (the encoder's in-stream error ends the
stream). An encoder keeps only its wire's state: block indexes, open items, sequence numbers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from agentkv import ReasoningDelta, Reply
from agentkv.call_stream import CallDelta
from agentkv.server.turns import AGENT_HEADER, TurnStream


class Encoder:
    """How one API writes a streamed turn: each method returns the events of its piece."""

    call_limit: int | None = None
    """Calls streamed at most (``parallel_tool_calls: false``: one); None: all of them."""

    async def start(self) -> list[str]:
        """The events before the first piece."""
        return []

    async def reasoning(self, text: str) -> list[str]:
        """A piece of a reasoning model's thinking."""
        return []

    async def text(self, piece: str) -> list[str]:
        """A piece of the reply's text."""
        return []

    async def call(self, piece: CallDelta) -> list[str]:
        """A piece of a tool call (its first opens it) within ``call_limit``."""
        return []

    async def end(self, reply: Reply, rest: str, streamed_calls: int) -> list[str]:
        """The events after the last piece: ``rest`` is the reply's text no piece showed,
        ``streamed_calls`` how many of its calls came as pieces (the others are the end's)."""
        raise NotImplementedError

    async def last(self, reply: Reply) -> list[str]:
        """The closing events, after the end's are sent (work that may wait, a response
        stored, goes here: the end's events do not wait for it)."""
        return []

    def error(self, exc: Exception) -> list[str]:
        """The events that tell the client the turn failed after the stream began."""
        raise NotImplementedError


async def wire(turn: TurnStream, encoder: Encoder) -> AsyncIterator[str]:
    """The turn as the encoder's server-sent events, in the order the turn made them."""
    for line in await encoder.start():
        yield line
    reply, shown, limit = None, 0, encoder.call_limit
    try:
        async for piece in turn.pieces():
            if isinstance(piece, Reply):
                reply = piece
                continue
            if isinstance(piece, CallDelta):
                lines = await encoder.call(piece) if limit is None or piece.index < limit else []
            elif isinstance(piece, ReasoningDelta):
                lines = await encoder.reasoning(piece.text)
            else:
                lines = await encoder.text(piece)
                shown += len(piece)
            for line in lines:
                yield line
    except Exception as exc:  # the turn failed after it started: tell the client in-stream
        for line in encoder.error(exc):
            yield line
        return
    assert reply is not None
    for line in await encoder.end(reply, reply.content.text[shown:], turn.streamed_calls):
        yield line
    for line in await encoder.last(reply):
        yield line


class TurnStreamingResponse(StreamingResponse):
    """A streamed turn's server-sent events (written by ``encoder``), a response that closes
    its turn however it ends."""

    def __init__(self, turn: TurnStream, encoder: Encoder):
        super().__init__(
            wire(turn, encoder),
            media_type="text/event-stream",
            headers={AGENT_HEADER: turn.agent_id, "cache-control": "no-cache"},
        )
        self._turn = turn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A disconnect cancels the body mid-iteration and leaves the generators open.
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._turn.aclose()
