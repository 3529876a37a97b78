"""The parts of ``benchmarks.bench_gpu``, most valuable first, each over the functions of the
benchmark it comes from (``bench_batching``, ``bench_mixed``, ``bench_blocks``,
``bench_prefill``; ``bench_budget``'s precisions and ``benchmarks.synthetic``'s caches).

A part is ``async def part(ctx: Context) -> None``: it opens its own engines or runtimes on
``ctx.model`` (and closes them), reads its sizes from ``ctx.sizes.of(name)`` and fills
``ctx.report`` as it goes, ``rows`` first and ``ratios`` last, so a part that fails midway
leaves what it measured. Every ratio is between two figures taken in the same run, in the same
process, on the same model. A loop over sizes stops between its steps once ``ctx.deadline``
has passed (``cut_short``: True). A part not written yet raises :class:`PartPending`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.meter import StepRecord
from agentkv.engine.request import GenerationRequest
from agentkv.engine.speculative import Speculation
from benchmarks import bench_blocks, bench_mixed, bench_prefill
from benchmarks.bench_batching import engine_batch, make_prompts, raw_batch
from benchmarks.bench_budget import PRECISIONS
from benchmarks.gpu_sizes import Sizes
from benchmarks.synthetic import synthetic_cache


class PartPending(Exception):
    """The part is a slot that a later change fills; the run records it as "pending"."""


@dataclass(slots=True)
class Context:
    """What a part runs on and where it reports."""

    model: str
    sizes: Sizes
    scratch: Path
    """A directory of the run's own (removed at its end)."""
    deadline: float | None
    """``time.perf_counter()`` after which loops stop between steps; None: no limit."""
    log: Callable[[str], None]
    report: dict = field(default_factory=dict)

    def out_of_time(self) -> bool:
        if self.deadline is None or time.perf_counter() < self.deadline:
            return False
        self.report["cut_short"] = True
        return True


async def batching(ctx: Context) -> None:
    """Aggregate decode tok/s (``bench_batching``'s measure: N prompts, each to ``tokens``,
    end-of-sequence ignored) of agentkv's engine and of mlx-lm's ``BatchGenerator`` on the
    engine's generation thread, per N. Ratios: ``engine_vs_raw[N]``, of the last round."""
    s = ctx.sizes.of("batching")
    top = max(s["ns"])
    config = EngineConfig(
        completion_batch_size=top, prefill_batch_size=min(8, top), speculative="off"
    )
    eng = await Engine.open(ctx.model, config)
    rows = ctx.report["rows"] = []
    try:
        for n in s["ns"]:
            if ctx.out_of_time():
                break
            prompts = make_prompts(eng.model.vocab_size, n, s["prompt"])
            rounds = []
            for _ in range(ctx.sizes.rounds):
                raw = await eng.run(raw_batch, eng, prompts, s["tokens"])
                engine = await engine_batch(eng, prompts, s["tokens"])
                rounds.append(
                    {"engine_tps": n * s["tokens"] / engine, "raw_tps": n * s["tokens"] / raw}
                )
            last = rounds[-1]
            ratio = last["engine_tps"] / last["raw_tps"]
            rows.append({"n": n, **last, "engine_vs_raw": ratio, "warm_rounds": rounds[:-1]})
            ctx.log(
                f"batching N={n}: engine {last['engine_tps']:.1f} tok/s, BatchGenerator "
                f"{last['raw_tps']:.1f} tok/s, engine/raw {ratio:.3f}"
            )
    finally:
        await eng.close()
    ctx.report["ratios"] = {"engine_vs_raw": {str(r["n"]): r["engine_vs_raw"] for r in rows}}


async def decode_rate(eng: Engine, agents: int, history: int, tokens: int) -> dict:
    """``agents`` agents with ``history``-token synthetic caches ask for ``tokens`` each at
    once: ``decode_tps`` is the median over the steps in which every one of them decoded and
    nothing prefilled (rows / the step's gap, as ``bench_budget`` measures it), free of joins
    and of a kernel's first compilation."""
    vocab = eng.model.vocab_size
    requests = []
    for i in range(agents):
        cache = await eng.run(synthetic_cache, eng.model.model, history, i, vocab)
        request = GenerationRequest(
            [20 + i], max_tokens=tokens, ignore_eos=True, cache=cache, return_cache=False
        )
        requests.append(request)
    steps: list[StepRecord] = []
    remove = eng.add_step_listener(steps.append)
    start = time.perf_counter()
    try:
        results = await asyncio.gather(*(eng.generate(r) for r in requests))
    finally:
        remove()
    wall = time.perf_counter() - start
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} of {agents} agents failed: {errors[0]!r}")
    full = [
        s
        for s in steps
        if s.decode_rows == agents and not (s.prefill_tokens or s.prefilling) and s.gap_s > 0
    ]
    if not full:
        raise RuntimeError(f"no step decoded all {agents} agents alone")
    return {
        "decode_tps": statistics.median(s.decode_rows / s.gap_s for s in full),
        "decode_steps": len(full),
        "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
        "kv_held_mb": max(s.kv_held_bytes for s in steps) / 2**20,
    }


async def batch_kv(ctx: Context) -> None:
    """Decode tok/s with the KV in the batch in the model's precision, q8 and q4
    (``batch_kv_bits``), per (agents, history) shape, one engine per precision. Ratios:
    ``decode_tps_vs_model[AxH][q8|q4]``, of the last round."""
    s = ctx.sizes.of("batch_kv")
    top = max(agents for agents, _ in s["shapes"])
    rows = ctx.report["rows"] = []
    for name, bits in PRECISIONS.items():
        if ctx.out_of_time():
            break
        config = EngineConfig(
            completion_batch_size=top,
            prefill_batch_size=top,
            batch_kv_bits=bits,
            speculative="off",
        )
        eng = await Engine.open(ctx.model, config)
        try:
            for agents, history in s["shapes"]:
                if ctx.out_of_time():
                    break
                rounds = [
                    await decode_rate(eng, agents, history, s["tokens"])
                    for _ in range(ctx.sizes.rounds)
                ]
                row = {"precision": name, "agents": agents, "history": history, **rounds[-1]}
                rows.append(row | {"warm_rounds": rounds[:-1]})
                ctx.log(
                    f"batch_kv {name} {agents}x{history}: {row['decode_tps']:.1f} tok/s "
                    f"decoding, KV held {row['kv_held_mb']:.0f} MB"
                )
        finally:
            await eng.close()
    ratios = {}
    for row in rows:
        same = (row["agents"], row["history"])
        base = next((r for r in rows if (r["agents"], r["history"]) == same), None)
        if row["precision"] != "model" and base["precision"] == "model":
            shape = ratios.setdefault(f"{row['agents']}x{row['history']}", {})
            shape[row["precision"]] = row["decode_tps"] / base["decode_tps"]
    ctx.report["ratios"] = {"decode_tps_vs_model": ratios}


async def mixed(ctx: Context) -> None:
    """Short agents decoding alone and beside one long agent, agentkv's length groups against
    one ``BatchGenerator`` batch left-padded to the longest (``bench_mixed``'s ``agentkv`` and
    ``padded``). Ratios, of the last round: ``short_vs_alone[path]`` (the short agents' tok/s
    beside the long one over alone), ``agentkv_vs_padded`` (the short agents' tok/s beside the
    long one, agentkv over padded) and ``held_vs_owned[path]`` (KV held over owned). The long
    history is cut to leave room for its reply within the model's context
    (``long_history`` says what ran)."""
    s = ctx.sizes.of("mixed")
    shorts, tokens = s["shorts"], s["tokens"]
    eng = await Engine.open(
        ctx.model, EngineConfig(completion_batch_size=shorts + 1, speculative="off")
    )
    rows = ctx.report["rows"] = []
    long_n = s["long_history"]
    if eng.model.max_context is not None:  # room for its reply within the model's context
        long_n = min(long_n, eng.model.max_context - tokens - 2)
    ctx.report["long_history"] = long_n
    try:
        short = await bench_mixed.histories(eng, [s["short_history"]] * shorts)
        (long,) = await bench_mixed.histories(eng, [long_n])
        for round_ in range(ctx.sizes.rounds):
            if round_ and ctx.out_of_time():
                break
            for n in (0, long_n):
                caches = short + ([long] if n else [])
                got = {
                    "agentkv": await bench_mixed.agentkv(eng, caches, shorts, tokens),
                    "padded": await eng.run(bench_mixed.padded, eng, caches, shorts, tokens),
                }
                for path, row in got.items():
                    rows.append({"round": round_, "path": path, "long": n, **row})
                    ctx.log(
                        f"mixed round {round_} {path} long={n}: short agents "
                        f"{row['short_tps']:.1f} tok/s each, KV held {row['held_vs_owned']:.2f}x "
                        f"owned, {row['groups']} group(s)"
                    )
    finally:
        await eng.close()
    for row in rows:  # the last round run is reported (all but it warmed kernels)
        row["reported"] = row["round"] == rows[-1]["round"]
    got = {(r["path"], r["long"]): r for r in rows if r["reported"]}
    paths = ("agentkv", "padded")
    ctx.report["ratios"] = {
        "short_vs_alone": {
            p: got[(p, long_n)]["short_tps"] / got[(p, 0)]["short_tps"] for p in paths
        },
        "agentkv_vs_padded": got[("agentkv", long_n)]["short_tps"]
        / got[("padded", long_n)]["short_tps"],
        "held_vs_owned": {p: got[(p, long_n)]["held_vs_owned"] for p in paths},
    }


async def resume(ctx: Context) -> None:
    """Disk resume through the runtime against raw mlx-lm (``load_prompt_cache`` +
    ``BatchGenerator.insert`` + its first token), ``bench_blocks``' resume part: one history
    imported and prefilled per length, then ``repeats`` reopens, medians. Ratios:
    ``disk_vs_raw[kv_bits][history]`` (time to first token, agentkv over raw)."""
    s = ctx.sizes.of("resume")
    args = argparse.Namespace(
        model=ctx.model, histories=list(s["histories"]), block_tokens=256, turn_words=300
    )
    root = ctx.scratch / "resume"
    (root / "raw").mkdir(parents=True)
    bench = bench_blocks.Resume(args, root)
    for name in s["kv_bits"]:
        await bench.build(name)
    for repeat in range(s["repeats"]):
        if repeat and ctx.out_of_time():
            break
        for name in s["kv_bits"]:
            await bench.resume(name)
    rows = ctx.report["rows"] = bench.rows()
    ratios: dict[str, dict[str, float]] = {}
    for row in rows:
        ratios.setdefault(row["kv_bits"], {})[str(row["history"])] = row["vs_raw"]
    ctx.report["ratios"] = {"disk_vs_raw": ratios}


async def prefill(ctx: Context) -> None:
    """A long prompt joining decoding agents (``bench_prefill.run``): the decoders' worst gap
    while it prefills, and its prefill time, under ``BatchGenerator`` (a decode step and a
    prompt chunk per ``next()``) and agentkv at each ``max_decode_stall``. Ratios:
    ``worst_gap_vs_median[who]`` (over the decoders' decode-only median gap) and
    ``prefill_vs_alone[who]`` (over the same prompt on an idle engine)."""
    s = ctx.sizes.of("prefill")
    args = argparse.Namespace(
        model=ctx.model,
        decoders=s["decoders"],
        decoder_history=s["decoder_history"],
        prompt=s["prompt"],
        warmup=s["warmup"],
        stalls=list(s["stalls"]),
    )
    report = await bench_prefill.run(args)
    rows = ctx.report["rows"] = report["rows"]
    ctx.report["alone_prefill_s"] = report["alone_prefill_s"]

    def who(row: dict) -> str:
        stall = row["max_decode_stall"]
        return "BatchGenerator" if stall is None else f"agentkv stall {stall:g}"

    ctx.report["ratios"] = {
        "worst_gap_vs_median": {who(r): r["worst_vs_median"] for r in rows},
        "prefill_vs_alone": {who(r): r["prefill_vs_alone"] for r in rows},
    }


async def speculative(ctx: Context) -> None:
    """Drafts verified in the batch against plain decoding, per N agents: the cost and gain
    of a drafted step on this device. A random-weight model restates nothing of its own, so
    the drafts are each reply's own tokens (from a run without drafts; one in ``wrong``
    changed), as an agent restating its history would have them: the upper end of what
    drafts give, with the acceptance they had. Ratios: ``drafts_vs_plain[N]`` of decode tok/s
    (first token to last, all agents), the same tokens checked."""
    s = ctx.sizes.of("speculative")
    rows = ctx.report["rows"] = []
    for n in s["ns"]:
        if ctx.out_of_time():
            break
        prompts = [[(37 * i + 11 * j) % 4000 + 16 for j in range(s["prompt"])] for i in range(n)]
        rounds = []
        for _ in range(ctx.sizes.rounds):
            plain, tokens = await _decode_tps(ctx.model, "off", prompts, s["tokens"], None)
            drafted, again = await _decode_tps(
                ctx.model, "lookup", prompts, s["tokens"], (tokens, s["wrong"])
            )
            rounds.append(
                {
                    "plain_tps": plain["tps"],
                    "drafts_tps": drafted["tps"],
                    "same_tokens": again == tokens,
                    "drafted": drafted["drafted"],
                    "accepted": drafted["accepted"],
                }
            )
        last = rounds[-1]
        ratio = last["drafts_tps"] / last["plain_tps"]
        rows.append({"n": n, **last, "drafts_vs_plain": ratio, "warm_rounds": rounds[:-1]})
        ctx.log(
            f"speculative N={n}: plain {last['plain_tps']:.1f} tok/s, drafts "
            f"{last['drafts_tps']:.1f} tok/s ({ratio:.2f}x), kept {last['accepted']} of "
            f"{last['drafted']}, same tokens {last['same_tokens']}"
        )
    ctx.report["ratios"] = {"drafts_vs_plain": {str(r["n"]): r["drafts_vs_plain"] for r in rows}}


async def _decode_tps(
    model: str, mode: str, prompts: list[list[int]], tokens: int, oracle: tuple | None
) -> tuple[dict, list[list[int]]]:
    """Decode tok/s of ``prompts`` together (``oracle``: (each reply's tokens, one draft in
    how many changed) to draft from), and their tokens."""
    config = EngineConfig(speculative=mode, completion_batch_size=max(16, len(prompts)))
    eng = await Engine.open(model, config)
    saved = Speculation.propose
    if oracle is not None:
        truths, wrong = oracle
        by_start = {tuple(p): t for p, t in zip(prompts, truths, strict=True)}
        length = len(prompts[0])

        def propose(spec, history, pending, room):  # the reply's own tokens, a few changed
            k, first = min(spec.k, room), int(pending is None)
            truth = by_start[tuple(history[:length])]
            at = len(history) + 1 - length - first
            got = truth[at : at + k + first] if k >= 1 else []
            return [t + 1 if (at + j) % wrong == wrong - 1 else t for j, t in enumerate(got)]

        Speculation.propose = propose
    try:
        requests = [GenerationRequest(p, max_tokens=tokens, ignore_eos=True) for p in prompts]
        results = await asyncio.gather(*(eng.generate(r) for r in requests))
        stats = eng.stats()
    finally:
        Speculation.propose = saved
        await eng.close()
    first = min(r.stats.first_token_at for r in results)
    last = max(r.stats.finished_at for r in results)
    generated = sum(len(r.token_ids) - 1 for r in results)
    out = {"tps": generated / (last - first), "drafted": stats.drafted_tokens}
    out["accepted"] = stats.accepted_tokens
    return out, [r.token_ids for r in results]


PARTS: dict[str, Callable[[Context], object]] = {
    "batching": batching,
    "batch_kv": batch_kv,
    "mixed": mixed,
    "resume": resume,
    "prefill": prefill,
    "speculative": speculative,
}
"""Every part, in the order a run takes them: most valuable first."""
