"""The KV memory budget: 4 x K agents ask at once with room for K.

    python -m benchmarks.bench_budget [--model tiny:gemma3-bench] [--quick]
    python -m benchmarks.bench_budget --mix [--long 32768] [--history 1024] [--prompt 128]
        [--agents 16] [--bits model q8 q4] [--budget-mb MB]

``4 * --fits`` agents, each with a ``--history``-token history (synthetic caches, see
``benchmarks.synthetic``) and ``--tokens`` to generate, ask at once. With ``kv_budget_bytes`` set
to what ``--fits`` of them need, every step records how many are in the batch and the bytes it
holds and sets aside; the same turns without a budget (the default, a share of memory) show what
the batch would hold otherwise. Writes benchmarks/results/budget.json and .png.

``--mix``, the heterogeneous case: one agent with a ``--long``-token history and ``--agents``
(default ``4 * --fits``) with ``--history``-token ones ask at once, each with a new turn of
``--prompt`` tokens, under ``--budget-mb`` (default: what the long one and ``--fits`` short ones
set aside in the model's precision), once per precision of ``--bits`` (KV in the batch: the
model's, q8, q4), same budget: what each sets aside, the most short agents in the batch while
the long one is, the KV held and tok/s. A fixed ``--budget-mb`` compares versions of the
engine. Writes benchmarks/results/budget_mix.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.meter import StepRecord
from agentkv.engine.request import GenerationRequest, GenerationResult
from benchmarks.plots import bar_labels, save_plot, write_report
from benchmarks.synthetic import synthetic_cache

RESULTS = Path(__file__).parent / "results"
PRECISIONS = {"model": None, "q8": 8, "q4": 4}  # --mix: KV in the batch (batch_kv_bits)


def group_size(args: argparse.Namespace) -> dict:
    """``batch_kv_group_size`` when ``args`` has a ``group_size`` (else the default's)."""
    size = getattr(args, "group_size", None)
    return {} if size is None else {"batch_kv_group_size": size}


async def ask(
    args: argparse.Namespace, budget: int | None, batch_kv_bits: int | None = None
) -> tuple[dict, int]:
    """``4 * args.fits`` agents (``args.agents`` if set) ask at once under ``budget``: the row
    of what the batch did, and the KV bytes one of them sets aside."""
    agents = getattr(args, "agents", None) or 4 * args.fits
    config = EngineConfig(
        completion_batch_size=agents,
        kv_budget_bytes=budget,
        batch_kv_bits=batch_kv_bits,
        speculative="off",
        **group_size(args),
    )
    eng = await Engine.open(args.model, config)
    steps: list[StepRecord] = []
    waiting = 0
    try:
        vocab = eng.model.vocab_size
        caches = [
            await eng.run(synthetic_cache, eng.model.model, args.history, i, vocab)
            for i in range(agents)
        ]
        requests = [  # no cache back: peak memory is the batch's, not the results'
            GenerationRequest(
                [20 + i], max_tokens=args.tokens, ignore_eos=True, cache=c, return_cache=False
            )
            for i, c in enumerate(caches)
        ]
        need = eng.kv_bytes_needed(requests[0])
        eng.add_step_listener(steps.append)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(eng.generate(r)) for r in requests]
        while not all(t.done() for t in tasks):
            waiting = max(waiting, eng.stats().waiting_for_memory)
            await asyncio.sleep(0.01)
        wall = time.perf_counter() - start
        results = [t.result() for t in tasks]
        peak = mx.get_peak_memory() - base
        budget_bytes = eng.kv_budget_bytes
    finally:
        await eng.close()
    # Steps that only decoded: their gap is the step's time, free of joins and prefill.
    decoding = [s for s in steps if not (s.prefill_tokens or s.prefilling) and s.gap_s > 0]
    row = {
        "budget": "none (default)" if budget is None else f"{args.fits} agents",
        "budget_mb": budget_bytes / 2**20,
        "agents": agents,
        "completed": sum(r.error is None and len(r.token_ids) == args.tokens for r in results),
        "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
        "decode_steps": len(decoding),
        "decode_tokens_per_s": (
            statistics.median(s.decode_rows / s.gap_s for s in decoding) if decoding else None
        ),
        "failed": sum(r.error is not None for r in results),
        "max_in_batch": max(s.decode_rows + s.prefilling for s in steps),
        "max_held_mb": max(s.kv_held_bytes for s in steps) / 2**20,
        "max_reserved_mb": max(s.kv_reserved_bytes for s in steps) / 2**20,
        "held_under_budget_every_step": all(s.kv_held_bytes <= budget_bytes for s in steps),
        "max_waiting_for_memory": waiting,
        "peak_mb": peak / 2**20,
        "wall_s": wall,
        "steps": len(steps),
    }
    return row, need


async def run(args: argparse.Namespace) -> dict:
    unbounded, need = await ask(args, None)
    bounded, _ = await ask(args, args.fits * need)
    for row in (bounded, unbounded):
        print(
            f"budget {row['budget']:>14}: {row['completed']}/{row['agents']} completed, "
            f"{row['failed']} failed, at most {row['max_in_batch']} in the batch, KV held at most "
            f"{row['max_held_mb']:.1f} MB of {row['budget_mb']:.1f} MB (every step under: "
            f"{row['held_under_budget_every_step']}), peak +{row['peak_mb']:.0f} MB, "
            f"{row['wall_s']:.1f} s",
            flush=True,
        )
    return {
        "benchmark": "budget",
        "model": args.model,
        "history": args.history,
        "tokens": args.tokens,
        "fits": args.fits,
        "need_mb": need / 2**20,
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": [bounded, unbounded],
    }


async def mixed(args: argparse.Namespace) -> dict:
    """``--mix``: one long agent and ``--agents`` short ones under one budget, per precision
    of ``--bits`` (the budget: the model's precision's default, or ``--budget-mb``)."""
    short = args.agents or 4 * args.fits

    async def asking(budget: int | None, bits: int | None) -> tuple[Engine, list]:
        config = EngineConfig(  # room for everyone but in memory: the budget decides
            completion_batch_size=short + 1,
            prefill_batch_size=short + 1,
            kv_budget_bytes=budget,
            speculative="off",
            batch_kv_bits=bits,
        )
        eng = await Engine.open(args.model, config)
        vocab, requests = eng.model.vocab_size, []
        for i in range(short + 1):
            history = args.long if i == 0 else args.history
            cache = await eng.run(synthetic_cache, eng.model.model, history, i, vocab)
            prompt = [16 + (7 * i + j) % 256 for j in range(args.prompt)]
            requests.append(  # no cache back: the batch's memory, not the results'
                GenerationRequest(
                    prompt, args.tokens, ignore_eos=True, cache=cache, return_cache=False
                )
            )
        return eng, requests

    async def needs(bits: int | None) -> tuple[int, int]:
        """What the long agent and a short one set aside (no turn runs)."""
        eng = await Engine.open(args.model, EngineConfig(batch_kv_bits=bits))
        try:
            vocab, needed = eng.model.vocab_size, []
            for history in (args.long, args.history):
                cache = await eng.run(synthetic_cache, eng.model.model, history, 0, vocab)
                request = GenerationRequest([16] * args.prompt, args.tokens, cache=cache)
                needed.append(eng.kv_bytes_needed(request))
            return needed[0], needed[1]
        finally:
            await eng.close()

    if args.budget_mb:
        budget = int(args.budget_mb * 2**20)
    else:  # the model's precision's: the long agent and --fits short ones
        need_long, need_short = await needs(None)
        budget = need_long + args.fits * need_short
    rows = {}
    for name in args.bits:
        bits = PRECISIONS[name]
        need_long, need_short = await needs(bits)
        eng, requests = await asking(budget, bits)
        steps: list[StepRecord] = []
        eng.add_step_listener(steps.append)
        try:
            start = time.perf_counter()
            results = await asyncio.gather(*(eng.generate(r) for r in requests))
            wall = time.perf_counter() - start
            preemptions = eng.stats().preemptions
        finally:
            await eng.close()
        row = rows[name] = {
            "budget_mb": budget / 2**20,
            "need_long_mb": need_long / 2**20,
            "need_short_mb": need_short / 2**20,
            "completed": sum(r.error is None and len(r.token_ids) == args.tokens for r in results),
            "agents": short + 1,
            "max_beside_long": beside(results[0], results[1:]),
            "preemptions": preemptions,  # (a paused turn counts as in the batch: want 0)
            "max_held_mb": max(s.kv_held_bytes for s in steps) / 2**20,
            "held_under_budget_every_step": all(s.kv_held_bytes <= budget for s in steps),
            "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
            "wall_s": wall,
        }
        print(
            f"{name:>5}: one {args.long}-token agent and {short} of {args.history} tokens, "
            f"{args.prompt}-token turns: {row['need_long_mb']:.1f} MB and "
            f"{row['need_short_mb']:.2f} MB set aside; in {row['budget_mb']:.1f} MB at most "
            f"{row['max_beside_long']} short ones beside the long one, KV held at most "
            f"{row['max_held_mb']:.1f} MB (every step under: "
            f"{row['held_under_budget_every_step']}), {row['completed']}/{row['agents']} "
            f"completed, {row['tokens_per_s']:.1f} tok/s",
            flush=True,
        )
    first = rows[args.bits[0]]["max_beside_long"]
    for row in rows.values():
        row["beside_long_vs_first"] = round(row["max_beside_long"] / first, 3) if first else None
    return {
        "benchmark": "budget_mix",
        "model": args.model,
        "long": args.long,
        "history": args.history,
        "prompt": args.prompt,
        "tokens": args.tokens,
        "fits": args.fits,
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


def beside(long: GenerationResult, short: list[GenerationResult]) -> int:
    """The most ``short`` turns in the batch at once while ``long`` was (from each turn's
    admission to its end)."""
    start, end = long.stats.admitted_at, long.stats.finished_at
    if start is None or end is None:
        return 0
    spans = [
        (r.stats.admitted_at, r.stats.finished_at)
        for r in short
        if r.stats.admitted_at is not None and r.stats.finished_at is not None
    ]
    moments = [start] + [a for a, _ in spans if start <= a <= end]
    return max(sum(a <= t < b for a, b in spans) for t in moments)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="4 x K agents ask with room for K")
    parser.add_argument("--model", default="tiny:gemma3-bench")
    parser.add_argument("--fits", type=int, default=4, help="K: agents the budget has room for")
    parser.add_argument("--history", type=int, help="default 8192; --mix: 1024 (the short ones)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, tiny sizes")
    parser.add_argument("--mix", action="store_true", help="one long agent among short ones")
    parser.add_argument("--long", type=int, default=32768, help="--mix: the long history")
    parser.add_argument("--prompt", type=int, default=128, help="--mix: each new turn's tokens")
    parser.add_argument("--budget-mb", type=float, help="--mix: the budget (default: see above)")
    parser.add_argument("--agents", type=int, help="--mix: short agents (default: 4 x --fits)")
    parser.add_argument(
        "--bits", nargs="+", choices=list(PRECISIONS), default=["model"], help="--mix: KV in"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.fits, args.history, args.tokens = "tiny:gemma3", 2, 300, 6
        args.long, args.prompt = 1200, 24
    if args.history is None:
        args.history = 1024 if args.mix else 8192
    if args.mix:
        report = asyncio.run(mixed(args))
        out = args.out or RESULTS / "budget_mix.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
        return report
    report = asyncio.run(run(args))
    write_report(report, args.out or RESULTS / "budget.json", plot)
    return report


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]
    names = [r["budget"] for r in rows]

    def batch(ax) -> None:
        bars = ax.bar(names, [r["max_in_batch"] for r in rows])
        bar_labels(ax, bars, "{:.0f}")
        ax.set_ylabel("agents in the batch at most")
        ax.set_title(f"{rows[0]['agents']} agents asking at once")

    def memory(ax) -> None:
        bars = ax.bar(names, [r["max_held_mb"] for r in rows])
        bar_labels(ax, bars, "{:.0f}")
        ax.axhline(rows[0]["budget_mb"], color="red", lw=0.8, label="budget")
        ax.set_ylabel("KV held at most (MB)")
        ax.set_title("the batch's KV memory")
        ax.legend(fontsize=7)

    title = f"{report['model']}, {report['history']}-token histories, {report['date']}"
    return save_plot(path, [batch, memory], title)


if __name__ == "__main__":
    main()
