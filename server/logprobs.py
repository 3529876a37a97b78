"""Tokens' log probabilities in OpenAI's shape (Chat Completions ``logprobs.content`` and the
Responses API's ``output_text.logprobs``).

Each entry is a generated token: its text, its log probability under the model (the
log-softmax of the logits at its step, before sampling settings: see
``agentkv.engine.request.TokenLogprob``), its bytes (a token can hold part of a UTF-8 character;
its ``token`` text then shows U+FFFD) and the likeliest tokens at that step, most likely
first. End-of-sequence tokens are not listed: they are not part of the reply's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentkv import MAX_TOP_LOGPROBS, AgentRuntime, TokenLogprob
from agentkv.server.errors import APIError


def top_logprobs(logprobs: bool | None, top: int | None, field: str = "top_logprobs") -> int | None:
    """What a request asks of the engine: None (no logprobs), else how many alternatives.
    Raises APIError (400) for a ``top`` out of 0..20 or without ``logprobs``."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError.invalid(f"{field}: must be 0 to {MAX_TOP_LOGPROBS}, got {top}", field)
    if not logprobs:
        if top is not None:
            raise APIError.invalid(f"{field}: needs logprobs: true", field)
        return None
    return top or 0


async def logprob_content(
    runtime: AgentRuntime, logprobs: Sequence[TokenLogprob]
) -> list[dict[str, Any]]:
    """``logprobs`` as OpenAI's list of token entries (end-of-sequence tokens left out)."""
    eos = runtime.eos_token_ids
    shown = [lp for lp in logprobs if lp.token_id not in eos]
    if not shown:
        return []
    ids = sorted({lp.token_id for lp in shown} | {t for lp in shown for t, _ in lp.top})
    raw = dict(zip(ids, await runtime.token_bytes(ids), strict=True))

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        data = raw[token_id]
        return {"token": data.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(data)}

    return [
        entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in shown
    ]
