"""RuntimeConfig: one validated object for everything AgentRuntime.open needs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentkv.engine.config import EngineConfig, group_size_for
from agentkv.engine.kv.encoded import DEFAULT_BLOCK_TOKENS

# hot_cache_bytes="auto": this share of the physical memory, at most HOT_CACHE_MAX_BYTES (the
# fallback where the platform does not say how much memory it has).
HOT_CACHE_SHARE = 0.10
HOT_CACHE_MAX_BYTES = 4 * 1024**3
HOT_CACHE_FALLBACK_BYTES = 2 * 1024**3
DISK_BUDGET_SHARE = 0.25
"""``disk_budget_bytes="auto"``: this share of the space the cache directory may take when the
runtime opens (what is free on its filesystem plus what its files hold already, so that a
restart does not shrink the budget below what was stored)."""

Bytes = Annotated[int, Field(ge=0)]
WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"


class RuntimeConfig(BaseModel):
    """How to run agentkv.

    Attributes:
        model: a Hugging Face id (``org/name[@revision]``), a local mlx-lm model directory,
            ``gemma3-270m`` or ``tiny:<name>``
            (``agentkv.models.directory.resolve_model_path``).
        data_dir: holds ``agentkv.sqlite`` and ``caches/`` unless overridden.
        db_url: SQLAlchemy URL or SQLite path overriding ``data_dir/agentkv.sqlite``.
        cache_dir: overrides ``data_dir/caches``.
        kv_bits: quantization of caches saved to disk: None (exact), 8 or 4.
        batch_kv_bits: quantization of the KV held in memory, in the running batch and the hot
            tier: None (the model's precision), 8 or 4 (``EngineConfig.batch_kv_bits``, which
            this sets; the two cannot disagree). When both are 8 (and the group sizes agree),
            caches go from disk to the batch and back without a dequantize: the stored bytes
            never drift across resumes. (At 4 bits the batch holds keys per channel as q4
            files do, and its newest positions in float: a q4 file joins as stored, but a q4
            row is expanded on its way to a file and quantized again there.)
        kv_group_size: preferred quantization group size; a layer whose head size it does not
            divide uses 64, 32 or 128, whichever divides it, or is saved unquantized (q4: of
            the values; keys are per channel over ``agentkv.engine.config.KEY_GROUP_SIZE``
            positions, in ``KEY_BITS``-bit codes). None: 128 (keys rotated at 8 bits, values
            at 4), as the batch quantizes (``agentkv.engine.config.GROUP_SIZE_BY_BITS``).
        hot_cache_bytes: memory budget for recently used agents' caches, held as the batch
            held them (quantized with ``batch_kv_bits``). "auto":
            ``HOT_CACHE_SHARE`` (10%) of the physical memory, at most ``HOT_CACHE_MAX_BYTES``
            (4 GiB), measured when the runtime opens.
        disk_budget_bytes: when the cache files exceed it, the caches of the agents idle
            longest are evicted (their transcripts stay; they are rebuilt when they speak).
            "auto": ``DISK_BUDGET_SHARE`` (25%) of the free space of the cache directory's
            filesystem plus what the cache files hold, measured when the runtime opens.
            None: no budget.
        kv_block_tokens: tokens per stored block. Caches are saved as blocks shared by every
            agent whose tokens start alike, plus a small per-agent tail; a turn writes only its
            new blocks and the tail.
        share_prefixes: a new agent (or one rebuilding) whose prompt starts with stored blocks
            resumes from them; when its system prompt (and tools) span a block and are not
            stored yet, it prefills them first and stores them for the agents that follow.
        speculative: ``"lookup"``: replies feed drafts from the agent's own history, several
            tokens a step where they restate it (the same tokens greedy, the same
            distribution sampled: ``agentkv.engine.speculative``); ``"draft"``: those, and
            where the history has none, ``draft_model``'s (``agentkv.engine.drafter``);
            ``"off"``: one a step; None (the default): ``"draft"`` when a ``draft_model`` is
            given, else ``"lookup"``.
        draft_model: a small model of the same tokenizer drafting replies' next tokens (a
            Hugging Face id, a local directory, ``tiny:<name>``; attention layers only).
        default_max_tokens: max_tokens of a turn when the call does not say; None (the
            default): a turn runs until the model stops or its context (or the KV budget, for
            it alone) is full, as OpenAI's API does without ``max_tokens``.
        engine: the batch: its limits, KV memory budget and scheduling policy (EngineConfig).
        worker_id: this process's name among the workers sharing a registry (``agentkv serve
            --worker-id``): leases, logs, ``/ready`` and the ``x-agentkv-worker`` header name
            it. One live process runs as an id (a lock file under ``data_dir/workers``), so a
            worker restarted with its id takes its leases back at once. None: the first free
            ``<hostname>-<dir>-<n>`` on ``data_dir`` (``dir``: six hex digits of its path; a
            lone worker restarted is ``...-0`` again).
        lease_s: seconds an agent's lease outlives a worker that stops renewing it (a crashed
            or partitioned worker's agents pass to another worker after this long); renewed
            every third of it while held.
        sweep_grace_s: the sweep of the cache directory at open removes files no registry
            entry lists (left by a crash mid-save) only once they are this old: a worker
            sharing the directory may be between writing a file and recording it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    data_dir: Path = Path("data")
    db_url: str | None = None
    cache_dir: Path | None = None
    kv_bits: Literal[8, 4] | None = 8
    kv_group_size: Literal[32, 64, 128] | None = None
    batch_kv_bits: Literal[8, 4] | None = None
    hot_cache_bytes: Bytes | Literal["auto"] = "auto"
    disk_budget_bytes: Bytes | Literal["auto"] | None = "auto"
    kv_block_tokens: int = Field(default=DEFAULT_BLOCK_TOKENS, ge=16, le=65536)
    share_prefixes: bool = True
    speculative: Literal["off", "lookup", "draft"] | None = None
    draft_model: str | None = Field(default=None, min_length=1)
    default_max_tokens: int | None = Field(default=None, ge=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    worker_id: str | None = Field(default=None, pattern=WORKER_ID_PATTERN)
    lease_s: float = Field(default=10.0, gt=0.5, le=3600)
    sweep_grace_s: float = Field(default=3600.0, ge=0)  # agents.caches.janitor.SWEEP_GRACE_S

    @model_validator(mode="after")
    def _one_batch_kv_bits(self) -> RuntimeConfig:
        mine, engine = self.batch_kv_bits, self.engine.batch_kv_bits
        if mine is not None and engine is not None and mine != engine:
            raise ValueError(
                f"batch_kv_bits ({mine}) and engine.batch_kv_bits ({engine}) disagree; set one"
            )
        return self

    @model_validator(mode="after")
    def _draft_model_given(self) -> RuntimeConfig:
        draft = self.draft_model or self.engine.draft_model
        mode = self.speculative or ("draft" if self.draft_model else self.engine.speculative)
        if (mode == "draft") != (draft is not None):
            raise ValueError(
                "speculative='draft' needs a draft_model, and a draft_model needs "
                f"speculative='draft' (got speculative={mode!r}, draft_model={draft!r})"
            )
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: ``engine`` with ``batch_kv_bits`` (set here or there),
        quantizing in ``kv_group_size`` (when given) unless ``EngineConfig.batch_kv_group_size`` was
        given, so the words a cache file stores are the batch's; its stored blocks'
        ``kv_block_tokens`` are where the batch's caches may start (``cache_block_tokens``)."""
        update: dict[str, object] = {}
        if self.batch_kv_bits is not None:
            update["batch_kv_bits"] = self.batch_kv_bits
        if "batch_kv_group_size" not in self.engine.model_fields_set:
            update["batch_kv_group_size"] = self.kv_group_size
        if "cache_block_tokens" not in self.engine.model_fields_set:
            update["cache_block_tokens"] = self.kv_block_tokens
        if self.speculative is not None:
            update["speculative"] = self.speculative
        if self.draft_model is not None:
            update["draft_model"] = self.draft_model
            update.setdefault("speculative", "draft")
        return EngineConfig.model_validate(self.engine.model_dump() | update)

    @property
    def disk_group_size(self) -> int:
        """The cache files' quantization group size: ``kv_group_size``, else ``kv_bits``'."""
        return group_size_for(self.kv_bits, self.kv_group_size)

    @property
    def database(self) -> str:
        return self.db_url or str(self.data_dir / "agentkv.sqlite")

    @property
    def caches_path(self) -> Path:
        return self.cache_dir or self.data_dir / "caches"

    def resolved(self) -> RuntimeConfig:
        """This config with its "auto" budgets measured now (itself when there are none):
        ``AgentRuntime.open`` runs with the resolved config, ``runtime.config``."""
        update: dict[str, int] = {}
        if self.hot_cache_bytes == "auto":
            update["hot_cache_bytes"] = default_hot_cache_bytes()
        if self.disk_budget_bytes == "auto":
            update["disk_budget_bytes"] = default_disk_budget_bytes(self.caches_path)
        return self.model_copy(update=update) if update else self


def default_hot_cache_bytes() -> int:
    """``HOT_CACHE_SHARE`` of the physical memory, at most ``HOT_CACHE_MAX_BYTES``."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a platform without these names
        return HOT_CACHE_FALLBACK_BYTES
    return min(int(memory * HOT_CACHE_SHARE), HOT_CACHE_MAX_BYTES)


def default_disk_budget_bytes(cache_dir: Path) -> int:
    """``DISK_BUDGET_SHARE`` of the space free on ``cache_dir``'s filesystem plus the bytes of
    the files under it (which need not exist yet)."""
    existing = next(p for p in (cache_dir, *cache_dir.absolute().parents) if p.exists())
    free = shutil.disk_usage(existing).free
    return int(DISK_BUDGET_SHARE * (free + _bytes_under(cache_dir)))


def _bytes_under(root: Path) -> int:
    """Bytes of the regular files under ``root``, a hard-linked file (a fork's tail) once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                stat = os.lstat(os.path.join(directory, name))
            except OSError:  # removed meanwhile
                continue
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total
