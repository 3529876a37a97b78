"""The scheduling policies on a mixed workload: short interactive turns arriving while long
background turns run.

    python -m benchmarks.bench_policies [--model tiny:gemma3-bench] [--quick]

``--background`` turns each prefill a ``--background-prompt``-token prompt and generate
``--background-tokens`` tokens; meanwhile ``--interactive`` short turns (``--short-prompt``
tokens, ``--short-tokens`` generated) arrive every ``--interval`` seconds. The batch holds
``--batch`` sequences, so turns compete for places. For each policy: the short turns' time to
first token (p50, p95), the background turns' completion time, and aggregate tok/s (every
generated token over the wall time). Writes benchmarks/results/policies.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from agentkv.engine.config import EngineConfig, Policy
from agentkv.engine.engine import Engine
from agentkv.engine.request import GenerationRequest
from benchmarks.bench_batching import make_prompts
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def workload(eng: Engine, args: argparse.Namespace) -> dict:
    vocab = eng.model.vocab_size
    background = [
        GenerationRequest(p, max_tokens=args.background_tokens, ignore_eos=True)
        for p in make_prompts(vocab, args.background, args.background_prompt)
    ]
    shorts = [
        GenerationRequest(p[: args.short_prompt], max_tokens=args.short_tokens, ignore_eos=True)
        for p in make_prompts(vocab, args.interactive + args.background, args.short_prompt)[
            args.background :
        ]
    ]
    start = time.perf_counter()
    long_tasks = [asyncio.ensure_future(eng.generate(r)) for r in background]
    short_tasks = []
    for request in shorts:
        await asyncio.sleep(args.interval)
        short_tasks.append(asyncio.ensure_future(eng.generate(request)))
    short_results = await asyncio.gather(*short_tasks)
    long_results = await asyncio.gather(*long_tasks)
    wall = time.perf_counter() - start
    results = [*short_results, *long_results]
    assert all(r.error is None for r in results)
    ttfts = [r.stats.ttft_s for r in short_results]
    return {
        "short_ttft_p50_s": percentile(ttfts, 0.5),
        "short_ttft_p95_s": percentile(ttfts, 0.95),
        "background_done_s": max(r.stats.finished_at for r in long_results) - start,
        "aggregate_tps": sum(len(r.token_ids) for r in results) / wall,
        "preemptions": eng.stats().preemptions,
    }


async def run(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        order = list(Policy) if repeat % 2 == 0 else list(reversed(Policy))
        for policy in order:
            config = EngineConfig(
                completion_batch_size=args.batch,
                prefill_batch_size=min(args.batch, 8),
                policy=policy,
                speculative="off",
            )
            eng = await Engine.open(args.model, config)
            try:
                await eng.generate(GenerationRequest([20, 21, 22], max_tokens=4))  # warm up
                row = await workload(eng, args)
            finally:
                await eng.close()
            runs.setdefault(str(policy), []).append(row)
            print(f"{policy:16} {_fmt(row)}", flush=True)
    rows = [
        {"policy": name, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
        for name, rs in runs.items()
    ]
    return {
        "benchmark": "policies",
        "model": args.model,
        "batch": args.batch,
        "background": f"{args.background} x {args.background_prompt} prompt tokens, "
        f"{args.background_tokens} generated",
        "interactive": f"{args.interactive} x {args.short_prompt} prompt tokens, "
        f"{args.short_tokens} generated, one every {args.interval} s",
        "repeats": args.repeats,
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


def _fmt(row: dict) -> str:
    return (
        f"short TTFT p50 {row['short_ttft_p50_s']:.2f} s, p95 {row['short_ttft_p95_s']:.2f} s; "
        f"background done at {row['background_done_s']:.1f} s; "
        f"{row['aggregate_tps']:.1f} tok/s; {row['preemptions']} preemptions"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="scheduling policies on a mixed workload")
    parser.add_argument("--model", default="tiny:gemma3-bench")
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--background", type=int, default=3)
    parser.add_argument("--background-prompt", type=int, default=2048)
    parser.add_argument("--background-tokens", type=int, default=160)
    parser.add_argument("--interactive", type=int, default=12)
    parser.add_argument("--short-prompt", type=int, default=48)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, tiny sizes")
    parser.add_argument("--out", type=Path, default=RESULTS / "policies.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.background, args.background_prompt = "tiny:gemma3", 3, 2, 200
        args.background_tokens, args.interactive, args.interval = 40, 4, 0.02
    report = asyncio.run(run(args))
    write_report(report, args.out, plot)
    return report


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]
    names = [r["policy"] for r in rows]

    def ttft(ax) -> None:
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["short_ttft_p50_s"] for r in rows], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [r["short_ttft_p95_s"] for r in rows], 0.4, label="p95")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("seconds")
        ax.set_title("short turns' time to first token")
        ax.legend(fontsize=7)

    def throughput(ax) -> None:
        ax.bar(names, [r["aggregate_tps"] for r in rows])
        ax.set_ylabel("tok/s")
        ax.set_title("aggregate decode throughput")

    return save_plot(path, [ttft, throughput], f"{report['model']}, {report['date']}")


if __name__ == "__main__":
    main()
