"""A mixed batch: one long agent beside short ones.

    python -m benchmarks.bench_mixed [--model tiny:gemma3-bench] [--quick]

Seven short agents (``--short-history`` tokens each) decode ``--tokens`` tokens, alone and
beside one long agent (each of ``--long-histories``), through agentkv's engine and through
mlx-lm's BatchGenerator (one batch, every sequence left-padded to the longest: how the engine
batched before length groups). All in one process on one model; runs interleaved ``--repeats``
times, medians reported. Histories are synthetic caches (``benchmarks.synthetic``): decoding
costs the same as over prefilled ones.

Reported per case: the short agents' median decode tok/s and its ratio to the shorts alone, the
KV the batch holds against what its agents own (sampled every step for agentkv; at the middle
of the run for BatchGenerator), and peak memory. Writes benchmarks/results/mixed.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.meter import StepRecord
from agentkv.engine.request import GenerationRequest, PromptCache
from benchmarks.plots import save_plot, write_report
from benchmarks.synthetic import synthetic_cache

RESULTS = Path(__file__).parent / "results"


async def histories(eng: Engine, lengths: list[int]) -> list[PromptCache]:
    vocab = eng.model.vocab_size
    return [
        await eng.run(synthetic_cache, eng.model.model, n, 100 + i, vocab)
        for i, n in enumerate(lengths)
    ]


def requests(caches: list[PromptCache], tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest([17 + i], max_tokens=tokens, ignore_eos=True, cache=c)
        for i, c in enumerate(caches)
    ]


async def agentkv(eng: Engine, caches: list[PromptCache], shorts: int, tokens: int) -> dict:
    steps: list[StepRecord] = []
    remove = eng.add_step_listener(steps.append)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    results = await asyncio.gather(*(eng.generate(r) for r in requests(caches, tokens)))
    peak = mx.get_peak_memory() - base
    remove()
    decoding = [s for s in steps if s.decode_rows == len(caches)]
    ratios = [s.kv_held_bytes / (s.kv_held_bytes - s.kv_padding_bytes) for s in decoding]
    assert all(r.error is None and len(r.token_ids) == tokens for r in results)
    return {
        "short_tps": statistics.median(r.stats.decode_tps for r in results[:shorts]),
        "held_vs_owned": max(ratios),
        "held_mb": max(s.kv_held_bytes for s in decoding) / 2**20,
        "groups": max(s.groups for s in decoding),
        "peak_mb": peak / 2**20,
    }


def padded(eng: Engine, caches: list[PromptCache], shorts: int, tokens: int) -> dict:
    """mlx-lm's BatchGenerator with every sequence in one left-padded batch (generation thread)."""
    layout = eng._thread.runner.layout
    reqs = requests(caches, tokens)
    gen = BatchGenerator(
        eng.model.model, completion_batch_size=len(reqs), prefill_batch_size=len(reqs)
    )
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    uids = gen.insert(
        [r.prompt_tokens for r in reqs],
        max_tokens=[tokens] * len(reqs),
        caches=[r.cache.layers for r in reqs],
        all_tokens=[list(r.cache.tokens) for r in reqs],
    )
    times: dict[int, list[float]] = {u: [] for u in uids}
    held = owned = 0
    while any(len(t) < tokens for t in times.values()):
        for r in gen.next_generated():
            times[r.uid].append(time.perf_counter())
        done = min(len(t) for t in times.values())
        if done == tokens // 2 and not held:
            held = gen.prompt_cache_nbytes
            owned = sum(layout.owned_bytes(c.num_tokens + 1 + done) for c in caches)
    peak = mx.get_peak_memory() - base
    gen.close()
    tps = [(len(t) - 1) / (t[-1] - t[0]) for t in (times[u] for u in uids[:shorts])]
    return {
        "short_tps": statistics.median(tps),
        "held_vs_owned": held / owned,
        "held_mb": held / 2**20,
        "groups": 1,
        "peak_mb": peak / 2**20,
    }


async def run(args: argparse.Namespace) -> dict:
    eng = await Engine.open(
        args.model, EngineConfig(completion_batch_size=args.shorts + 1, speculative="off")
    )
    cases = [0, *args.long_histories]
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        short = await histories(eng, [args.short_history] * args.shorts)
        longs = {n: (await histories(eng, [n]))[0] for n in args.long_histories}
        await agentkv(eng, short[:2], 2, 4)  # warm up both paths
        await eng.run(padded, eng, short[:2], 2, 4)
        for repeat in range(args.repeats):
            for n in cases:
                caches = short + ([longs[n]] if n else [])
                for path in ("agentkv", "padded") if repeat % 2 == 0 else ("padded", "agentkv"):
                    if path == "agentkv":
                        row = await agentkv(eng, caches, args.shorts, args.tokens)
                    else:
                        row = await eng.run(padded, eng, caches, args.shorts, args.tokens)
                    runs.setdefault((path, n), []).append(row)
                    print(f"{path:8} long={n:>6}  {_fmt(row)}", flush=True)
    finally:
        await eng.close()
    rows = []
    for path in ("agentkv", "padded"):
        alone = statistics.median(r["short_tps"] for r in runs[(path, 0)])
        for n in cases:
            row = {k: statistics.median(r[k] for r in runs[(path, n)]) for k in runs[(path, n)][0]}
            row["short_vs_alone"] = row["short_tps"] / alone
            rows.append({"path": path, "long_history": n, **row})
    for row in rows:
        ratio = f"short agents {row['short_vs_alone']:.2f}x alone"
        print(f"{row['path']:8} long={row['long_history']:>6}  {ratio}, {_fmt(row)}")
    return {
        "benchmark": "mixed",
        "model": args.model,
        "shorts": args.shorts,
        "short_history": args.short_history,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


def _fmt(row: dict[str, Any]) -> str:
    return (
        f"short agents {row['short_tps']:.2f} tok/s each, KV held {row['held_mb']:.1f} MB = "
        f"{row['held_vs_owned']:.2f}x owned, {row['groups']} group(s), "
        f"peak +{row['peak_mb']:.0f} MB"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="short agents beside a long one")
    parser.add_argument("--model", default="tiny:gemma3-bench")
    parser.add_argument("--shorts", type=int, default=7)
    parser.add_argument("--short-history", type=int, default=256)
    parser.add_argument("--long-histories", type=int, nargs="+", default=[16_384, 32_768])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, tiny sizes")
    parser.add_argument("--out", type=Path, default=RESULTS / "mixed.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.shorts, args.short_history = "tiny:gemma3", 3, 20
        args.long_histories, args.tokens, args.repeats = [400], 8, 1
    report = asyncio.run(run(args))
    write_report(report, args.out, plot)
    return report


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]
    cases = sorted({r["long_history"] for r in rows})
    labels = ["alone" if n == 0 else f"+{n // 1024}K" for n in cases]

    def panel(key: str, ylabel: str, title: str):
        def draw(ax) -> None:
            width = 0.38
            for i, name in enumerate(("agentkv", "padded")):
                values = [
                    next(r[key] for r in rows if r["path"] == name and r["long_history"] == n)
                    for n in cases
                ]
                xs = [j + (i - 0.5) * width for j in range(len(cases))]
                ax.bar(
                    xs,
                    values,
                    width,
                    label="agentkv (length groups)" if i == 0 else "one padded batch",
                )
            ax.set_xticks(range(len(cases)), labels)
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.legend(fontsize=7)

        return draw

    return save_plot(
        path,
        [
            panel("short_tps", "tok/s per short agent", "short agents' decode speed"),
            panel("held_vs_owned", "KV held / KV owned", "KV the batch holds"),
        ],
        f"{report['model']}, {report['shorts']} x {report['short_history']} tokens, "
        f"{report['date']}",
    )


if __name__ == "__main__":
    main()
