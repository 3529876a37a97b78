"""Per-agent caches on disk: quantized on the generation thread, written by a writer thread.

Save path: finished cache -> ``encode_cache`` on the generation thread (quantize, copy to host)
-> writer thread writes safetensors atomically -> registry points at the new file -> the old
file is removed. Neither the event loop nor the decode loop waits on disk. If a newer cache of
the same agent is queued before an older one is written, the older write is skipped.

Load path: registry entry -> read and verify the file in a worker thread -> on a CPU, dequantize
there too (numpy), so the generation thread only copies arrays in; on a GPU, ``decode_cache``
dequantizes on the device (far cheaper than host float16 math) -> a PromptCache ready to merge
into the batch.
Any problem (missing, truncated, corrupt, other model, old format) is logged and reported as
"no cache".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.engine import Engine
from engine.kv_codec import (
    FORMAT_VERSION,
    CacheFormatError,
    EncodedCache,
    decode_cache,
    dequantize_on_host,
    encode_cache,
)
from engine.request import PromptCache
from store import AgentNotFoundError, NewCacheEntry, Registry
from store.cache_files import read_cache_file, remove_cache_file, write_cache_file
from store.errors import CacheFileError
from store.writer import CacheWriter

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class LoadedCache:
    cache: PromptCache
    message_count: int


# What ``_save`` names files (``<message count>-<hex>.safetensors``) and the writer's temp files.
_WRITTEN_NAME = re.compile(r"\.?\d{6,}-[0-9a-f]+\.safetensors(\.tmp-\w+)?")


_EVICTION_SCAN = 1000  # cache entries looked at per eviction pass, coldest first


class StaleCacheError(ValueError):
    """A cache file that does not belong to this model, format or registry entry."""


class DiskCaches:
    """Saves and loads agents' caches under ``root/<agent_id>/``."""

    def __init__(
        self,
        root: Path,
        registry: Registry,
        engine: Engine,
        kv_bits: int | None,
        group_size: int,
        *,
        budget_bytes: int | None = None,
        lock_of: Callable[[str], asyncio.Lock] | None = None,
    ):
        """
        Args:
            budget_bytes: evict the caches of the agents idle longest when the files exceed it
                (None: no budget). Transcripts stay; an evicted agent is rebuilt when it speaks.
            lock_of: the per-agent turn lock; eviction skips agents whose lock is held and
                holds it while it evicts.
        """
        self.root = root
        self._registry = registry
        self._engine = engine
        self._kv_bits = kv_bits
        self._group_size = group_size
        self._budget_bytes = budget_bytes
        self._lock_of = lock_of or (lambda agent_id: asyncio.Lock())
        self._evicting = asyncio.Lock()
        self._writer = CacheWriter()
        self._pending: dict[str, set[asyncio.Task]] = {}
        self._loop = asyncio.get_running_loop()
        self.saved = 0
        self.load_failures = 0
        self.evictions = 0
        self.usage = (0, 0)  # (bytes, files) of the current cache files, as last counted

    @property
    def fingerprint(self) -> str:
        return self._engine.model.fingerprint

    def save(self, agent_id: str, cache: PromptCache, message_count: int) -> None:
        """Schedule a save; returns at once. ``wait`` or ``close`` waits for it."""
        task = asyncio.create_task(self._save(agent_id, cache, message_count))
        tasks = self._pending.setdefault(agent_id, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _save(self, agent_id: str, cache: PromptCache, message_count: int) -> None:
        try:
            encoded = await self._engine.run(encode_cache, cache, self._kv_bits, self._group_size)
            name = f"{message_count:06d}-{uuid.uuid4().hex[:8]}.safetensors"
            job = self._writer.submit(
                agent_id,
                lambda: self._write(agent_id, Path(agent_id) / name, encoded, message_count),
            )
            await asyncio.wrap_future(job)
            await self._keep_budget()
        except Exception:
            log.exception("saving the cache of agent %r failed; its transcript is intact", agent_id)

    async def _keep_budget(self) -> None:
        """Count the files; over the budget, evict the caches of the agents idle longest."""
        async with self._evicting:  # one pass at a time; later saves find it done
            self.usage = await self._registry.cache_usage()
            if self._budget_bytes is None or self.usage[0] <= self._budget_bytes:
                return
            for entry in await self._registry.coldest_caches(_EVICTION_SCAN):
                lock = self._lock_of(entry.agent_id)
                if lock.locked() or self._pending.get(entry.agent_id):
                    continue  # speaking now or saving: not cold
                async with lock:
                    if await self._registry.clear_cache(entry.agent_id, entry.path):
                        await asyncio.to_thread(remove_cache_file, self.root / entry.path)
                        self.evictions += 1
                        log.info("evicted the cache of agent %r (disk budget)", entry.agent_id)
                self.usage = await self._registry.cache_usage()
                if self.usage[0] <= self._budget_bytes:
                    return

    def _write(self, agent_id: str, rel: Path, encoded: EncodedCache, message_count: int) -> None:
        """On the writer thread: write the file, point the registry at it, drop the old one."""
        metadata = encoded.metadata | {
            "model_fingerprint": self.fingerprint,
            "message_count": str(message_count),
        }
        info = write_cache_file(self.root / rel, encoded.tensors, metadata)
        entry = NewCacheEntry(
            path=rel.as_posix(),
            token_count=encoded.num_tokens,
            model_fingerprint=self.fingerprint,
            nbytes=info.nbytes,
            checksum=info.checksum,
            format_version=FORMAT_VERSION,
            kv_bits=self._kv_bits,
            group_size=self._group_size if self._kv_bits else None,
            message_count=message_count,
        )
        try:
            previous = asyncio.run_coroutine_threadsafe(
                self._registry.set_cache(agent_id, entry), self._loop
            ).result()
        except AgentNotFoundError:
            remove_cache_file(info.path)  # deleted while this was queued
            return
        self.saved += 1
        if previous is not None and previous.path != entry.path:
            remove_cache_file(self.root / previous.path)

    async def load(self, agent_id: str) -> LoadedCache | None:
        """The agent's saved cache ready to resume, or None (logged) if there is none usable."""
        record = await self._registry.get_cache(agent_id)
        if record is None:
            return None
        try:
            if record.model_fingerprint != self.fingerprint:
                raise StaleCacheError("saved for another model")
            if record.format_version != FORMAT_VERSION:
                raise StaleCacheError(f"format version {record.format_version}")
            file = await asyncio.to_thread(
                read_cache_file, self.root / record.path, expected_checksum=record.checksum
            )
            meta = file.metadata
            if meta.get("model_fingerprint") != self.fingerprint:
                raise StaleCacheError("file was written for another model")
            if meta.get("message_count") != str(record.message_count):
                raise StaleCacheError("file does not match its registry entry")
            encoded = EncodedCache(file.tensors, meta)
            if not self._engine.model.on_gpu:  # host math off the generation thread
                encoded = await asyncio.to_thread(dequantize_on_host, encoded)
            cache = await self._engine.run(decode_cache, encoded)
        except (CacheFileError, CacheFormatError, StaleCacheError, OSError) as exc:
            self.load_failures += 1
            log.warning(
                "cache of agent %r unusable (%s); rebuilding from its transcript", agent_id, exc
            )
            return None
        return LoadedCache(cache, record.message_count)

    async def wait(self, agent_id: str | None = None) -> None:
        """Wait for scheduled saves (of one agent, or all) to finish."""
        while True:
            ids = [agent_id] if agent_id is not None else list(self._pending)
            tasks = [t for a in ids for t in self._pending.get(a, ())]
            if not tasks:
                return
            await asyncio.gather(*tasks, return_exceptions=True)

    async def fork(self, source_id: str, agent_id: str) -> bool:
        """Give ``agent_id`` the source's current cache file: hard-linked, so no byte is copied
        (copied only where the filesystem cannot link). Returns whether there was one."""
        await self.wait(source_id)  # the newest cache of the source has landed
        record = await self._registry.get_cache(source_id)
        if record is None:
            return False
        source = self.root / record.path
        rel = Path(agent_id) / Path(record.path).name
        try:
            await asyncio.to_thread(_link_or_copy, source, self.root / rel)
        except FileNotFoundError:  # evicted or replaced meanwhile: the fork rebuilds instead
            return False
        fields_ = {f.name: getattr(record, f.name) for f in dataclasses.fields(NewCacheEntry)}
        try:
            await self._registry.set_cache(
                agent_id, NewCacheEntry(**fields_ | {"path": rel.as_posix()})
            )
        except BaseException:
            remove_cache_file(self.root / rel)
            raise
        self.usage = await self._registry.cache_usage()
        return True

    async def remove_agent(self, agent_id: str) -> None:
        """Delete every file of an agent (after its saves finished)."""
        await self.wait(agent_id)
        self._pending.pop(agent_id, None)
        await asyncio.to_thread(shutil.rmtree, self.root / agent_id, ignore_errors=True)
        self.usage = await self._registry.cache_usage()

    async def sweep(self) -> int:
        """Remove cache files no registry entry points at (left by a crash mid-save, or by agents
        deleted behind the runtime's back). Call before any save starts. Returns the count.

        One registry query, whatever the number of agents. Only names this module writes are
        touched, and a file that cannot be removed is logged and left: opening never fails here.
        """
        removed = await asyncio.to_thread(self._sweep_files, await self._registry.cache_paths())
        await self._keep_budget()  # also counts what is on disk
        return removed

    def _sweep_files(self, current: dict[str, str | None]) -> int:
        ours = [f for f in self.root.glob("*/*") if _WRITTEN_NAME.fullmatch(f.name)]
        removed = 0
        for file in ours:
            rel = file.relative_to(self.root)
            if current.get(rel.parts[0], "") == rel.as_posix():
                continue
            try:
                remove_cache_file(file)
            except OSError as exc:
                log.warning("could not remove stale cache file %s: %s", file, exc)
            else:
                removed += 1
        for directory in {f.parent for f in ours}:
            if directory.name not in current:
                with contextlib.suppress(OSError):  # not empty: something else lives there
                    directory.rmdir()
        if removed:
            log.info("removed %d cache files no agent points at", removed)
        return removed

    async def close(self) -> None:
        await self.wait()
        await asyncio.to_thread(self._writer.close)


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        shutil.copy2(source, target)  # another filesystem, or links not supported
