"""Engine limits, validated on construction."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Policy(StrEnum):
    """How the engine shares its steps between turns (see ``engine.scheduler``)."""

    FAIR = "fair"
    LATENCY_FIRST = "latency_first"
    THROUGHPUT_FIRST = "throughput_first"


class EngineConfig(BaseModel):
    """Continuous-batching limits.

    Attributes:
        completion_batch_size: most sequences in the batch together.
        prefill_batch_size: most of them prefilling their prompts at once (default: 8, or
            completion_batch_size when that is smaller).
        prefill_step_size: most prompt tokens of one sequence in one step.
        kv_budget_bytes: KV memory the batch may hold, padding included. A turn joins only
            when its history + prompt + max_tokens fit beside the turns already in; one that
            could never fit is refused at once. None: a share of the device memory left after
            the weights (Apple: recommended working set; CUDA: free memory; CPU: available RAM).
        policy: ``fair``, ``latency_first`` or ``throughput_first``.
        max_decode_stall: while prompts prefill beside decoding turns (``fair`` and
            ``latency_first``), each step's prefill tokens are sized so a decoding turn's
            inter-token gap stays within this multiple of a decode-only step.
        max_queue_size: waiting requests beyond this are refused with EngineOverloadedError.
        priority_aging_per_s: priority a waiting request gains per second of waiting.
        stats_window_s: window of the aggregate decode tok/s.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    completion_batch_size: int = Field(default=16, ge=1, le=1024)
    prefill_batch_size: int = Field(default=8, ge=1, le=1024)
    prefill_step_size: int = Field(default=512, ge=16, le=65536)
    kv_budget_bytes: int | None = Field(default=None, ge=1)
    policy: Policy = Policy.FAIR
    max_decode_stall: float = Field(default=2.0, ge=1.1, le=100.0)
    max_queue_size: int = Field(default=1024, ge=1)
    priority_aging_per_s: float = Field(default=0.1, ge=0.0)
    stats_window_s: float = Field(default=10.0, gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _default_prefill_batch(cls, data: object) -> object:
        if isinstance(data, dict) and "prefill_batch_size" not in data:
            try:
                completion = int(data.get("completion_batch_size", 16))
            except (TypeError, ValueError):
                return data  # the field's own validation names it
            if 1 <= completion < 8:
                return {**data, "prefill_batch_size": completion}
        return data

    @model_validator(mode="after")
    def _prefill_fits(self) -> EngineConfig:
        if self.prefill_batch_size > self.completion_batch_size:
            raise ValueError(
                f"prefill_batch_size ({self.prefill_batch_size}) cannot exceed "
                f"completion_batch_size ({self.completion_batch_size})"
            )
        return self
