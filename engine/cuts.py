"""Cuts of running requests: the cache of a request's first tokens, asked while it still runs
(``RequestHandle.cut``). A new conversation's shared start is cut out of the batch this way
for the conversations that arrive while it is prefilled and begin the way it began, instead
of each prefilling it again (``agentkv.caches.flights``).

A cut is answered on the generation thread, between steps, once the request's prefill has
passed its point: a copy of the request's rows as they are then, cut back to the point (a
sliding-window or recurrent layer, which has moved on, from the request's snapshot there:
``GenerationRequest.snapshots_at``). It is None when the request ends first, or when no cut
can be had there (no snapshot at the point, KV held with keys per channel).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.engine.prompt_cache import PromptCache
    from agentkv.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class CutAsked:
    """A cut of ``seq`` after its first ``at`` tokens, to be set as ``future``'s result (on
    ``loop``)."""

    seq: Sequence
    at: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    @property
    def is_ready(self) -> bool:
        """Whether ``seq`` holds its first ``at`` tokens (and so its snapshot there, if it
        keeps one: the step that reaches a snapshot point takes it)."""
        return len(self.seq.tokens) >= self.at

    def answer(self, cache: PromptCache | None) -> None:
        def done() -> None:
            if not self.future.done():
                self.future.set_result(cache)

        with contextlib.suppress(RuntimeError):  # (a closed event loop has no one waiting)
            self.loop.call_soon_threadsafe(done)


class Cuts:
    """The cuts asked of running requests, answered on the generation thread."""

    def __init__(self) -> None:
        self.asked: list[CutAsked] = []
        self.closed = False

    def ask(self, asked: CutAsked) -> None:
        """Ask a cut (from any thread; answered None at once once the engine has stopped)."""
        self.asked.append(asked)
        if self.closed:
            asked.answer(None)

    def serve(self, whole: Callable[[Sequence], PromptCache | None]) -> None:
        """Answer the cuts whose requests are past their point (``whole``: a request's cache
        as it is now, with its checkpoints; copied once a request, the cuts sharing the copy's
        arrays) or have ended."""
        copies: dict[int, PromptCache | None] = {}
        for asked in list(self.asked):
            seq = asked.seq
            if seq.is_finished:
                asked.answer(None)
            elif asked.is_ready:
                if id(seq) not in copies:
                    copies[id(seq)] = whole(seq)
                cache = copies[id(seq)]
                asked.answer(None if cache is None else cache.longest_prefix(asked.at))
            else:
                continue
            self.asked.remove(asked)

    def drop(self) -> None:
        """The engine stops: no cut will be had."""
        self.closed = True
        for asked in list(self.asked):
            asked.answer(None)
        self.asked.clear()
