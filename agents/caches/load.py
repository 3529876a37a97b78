"""Loading a saved cache: registry entry -> on the generation thread, ``decode_paged`` reads
the tail and segments straight into MLX (``mx.load``, each file once), verifies every file
from that memory (checksums, fingerprints, block keys, the registry entry, shapes: numpy and
hashing only) before anything uses it, then joins the runs of blocks per layer and dequantizes
in float32 (or, for layers stored as the batch holds them quantized, packs the words as they
are) -> a PromptCache ready to merge into the batch. Any problem is logged and reported
as "no cache": the transcript is the source of truth; a corrupt segment or window file is
removed, so the next save that lists its blocks writes them again."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv.caches.layout import BLOCKS_DIR, names_segment_of, remove_quietly
from agentkv.caches.shared import Part
from agentkv.engine.errors import CacheFormatError, CacheUnusableError
from agentkv.engine.kv.assemble import assemble_paged
from agentkv.engine.kv.encoded import (
    FORMAT_VERSION,
    PAGED_FORMAT_VERSIONS,
    EncodedCache,
    block_tokens_of,
)
from agentkv.engine.kv.load import BlockRun, LoadedFile, decode_paged
from agentkv.engine.kv.paged import split_blocks
from agentkv.engine.kv.quant import dequantize_on_host
from agentkv.engine.kv.whole import decode_cache
from agentkv.engine.request import PromptCache
from agentkv.store import CacheRecord, StoredBlock
from agentkv.store.cache_files import load_into_mlx, read_cache_file, verify_checksum
from agentkv.store.errors import CacheFileCorruptError

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class LoadedCache:
    cache: PromptCache
    message_count: int
    digest: str | None  # conversation_digest of those messages (None: saved without one)


class StaleCacheError(CacheUnusableError, ValueError):
    """A cache file that does not belong to this model, format or registry entry."""


class Loader(Part):
    async def load(self, agent_id: str) -> LoadedCache | None:
        """The agent's saved cache ready to resume, or None (logged) if there is none usable."""
        record = await self._registry.caches.get(agent_id)
        if record is None:
            return None
        try:
            if record.model_fingerprint != self._layout.fingerprint:
                raise StaleCacheError("saved for another model")
            meta: dict[str, str] = {}
            if record.format_version in PAGED_FORMAT_VERSIONS:
                tail = self._layout.root / record.path
                check = functools.partial(_check_tail, record, meta)
                cache = await self.load_paged(tail, list(record.blocks), record.checksum, check)
            elif record.format_version == FORMAT_VERSION:
                encoded = await asyncio.to_thread(self._read_whole, record)
                meta = encoded.metadata
                cache = await self._decode(encoded)
            else:
                raise StaleCacheError(f"format version {record.format_version}")
        except (CacheUnusableError, OSError) as exc:
            self._stats.load_failures += 1
            log.warning(
                "cache of agent %r unusable (%s); rebuilding from its transcript", agent_id, exc
            )
            return None
        return LoadedCache(cache, record.message_count, meta.get("conversation_digest"))

    async def load_paged(
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
        known = await self._registry.caches.known_blocks(keys)
        if missing := [key for key in keys if key not in known]:
            raise StaleCacheError(f"{len(missing)} of its blocks are not recorded")
        runs = self._runs(keys, known)
        fingerprint = self._layout.fingerprint

        def check(files: list[LoadedFile]) -> None:  # generation thread; numpy and hashing only
            *segments, (_, tensors, meta) = files
            if window:  # the tail first: what it says about the segments is verified
                window_keys, tail_file = _segment(tail, tensors, meta, fingerprint)
                if window_keys != [tail_checksum_or_key]:
                    raise StaleCacheError(f"{tail.name} is not the window of its block")
            else:
                verify_checksum(tail, tensors, meta, expected_checksum=tail_checksum_or_key)
                tail_file = EncodedCache(tensors, meta)
            if meta.get("model_fingerprint") != fingerprint:
                raise StaleCacheError("file was written for another model")
            check_tail(meta)
            block_tokens = block_tokens_of(meta, tail.name)
            loaded = {path: _segment(Path(path), t, m, fingerprint) for path, t, m in segments}
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
                decode_paged,
                load_into_mlx,
                str(tail),
                [run for run, _ in runs],
                self._engine.model.on_gpu,
                check,
                self._engine.packing,
                self._engine.first_positions,
            )
        except CacheFileCorruptError as exc:
            if Path(exc.path).parent.parent.name == BLOCKS_DIR:
                # Gone, the next save that lists these blocks (or stores this window) writes it.
                await asyncio.to_thread(remove_quietly, Path(exc.path))
            raise
        except CacheUnusableError:
            raise
        except Exception as exc:  # MLX could not read a file (missing, truncated): find which
            files = [tail, *(Path(p) for p in dict.fromkeys(run.path for run, _ in runs))]
            await asyncio.to_thread(_find_damage, files)
            raise CacheFormatError(f"reading {tail.name} and its blocks: {exc}") from exc

    def _runs(
        self, keys: Sequence[str], known: dict[str, StoredBlock]
    ) -> list[tuple[BlockRun, list[str]]]:
        """``keys`` as runs of consecutive blocks of one file each, with their keys."""
        runs: list[tuple[BlockRun, list[str]]] = []
        for key in keys:
            where = known[key]
            path = str(self._layout.file_of(key, where))
            if runs and runs[-1][0].path == path and where.segment is not None:
                run, run_keys = runs[-1]
                if run.first + run.count == where.index:
                    runs[-1] = (run._replace(count=run.count + 1), [*run_keys, key])
                    continue
            runs.append((BlockRun(path, where.index, 1), [key]))
        return runs

    def _read_whole(self, record: CacheRecord) -> EncodedCache:
        """On a worker thread: a format-1 file (a whole cache), verified."""
        file = read_cache_file(self._layout.root / record.path, expected_checksum=record.checksum)
        meta = file.metadata
        if meta.get("model_fingerprint") != self._layout.fingerprint:
            raise StaleCacheError("file was written for another model")
        if meta.get("message_count") != str(record.message_count):
            raise StaleCacheError("file does not match its registry entry")
        return EncodedCache(file.tensors, meta)

    async def _decode(self, encoded: EncodedCache) -> PromptCache:
        if not self._engine.model.on_gpu:  # host math off the generation thread
            encoded = await asyncio.to_thread(dequantize_on_host, encoded)
        return await self._engine.run(decode_cache, encoded)


def _segment(
    path: Path, tensors: dict[str, Any], meta: dict[str, str], fingerprint: str
) -> tuple[list[str], EncodedCache]:
    """A loaded segment, block or window file, verified: the keys it says it holds (a window:
    its block's), and it."""
    verify_checksum(path, tensors, meta)
    if meta.get("model_fingerprint") != fingerprint:
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
        or not names_segment_of(name, keys)
    ):
        raise StaleCacheError(f"{path.name} does not hold the blocks its name says")
    return keys, EncodedCache(tensors, meta)


def _find_damage(paths: list[Path]) -> None:
    """On a worker thread: raise the error of the first file that cannot be read (removing it
    when it is a corrupt block or window)."""
    for path in paths:
        try:
            read_cache_file(path)
        except CacheFileCorruptError:
            if path.parent.parent.name == BLOCKS_DIR:
                remove_quietly(path)
            raise


def _check_tail(record: CacheRecord, seen: dict[str, str], meta: dict[str, str]) -> None:
    """Check an agent's tail file against its registry entry; its metadata goes to ``seen``."""
    seen.update(meta)
    if meta.get("message_count") != str(record.message_count):
        raise StaleCacheError("file does not match its registry entry")
    if meta.get("blocks") != str(len(record.blocks)):
        raise StaleCacheError(
            f"tail lists {meta.get('blocks')} blocks, the registry {len(record.blocks)}"
        )
