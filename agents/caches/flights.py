"""New conversations whose first turn is in flight (``Flights``): a conversation that arrives
while another is prefilled, and begins the way it began (a fan-out's workers handed one brief
all at once), resumes the start they share from it, cut out of the running batch
(``RequestHandle.cut``), instead of prefilling it again.

A new conversation's turn registers its prompt before it looks up a start of its own, and
its engine request (with the points it keeps snapshots at, on a model whose windows move on)
once it is submitted; it leaves when its turn is over, by then kept in the hot tier. One that
arrives later takes the cut of the earlier flight sharing the most with it: at the latest
snapshot within what they share (anywhere, when every layer is global). It waits only for
flights registered before it, so no two wait for each other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from agentkv.caches.hot import shared_length
from agentkv.engine.request import PromptCache


@dataclass(slots=True, eq=False)
class Flight:
    """A new conversation's first turn: its prompt's tokens, and once submitted its engine
    request and where it keeps snapshots (``submitted``; None: it never was)."""

    tokens: list[int]
    submitted: asyncio.Future[tuple[Any, tuple[int, ...]] | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    kept: asyncio.Future[PromptCache | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )  # the cache its turn left, once over (None: it failed)

    def started(self, handle: Any, snapshots_at: tuple[int, ...]) -> None:
        if not self.submitted.done():
            self.submitted.set_result((handle, snapshots_at))


class Flights:
    """The new conversations in flight, in the order they arrived."""

    def __init__(self) -> None:
        self.flying: list[Flight] = []

    def add(self, tokens: list[int]) -> Flight:
        flight = Flight(tokens)
        self.flying.append(flight)
        return flight

    def landed(self, flight: Flight, cache: PromptCache | None) -> None:
        """Its turn is over, leaving ``cache`` (kept; None: it failed)."""
        if flight in self.flying:
            self.flying.remove(flight)
        if not flight.submitted.done():
            flight.submitted.set_result(None)
        if not flight.kept.done():
            flight.kept.set_result(cache)

    async def cut(
        self, tokens: list[int], limit: int, have: int, flight: Flight, windowed: bool
    ) -> PromptCache | None:
        """The cache of the start of ``tokens`` (at most ``limit`` of them, more than
        ``have``) from the flight before ``flight`` sharing the most with them, once its
        prefill has passed it (``windowed``: at a snapshot, the model's windows move on);
        None when none shares more than ``have`` or none can be cut."""
        if flight not in self.flying:
            return None
        earlier = self.flying[: self.flying.index(flight)]
        first = tokens[0]
        alike = [
            (shared_length(f.tokens, tokens, limit), f) for f in earlier if f.tokens[:1] == [first]
        ]
        for shared, other in sorted(alike, key=lambda t: -t[0]):
            if shared <= have:
                break
            submitted = await asyncio.shield(other.submitted)
            if submitted is None:
                continue
            handle, points = submitted
            at = shared if not windowed else max((p for p in points if p <= shared), default=0)
            if at <= have:
                continue
            cut = await handle.cut(at)
            if cut is None:  # it ended first: from the cache it left
                kept = await asyncio.shield(other.kept)
                cut = None if kept is None else kept.longest_prefix(at)
            if cut is not None and cut.num_tokens > have:
                return cut
        return None
