"""Recently used agents' caches, in memory, under a byte budget (LRU), held as the batch held
them: quantized (packed, ``PromptCache.packing``) when the batch holds KV quantized, so at q8
the same budget holds 1.8x the agents of a float16 batch (q4: a little under 3.1x for long
histories; each row also keeps its newest positions in float, see ``agentkv.engine.batch``).

Other conversations start from them too: :func:`longest_shared` finds the entry sharing the
longest token prefix with a new prompt and cuts it back there (exactly: see
``PromptCache.longest_prefix``)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.engine.request import Checkpoint, PromptCache


@dataclass(slots=True, frozen=True)
class HotEntry:
    cache: PromptCache
    message_count: int  # transcript messages the cache covers
    digest: str  # agents.prompt.conversation_digest of those messages
    nbytes: int
    version: int = 0  # the agent's version (AgentRecord.version) once the turn was stored

    @property
    def precision(self) -> str:
        """``q8`` / ``q4`` for a cache held packed, ``model`` for the model's precision."""
        packing = self.cache.packing
        return "model" if packing is None else f"q{packing.bits}"


class HotTier:
    """An LRU map agent id -> HotEntry holding at most ``budget_bytes`` of caches.

    Entries are never mutated: the engine merges a cache into its batch by copy, so the same
    entry can be resumed again. A shared head's checkpoint (the same windows in every cache
    resumed from it) counts once, while an entry holds it.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, HotEntry] = OrderedDict()
        self._heads: dict[int, tuple[Checkpoint, int]] = {}  # id -> (head, entries holding it)
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._entries

    def get(self, agent_id: str) -> HotEntry | None:
        entry = self._entries.get(agent_id)
        if entry is not None:
            self._entries.move_to_end(agent_id)
        return entry

    def put(
        self, agent_id: str, cache: PromptCache, message_count: int, digest: str, version: int = 0
    ) -> None:
        self.drop(agent_id)
        if self._cost(cache) > self.budget_bytes >= cache.nbytes:
            cache = dataclasses.replace(cache, checkpoints=())  # the cache before its extras
        if self._cost(cache) > self.budget_bytes:
            return
        entry = HotEntry(cache, message_count, digest, cache.held_nbytes, version)
        self._entries[agent_id] = entry
        self._hold(entry, 1)
        while self.nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self._hold(old, -1)
            self.evictions += 1

    def _cost(self, cache: PromptCache) -> int:
        """What holding ``cache`` would add: its own bytes and the heads no entry holds yet."""
        new_heads = (c for c in cache.checkpoints if c.head and id(c) not in self._heads)
        return cache.held_nbytes + sum(c.nbytes for c in new_heads)

    def _hold(self, entry: HotEntry, change: int) -> None:
        """Count an entry in (``change`` 1) or out (-1), its shared heads once across entries."""
        self.nbytes += change * entry.nbytes
        for point in entry.cache.checkpoints:
            if not point.head:
                continue
            _, holders = self._heads.get(id(point), (point, 0))
            if holders == 0:
                self.nbytes += point.nbytes
            if holders + change == 0:
                del self._heads[id(point)]
                self.nbytes -= point.nbytes
            else:
                self._heads[id(point)] = (point, holders + change)

    def advance(self, agent_id: str, version: int) -> None:
        """The agent moved from ``version`` to the next by a change its entry still covers a
        prefix of (messages appended here): the entry follows it."""
        entry = self._entries.get(agent_id)
        if entry is not None and entry.version == version:
            self._entries[agent_id] = dataclasses.replace(entry, version=version + 1)

    def entries(self) -> list[HotEntry]:
        """The entries now (a snapshot another thread may read: entries are never changed)."""
        return list(self._entries.values())

    def report(self) -> dict[str, Any]:
        """Agents and bytes held (shared heads' windows once), the budget, evictions so far,
        and by precision (``q8``, ``q4``, ``model``): agents, the bytes they hold (turn
        checkpoints' windows included, shared heads' not), the tokens their caches hold and
        the K+V bytes of those caches a token (``token_bytes``, checkpoints not counted)."""
        by_precision: dict[str, dict[str, float]] = {}
        kv: dict[str, int] = {}
        for entry in self._entries.values():
            row = by_precision.setdefault(entry.precision, {"agents": 0, "bytes": 0, "tokens": 0})
            row["agents"] += 1
            row["bytes"] += entry.nbytes
            row["tokens"] += entry.cache.num_tokens
            kv[entry.precision] = kv.get(entry.precision, 0) + (entry.cache.nbytes or 0)
        for precision, row in by_precision.items():
            row["token_bytes"] = kv[precision] / row["tokens"] if row["tokens"] else 0.0
        return {
            "agents": len(self._entries),
            "bytes": self.nbytes,
            "shared_heads": len(self._heads),
            "budget_bytes": self.budget_bytes,
            "evictions": self.evictions,
            "by_precision": by_precision,
        }

    def drop(self, agent_id: str) -> None:
        entry = self._entries.pop(agent_id, None)
        if entry is not None:
            self._hold(entry, -1)


COMPARED = 1024  # tokens compared at once while looking for where two prompts differ


def shared_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of two token lists, at most ``limit`` (chunks compared in
    C, then the differing chunk token by token)."""
    n = min(len(a), len(b), limit)
    at = 0
    while at < n and a[at : at + COMPARED] == b[at : at + COMPARED]:
        at += COMPARED
    while at < n and a[at] == b[at]:
        at += 1
    return min(at, n)


def longest_shared(
    entries: Sequence[HotEntry], tokens: Sequence[int], limit: int
) -> tuple[PromptCache | None, int]:
    """The longest cache of a prefix of ``tokens`` (at most ``limit`` of them) that an entry
    can be cut back to, or None; and how many of ``tokens`` the entry sharing the most begins
    with, cut back there or not. Runs in a worker thread: no MLX work, shares the arrays."""
    best: PromptCache | None = None
    alike = 0
    for entry in entries:
        cached = entry.cache.tokens
        if not cached or cached[0] != tokens[0]:
            continue
        n = shared_length(cached, tokens, limit)
        alike = max(alike, n)
        if n == 0 or (best is not None and n <= best.num_tokens):
            continue
        cut = entry.cache.longest_prefix(n)
        if cut is not None and (best is None or cut.num_tokens > best.num_tokens):
            best = cut
    return best, alike
