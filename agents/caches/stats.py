"""What the cache store has done, counted by the store alone (the runtime reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentkv.store import DiskUsage


@dataclass(slots=True)
class DiskStats:
    """Counters since the store opened, and the files as last counted.

    Attributes:
        saved: caches saved.
        load_failures: saved caches found unusable (their agents were rebuilt).
        evictions: caches evicted for the disk budget.
        blocks_written: blocks written (new to the store).
        blocks_shared: blocks a save found already stored.
        bytes_written: bytes of the blocks, windows and tails written.
        prefix_lookups: turns that looked for another conversation's cache to start from (no
            cache of their own, or one sharing less with the prompt).
        prefix_hits: of those, the ones that started from one (stored blocks, a shared head
            being prefilled, a cache in memory).
        prefix_tokens: tokens taken from them instead of prefilled.
        usage: the files' bytes, count and blocks, as last counted.
    """

    saved: int = 0
    load_failures: int = 0
    evictions: int = 0
    blocks_written: int = 0
    blocks_shared: int = 0
    bytes_written: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_tokens: int = 0
    usage: DiskUsage = field(default_factory=lambda: DiskUsage(0, 0, 0))
