"""The cache store's front: one object the runtime holds, made of the parts that each own a
noun (layout, writes, janitor, saver, loader, prefixes) and sharing one ``DiskStats``. Callers
use the parts themselves (``disk.saver.save``, ``disk.loader.load``, ``disk.prefixes.stored``,
``disk.writes.wait``, ``disk.janitor.sweep``); this class holds what spans them (a fork, the
report)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from agentkv.caches.janitor import SWEEP_GRACE_S, Janitor
from agentkv.caches.layout import CacheLayout, link_or_copy
from agentkv.caches.load import Loader
from agentkv.caches.prefixes import Prefixes
from agentkv.caches.save import Saver
from agentkv.caches.shared import Shared
from agentkv.caches.stats import DiskStats
from agentkv.caches.writes import Writes
from agentkv.engine.engine import Engine
from agentkv.engine.kv.encoded import DEFAULT_BLOCK_TOKENS
from agentkv.store import BlocksMissingError, NewCacheEntry, Registry
from agentkv.store.cache_files import remove_cache_file


class DiskCaches:
    """Saves and loads agents' caches under ``root`` (see ``agentkv.caches``)."""

    def __init__(
        self,
        root: Path,
        registry: Registry,
        engine: Engine,
        kv_bits: int | None,
        group_size: int,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        budget_bytes: int | None = None,
        share_prefixes: bool = True,
        lock_of: Callable[[str], asyncio.Lock] | None = None,
        sweep_grace_s: float = SWEEP_GRACE_S,
    ):
        """
        Args:
            block_tokens: tokens per block.
            budget_bytes: evict the caches of the agents idle longest when the files exceed it
                (None: no budget). Transcripts stay; an evicted agent is rebuilt when it speaks.
            share_prefixes: turns without a cache of their own start from stored prefixes
                and store their heads for others.
            lock_of: the per-agent turn lock; eviction skips agents whose lock is held and
                holds it while it evicts.
            sweep_grace_s: the sweep at open leaves files younger than this (other workers
                sharing the directory may be writing them).
        """
        self.layout = CacheLayout(root, engine.model.fingerprint, kv_bits, group_size, block_tokens)
        self.stats = DiskStats()
        self._registry = registry
        self._share_prefixes = share_prefixes
        self._engine = engine
        self.writes = Writes()
        shared = Shared(self.layout, registry, engine, self.writes, self.stats)
        lock_of = lock_of or (lambda agent_id: asyncio.Lock())
        self.janitor = Janitor(shared, budget_bytes, lock_of, sweep_grace_s)
        self.saver = Saver(shared, self.janitor)
        self.loader = Loader(shared)
        self.prefixes = Prefixes(shared, self.janitor, self.saver, self.loader)

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def saves_in_flight(self) -> int:
        """Saves (and shared-prefix writes) scheduled and not yet on disk and in the registry."""
        return self.writes.in_flight

    @property
    def shares_prefixes(self) -> bool:
        return self._share_prefixes

    @property
    def windowed(self) -> bool:
        """Whether the model has sliding-window layers or recurrent state (a cache cannot be
        cut back anywhere)."""
        return self.recurrent or bool(self._engine.model.sliding_window)

    @property
    def recurrent(self) -> bool:
        """Whether the model has recurrent state (a cache is cut back only at checkpoints)."""
        return self._engine.model.recurrent

    async def block_files(self, keys: Sequence[str]) -> list[Path]:
        """The files holding these recorded blocks (each once, in order)."""
        known = await self._registry.caches.known_blocks(keys)
        file_of = self.layout.file_of
        return list(dict.fromkeys(file_of(key, known[key]) for key in keys if key in known))

    async def fork(self, source_id: str, agent_id: str) -> bool:
        """Give ``agent_id`` the source's current cache: the same blocks, and its tail
        hard-linked (copied only where the filesystem cannot link). Returns whether there was
        one."""
        await self.writes.wait(source_id)  # the newest cache of the source has landed
        record = await self._registry.caches.get(source_id)
        if record is None:
            return False
        root = self.layout.root
        rel = Path(agent_id) / Path(record.path).name
        try:
            await asyncio.to_thread(link_or_copy, root / record.path, root / rel)
        except FileNotFoundError:  # evicted or replaced meanwhile: the fork rebuilds instead
            return False
        fields_ = {
            name: getattr(record, name)
            for name in NewCacheEntry.__dataclass_fields__  # type: ignore[attr-defined]
        }
        try:
            await self._registry.caches.set(
                agent_id, NewCacheEntry(**fields_ | {"path": rel.as_posix()}), blocks=record.blocks
            )
        except BlocksMissingError:  # collected meanwhile (the source moved on): it rebuilds
            await asyncio.to_thread(remove_cache_file, root / rel)
            return False
        except BaseException:
            remove_cache_file(root / rel)
            raise
        self.stats.usage = await self._registry.caches.usage()
        return True

    def report(self) -> dict[str, int | None]:
        """The files, the budget, and what the store did since it opened (a snapshot)."""
        stats = self.stats
        return {
            "bytes": stats.usage.bytes,
            "files": stats.usage.files,
            "blocks": stats.usage.blocks,
            "budget_bytes": self.janitor.budget_bytes,
            "evictions": stats.evictions,
            "blocks_written": stats.blocks_written,
            "blocks_shared": stats.blocks_shared,
            "bytes_written": stats.bytes_written,
            "saves_in_flight": self.saves_in_flight,
            "prefix_lookups": stats.prefix_lookups,
            "prefix_hits": stats.prefix_hits,
            "prefix_tokens": stats.prefix_tokens,
            # shared heads being prefilled or stored now (turns that start alike wait for
            # them), and
            # the segments kept for running turns that stored them
            "heads_in_flight": len(self.prefixes.heads),
            "pinned_blocks": len(self.janitor.pinned()),
        }
