"""What ``benchmarks.bench_gpu`` runs with: one :class:`Sizes` per mode.

``FULL`` is sized for one accelerator (an NVIDIA H200 or a large Apple GPU) and a Gemma 3
12B-shaped model, the whole run within ``budget_s`` wall seconds, model build included;
``QUICK`` is a smoke run of the same parts on a CPU (the tiny float32 Gemma 3, a few tokens).
Each part reads only the fields named after it (``batching_*`` for ``batching``, ...), and its
JSON records exactly those.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Sizes:
    """The model and every part's sizes for one mode."""

    model: str
    budget_s: float | None
    """Wall seconds from the start of the process (the build included) after which no part
    starts and a part's loop stops between its steps; None: no limit."""
    rounds: int
    """Rounds of batching, batch_kv and mixed: all but the last warm kernels (a GPU compiles
    them at a shape's first use); the last is reported."""
    batching_ns: tuple[int, ...]
    batching_tokens: int
    batching_prompt: int
    batch_kv_shapes: tuple[tuple[int, int], ...]
    """(agents, history tokens) of each batch timed per precision of KV in the batch."""
    batch_kv_tokens: int
    mixed_shorts: int
    mixed_short_history: int
    mixed_long_history: int
    mixed_tokens: int
    resume_histories: tuple[int, ...]
    resume_kv_bits: tuple[str, ...]
    """``benchmarks.bench_blocks.KV_BITS`` names: "none" is the like-for-like one against
    raw mlx-lm (both files exact)."""
    resume_repeats: int
    prefill_decoders: int
    prefill_decoder_history: int
    prefill_prompt: int
    prefill_warmup: int
    prefill_stalls: tuple[float, ...]
    speculative_ns: tuple[int, ...]
    speculative_prompt: int
    speculative_tokens: int
    speculative_wrong: int
    """One draft in this many is changed (so some are rejected)."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")
        if self.budget_s is not None and self.budget_s < 0:
            raise ValueError(f"budget_s must be None or at least 0, got {self.budget_s}")

    def of(self, part: str) -> dict:
        """The fields one part runs with, by their names without the part's prefix."""
        prefix = f"{part}_"
        return {k.removeprefix(prefix): v for k, v in asdict(self).items() if k.startswith(prefix)}


FULL = Sizes(
    model="tiny:gemma3-12b",
    budget_s=420.0,
    rounds=2,
    batching_ns=(1, 2, 4, 8, 16, 32),
    batching_tokens=48,
    batching_prompt=64,
    batch_kv_shapes=((4, 8192), (16, 2048)),
    batch_kv_tokens=32,
    mixed_shorts=7,
    mixed_short_history=256,
    mixed_long_history=32_768,
    mixed_tokens=48,
    resume_histories=(4096, 16_384),
    resume_kv_bits=("none",),
    resume_repeats=3,
    prefill_decoders=8,
    prefill_decoder_history=256,
    prefill_prompt=8192,
    prefill_warmup=32,
    prefill_stalls=(2.0,),
    speculative_ns=(1, 8),
    speculative_prompt=256,
    speculative_tokens=64,
    speculative_wrong=8,
)

QUICK = Sizes(
    model="tiny:gemma3",
    budget_s=None,
    rounds=2,
    batching_ns=(1, 2, 4),
    batching_tokens=8,
    batching_prompt=16,
    batch_kv_shapes=((2, 512), (4, 128)),
    batch_kv_tokens=6,
    mixed_shorts=3,
    mixed_short_history=20,
    mixed_long_history=400,
    mixed_tokens=8,
    resume_histories=(600,),
    resume_kv_bits=("none",),
    resume_repeats=1,
    prefill_decoders=3,
    prefill_decoder_history=20,
    prefill_prompt=600,
    prefill_warmup=8,
    prefill_stalls=(2.0,),
    speculative_ns=(1, 2),
    speculative_prompt=32,
    speculative_tokens=12,
    speculative_wrong=4,
)
