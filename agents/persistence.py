"""Agents' KV caches on disk: paged into content-addressed blocks shared between agents.

Layout under ``root``::

    <agent id>/<messages>-<hex>.safetensors     the agent's tail (format 2; format 1: a whole
                                                cache, still read, replaced at the next save)
    _blocks/<key[:2]>/<key>-<n>.safetensors     a segment: n consecutive blocks, the last one
                                                ``key``, written by one save (a block is the
                                                global-attention layers' keys and values of
                                                ``block_tokens`` tokens)
    _blocks/<key[:2]>/<key>.window.safetensors  optional: the sliding-window layers' state at
                                                block ``key``'s end (a new cache can start there)
    _blocks/<key[:2]>/<key>.safetensors         one block (written before segments; still read)

A block's key is a hash chain (XXH3-128) over the model, the storage settings and every token
up to the block's end, so caches whose tokens start alike list the same keys and share the
files; a segment's name says its content (its last key fixes every token before it). The
registry records where each block is (``kv_blocks``) and lists each agent's blocks
(``kv_cache_blocks``). A segment none of whose blocks an agent lists is garbage and is
collected after saves and deletions, except while a turn that stored it as a shared prefix
still runs (it is pinned). Segments keep a resume to a few files (one per save that added
blocks, plus the tail) however small the blocks.

Save path: finished cache -> the registry says which of its blocks are stored -> the
generation thread encodes only the new blocks (one segment per run of them) and the tail
(quantizing them) -> the writer thread writes the files, records them and points the agent at
the tail in one registry transaction, removes the agent's previous tail, and collects garbage.
A turn therefore writes its new tokens and one tail (a partial block plus the sliding layers'
windows), whatever the length of the history. Writer jobs run one at a time, so a block is
written at most once and never removed while a save that counts on it is between its check
and its commit; if one was collected before the check, the commit fails and the save starts
again.

Load path: registry entry -> on the generation thread, ``decode_paged`` reads the tail and
segments straight into MLX (``mx.load``, each file once), verifies every file from that memory
(checksums, fingerprints, block keys, the registry entry, shapes: numpy and hashing only)
before anything uses it, then joins the runs of blocks per layer and dequantizes in float32 ->
a PromptCache ready to merge into the batch. Any problem is logged and reported as "no cache":
the transcript is the source of truth; a corrupt segment or window file is removed, so the
next save that lists its blocks writes them again.

Prefix reuse: a cache that starts with stored blocks whose last one has a window file can be
built from them, so a new agent with a stored system prompt prefills only the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import xxhash

from engine.engine import Engine
from engine.errors import CacheFormatError, CacheUnusableError
from engine.kv.assemble import assemble_paged
from engine.kv.encoded import (
    DEFAULT_BLOCK_TOKENS,
    FORMAT_VERSION,
    PAGED_FORMAT_VERSION,
    EncodedCache,
)
from engine.kv.load import BlockRun, LoadedFile, decode_paged
from engine.kv.paged import PagedCache, encode_paged, split_blocks, token_slice
from engine.kv.quant import dequantize_on_host
from engine.kv.whole import decode_cache
from engine.request import PromptCache
from store import (
    AgentNotFoundError,
    BlocksMissingError,
    CacheRecord,
    DiskUsage,
    NewBlock,
    NewCacheEntry,
    Registry,
    StoredBlock,
)
from store.cache_files import (
    read_cache_file,
    remove_cache_file,
    verify_checksum,
    write_cache_file,
)
from store.errors import CacheFileCorruptError
from store.writer import CacheWriter

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOCKS_DIR = "_blocks"  # agent ids start with a letter or digit: no agent has this directory

# What ``_save`` names tails (``<message count>-<hex>.safetensors``) and the writer's temp files.
_WRITTEN_NAME = re.compile(r"\.?\d{6,}-[0-9a-f]+\.safetensors(\.tmp-\w+)?")
# Segment, window and (older) block files, and their temp files.
_BLOCK_NAME = re.compile(r"\.?([0-9a-f]{32})(-\d+|\.window)?\.safetensors(\.tmp-\w+)?")
_EVICTION_SCAN = 1000  # cache entries looked at per eviction pass, coldest first
_SAVE_ATTEMPTS = 3
_GC_JOB = "\x00collect"  # writer key of garbage collection (coalesced: one pending at a time)
_PREFIX_TASKS = "\x00prefixes"  # key of shared-prefix writes in ``_pending``


@dataclass(slots=True, frozen=True)
class LoadedCache:
    cache: PromptCache
    message_count: int


class StaleCacheError(CacheUnusableError, ValueError):
    """A cache file that does not belong to this model, format or registry entry."""


def chain_keys(seed: bytes, tokens: Sequence[int], block_tokens: int) -> list[str]:
    """The key of each full block of ``tokens``: XXH3-128 of the previous key (``seed`` for
    the first) and the block's tokens as little-endian int32, in hex."""
    array = np.asarray(tokens, dtype="<i4")
    keys, previous = [], seed
    for start in range(0, len(array) - block_tokens + 1, block_tokens):
        digest = xxhash.xxh3_128(previous)
        digest.update(array[start : start + block_tokens].tobytes())
        previous = digest.digest()
        keys.append(digest.hexdigest())
    return keys


class DiskCaches:
    """Saves and loads agents' caches under ``root`` (see the module docstring)."""

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
        lock_of: Callable[[str], asyncio.Lock] | None = None,
    ):
        """
        Args:
            block_tokens: tokens per block.
            budget_bytes: evict the caches of the agents idle longest when the files exceed it
                (None: no budget). Transcripts stay; an evicted agent is rebuilt when it speaks.
            lock_of: the per-agent turn lock; eviction skips agents whose lock is held and
                holds it while it evicts.
        """
        self.root = root
        self.block_tokens = block_tokens
        self._registry = registry
        self._engine = engine
        self._kv_bits = kv_bits
        self._group_size = group_size
        self._budget_bytes = budget_bytes
        self._lock_of = lock_of or (lambda agent_id: asyncio.Lock())
        self._evicting = asyncio.Lock()
        self._writer = CacheWriter()
        self._pending: dict[str, set[asyncio.Task]] = {}
        self._pins: Counter[str] = Counter()
        self._storing: dict[str, asyncio.Task] = {}  # prefix writes in flight, by last key
        self._loop = asyncio.get_running_loop()
        self._seed = "|".join(
            (
                "agentkv-blocks-v2",
                self.fingerprint,
                str(kv_bits),
                str(group_size),
                str(block_tokens),
            )
        ).encode()
        self.saved = 0
        self.load_failures = 0
        self.evictions = 0
        self.blocks_written = 0
        self.blocks_shared = 0  # blocks a save found already stored
        self.bytes_written = 0
        self.prefix_lookups = 0  # turns without a cache of their own that looked for a prefix
        self.prefix_hits = 0
        self.prefix_tokens = 0  # tokens taken from stored prefixes instead of prefilled
        self.usage = DiskUsage(0, 0, 0)  # as last counted

    @property
    def fingerprint(self) -> str:
        return self._engine.model.fingerprint

    def keys(self, tokens: Sequence[int]) -> list[str]:
        """The block keys of ``tokens`` (one per full block) under this model and settings."""
        return chain_keys(self._seed, tokens, self.block_tokens)

    # ---- saving ------------------------------------------------------------------------------

    def save(
        self,
        agent_id: str,
        cache: PromptCache,
        message_count: int,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Schedule a save; returns at once. ``wait`` or ``close`` waits for it. ``then`` is
        called when it is over (saved or not)."""
        task = asyncio.create_task(self._save(agent_id, cache, message_count))
        tasks = self._pending.setdefault(agent_id, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if then is not None:
            task.add_done_callback(lambda _: then())

    async def _save(self, agent_id: str, cache: PromptCache, message_count: int) -> None:
        try:
            keys = self.keys(cache.tokens)
            for attempt in range(_SAVE_ATTEMPTS):
                missing = await self._missing(keys)
                paged = await self._engine.run(
                    encode_paged, cache, self._kv_bits, self._group_size, self.block_tokens, missing
                )
                name = f"{message_count:06d}-{uuid.uuid4().hex[:8]}.safetensors"
                keep = self._pinned()
                job = self._writer.submit(
                    agent_id,
                    functools.partial(
                        self._write, agent_id, name, paged, keys, message_count, keep
                    ),
                )
                try:
                    await asyncio.wrap_future(job)
                    break
                except BlocksMissingError:
                    if attempt == _SAVE_ATTEMPTS - 1:
                        raise
                    log.info("blocks of agent %r were collected meanwhile; saving again", agent_id)
            await self._keep_budget()
        except Exception:
            log.exception("saving the cache of agent %r failed; its transcript is intact", agent_id)

    async def _missing(self, keys: Sequence[str]) -> set[int]:
        """Indexes of the blocks to write: not recorded, or recorded but their file is gone
        (removed as corrupt by a load)."""
        known = await self._registry.known_blocks(keys)
        return await asyncio.to_thread(
            lambda: {j for j, key in enumerate(keys) if not self._stored(key, known)}
        )

    def _stored(self, key: str, known: dict[str, StoredBlock], window: bool = False) -> bool:
        where = known.get(key)
        if where is None or (window and not where.window):
            return False
        return (self._block_path(key, True) if window else self._file_of(key, where)).exists()

    def _write(
        self,
        agent_id: str,
        name: str,
        paged: PagedCache,
        keys: list[str],
        message_count: int,
        keep: frozenset[str],
    ) -> None:
        """On the writer thread: write new blocks and the tail, record them, drop the old tail,
        collect garbage."""
        new_blocks, written = [], []
        try:
            new_blocks = self._write_segments(paged, keys, written)
            rel = Path(agent_id) / name
            meta = {"message_count": str(message_count), "blocks": str(len(keys))}
            info = self._write_file(self.root / rel, paged.tail, meta)
            written.append(info.path)
            entry = NewCacheEntry(
                path=rel.as_posix(),
                token_count=len(keys) * self.block_tokens + paged.tail.num_tokens,
                model_fingerprint=self.fingerprint,
                nbytes=info.nbytes,
                checksum=info.checksum,
                format_version=PAGED_FORMAT_VERSION,
                kv_bits=self._kv_bits,
                group_size=self._group_size if self._kv_bits else None,
                message_count=message_count,
            )
            previous = self._call(
                self._registry.set_cache(agent_id, entry, blocks=keys, new_blocks=new_blocks)
            )
        except AgentNotFoundError:  # deleted while this was queued
            _remove_all(written)
            return
        except BaseException:
            _remove_all(written)  # nothing of it was recorded
            raise
        self.saved += 1
        self.blocks_written += len(new_blocks)
        self.blocks_shared += len(keys) - len(new_blocks)
        self.bytes_written += sum(b.nbytes or 0 for b in new_blocks) + info.nbytes
        if previous is not None and previous.path != entry.path:
            remove_cache_file(self.root / previous.path)
        self._collect(keep)

    def _write_segments(
        self, paged: PagedCache, keys: Sequence[str], written: list[Path]
    ) -> list[NewBlock]:
        """On the writer thread: write the new blocks (one file per run of them no other save
        stored since this one looked; their paths go to ``written``) and return their rows."""
        fresh = [keys[j] for first in paged.segments for j in paged.blocks_in(first)]
        known = self._call(self._registry.known_blocks(fresh)) if fresh else {}
        new_blocks = []
        for first, segment in paged.segments.items():
            todo = [j for j in paged.blocks_in(first) if not self._stored(keys[j], known)]
            runs: list[list[int]] = []
            for j in todo:
                if runs and runs[-1][-1] == j - 1:
                    runs[-1].append(j)
                else:
                    runs.append([j])
            for run in runs:
                part = segment
                if len(run) < len(paged.blocks_in(first)):  # some were stored meanwhile
                    size = self.block_tokens
                    part = token_slice(
                        segment, (run[0] - first) * size, (run[-1] + 1 - first) * size
                    )
                run_keys = [keys[j] for j in run]
                name = f"{run_keys[-1]}-{len(run)}"
                info = self._write_file(
                    self._segment_path(name), part, {"keys": json.dumps(run_keys)}
                )
                written.append(info.path)
                share, extra = divmod(info.nbytes, len(run))  # the first block takes the rest
                new_blocks += [
                    NewBlock(
                        key,
                        share + (extra if k == 0 else 0),
                        info.checksum,
                        segment=name,
                        segment_index=k,
                    )
                    for k, key in enumerate(run_keys)
                ]
        return new_blocks

    def _write_file(self, path: Path, encoded: EncodedCache, extra: dict[str, str]) -> Any:
        metadata = encoded.metadata | {"model_fingerprint": self.fingerprint} | extra
        return write_cache_file(path, encoded.tensors, metadata)

    def _block_path(self, key: str, window: bool = False) -> Path:
        """A block's window file, or (``window`` False) the file of a block stored before
        segments."""
        suffix = ".window.safetensors" if window else ".safetensors"
        return self.root / BLOCKS_DIR / key[:2] / f"{key}{suffix}"

    def _segment_path(self, name: str) -> Path:
        return self.root / BLOCKS_DIR / name[:2] / f"{name}.safetensors"

    def _file_of(self, key: str, where: StoredBlock) -> Path:
        """The file holding block ``key``."""
        return self._block_path(key) if where.segment is None else self._segment_path(where.segment)

    async def block_files(self, keys: Sequence[str]) -> list[Path]:
        """The files holding these recorded blocks (each once, in order)."""
        known = await self._registry.known_blocks(keys)
        return list(dict.fromkeys(self._file_of(key, known[key]) for key in keys if key in known))

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a registry call on the event loop from the writer thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _collect(self, keep: frozenset[str]) -> int:
        """On the writer thread: delete the segments none of whose blocks a cache lists (or
        ``keep`` holds), their blocks' rows and window files."""
        removed = self._call(self._registry.collect_garbage(sorted(keep)))
        for file in dict.fromkeys(self._file_of(key, where) for key, where in removed):
            _remove_quietly(file)
        for key, where in removed:
            if where.window:
                _remove_quietly(self._block_path(key, window=True))
        if removed:
            log.debug("collected %d blocks no cache needs", len(removed))
        return len(removed)

    async def collect(self) -> int:
        """Collect garbage blocks now (after the writer's queued jobs); returns how many."""
        keep = self._pinned()
        removed = await asyncio.wrap_future(
            self._writer.submit(_GC_JOB, lambda: self._collect(keep))
        )
        self.usage = await self._registry.cache_usage()
        return removed or 0

    # ---- shared prefixes ---------------------------------------------------------------------

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

    def _pinned(self) -> frozenset[str]:
        return frozenset(self._pins)

    async def stored_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` (a chain) can be resumed from: the longest run of stored blocks
        from the first that ends at a block with a window file."""
        # A prefix being written now counts: wait for it rather than prefill it again.
        if writing := [task for key in keys if (task := self._storing.get(key))]:
            await asyncio.wait(writing)  # (unlike gather, a cancelled caller cancels nothing)
        known = await self._registry.known_blocks(keys)
        run = next((j for j, key in enumerate(keys) if key not in known), len(keys))
        windows = [j for j in range(run) if known[keys[j]].window]
        for j in reversed(windows):  # a window removed as corrupt does not count
            if await asyncio.to_thread(self._stored, keys[j], known, True):
                return j + 1
        return 0

    def store_prefix(self, cache: PromptCache, keys: Sequence[str]) -> None:
        """Schedule storing a cache that ends at a block boundary as blocks plus a window, for
        caches that start the same way (:meth:`pin` ``keys`` first). ``wait()`` waits for it."""
        task = asyncio.create_task(self._store_prefix(cache, keys))
        tasks = self._pending.setdefault(_PREFIX_TASKS, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        self._storing[keys[-1]] = task
        task.add_done_callback(lambda _: self._storing.pop(keys[-1], None))

    async def _store_prefix(self, cache: PromptCache, keys: Sequence[str]) -> None:
        try:
            await self._store_prefix_now(cache, keys)
        except Exception:
            log.exception("storing a shared prefix of %d blocks failed", len(keys))

    async def _store_prefix_now(self, cache: PromptCache, keys: Sequence[str]) -> None:
        missing = await self._missing(keys)
        paged = await self._engine.run(
            encode_paged, cache, self._kv_bits, self._group_size, self.block_tokens, missing
        )
        job = self._writer.submit(f"\x00prefix-{keys[-1]}", lambda: self._write_prefix(paged, keys))
        await asyncio.wrap_future(job)

    def _write_prefix(self, paged: PagedCache, keys: Sequence[str]) -> None:
        known = self._call(self._registry.known_blocks(keys[-1:]))
        new_blocks, written = [], []
        try:
            new_blocks = self._write_segments(paged, keys, written)
            last = keys[-1]
            if not self._stored(last, known, window=True):
                info = self._write_file(
                    self._block_path(last, window=True), paged.tail, {"key": last}
                )
                written.append(info.path)
                if any(b.key == last for b in new_blocks):
                    block = next(b for b in new_blocks if b.key == last)
                    new_blocks.remove(block)
                    new_blocks.append(
                        dataclasses.replace(
                            block, window_nbytes=info.nbytes, window_checksum=info.checksum
                        )
                    )
                else:
                    new_blocks.append(NewBlock(last, None, None, info.nbytes, info.checksum))
            self._call(self._registry.add_blocks(new_blocks))
        except BaseException:
            _remove_all(written)
            raise
        self.blocks_written += sum(1 for b in new_blocks if b.nbytes is not None)
        self.bytes_written += sum((b.nbytes or 0) + (b.window_nbytes or 0) for b in new_blocks)

    async def load_prefix(self, tokens: Sequence[int], keys: Sequence[str]) -> PromptCache | None:
        """The cache of ``tokens`` (``len(keys)`` full blocks) from stored blocks and the last
        one's window, or None (logged) when they cannot be read."""
        release = self.pin(keys)  # kept through collection while they are read
        window = self._block_path(keys[-1], window=True)
        try:
            cache = await self._load_paged(window, list(keys), keys[-1], lambda meta: None)
        except (CacheUnusableError, OSError) as exc:
            log.warning("stored prefix of %d blocks unusable (%s); prefilling it", len(keys), exc)
            return None
        finally:
            release()
        if cache.tokens != list(tokens):
            log.warning("stored prefix holds other tokens than its keys say; prefilling it")
            return None
        self.prefix_hits += 1
        self.prefix_tokens += cache.num_tokens
        return cache

    # ---- loading -----------------------------------------------------------------------------

    async def load(self, agent_id: str) -> LoadedCache | None:
        """The agent's saved cache ready to resume, or None (logged) if there is none usable."""
        record = await self._registry.get_cache(agent_id)
        if record is None:
            return None
        try:
            if record.model_fingerprint != self.fingerprint:
                raise StaleCacheError("saved for another model")
            if record.format_version == PAGED_FORMAT_VERSION:
                tail = self.root / record.path
                check = functools.partial(self._check_tail, record)
                cache = await self._load_paged(tail, list(record.blocks), record.checksum, check)
            elif record.format_version == FORMAT_VERSION:
                encoded = await asyncio.to_thread(self._read_whole, record)
                cache = await self._decode(encoded)
            else:
                raise StaleCacheError(f"format version {record.format_version}")
        except (CacheUnusableError, OSError) as exc:
            self.load_failures += 1
            log.warning(
                "cache of agent %r unusable (%s); rebuilding from its transcript", agent_id, exc
            )
            return None
        return LoadedCache(cache, record.message_count)

    async def _load_paged(
        self,
        tail: Path,
        keys: list[str],
        tail_checksum_or_key: str,
        check_tail: Callable[[dict[str, str]], None],
    ) -> PromptCache:
        """Read a tail (an agent's, or a window: then ``tail_checksum_or_key`` is its block's
        key, else the registry's checksum of it) and its blocks into MLX on the generation
        thread, verifying every file there before it is used (``decode_paged``)."""
        window = tail.name.endswith(".window.safetensors")
        known = await self._registry.known_blocks(keys)
        if missing := [key for key in keys if key not in known]:
            raise StaleCacheError(f"{len(missing)} of its blocks are not recorded")
        runs = self._runs(keys, known)

        def check(files: list[LoadedFile]) -> None:  # generation thread; numpy and hashing only
            *segments, (_, tensors, meta) = files
            if window:  # the tail first: what it says about the segments is verified
                window_keys, tail_file = self._segment(tail, tensors, meta)
                if window_keys != [tail_checksum_or_key]:
                    raise StaleCacheError(f"{tail.name} is not the window of its block")
            else:
                verify_checksum(tail, tensors, meta, expected_checksum=tail_checksum_or_key)
                tail_file = EncodedCache(tensors, meta)
            if meta.get("model_fingerprint") != self.fingerprint:
                raise StaleCacheError("file was written for another model")
            check_tail(meta)
            try:
                block_tokens = int(meta["block_tokens"])
            except (KeyError, ValueError) as exc:
                raise CacheFormatError(f"{tail.name}: metadata 'block_tokens': {exc}") from exc
            loaded = {path: self._segment(Path(path), t, m) for path, t, m in segments}
            blocks = []
            for run, run_keys in runs:
                stored_keys, segment = loaded[run.path]
                held = split_blocks(segment, block_tokens)
                end = run.first + run.count
                if len(held) != len(stored_keys) or stored_keys[run.first : end] != run_keys:
                    raise StaleCacheError(
                        f"{Path(run.path).name} does not hold blocks {run_keys[0]}.."
                    )
                blocks += held[run.first : end]
            assemble_paged(tail_file, blocks, join=False)

        try:
            return await self._engine.run(
                decode_paged, str(tail), [run for run, _ in runs], self._engine.model.on_gpu, check
            )
        except CacheFileCorruptError as exc:
            if Path(exc.path).parent.parent.name == BLOCKS_DIR:
                # Gone, the next save that lists these blocks (or stores this window) writes it.
                await asyncio.to_thread(_remove_quietly, Path(exc.path))
            raise
        except CacheUnusableError:
            raise
        except Exception as exc:  # MLX could not read a file (missing, truncated): find which
            files = [tail, *(Path(p) for p in dict.fromkeys(run.path for run, _ in runs))]
            await asyncio.to_thread(self._find_damage, files)
            raise CacheFormatError(f"reading {tail.name} and its blocks: {exc}") from exc

    def _runs(
        self, keys: Sequence[str], known: dict[str, StoredBlock]
    ) -> list[tuple[BlockRun, list[str]]]:
        """``keys`` as runs of consecutive blocks of one file each, with their keys."""
        runs: list[tuple[BlockRun, list[str]]] = []
        for key in keys:
            where = known[key]
            path = str(self._file_of(key, where))
            if runs and runs[-1][0].path == path and where.segment is not None:
                run, run_keys = runs[-1]
                if run.first + run.count == where.index:
                    runs[-1] = (run._replace(count=run.count + 1), [*run_keys, key])
                    continue
            runs.append((BlockRun(path, where.index, 1), [key]))
        return runs

    def _segment(
        self, path: Path, tensors: dict[str, Any], meta: dict[str, str]
    ) -> tuple[list[str], EncodedCache]:
        """A loaded segment, block or window file, verified: the keys it says it holds (a
        window: its block's), and it."""
        verify_checksum(path, tensors, meta)
        if meta.get("model_fingerprint") != self.fingerprint:
            raise StaleCacheError(f"{path.name} was written for another model")
        try:
            keys = json.loads(meta["keys"]) if "keys" in meta else [meta.get("key")]
        except ValueError as exc:
            raise CacheFormatError(f"{path.name}: metadata 'keys' is not JSON: {exc}") from exc
        name = path.name.removesuffix(".safetensors").removesuffix(".window")
        if (
            not isinstance(keys, list)
            or not keys
            or not all(isinstance(k, str) for k in keys)
            or name not in (keys[-1], f"{keys[-1]}-{len(keys)}")
        ):
            raise StaleCacheError(f"{path.name} does not hold the blocks its name says")
        return keys, EncodedCache(tensors, meta)

    def _find_damage(self, paths: list[Path]) -> None:
        """On a worker thread: raise the error of the first file that cannot be read (removing
        it when it is a corrupt block or window)."""
        for path in paths:
            try:
                read_cache_file(path)
            except CacheFileCorruptError:
                if path.parent.parent.name == BLOCKS_DIR:
                    _remove_quietly(path)
                raise

    def _check_tail(self, record: CacheRecord, meta: dict[str, str]) -> None:
        if meta.get("message_count") != str(record.message_count):
            raise StaleCacheError("file does not match its registry entry")
        if meta.get("blocks") != str(len(record.blocks)):
            raise StaleCacheError(
                f"tail lists {meta.get('blocks')} blocks, the registry {len(record.blocks)}"
            )

    def _read_whole(self, record: CacheRecord) -> EncodedCache:
        """On a worker thread: a format-1 file (a whole cache), verified."""
        file = read_cache_file(self.root / record.path, expected_checksum=record.checksum)
        meta = file.metadata
        if meta.get("model_fingerprint") != self.fingerprint:
            raise StaleCacheError("file was written for another model")
        if meta.get("message_count") != str(record.message_count):
            raise StaleCacheError("file does not match its registry entry")
        return EncodedCache(file.tensors, meta)

    async def _decode(self, encoded: EncodedCache) -> PromptCache:
        if not self._engine.model.on_gpu:  # host math off the generation thread
            encoded = await asyncio.to_thread(dequantize_on_host, encoded)
        return await self._engine.run(decode_cache, encoded)

    # ---- budget, fork, removal ---------------------------------------------------------------

    async def _keep_budget(self) -> None:
        """Count the files; over the budget, evict the caches of the agents idle longest
        (their blocks go when no other cache lists them)."""
        async with self._evicting:  # one pass at a time; later saves find it done
            self.usage = await self._registry.cache_usage()
            if self._budget_bytes is None or self.usage.bytes <= self._budget_bytes:
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
                await self.collect()
                if self.usage.bytes <= self._budget_bytes:
                    return

    @property
    def saves_in_flight(self) -> int:
        """Saves scheduled and not yet on disk and in the registry."""
        return sum(len(tasks) for tasks in self._pending.values())

    async def wait(self, agent_id: str | None = None) -> None:
        """Wait for scheduled saves (of one agent, or all) to finish."""
        while True:
            ids = [agent_id] if agent_id is not None else list(self._pending)
            tasks = [t for a in ids for t in self._pending.get(a, ())]
            if not tasks:
                return
            await asyncio.wait(tasks)  # a cancelled caller does not cancel the saves

    async def fork(self, source_id: str, agent_id: str) -> bool:
        """Give ``agent_id`` the source's current cache: the same blocks, and its tail
        hard-linked (copied only where the filesystem cannot link). Returns whether there was
        one."""
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
        fields_ = {
            name: getattr(record, name)
            for name in NewCacheEntry.__dataclass_fields__  # type: ignore[attr-defined]
        }
        try:
            await self._registry.set_cache(
                agent_id, NewCacheEntry(**fields_ | {"path": rel.as_posix()}), blocks=record.blocks
            )
        except BaseException:
            remove_cache_file(self.root / rel)
            raise
        self.usage = await self._registry.cache_usage()
        return True

    async def remove_agent(self, agent_id: str) -> None:
        """Delete the files of a deleted agent (after its saves) and blocks no one lists."""
        await self.wait(agent_id)
        self._pending.pop(agent_id, None)
        await asyncio.to_thread(shutil.rmtree, self.root / agent_id, ignore_errors=True)
        await self.collect()

    async def sweep(self) -> int:
        """Remove files no registry entry points at (left by a crash mid-save, or by agents
        deleted behind the runtime's back) and collect unlisted blocks. Call before any save
        starts. Returns the count of files removed.

        A few registry queries, whatever the number of agents. Only names this module writes are
        touched, and a file that cannot be removed is logged and left: opening never fails here.
        """
        removed = await self.collect()
        current = await self._registry.cache_paths()
        blocks = await self._registry.block_keys()
        removed += await asyncio.to_thread(self._sweep_files, current, blocks)
        await self._keep_budget()  # also counts what is on disk
        return removed

    def _sweep_files(self, current: dict[str, str | None], blocks: dict[str, StoredBlock]) -> int:
        ours = [f for f in self.root.glob("*/*") if _WRITTEN_NAME.fullmatch(f.name)]
        stale = [f for f in ours if current.get(f.parent.name, "") != f"{f.parent.name}/{f.name}"]
        segments = {where.segment for where in blocks.values()}
        for file in (self.root / BLOCKS_DIR).glob("*/*"):
            match = _BLOCK_NAME.fullmatch(file.name)
            if match is None:
                continue
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
        for directory in {f.parent for f in stale}:
            if directory.parent == self.root and directory.name in current:
                continue
            with contextlib.suppress(OSError):  # not empty: something else lives there
                directory.rmdir()
        if removed:
            log.info("removed %d cache files no agent points at", removed)
        return removed

    async def close(self) -> None:
        await self.wait()
        await asyncio.to_thread(self._writer.close)


def _remove_quietly(path: Path) -> None:
    """Remove a file; one that cannot be removed is logged (the sweep retries it at open)."""
    try:
        remove_cache_file(path)
    except OSError as exc:
        log.warning("could not remove cache file %s: %s", path, exc)


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            remove_cache_file(path)


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        shutil.copy2(source, target)  # another filesystem, or links not supported
