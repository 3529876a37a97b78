"""An agent's KV cache in its two tiers: the copy in memory (``HotTier``) and the files on disk
(``DiskCaches``). Turns resume from here and keep their caches here; the runtime's cache seams
(``cache_info``, ``export_cache``, ``unload``) and ``fork`` and ``delete_agent`` read and change
both tiers through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agents.caches.disk import DiskCaches
from agents.caches.hot import HotTier
from engine.request import PromptCache
from store import CacheRecord, Registry


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
        digest: ``agents.prompt.conversation_digest`` of the messages it was made from (the
            system prompt and those ``message_count``); None for a file saved without one.
    """

    cache: PromptCache
    message_count: int
    source: Literal["hot", "disk"]
    digest: str | None


class CacheTiers:
    """The hot tier and the disk caches, used as one."""

    def __init__(self, hot: HotTier, disk: DiskCaches, registry: Registry):
        self.hot = hot
        self.disk = disk
        self._registry = registry

    async def resume(self, agent_id: str) -> Resumed | None:
        """The agent's cache from the hot tier, else from disk (after a save in flight has
        landed); None when it has none usable."""
        hot = self.hot.get(agent_id)
        if hot is not None:
            return Resumed(hot.cache, hot.message_count, "hot", hot.digest)
        await self.disk.wait(agent_id)  # a save in flight is the newest cache: let it land
        loaded = await self.disk.load(agent_id)
        if loaded is None:
            return None
        return Resumed(loaded.cache, loaded.message_count, "disk", loaded.digest)

    def keep(
        self,
        agent_id: str,
        cache: PromptCache,
        covered: int,
        digest: str,
        then: Callable[[], None] | None = None,
    ) -> None:
        """A finished turn's cache, covering ``covered`` messages (``digest``: their
        ``conversation_digest``): into the hot tier, and a save to disk scheduled (``then`` is
        called when the save is over)."""
        self.hot.put(agent_id, cache, covered, digest)
        self.disk.save(agent_id, cache, covered, digest, then=then)

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
        await self.disk.wait(agent_id)
        self.hot.drop(agent_id)

    async def fork(self, source_id: str, agent_id: str) -> None:
        """Give ``agent_id`` the source's caches: the same entry in memory (the engine merges
        caches into its batch by copy, so sharing it is safe) and the same files on disk."""
        hot = self.hot.get(source_id)
        if hot is not None:
            self.hot.put(agent_id, hot.cache, hot.message_count, hot.digest)
        await self.disk.fork(source_id, agent_id)

    async def remove(self, agent_id: str) -> None:
        """Forget a deleted agent's caches: memory, then its files (after its saves)."""
        self.hot.drop(agent_id)
        await self.disk.remove_agent(agent_id)
