"""A finished turn as its Reply (the answer apart from a reasoning model's thinking, the
usage, the timings) and the one log line each turn writes."""

from __future__ import annotations

import logging
import time

from agentkv.engine.request import GenerationResult
from agentkv.reasoning import ReasoningFormat
from agentkv.types import Reply, Timings, TurnPlan, Usage

log = logging.getLogger("agentkv.turns")  # (the turn's line, where operators look for it)


def finished_reply(
    agent_id: str,
    plan: TurnPlan,
    result: GenerationResult,
    started: float,
    reasoning: ReasoningFormat | None,
    opened: bool,
) -> Reply:
    """The Reply of a turn that ran ``plan`` and generated ``result`` (``started``: when the
    turn began, ``time.perf_counter``; ``opened``: the prompt left the thinking open)."""
    s = result.stats
    # (a reply that restates a part of its prediction twice keeps drafts of it twice)
    predicted = min(s.accepted_prediction_tokens, s.prediction_tokens)
    resumed = plan.cache.num_tokens if plan.cache else 0
    cached = resumed - plan.fresh  # a head this turn prefilled itself is not cached
    thinking, text, thought = "", result.text, 0
    if reasoning is not None:
        thinking, text = reasoning.split(result.text, opened)
        thought = reasoning.tokens_of(result.token_ids, opened)
    return Reply(
        agent_id=agent_id,
        text=text,
        reasoning=thinking,
        token_ids=list(result.token_ids),
        finish_reason=str(result.finish_reason),
        usage=Usage(
            resumed + len(plan.prompt_tokens),
            cached,
            len(result.token_ids),
            thought,
            predicted,
            s.prediction_tokens - predicted,
        ),
        cache_source=plan.source,
        timings=Timings(
            cache_load_s=plan.load_s,
            queue_s=s.queue_wait_s or 0.0,
            prefill_s=s.prefill_s or 0.0,
            ttft_s=(s.first_token_at or s.submitted_at) - started,
            decode_s=s.decode_s or 0.0,
            total_s=time.perf_counter() - started,
            decode_tps=s.decode_tps,
            drafted_tokens=s.drafted_tokens,
            accepted_tokens=s.accepted_tokens,
        ),
        stop_sequence=result.stop_sequence,
        logprobs=result.logprobs,
    )


def log_turn(reply: Reply) -> None:
    """One line per turn: where its cache came from and what it cost (a miss shows here)."""
    usage, timings = reply.usage, reply.timings
    drafts = ""
    if timings.drafted_tokens:
        drafts = f" ({timings.accepted_tokens} of {timings.drafted_tokens} drafts kept)"
    log.info(
        "agent %r: cache %s, prompt %d tokens (%d cached, %d prefilled), %d generated, "
        "ttft %.3f s, decode %.1f tok/s%s",
        reply.agent_id,
        reply.cache_source,
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.prompt_tokens - usage.cached_tokens,
        usage.completion_tokens,
        timings.ttft_s,
        timings.decode_tps or 0.0,
        drafts,
    )
