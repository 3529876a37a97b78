"""Engine limits, validated on construction."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    """Continuous-batching limits.

    Attributes:
        completion_batch_size: most sequences decoding together.
        prefill_batch_size: most sequences prefilling together (joins alongside decoding).
        prefill_step_size: prompt tokens processed per model call during prefill.
        max_queue_size: waiting requests beyond this are refused with EngineOverloadedError.
        priority_aging_per_s: priority a waiting request gains per second of waiting.
        stats_window_s: window of the aggregate decode tok/s.
        solo_fast_path: run a request that is alone outside the batch (faster at batch size
            1); it joins the batch as soon as another request arrives.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    completion_batch_size: int = Field(default=16, ge=1, le=1024)
    prefill_batch_size: int = Field(default=8, ge=1, le=1024)
    prefill_step_size: int = Field(default=512, ge=16, le=65536)
    max_queue_size: int = Field(default=1024, ge=1)
    priority_aging_per_s: float = Field(default=0.1, ge=0.0)
    stats_window_s: float = Field(default=10.0, gt=0.0)
    solo_fast_path: bool = True

    @model_validator(mode="after")
    def _prefill_fits(self) -> EngineConfig:
        if self.prefill_batch_size > self.completion_batch_size:
            raise ValueError(
                f"prefill_batch_size ({self.prefill_batch_size}) cannot exceed "
                f"completion_batch_size ({self.completion_batch_size})"
            )
        return self
