"""A submitted request, as its caller holds it: its events, its result, its cancel, cuts of
its cache while it runs."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import TYPE_CHECKING

from agentkv.engine.cuts import CutAsked
from agentkv.engine.errors import EngineClosedError
from agentkv.engine.request import GenerationResult, PromptCache, TokenEvent

if TYPE_CHECKING:
    from agentkv.engine.loop import GenerationLoop
    from agentkv.engine.sequence import Sequence


class RequestHandle:
    """A submitted request: iterate it for TokenEvents, then ``await result()``.

    Dropping the handle, leaving ``async with``, or ``cancel()`` before it finishes removes the
    sequence from the batch at the next step boundary.
    """

    def __init__(self, thread: GenerationLoop, seq: Sequence, events: asyncio.Queue):
        self._thread = thread
        self._seq = seq
        self._events = events
        self._result: GenerationResult | None = None
        self._finalizer = weakref.finalize(self, thread.cancel, seq)

    @property
    def done(self) -> bool:
        return self._result is not None

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._result is not None:
            raise StopAsyncIteration
        item = await self._events.get()
        if isinstance(item, GenerationResult):
            self._result = item
            self._finalizer.detach()
            raise StopAsyncIteration
        return item

    async def result(self) -> GenerationResult:
        """Wait for the end (consuming any unread events) and return the result."""
        async for _ in self:
            pass
        assert self._result is not None
        return self._result

    def cancel(self, keep_cache: bool = False) -> None:
        """Ask the engine to stop this request; ``result()`` then reports ``cancelled``.

        Args:
            keep_cache: hand back the partial cache (prompt + tokens so far) in the result.
        """
        if self._result is None:
            self._thread.cancel(self._seq, keep_cache)

    async def cut(self, at: int) -> PromptCache | None:
        """The cache of the request's first ``at`` tokens (its history and prompt), once its
        prefill has passed them, while it runs on (``agentkv.engine.cuts``); where a sliding
        window or recurrent state has moved on, from its snapshot there (``snapshots_at``) or
        an earlier checkpoint. None when it ends first, or no cut can be had."""
        if self._result is not None:
            return None
        loop = asyncio.get_running_loop()
        asked = CutAsked(self._seq, at, loop, loop.create_future())
        self._thread.cuts.ask(asked)
        with contextlib.suppress(EngineClosedError):
            self._thread.call_soon(lambda: None)  # (wakes it)
        return await asked.future

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._result is None:
            self.cancel(keep_cache=self._seq.request.keep_cache_on_cancel)
            await asyncio.shield(self.result())
