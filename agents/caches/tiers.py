"""An agent's KV cache in its two tiers: the copy in memory (``HotTier``) and the files on disk
(``DiskCaches``). Turns resume from here and keep their caches here; the runtime's cache seams
(``cache_info``, ``export_cache``, ``unload``) and ``fork`` and ``delete_agent`` read and change
both tiers through it.

A turn without a cache of its own (or whose own shares less) starts from another
conversation's (:meth:`CacheTiers.prefix`): the longest prefix of its prompt that a cache in
memory can be cut back to exactly, or stored blocks on disk. Where a sliding-window layer has
moved on, a cache can be cut back only at its checkpoints: the previous turn boundaries and the
end of its shared head (system prompt and tools), which a turn that started from stored blocks
prefills exactly to, once, and keeps as a checkpoint for the conversations that follow. A turn
whose prompt begins the way another conversation's began, past what it can resume (workers
handed one brief), treats the point where they part as a shared head of its own: prefilled
alone, stored as blocks and a window, kept as a checkpoint, so the conversations that follow
resume the shared start instead of prefilling it each. The conversation it parts from, new
then, kept snapshots at its last block boundaries (:meth:`CacheTiers.snapshots`): the turn
that parts from it resumes the latest one before the parting point, and prefills less than a
block of the shared start.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentkv.caches.disk import DiskCaches
from agentkv.caches.flights import Flight, Flights
from agentkv.caches.hot import HotTier, longest_shared, shared_length
from agentkv.engine.request import PromptCache
from agentkv.store import CacheRecord, Registry

log = logging.getLogger(__name__)

SNAPSHOTS = 2
"""Block boundaries before its prompt's end at which a new conversation's prefill keeps
snapshots, on a model whose cache cannot be cut back anywhere (``CacheTiers.snapshots``):
each holds the sliding-window layers' windows (or the recurrent state), 15.7 MB on the trained
Gemma 3 270M, so a second conversation parting from it within the last 256 to 511 tokens
(a fan-out worker's own task after a shared brief) resumes nearly all that it shares."""
RECENT_TOKENS = 262_144
"""Tokens of the recent prompts remembered (about 9 MB at most) for where new conversations
part from them (``CacheTiers.prefix``)."""


@dataclass(slots=True, frozen=True)
class CacheInfo:
    """What agentkv holds of one agent's KV cache (``AgentRuntime.cache_info``).

    Attributes:
        stored: the registry's entry of the cache on disk (tokens, bits, blocks, checksum of
            its tail); None when the agent has none.
        files: the files a resume from disk reads: the tail, then the files holding its blocks
            (each once, in order); empty when nothing is stored.
        hot_tokens: tokens of the copy in memory (the hot tier); None when it has none.
    """

    stored: CacheRecord | None
    files: tuple[Path, ...]
    hot_tokens: int | None


@dataclass(slots=True, frozen=True)
class Resumed:
    """An agent's cache as a turn resumes it.

    Attributes:
        cache: the KV cache and its tokens.
        message_count: transcript messages it covers.
        source: the tier it came from.
        digest: ``agentkv.messages.conversation_digest`` of the messages it was made from (the
            system prompt and those ``message_count``); None for a file saved without one.
    """

    cache: PromptCache
    message_count: int
    source: Literal["hot", "disk"]
    digest: str | None


@dataclass(slots=True, frozen=True)
class Start:
    """Where a turn starts (``CacheTiers.prefix``).

    Attributes:
        cache: the cache to resume (None: prefill everything).
        fresh: its tokens this turn prefilled itself (shared heads it stored or marked).
        borrowed: its tokens taken from other conversations' caches.
        release: unpins the blocks of a head this turn stored, once the turn has saved.
    """

    cache: PromptCache | None
    fresh: int = 0
    borrowed: int = 0
    release: Callable[[], None] | None = None

    def grown(self, cache: PromptCache, added: int, release: Callable[[], None] | None) -> Start:
        """This start, now ``cache``: ``added`` more tokens prefilled after it, or (0) a head
        another turn prefilled meanwhile, or (itself) this start stored as it is."""
        release = release or self.release
        if cache is self.cache:
            return Start(cache, self.fresh, self.borrowed, release)
        if added:
            return Start(cache, self.fresh + added, self.borrowed, release)
        # What this turn prefilled itself before it took the head stays its own.
        return Start(cache, self.fresh, cache.num_tokens - self.fresh, release)


class CacheTiers:
    """The hot tier and the disk caches, used as one."""

    def __init__(self, hot: HotTier, disk: DiskCaches, registry: Registry):
        self.hot = hot
        self.disk = disk
        self._registry = registry
        self._recent: collections.deque[list[int]] = collections.deque()  # prompts, newest last
        self._recent_tokens = 0
        self.flights = Flights()
        # Heads being prefilled to a token that is no block boundary: (tokens, their cache).
        self._prefilling: list[tuple[list[int], asyncio.Future[PromptCache | None]]] = []

    async def resume(self, agent_id: str, version: int | None = None) -> Resumed | None:
        """The agent's cache from the hot tier, else from disk (after a save in flight has
        landed); None when it has none usable. A copy in memory made at another ``version``
        of the agent (another worker sharing the registry stored turns of it since) is
        dropped: the newest cache is the one on disk."""
        hot = self.hot.get(agent_id)
        if hot is not None and version is not None and hot.version != version:
            log.info(
                "agent %r: changed elsewhere since its cache in memory was made (version %d, "
                "now %d); resuming from disk",
                agent_id,
                hot.version,
                version,
            )
            self.hot.drop(agent_id)
            hot = None
        if hot is not None:
            return Resumed(hot.cache, hot.message_count, "hot", hot.digest)
        await self.disk.writes.wait(agent_id)  # a save in flight is the newest cache: let it land
        loaded = await self.disk.loader.load(agent_id)
        if loaded is None:
            return None
        return Resumed(loaded.cache, loaded.message_count, "disk", loaded.digest)

    async def prefix(
        self,
        tokens: list[int],
        heads: Callable[[], list[int]],
        priority: float,
        own: PromptCache | None = None,
        flight: Flight | None = None,
    ) -> Start:
        """The longest cache for the start of ``tokens`` (at least one token left to prefill):
        ``own`` (the turn's own cache, cut back) unless other conversations' caches hold more
        (a new conversation's ``flight``: those in flight too), carried on to the ends of the
        shared heads (``heads()``, ascending) it falls short of. See the module docstring."""
        start = Start(own)
        if not self.disk.shares_prefixes or len(tokens) < 2:
            return start
        limit, block, stats = len(tokens) - 1, self.disk.block_tokens, self.disk.stats
        stats.prefix_lookups += 1
        # Like a stored prefix, at least a block: merging less saves less than it costs.
        have = max(own.num_tokens if own else 0, block - 1)
        if flight is not None:  # (first: one that lands meanwhile is in the hot tier by then)
            cut = await self.flights.cut(tokens, limit, have, flight, self.disk.windowed)
            if cut is not None:
                start, have = Start(cut, borrowed=cut.num_tokens), cut.num_tokens
        hot, alike = await asyncio.to_thread(longest_shared, self.hot.entries(), tokens, limit)
        if hot is not None and hot.num_tokens > have:
            start, have = Start(hot, borrowed=hot.num_tokens), hot.num_tokens
        stored = await self.disk.prefixes.stored(tokens, have)
        if stored is not None:
            start, have = Start(stored, borrowed=stored.num_tokens), stored.num_tokens
        store = stored is None
        at = start.cache.num_tokens if start.cache else 0
        # Where a new conversation (no cache of its own) parts from another: a head.
        if self.disk.windowed and own is None:
            parted = await self._parted(tokens, limit, alike)
            if parted >= at + 2:  # (a request prefills one token at least, the head's last)
                heads, store = _with_end(heads, parted), store or parted >= at + block
        start = await self._to_heads(start, tokens, heads, priority, store)
        if start.borrowed:
            stats.prefix_hits += 1
            stats.prefix_tokens += start.borrowed
        return start

    async def _parted(self, tokens: list[int], limit: int, alike: int) -> int:
        """How many of the first ``tokens`` (at most ``limit``) another conversation began
        with: a new conversation's prompt seen recently (its turn in flight or done), a cache
        in memory (``alike``: as ``longest_shared`` found), or stored blocks (whole ones:
        conversations stored before a restart). ``tokens`` are remembered for the prompts
        that follow."""
        prompts = list(self._recent)
        # Remembered at once: a conversation that arrives while this one is looked up parts
        # from it (the second of a fan-out stores the shared start, the others wait for it).
        self._recent.append(tokens)
        self._recent_tokens += len(tokens)
        while self._recent_tokens > RECENT_TOKENS and len(self._recent) > 1:
            self._recent_tokens -= len(self._recent.popleft())

        def seen() -> int:
            first = tokens[0]
            shared = (shared_length(p, tokens, limit) for p in prompts if p and p[0] == first)
            return max(shared, default=0)

        found = max(alike, await asyncio.to_thread(seen))
        if found < limit:
            found = max(found, min(await self.disk.prefixes.held(tokens), limit))
        return found

    async def _to_heads(
        self,
        start: Start,
        tokens: list[int],
        heads: Callable[[], list[int]],
        priority: float,
        store: bool,
    ) -> Start:
        """``start`` carried on to each shared head's end beyond it (heads of a block at
        least), each prefilled alone and marked (``PromptCache.as_head``), on models with
        sliding-window layers; on the way to the last one, its whole blocks are stored first
        when ``store`` (nothing was stored for them)."""
        ends = await asyncio.to_thread(heads)
        points = tuple(ends)  # (every head's end fences a q8 batch's float reads)
        at = start.cache.num_tokens if start.cache else 0
        block = self.disk.block_tokens
        cuts = [end for end in ends if at < end < len(tokens) and end >= block]
        # The last head's whole blocks are stored before the way goes past their end (an
        # inner head beyond it first would leave them nothing to store: no window, and after
        # a restart no head to resume from).
        blocks_end = cuts[-1] // block * block if store and cuts else 0
        try:
            for i, end in enumerate(cuts):
                last = i == len(cuts) - 1
                if store and (last or end > blocks_end):
                    store = False
                    cache, added, release = await self.disk.prefixes.store_head(
                        tokens, cuts[-1], priority, start.cache, points
                    )
                    start = start.grown(cache, added, release)
                if not self.disk.windowed:
                    continue  # every layer global: a cache in memory is cut at any token
                at = start.cache.num_tokens if start.cache else 0
                # An inner head (tools before the system prompt) is worth a checkpoint past a
                # block; the last one whatever is left of it.
                if end - at >= (2 if last else block):
                    grown = await self._head(start, tokens[:end], priority, points)
                    if grown is None:
                        break
                    start = grown
        except BaseException:
            if start.release:  # the pin of a head this turn stored (idempotent)
                start.release()
            raise
        return start

    async def _head(
        self, start: Start, tokens: list[int], priority: float, points: tuple[int, ...]
    ) -> Start | None:
        """``start`` prefilled to the end of ``tokens`` alone and marked a head, or the same
        head another turn is prefilling now (turns of a fan-out that arrive together wait for
        it instead of prefilling it again); None when that fails."""
        at = start.cache.num_tokens if start.cache else 0
        for head, pending in self._prefilling:
            if head == tokens:
                cache = await asyncio.shield(pending)
                return None if cache is None else start.grown(cache, 0, None)
        pending = asyncio.get_running_loop().create_future()
        entry = (tokens, pending)
        self._prefilling.append(entry)
        cache = None
        try:
            cache = await self.disk.prefixes.extend(start.cache, tokens, priority, points)
            if cache is not None:
                cache = cache.as_head()
        finally:
            self._prefilling.remove(entry)
            pending.set_result(cache)
        return None if cache is None else start.grown(cache, len(tokens) - at, None)

    def fly(self, tokens: list[int]) -> Flight | None:
        """Register a new conversation's first turn, prompting ``tokens``, as in flight (None
        where prefixes are not shared); ``flights.landed`` once it is over."""
        return self.flights.add(tokens) if self.disk.shares_prefixes else None

    def snapshots(self, cache: PromptCache | None, end: int) -> tuple[int, ...]:
        """Where a new conversation's prefill after ``cache`` keeps snapshots (the engine's
        ``snapshots_at``): the last :data:`SNAPSHOTS` block boundaries before ``end``, where
        its prompt ends, on a model with sliding-window layers or recurrent state. A second
        conversation that begins the same way and parts from it there (workers of a fan-out
        handed one brief, each its own task after it) resumes from the latest one before it
        parts instead of prefilling the shared start again; () where prefixes are not shared
        or any cache can be cut back anywhere."""
        disk = self.disk
        if not (disk.windowed and disk.shares_prefixes):
            return ()
        block, have = disk.block_tokens, cache.num_tokens if cache else 0
        last = (end - 1) // block * block
        return tuple(sorted(range(last, have, -block)[:SNAPSHOTS]))

    def keep(
        self,
        agent_id: str,
        cache: PromptCache,
        covered: int,
        digest: str,
        version: int,
        then: Callable[[], None] | None = None,
    ) -> None:
        """A finished turn's cache, covering ``covered`` messages (``digest``: their
        ``conversation_digest``) of the agent at ``version``: into the hot tier, and a save
        to disk scheduled (``then`` is called when the save is over)."""
        self.hot.put(agent_id, cache, covered, digest, version)
        self.disk.saver.save(agent_id, cache, covered, digest, then=then)

    async def info(self, agent_id: str) -> CacheInfo:
        stored = await self._registry.caches.get(agent_id)
        files: tuple[Path, ...] = ()
        if stored is not None:
            blocks = await self.disk.block_files(stored.blocks)
            files = (self.disk.layout.root / stored.path, *blocks)
        hot = self.hot.get(agent_id)
        return CacheInfo(stored, files, hot.cache.num_tokens if hot else None)

    async def unload(self, agent_id: str) -> None:
        """Drop the copy in memory once the agent's save has landed."""
        await self.disk.writes.wait(agent_id)
        self.hot.drop(agent_id)

    def advanced(self, agent_id: str, version: int) -> None:
        """The agent moved on from ``version`` by messages appended after its caches' (which
        still cover a prefix of its transcript)."""
        self.hot.advance(agent_id, version)

    async def fork(self, source_id: str, agent_id: str, version: int) -> None:
        """Give ``agent_id`` (at ``version``) the source's caches: the same entry in memory
        (the engine merges caches into its batch by copy, so sharing it is safe) and the same
        files on disk."""
        hot = self.hot.get(source_id)
        if hot is not None:
            self.hot.put(agent_id, hot.cache, hot.message_count, hot.digest, version)
        await self.disk.fork(source_id, agent_id)

    async def remove(self, agent_id: str) -> None:
        """Forget a deleted agent's caches: memory, then its files (after its saves)."""
        self.hot.drop(agent_id)
        await self.disk.janitor.remove_agent(agent_id)


def _with_end(heads: Callable[[], list[int]], end: int) -> Callable[[], list[int]]:
    """``heads`` with one more end: where a prompt parts from another conversation's."""
    return lambda: sorted({*heads(), end})
