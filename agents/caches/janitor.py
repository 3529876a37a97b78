"""Keeping the cache root tidy: garbage collection of blocks no cache lists (except pinned
ones), the disk budget (evicting the caches of the agents idle longest), and the sweep at open
of files no registry entry points at.

Several workers may share the cache root and the registry: the sweep leaves files younger than
its grace time (another worker may be writing or recording them, and nothing here can see its
saves in flight), and eviction leaves the agents another worker holds the lease of."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from agentkv.caches.layout import BLOCK_NAME, BLOCKS_DIR, WRITTEN_NAME, remove_quietly
from agentkv.caches.shared import Part, Shared
from agentkv.store import StoredBlock
from agentkv.store.cache_files import remove_cache_file

log = logging.getLogger(__name__)

EVICTION_SCAN = 1000  # cache entries looked at per eviction pass, coldest first
SWEEP_GRACE_S = 3600.0
"""The sweep at open removes no file younger than this (its last change, links included)."""
GC_JOB = "\x00collect"  # writer key of garbage collection (coalesced: one pending at a time)


class Janitor(Part):
    def __init__(
        self,
        shared: Shared,
        budget_bytes: int | None,
        lock_of: Callable[[str], asyncio.Lock],
        sweep_grace_s: float = SWEEP_GRACE_S,
    ):
        super().__init__(shared)
        self.budget_bytes = budget_bytes
        self.sweep_grace_s = sweep_grace_s
        self._lock_of = lock_of
        self._evicting = asyncio.Lock()
        self._pins: Counter[str] = Counter()

    # ---- pins --------------------------------------------------------------------------------

    def pin(self, keys: Sequence[str]) -> Callable[[], None]:
        """Keep these blocks through garbage collection until the returned release is called
        (idempotent): a prefix stored for a turn that has not saved its own cache yet."""
        self._pins.update(keys)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._pins.subtract(keys)
                for key in keys:
                    if self._pins[key] <= 0:
                        del self._pins[key]

        return release

    def pinned(self) -> frozenset[str]:
        return frozenset(self._pins)

    # ---- garbage collection ------------------------------------------------------------------

    def collect_now(self, keep: frozenset[str]) -> int:
        """On the writer thread: delete the segments none of whose blocks a cache lists (or
        ``keep`` holds), their blocks' rows and window files."""
        removed = self._writes.call(self._registry.caches.collect_garbage(sorted(keep)))
        for file in dict.fromkeys(self._layout.file_of(key, where) for key, where in removed):
            remove_quietly(file)
        for key, where in removed:
            if where.window:
                remove_quietly(self._layout.block_path(key, window=True))
        if removed:
            log.debug("collected %d blocks no cache needs", len(removed))
        return len(removed)

    async def collect(self) -> int:
        """Collect garbage blocks now (after the writer's queued jobs); returns how many."""
        keep = self.pinned()
        removed = await asyncio.wrap_future(
            self._writes.submit(GC_JOB, lambda: self.collect_now(keep))
        )
        self._stats.usage = await self._registry.caches.usage()
        return removed or 0

    # ---- budget, removal, sweep --------------------------------------------------------------

    async def keep_budget(self) -> None:
        """Count the files; over the budget, evict the caches of the agents idle longest
        (their blocks go when no other cache lists them)."""
        async with self._evicting:  # one pass at a time; later saves find it done
            self._stats.usage = await self._registry.caches.usage()
            if self.budget_bytes is None or self._stats.usage.bytes <= self.budget_bytes:
                return
            coldest = await self._registry.caches.coldest(EVICTION_SCAN)
            leased = await self._registry.leases.get([entry.agent_id for entry in coldest])
            for entry in coldest:
                lock = self._lock_of(entry.agent_id)
                if lock.locked() or self._writes.busy(entry.agent_id):
                    continue  # speaking now or saving: not cold
                if entry.agent_id in leased:
                    continue  # a worker runs a turn of it or saves it now
                async with lock:
                    if await self._registry.caches.clear(entry.agent_id, entry.path):
                        await asyncio.to_thread(remove_cache_file, self._layout.root / entry.path)
                        self._stats.evictions += 1
                        log.info("evicted the cache of agent %r (disk budget)", entry.agent_id)
                await self.collect()
                if self._stats.usage.bytes <= self.budget_bytes:
                    return

    async def remove_agent(self, agent_id: str) -> None:
        """Delete the files of a deleted agent (after its saves) and blocks no one lists."""
        await self._writes.wait(agent_id)
        self._writes.forget(agent_id)
        await asyncio.to_thread(shutil.rmtree, self._layout.root / agent_id, ignore_errors=True)
        await self.collect()

    async def sweep(self) -> int:
        """Remove files no registry entry points at (left by a crash mid-save, or by agents
        deleted behind the runtime's back) and collect unlisted blocks. Call before any save
        starts. Returns the count of files removed.

        A few registry queries, whatever the number of agents. Only names the store writes are
        touched, and a file that cannot be removed is logged and left: opening never fails here.
        """
        removed = await self.collect()
        # The files first, then the registry: a file recorded meanwhile is then known.
        tails, block_files = await asyncio.to_thread(self._old_files)
        current = await self._registry.caches.paths()
        blocks = await self._registry.caches.block_keys()
        removed += await asyncio.to_thread(self._sweep_files, tails, block_files, current, blocks)
        await self.keep_budget()  # also counts what is on disk
        return removed

    def _old_files(self) -> tuple[list[Path], list[Path]]:
        """The tails and block files (names the store writes) older than the grace time."""
        root, cutoff = self._layout.root, time.time() - self.sweep_grace_s
        tails = [f for f in root.glob("*/*") if WRITTEN_NAME.fullmatch(f.name)]
        blocks = [f for f in (root / BLOCKS_DIR).glob("*/*") if BLOCK_NAME.fullmatch(f.name)]
        return [f for f in tails if _changed_before(f, cutoff)], [
            f for f in blocks if _changed_before(f, cutoff)
        ]

    def _sweep_files(
        self,
        tails: list[Path],
        block_files: list[Path],
        current: dict[str, str | None],
        blocks: dict[str, StoredBlock],
    ) -> int:
        root = self._layout.root
        stale = [f for f in tails if current.get(f.parent.name, "") != f"{f.parent.name}/{f.name}"]
        segments = {where.segment for where in blocks.values()}
        for file in block_files:
            match = BLOCK_NAME.fullmatch(file.name)
            assert match is not None  # listed so
            key, kind, temp = match.groups()
            if kind == ".window":
                wanted = key in blocks and blocks[key].window
            elif kind:  # a segment
                wanted = f"{key}{kind}" in segments
            else:  # a block in its own file
                wanted = key in blocks and blocks[key].segment is None
            if temp or not wanted:
                stale.append(file)
        removed = 0
        for file in stale:
            try:
                remove_cache_file(file)
            except OSError as exc:
                log.warning("could not remove stale cache file %s: %s", file, exc)
            else:
                removed += 1
        cutoff = time.time() - self.sweep_grace_s
        for directory in {f.parent for f in stale}:
            # An agent's directory another worker may be about to write into is left; the
            # blocks' directories always are.
            if directory.parent != root or directory.name in current:
                continue
            if not _changed_before(directory, cutoff):
                continue
            with contextlib.suppress(OSError):  # not empty: something else lives there
                directory.rmdir()
        if removed:
            log.info("removed %d cache files no agent points at", removed)
        return removed


def _changed_before(path: Path, cutoff: float) -> bool:
    """Whether ``path`` was last written, linked or renamed before ``cutoff`` (a hard link or
    a copy keeps the source's mtime, not its ctime). False when it is gone."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return max(stat.st_mtime, stat.st_ctime) < cutoff
