"""How many prompt tokens a step may prefill beside decoding sequences (stall-free prefill).

A step that decodes and prefills at once costs the decode rows plus the prompt tokens (the
weights are read once for both). Sized to the time a decode-only step takes, prefill chunks
keep every decoding sequence's inter-token gap bounded, the way Sarathi-Serve's token budget or
vLLM's chunked prefill do, while a prompt alone still prefills in whole ``prefill_step_size``
chunks.
"""

from __future__ import annotations

MIN_CHUNK = 16
PACER_REFRESH_STEPS = 32  # a decode-only step every so often re-measures the decode time
EMA = 0.3


class PrefillPacer:
    """Sizes the prefill tokens of a step that also decodes, so decoding sequences'
    inter-token gap stays within ``stall_factor`` times their decode-only step time.

    It learns two figures from the steps it is told about: the time of a decode-only step and
    the time one prefill token adds to a step (which grows as a long prompt's chunks attend to
    more keys), and picks ``(stall_factor - 1) * decode_time / token_time`` tokens.
    """

    def __init__(self, max_chunk: int, stall_factor: float):
        self.max_chunk = max_chunk
        self.stall_factor = stall_factor
        self.decode_s: float | None = None
        self.token_s: float | None = None  # added by one prefill token beside decoding
        self.prefill_token_s = 5e-4  # per prefill token in any step (queue estimates)
        self.mixed_since_decode = 0
        self.last_budget = max_chunk

    def expected_seconds(self, prompt_tokens: int, new_tokens: int) -> float:
        """A rough time for a turn's work: its prompt's prefill and its tokens' decode."""
        return prompt_tokens * self.prefill_token_s + new_tokens * (self.decode_s or 0.05)

    def budget(self) -> int:
        """Prefill tokens for the next step with decoding sequences (0: decode only)."""
        if self.decode_s is None or self.mixed_since_decode >= PACER_REFRESH_STEPS:
            return 0
        if self.token_s is None:
            self.last_budget = MIN_CHUNK
        else:
            chunk = (self.stall_factor - 1) * self.decode_s / max(self.token_s, 1e-9)
            self.last_budget = int(min(max(chunk, MIN_CHUNK), self.max_chunk))
        return self.last_budget

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        if prefill_tokens:
            self.prefill_token_s = _ema(self.prefill_token_s, seconds / prefill_tokens)
        if not decode_rows:
            return
        if not prefill_tokens:
            self.decode_s = _ema(self.decode_s, seconds)
            self.mixed_since_decode = 0
            return
        self.mixed_since_decode += 1
        if self.decode_s is not None:
            added = max(seconds - self.decode_s, 0.0) / prefill_tokens
            self.token_s = _ema(self.token_s, added)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)
