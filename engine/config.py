"""Engine limits, validated on construction, and the quantization group sizes ``mx.quantize``
takes (no MLX import here: configuration stays light)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts
# The group size a precision quantizes in unless told: 128 for q4 (values rotated; keys per
# channel in groups of KEY_GROUP_SIZE positions, ``agentkv.engine.kv.quant``) and q8 (keys rotated),
# 4.25 bits a q4 value and 0.516x the bytes of float16 at q8 (0.5625x in groups of 32); the
# research log (docs/research/kv-fidelity.md) has their fidelity. Unquantized caches record
# DEFAULT_GROUP_SIZE (it is not used).
DEFAULT_GROUP_SIZE = 32
GROUP_SIZE_BY_BITS = {8: 128, 4: 128}
# q4 keys per channel: the positions each channel's scale and bias cover, and the bits of
# each key's code. Keys cost q4 most of its fidelity. Five-bit codes over 32 positions take
# the bytes of four-bit codes over 16 (6 bits a key with its group's float16 scale and bias;
# 5.125 bits a value with values in groups of 128), and halve the step wherever a channel's
# range over 32 positions is its range over 16 (docs/research/kv-fidelity.md).
KEY_GROUP_SIZE = 32
KEY_BITS = 5
FALLBACK_GROUP_SIZES = (64, 32, 128)  # tried in this order after the preferred one


def group_size_for(bits: int | None, preferred: int | None = None) -> int:
    """The group size to quantize at ``bits`` in: ``preferred``, else the precision's own."""
    if preferred is not None:
        return preferred
    return GROUP_SIZE_BY_BITS.get(bits, DEFAULT_GROUP_SIZE)  # type: ignore[arg-type]


def choose_group_size(head_dim: int, preferred: int = 64) -> int | None:
    """The quantization group size for rows of ``head_dim``: ``preferred`` if it divides them,
    else the first of 64, 32, 128 that does; None when none does (store the layer unquantized).
    """
    for group_size in (preferred, *FALLBACK_GROUP_SIZES):
        if group_size in GROUP_SIZES and head_dim % group_size == 0:
            return group_size
    return None


class Policy(StrEnum):
    """How the engine shares its steps between turns (see ``agentkv.engine.scheduler``)."""

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
        kv_budget_bytes: KV memory the batch may hold, padding included. A turn joins when
            its history and prompt (and a growth beyond) fit beside the turns already in, and
            its reservation grows as it decodes (``agentkv.engine.scheduler``); one whose
            prompt could never fit is refused at once. None: a share of the device memory left
            after the weights (Apple: recommended working set; CUDA: free memory; CPU:
            available RAM).
        policy: ``fair``, ``latency_first`` or ``throughput_first``.
        max_decode_stall: while prompts prefill beside decoding turns (``fair`` and
            ``latency_first``), each step's prefill tokens are sized so a decoding turn's
            inter-token gap stays within this multiple of a decode-only step.
        max_prefill_step_s: a step that only prefills (nobody decoding; ``fair`` and
            ``latency_first``) holds about this many seconds of prompt tokens, as measured
            (between 64 and ``prefill_step_size``), so a turn that arrives while a long prompt
            prefills joins within about this long; where a whole ``prefill_step_size`` chunk
            takes less (a GPU), nothing changes.
        max_queue_size: waiting requests beyond this are refused with EngineOverloadedError.
        priority_aging_per_s: priority a waiting request gains per second of waiting.
        stats_window_s: window of the aggregate decode tok/s.
        batch_kv_bits: hold the layers' keys and values quantized in the running batch (8
            or 4; None: in the model's precision): q8 in groups of 128 is 0.52x the bytes of
            float16 (0.26x of float32; keys rotated), q4 0.32x and 0.16x (keys per channel
            in 5-bit codes over 32 positions, values rotated in 4-bit codes in groups of
            128), each plus a row's newest
            positions in float (see ``agentkv.engine.batch``), so the KV budget holds more
            long-history turns.
        batch_kv_group_size: its quantization group size (32, 64 or 128; q4: of the values,
            its keys' groups are :data:`KEY_GROUP_SIZE` positions; a layer whose heads it
            does not divide uses another that does, or stays unquantized). None: 128
            (:data:`GROUP_SIZE_BY_BITS`).
        cache_block_tokens: tokens per stored cache block (the runtime's ``kv_block_tokens``):
            a cache may start at any multiple of it, so a q8 batch reads no float copy across
            one (see ``agentkv.engine.batch.quantized.QuantizedLayer``). None: caches start only
            where turns joined and at their requests' ``cache_points``.
        speculative: ``"lookup"``: decoding sequences feed drafts taken from their own
            history, several tokens a step where the model restates it
            (``agentkv.engine.speculative``); ``"draft"``: those, and where the history has
            none, the draft model's (``draft_model``, ``agentkv.engine.drafter``); ``"off"``:
            one token a step.
        speculative_tokens: the most drafts a sequence feeds in one step.
        draft_model: the draft model (``speculative="draft"``): a spec as the main model's
            (a Hugging Face id, a local directory, ``tiny:<name>``), of the same tokenizer,
            much smaller, attention layers only.
        draft_cache_bytes: draft KVs of finished turns kept for their conversations' next
            turns (``agentkv.engine.drafter``; least recently used dropped first).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    completion_batch_size: int = Field(default=16, ge=1, le=1024)
    prefill_batch_size: int = Field(default=8, ge=1, le=1024)
    prefill_step_size: int = Field(default=512, ge=16, le=65536)
    kv_budget_bytes: int | None = Field(default=None, ge=1)
    policy: Policy = Policy.FAIR
    max_decode_stall: float = Field(default=2.0, ge=1.1, le=100.0)
    max_prefill_step_s: float = Field(default=0.5, gt=0.0, le=3600.0)
    max_queue_size: int = Field(default=1024, ge=1)
    priority_aging_per_s: float = Field(default=0.1, ge=0.0)
    stats_window_s: float = Field(default=10.0, gt=0.0)
    batch_kv_bits: Literal[8, 4] | None = None
    batch_kv_group_size: Literal[32, 64, 128] | None = None
    cache_block_tokens: int | None = Field(default=None, ge=1)
    speculative: Literal["off", "lookup", "draft"] = "lookup"
    speculative_tokens: int = Field(default=8, ge=1, le=64)
    draft_model: str | None = Field(default=None, min_length=1)
    draft_cache_bytes: int = Field(default=512 * 2**20, ge=0)

    @property
    def batch_group_size(self) -> int:
        """The batch's quantization group size: ``batch_kv_group_size``, else its bits'."""
        return group_size_for(self.batch_kv_bits, self.batch_kv_group_size)

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
    def _draft_model_given(self) -> EngineConfig:
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError(
                "speculative='draft' needs a draft_model, and a draft_model needs "
                f"speculative='draft' (got speculative={self.speculative!r}, "
                f"draft_model={self.draft_model!r})"
            )
        return self

    @model_validator(mode="after")
    def _prefill_fits(self) -> EngineConfig:
        if self.prefill_batch_size > self.completion_batch_size:
            raise ValueError(
                f"prefill_batch_size ({self.prefill_batch_size}) cannot exceed "
                f"completion_batch_size ({self.completion_batch_size})"
            )
        return self
