"""Saving a finished turn's cache: the registry says which of its blocks are stored, the
generation thread encodes only the new blocks (one segment per run of them) and the tail, and
the writer thread writes the files, records them and points the agent at the tail in one
registry transaction, removes the agent's previous tail, and collects garbage.

A turn therefore writes its new tokens and one tail (a partial block plus the sliding layers'
windows), whatever the length of the history. Writer jobs run one at a time, so a block is
written at most once and never removed while a save that counts on it is between its check
and its commit; if one was collected before the check, the commit fails and the save starts
again."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentkv.caches.janitor import Janitor
from agentkv.caches.layout import remove_all, segment_name
from agentkv.caches.shared import Part, Shared
from agentkv.engine.kv.encoded import EncodedCache, consecutive_runs
from agentkv.engine.kv.paged import PagedCache, encode_paged, token_slice
from agentkv.engine.request import PromptCache
from agentkv.store import AgentNotFoundError, BlocksMissingError, NewBlock, NewCacheEntry
from agentkv.store.cache_files import remove_cache_file, write_cache_file

log = logging.getLogger(__name__)

SAVE_ATTEMPTS = 3


class Saver(Part):
    def __init__(self, shared: Shared, janitor: Janitor):
        super().__init__(shared)
        self._janitor = janitor

    def save(
        self,
        agent_id: str,
        cache: PromptCache,
        message_count: int,
        digest: str,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Schedule a save; returns at once. ``then`` is called when it is over (saved or
        not)."""
        meta = {"message_count": str(message_count), "conversation_digest": digest}
        task = self._writes.track(agent_id, self._save(agent_id, cache, meta))
        if then is not None:
            task.add_done_callback(lambda _: then())

    async def _save(self, agent_id: str, cache: PromptCache, meta: dict[str, str]) -> None:
        try:
            keys = self._layout.keys(cache.tokens)
            for attempt in range(SAVE_ATTEMPTS):
                paged = await self.encode(cache, keys, points=True)
                name = f"{int(meta['message_count']):06d}-{uuid.uuid4().hex[:8]}.safetensors"
                keep = self._janitor.pinned()
                job = self._writes.submit(
                    agent_id,
                    functools.partial(self._write, agent_id, name, paged, keys, meta, keep),
                )
                try:
                    await asyncio.wrap_future(job)
                    break
                except BlocksMissingError:
                    if attempt == SAVE_ATTEMPTS - 1:
                        raise
                    log.info("blocks of agent %r were collected meanwhile; saving again", agent_id)
            await self._janitor.keep_budget()
        except Exception:
            log.exception("saving the cache of agent %r failed; its transcript is intact", agent_id)

    async def encode(
        self, cache: PromptCache, keys: Sequence[str], points: bool = False
    ) -> PagedCache:
        """On the generation thread: the blocks of ``keys`` that are not stored, and the tail
        (with ``points``, keeping the checkpoint where the cache's last prompt ended)."""
        known = await self._registry.caches.known_blocks(keys)
        layout = self._layout

        def encode() -> PagedCache:
            # The files of the blocks the registry knows are looked at here, not on a thread
            # of their own: a stat a block (microseconds) against the encoding's milliseconds,
            # and one hop fewer for every save.
            missing = {j for j, key in enumerate(keys) if not layout.is_stored(key, known)}
            return encode_paged(
                cache, layout.kv_bits, layout.group_size, layout.block_tokens, missing, points
            )

        return await self._engine.run(encode)

    def _write(
        self,
        agent_id: str,
        name: str,
        paged: PagedCache,
        keys: list[str],
        tail_meta: dict[str, str],
        keep: frozenset[str],
    ) -> None:
        """On the writer thread: write new blocks and the tail, record them, drop the old tail,
        collect garbage."""
        layout = self._layout
        new_blocks, written = [], []
        try:
            new_blocks = self.write_segments(paged, keys, written)
            rel = Path(agent_id) / name
            meta = tail_meta | {"blocks": str(len(keys))}
            info = self.write_file(layout.root / rel, paged.tail, meta)
            written.append(info.path)
            entry = NewCacheEntry(
                path=rel.as_posix(),
                token_count=len(keys) * layout.block_tokens + paged.tail.num_tokens,
                model_fingerprint=layout.fingerprint,
                nbytes=info.nbytes,
                checksum=info.checksum,
                format_version=int(paged.tail.metadata["format_version"]),
                kv_bits=layout.kv_bits,
                group_size=layout.group_size if layout.kv_bits else None,
                message_count=int(tail_meta["message_count"]),
            )
            previous = self._writes.call(
                self._registry.caches.set(agent_id, entry, blocks=keys, new_blocks=new_blocks)
            )
        except AgentNotFoundError:  # deleted while this was queued
            remove_all(written)
            return
        except BaseException:
            remove_all(written)  # nothing of it was recorded
            raise
        stats = self._stats
        stats.saved += 1
        stats.blocks_written += len(new_blocks)
        stats.blocks_shared += len(keys) - len(new_blocks)
        stats.bytes_written += sum(b.nbytes or 0 for b in new_blocks) + info.nbytes
        if previous is not None and previous.path != entry.path:
            remove_cache_file(layout.root / previous.path)
        self._janitor.collect_now(keep)

    def write_segments(
        self, paged: PagedCache, keys: Sequence[str], written: list[Path]
    ) -> list[NewBlock]:
        """On the writer thread: write the new blocks (one file per run of them no other save
        stored since this one looked; their paths go to ``written``) and return their rows."""
        layout = self._layout
        fresh = [keys[j] for first in paged.segments for j in paged.blocks_in(first)]
        known = self._writes.call(self._registry.caches.known_blocks(fresh)) if fresh else {}
        new_blocks = []
        for first, segment in paged.segments.items():
            todo = [j for j in paged.blocks_in(first) if not layout.is_stored(keys[j], known)]
            for run in consecutive_runs(todo):
                part = segment
                if len(run) < len(paged.blocks_in(first)):  # some were stored meanwhile
                    size = layout.block_tokens
                    part = token_slice(
                        segment, (run[0] - first) * size, (run[-1] + 1 - first) * size
                    )
                run_keys = [keys[j] for j in run]
                # Named for its blocks and made unique: workers sharing the directory may
                # write the same run at once, and each removes only its own files.
                name = segment_name(run_keys)
                info = self.write_file(
                    layout.segment_path(name), part, {"keys": json.dumps(run_keys)}
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

    def write_file(self, path: Path, encoded: EncodedCache, extra: dict[str, str]) -> Any:
        metadata = encoded.metadata | {"model_fingerprint": self._layout.fingerprint} | extra
        return write_cache_file(path, encoded.tensors, metadata)
