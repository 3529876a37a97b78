"""Recently used agents' unquantized caches, in memory, under a byte budget (LRU)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from engine.request import PromptCache


@dataclass(slots=True, frozen=True)
class HotEntry:
    cache: PromptCache
    message_count: int  # transcript messages the cache covers
    digest: str  # agents.prompt.conversation_digest of those messages
    nbytes: int


class HotTier:
    """An LRU map agent id -> HotEntry holding at most ``budget_bytes`` of caches.

    Entries are never mutated: the engine merges a cache into its batch by copy, so the same
    entry can be resumed again.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, HotEntry] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, agent_id: str) -> HotEntry | None:
        entry = self._entries.get(agent_id)
        if entry is not None:
            self._entries.move_to_end(agent_id)
        return entry

    def put(self, agent_id: str, cache: PromptCache, message_count: int, digest: str) -> None:
        self.drop(agent_id)
        if cache.held_nbytes > self.budget_bytes >= cache.nbytes:
            cache = dataclasses.replace(cache, checkpoints=())  # the cache before its extras
        nbytes = cache.held_nbytes  # its checkpoints' windows too
        if nbytes > self.budget_bytes:
            return
        self._entries[agent_id] = HotEntry(cache, message_count, digest, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1

    def report(self) -> dict[str, int]:
        """Agents and bytes held, the budget, evictions so far."""
        return {
            "agents": len(self._entries),
            "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes,
            "evictions": self.evictions,
        }

    def drop(self, agent_id: str) -> None:
        entry = self._entries.pop(agent_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
