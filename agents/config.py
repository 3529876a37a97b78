"""RuntimeConfig: one validated object for everything AgentRuntime.open needs."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.config import EngineConfig
from engine.kv.encoded import DEFAULT_BLOCK_TOKENS, DEFAULT_GROUP_SIZE


class RuntimeConfig(BaseModel):
    """How to run agentkv.

    Attributes:
        model: ``tiny:<name>`` or a local mlx-lm model directory.
        data_dir: holds ``agentkv.sqlite`` and ``caches/`` unless overridden.
        db_url: SQLAlchemy URL or SQLite path overriding ``data_dir/agentkv.sqlite``.
        cache_dir: overrides ``data_dir/caches``.
        kv_bits: quantization of caches saved to disk: None (exact), 8 or 4.
        kv_group_size: preferred quantization group size; a layer whose head size it does not
            divide uses 64, 32 or 128, whichever divides it, or is saved unquantized.
        hot_cache_bytes: memory budget for recently used agents' unquantized caches.
        disk_budget_bytes: when the cache files exceed it, the caches of the agents idle
            longest are evicted (their transcripts stay; they are rebuilt when they speak).
            None: no budget.
        kv_block_tokens: tokens per stored block. Caches are saved as blocks shared by every
            agent whose tokens start alike, plus a small per-agent tail; a turn writes only its
            new blocks and the tail.
        share_prefixes: a new agent (or one rebuilding) whose prompt starts with stored blocks
            resumes from them; when its system prompt (and tools) span a block and are not
            stored yet, it prefills them first and stores them for the agents that follow.
        default_max_tokens: max_tokens of a turn when the call does not say.
        engine: the batch: its limits, KV memory budget and scheduling policy (EngineConfig).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    data_dir: Path = Path("data")
    db_url: str | None = None
    cache_dir: Path | None = None
    kv_bits: Literal[8, 4] | None = 8
    kv_group_size: Literal[32, 64, 128] = DEFAULT_GROUP_SIZE
    hot_cache_bytes: int = Field(default=2 * 1024**3, ge=0)
    disk_budget_bytes: int | None = Field(default=None, ge=0)
    kv_block_tokens: int = Field(default=DEFAULT_BLOCK_TOKENS, ge=16, le=65536)
    share_prefixes: bool = True
    default_max_tokens: int = Field(default=512, ge=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @property
    def database(self) -> str:
        return self.db_url or str(self.data_dir / "agentkv.sqlite")

    @property
    def caches_path(self) -> Path:
        return self.cache_dir or self.data_dir / "caches"
