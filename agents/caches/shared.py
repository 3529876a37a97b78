"""What the cache store's parts share: one layout, registry, engine, writer and DiskStats."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.caches.layout import CacheLayout
from agentkv.caches.stats import DiskStats
from agentkv.caches.writes import Writes
from agentkv.engine.engine import Engine
from agentkv.store import Registry


@dataclass(slots=True, frozen=True)
class Shared:
    layout: CacheLayout
    registry: Registry
    engine: Engine
    writes: Writes
    stats: DiskStats


class Part:
    """A part of the cache store (saver, loader, janitor, prefixes), over what they share."""

    def __init__(self, shared: Shared):
        self._layout = shared.layout
        self._registry = shared.registry
        self._engine = shared.engine
        self._writes = shared.writes
        self._stats = shared.stats
