"""Shared prefixes on disk: a cache that starts with stored blocks whose last one has a window
file can be built from them, so a new agent with a stored system prompt prefills only the rest.

A turn without a cache of its own looks for the longest stored prefix of its prompt
(:meth:`Prefixes.stored`); failing that, when its head (the system prompt and tools) spans a
block, it prefills the head's whole blocks alone first and stores them as blocks plus a window
(:meth:`Prefixes.store_head`; pinned until the turn has saved its own cache). Turns that start
the same way meanwhile wait for that head instead of prefilling it again. ``CacheTiers.prefix``
decides between these and the caches in memory."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

from agentkv.caches.janitor import Janitor
from agentkv.caches.layout import remove_all
from agentkv.caches.load import Loader
from agentkv.caches.save import Saver
from agentkv.caches.shared import Part, Shared
from agentkv.engine.errors import CacheUnusableError
from agentkv.engine.kv.paged import PagedCache
from agentkv.engine.request import GenerationRequest, PromptCache
from agentkv.store import NewBlock

log = logging.getLogger(__name__)

PREFIX_TASKS = "\x00prefixes"  # key of shared-prefix writes among the writes in flight
HEAD_KEEP_S = 900.0
"""A stored head's blocks are kept through every worker's garbage collection this long, listed
or not (this worker also pins them until the turns using them have saved)."""

Prefix = tuple[PromptCache | None, int, Callable[[], None] | None]
"""A cache for the start of a prompt (None: prefill everything), how many of its tokens this
turn prefilled (a head it stored for others), and the release of the pin that keeps that head
until the turn has saved."""


class Prefixes(Part):
    def __init__(self, shared: Shared, janitor: Janitor, saver: Saver, loader: Loader):
        super().__init__(shared)
        self._janitor = janitor
        self._saver = saver
        self._loader = loader
        self._storing: dict[str, asyncio.Task] = {}  # prefix writes in flight, by last key
        # Shared heads being prefilled now, or prefilled and not yet stored, by the key of
        # their last block: turns that start the same way wait for them (or take them)
        # instead of prefilling the same tokens again.
        self.heads: dict[str, asyncio.Future[PromptCache | None]] = {}

    def _usable(self, tokens: list[int]) -> int:
        """Full blocks of ``tokens`` a prefix may cover (at least one token is left to
        prefill); 0 for a prompt over the context (it is refused: nothing is prefilled)."""
        limit = self._engine.model.max_context
        if limit and len(tokens) >= limit:
            return 0
        return (len(tokens) - 1) // self._layout.block_tokens

    async def stored(self, tokens: list[int], at_least: int) -> PromptCache | None:
        """Stored blocks for the start of ``tokens``, or a head another turn is storing now,
        longer than ``at_least`` tokens; None when there are none."""
        size = self._layout.block_tokens
        usable = self._usable(tokens)
        if usable * size <= at_least:
            return None
        keys = self._layout.keys(tokens[: usable * size])
        # Heads in flight before the lookup too: one may land while the registry is read.
        before = {n: head for n in range(usable, 0, -1) if (head := self.heads.get(keys[n - 1]))}
        stored = await self._stored(keys)
        for n in range(usable, stored, -1):  # a longer head is on its way: wait for it
            pending = self.heads.get(keys[n - 1]) or before.get(n)
            if n * size > at_least and pending is not None:  # noqa: SIM102 (awaits only then)
                if (cache := await asyncio.shield(pending)) is not None:
                    return cache
        if stored * size > at_least:
            return await self._load(tokens[: stored * size], keys[:stored])
        return None

    async def held(self, tokens: list[int]) -> int:
        """Tokens of the longest run of whole blocks of ``tokens`` stored for any cache, a
        window at its end or not (where a conversation stored before a restart parts from
        them)."""
        size = self._layout.block_tokens
        keys = await asyncio.to_thread(self._layout.keys, tokens[: self._usable(tokens) * size])
        if not keys:
            return 0
        known = await self._registry.caches.known_blocks(keys)
        return next((j for j, key in enumerate(keys) if key not in known), len(keys)) * size

    async def store_head(
        self,
        tokens: list[int],
        end: int,
        priority: float,
        start: PromptCache | None,
        points: tuple[int, ...] = (),
    ) -> Prefix:
        """Prefill the whole blocks of ``tokens[:end]`` (a shared head) after ``start`` (a
        cache of a prefix of them, left intact; None: from the first token) and store them as
        blocks plus a window, for the turns that follow; a turn storing the same head now is
        waited for instead. A ``start`` that ends where the whole blocks do (another
        conversation's snapshot there) is stored as it is. Returns ``start`` when there is no
        whole block more to store. ``points``: the shared heads' ends (see :meth:`extend`)."""
        size = self._layout.block_tokens
        n = min(end // size, self._usable(tokens))
        have = start.num_tokens if start else 0
        # (a request prefills one token at least)
        if n * size - have < 2 and not (have and have == n * size):
            return start, 0, None
        keys = self._layout.keys(tokens[: n * size])
        pending = self.heads.get(keys[-1])  # another turn began storing it meanwhile
        if pending is None:
            return await self._store_head(tokens[: n * size], keys, priority, start, points)
        if (cache := await asyncio.shield(pending)) is None:
            return start, 0, None  # it failed: go on from where this turn was
        return cache, 0, None

    async def extend(
        self,
        cache: PromptCache | None,
        tokens: list[int],
        priority: float,
        points: tuple[int, ...] = (),
    ) -> PromptCache | None:
        """The cache of ``tokens``: ``cache`` (of a prefix of them, left intact; None: none)
        and the rest prefilled alone, its last token forced so that the cache ends exactly
        there; None (logged) when that fails. ``cache``'s shared heads are carried on.
        ``points``: the shared heads' ends, where other turns may resume (the request's
        ``cache_points``: the positions after them compute as they do from there)."""
        rest = tokens[cache.num_tokens :] if cache else tokens
        if len(rest) < 2:  # a request prefills at least one token before the forced one
            return None
        request = GenerationRequest(
            rest[:-1],
            max_tokens=1,
            forced_token=rest[-1],
            priority=priority,
            cache=cache,
            cache_points=points,
        )
        result = await self._engine.generate(request)
        if result.is_error or result.cache is None or result.cache.tokens != tokens:
            log.warning("prefilling a shared head failed (%s)", result.error)
            return None
        return result.cache.checkpointed(cache, recent=False) if cache else result.cache

    async def _store_head(
        self,
        tokens: list[int],
        keys: list[str],
        priority: float,
        start: PromptCache | None,
        points: tuple[int, ...],
    ) -> Prefix:
        """Prefill a shared head after ``start`` alone (its last token forced, so the cache
        ends exactly at its last block) and store it as blocks plus a window."""
        future: asyncio.Future[PromptCache | None] = asyncio.get_running_loop().create_future()
        self.heads[keys[-1]] = future
        release = self._janitor.pin(keys)
        cache = None
        try:
            if start is not None and start.num_tokens == len(tokens):
                cache = start
            else:
                cache = await self.extend(start, tokens, priority, points)
            if cache is None:
                release()
                return start, 0, None
            self._store(cache, keys)
            return cache, cache.num_tokens - (start.num_tokens if start else 0), release
        except BaseException:
            release()
            raise
        finally:
            future.set_result(cache)
            self._forget_head(keys[-1], future)

    def _forget_head(self, key: str, future: asyncio.Future) -> None:
        """Stop offering a head's prefilled cache once its blocks are stored (a turn that
        read the registry before they landed takes the cache instead of prefilling again),
        at once when it failed."""

        def forget(_: object = None) -> None:
            if self.heads.get(key) is future:
                del self.heads[key]

        writing = self._storing.get(key)
        if future.result() is None or writing is None:
            forget()
        else:
            writing.add_done_callback(forget)

    async def _stored(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` (a chain) can be resumed from: the longest run of stored blocks
        from the first that ends at a block with a window file."""
        # A prefix being written now counts: wait for it rather than prefill it again.
        if writing := [task for key in keys if (task := self._storing.get(key))]:
            await asyncio.wait(writing)  # (unlike gather, a cancelled caller cancels nothing)
        known = await self._registry.caches.known_blocks(keys)
        run = next((j for j, key in enumerate(keys) if key not in known), len(keys))
        windows = [j for j in range(run) if known[keys[j]].window]
        for j in reversed(windows):  # a window removed as corrupt does not count
            if await asyncio.to_thread(self._layout.is_stored, keys[j], known, True):
                return j + 1
        return 0

    def _store(self, cache: PromptCache, keys: Sequence[str]) -> None:
        """Schedule storing a cache that ends at a block boundary as blocks plus a window, for
        caches that start the same way (``keys`` pinned first)."""
        task = self._writes.track(PREFIX_TASKS, self._store_logged(cache, keys))
        self._storing[keys[-1]] = task
        task.add_done_callback(lambda _: self._storing.pop(keys[-1], None))

    async def _store_logged(self, cache: PromptCache, keys: Sequence[str]) -> None:
        try:
            paged = await self._saver.encode(cache, keys)
            job = self._writes.submit(f"\x00prefix-{keys[-1]}", lambda: self._write(paged, keys))
            await asyncio.wrap_future(job)
        except Exception:
            log.exception("storing a shared prefix of %d blocks failed", len(keys))

    def _write(self, paged: PagedCache, keys: Sequence[str]) -> None:
        """On the writer thread: the new blocks, and the last one's window."""
        layout = self._layout
        known = self._writes.call(self._registry.caches.known_blocks(keys[-1:]))
        new_blocks, written = [], []
        try:
            new_blocks = self._saver.write_segments(paged, keys, written)
            last = keys[-1]
            if not layout.is_stored(last, known, window=True):
                info = self._saver.write_file(
                    layout.block_path(last, window=True), paged.tail, {"key": last}
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
            # Out of other workers' garbage collection while this one's turns save.
            self._writes.call(self._registry.caches.add_blocks(new_blocks, HEAD_KEEP_S))
        except BaseException:
            remove_all(written)
            raise
        self._stats.blocks_written += sum(1 for b in new_blocks if b.nbytes is not None)
        self._stats.bytes_written += sum(
            (b.nbytes or 0) + (b.window_nbytes or 0) for b in new_blocks
        )

    async def _load(self, tokens: Sequence[int], keys: Sequence[str]) -> PromptCache | None:
        """The cache of ``tokens`` (``len(keys)`` full blocks) from stored blocks and the last
        one's window, or None (logged) when they cannot be read."""
        release = self._janitor.pin(keys)  # kept through collection while they are read
        window = self._layout.block_path(keys[-1], window=True)
        try:
            cache = await self._loader.load_paged(window, list(keys), keys[-1], lambda meta: None)
        except (CacheUnusableError, OSError) as exc:
            log.warning("stored prefix of %d blocks unusable (%s); prefilling it", len(keys), exc)
            return None
        finally:
            release()
        if cache.tokens != list(tokens):
            log.warning("stored prefix holds other tokens than its keys say; prefilling it")
            return None
        return cache
