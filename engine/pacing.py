"""How many prompt tokens a step may prefill beside decoding sequences (stall-free prefill).

A step that decodes and prefills at once costs the decode rows plus the prompt tokens (the
weights are read once for both). Sized to the time a decode-only step takes, prefill chunks
keep every decoding sequence's inter-token gap bounded, the way Sarathi-Serve's token budget or
vLLM's chunked prefill do. A step that only prefills is cut to about ``max_prefill_step_s``
of work (at most ``prefill_step_size`` tokens): a turn that arrives meanwhile joins the batch
after that much, not after a whole chunk's time on slow hardware (512 tokens of a small model
take ~1.8 s on a 2-core CPU; on a GPU such a chunk is far below the bound and nothing changes).
"""

from __future__ import annotations

from agentkv.engine.config import EngineConfig

MIN_CHUNK = 16
MIN_PREFILL_ONLY = 64  # a prefill-only step's floor: below it each step's fixed cost shows
PACER_REFRESH_STEPS = 32  # a decode-only step every so often re-measures the decode time
EMA = 0.3


class PrefillPacer:
    """Sizes the prefill tokens of a step that also decodes, so decoding sequences'
    inter-token gap stays within ``stall_factor`` times their decode-only step time, and of one
    that only prefills, so it lasts about ``step_s``.

    It learns two figures from the steps it is told about: the time of a decode-only step and
    the time one prefill token adds to a step (which grows as a long prompt's chunks attend to
    more keys), and picks ``(stall_factor - 1) * decode_time / token_time`` tokens.
    """

    def __init__(self, config: EngineConfig):
        self.max_chunk = config.prefill_step_size
        self.stall_factor = config.max_decode_stall
        self.step_s = config.max_prefill_step_s  # a prefill-only step's time bound
        self.decode_s: float | None = None
        self.token_s: float | None = None  # added by one prefill token beside decoding
        self.prefill_token_s = 5e-4  # per prefill token in any step (queue estimates)
        self.alone_token_s: float | None = None  # per prefill token in a prefill-only step
        self.mixed_since_decode = 0
        self.last_budget = self.max_chunk

    def expected_seconds(self, prompt_tokens: int, new_tokens: int) -> float:
        """A rough time for a turn's work: its prompt's prefill and its tokens' decode."""
        return prompt_tokens * self.prefill_token_s + new_tokens * (self.decode_s or 0.05)

    def budget(self, decoding: bool) -> int:
        """Prefill tokens for the next step, with decoding sequences (0: decode only) or
        without."""
        if not decoding:
            return self._alone_budget()
        if self.decode_s is None or self.mixed_since_decode >= PACER_REFRESH_STEPS:
            return 0
        if self.token_s is None:
            self.last_budget = MIN_CHUNK
        else:
            chunk = (self.stall_factor - 1) * self.decode_s / max(self.token_s, 1e-9)
            self.last_budget = int(min(max(chunk, MIN_CHUNK), self.max_chunk))
        return self.last_budget

    def _alone_budget(self) -> int:
        """Prefill tokens for a step that decodes nothing: about ``step_s`` of work (until
        such steps were measured, at the cost a token had in any step)."""
        tokens = self.step_s / max(self.alone_token_s or self.prefill_token_s, 1e-9)
        return int(min(max(tokens, MIN_PREFILL_ONLY), self.max_chunk))

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        if prefill_tokens:
            self.prefill_token_s = _ema(self.prefill_token_s, seconds / prefill_tokens)
        if not decode_rows:
            if prefill_tokens:
                self.alone_token_s = _ema(self.alone_token_s, seconds / prefill_tokens)
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
