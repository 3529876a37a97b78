"""Aggregate decode throughput: agentkv's engine vs a raw mlx-lm BatchGenerator loop vs
sequential single-sequence generation, same model, same prompts, same process.

    python -m benchmarks.bench_batching [--model tiny:gemma3-bench] [--quick]

All three run on the engine's generation thread (the raw loop and the sequential baseline
through ``Engine.run``), so they share one model instance and one MLX thread. Every sequence
generates exactly ``--tokens`` tokens (end-of-sequence ignored). Writes
benchmarks/results/batching.json and batching.png.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.request import GenerationRequest
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"


def make_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    return [[(31 * i + 7 * j) % (vocab - 16) + 16 for j in range(length)] for i in range(n)]


def raw_batch(eng: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Seconds for mlx-lm's BatchGenerator alone to generate ``tokens`` per prompt."""
    gen = BatchGenerator(
        eng.model.model,
        completion_batch_size=eng.config.completion_batch_size,
        prefill_batch_size=eng.config.prefill_batch_size,
        prefill_step_size=eng.config.prefill_step_size,
    )
    start = time.perf_counter()
    gen.insert(prompts, max_tokens=[tokens] * len(prompts))
    remaining = len(prompts)
    while remaining:
        remaining -= sum(r.finish_reason is not None for r in gen.next_generated())
    elapsed = time.perf_counter() - start
    gen.close()
    return elapsed


def sequential(eng: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Seconds for mlx-lm's single-sequence generate_step, one prompt after another."""
    start = time.perf_counter()
    for p in prompts:
        for _ in generate_step(mx.array(p), eng.model.model, max_tokens=tokens):
            pass
    return time.perf_counter() - start


async def engine_batch(eng: Engine, prompts: list[list[int]], tokens: int) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(
        *(eng.generate(GenerationRequest(p, max_tokens=tokens, ignore_eos=True)) for p in prompts)
    )
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == tokens for r in results)
    return elapsed


async def run(args: argparse.Namespace) -> dict:
    top = max(args.ns)
    config = EngineConfig(
        completion_batch_size=top, prefill_batch_size=min(8, top), speculative="off"
    )
    eng = await Engine.open(args.model, config)
    rows = []
    try:
        vocab = eng.model.vocab_size
        warm = make_prompts(vocab, 2, args.prompt_len)
        await engine_batch(eng, warm, 4)
        await eng.run(raw_batch, eng, warm, 4)
        for n in args.ns:
            prompts = make_prompts(vocab, n, args.prompt_len)
            times = {"engine": [], "raw": [], "sequential": []}
            for _ in range(args.repeats):  # interleaved so drift hits all three alike
                times["raw"].append(await eng.run(raw_batch, eng, prompts, args.tokens))
                times["engine"].append(await engine_batch(eng, prompts, args.tokens))
                times["sequential"].append(await eng.run(sequential, eng, prompts, args.tokens))
            tps = {k: n * args.tokens / statistics.median(v) for k, v in times.items()}
            row = {
                "n": n,
                "engine_tps": tps["engine"],
                "raw_tps": tps["raw"],
                "sequential_tps": tps["sequential"],
                "engine_vs_raw": tps["engine"] / tps["raw"],
                "engine_vs_sequential": tps["engine"] / tps["sequential"],
            }
            rows.append(row)
            print(
                f"N={n:>2}  engine {row['engine_tps']:7.1f} tok/s  raw {row['raw_tps']:7.1f}  "
                f"sequential {row['sequential_tps']:7.1f}  engine/raw {row['engine_vs_raw']:.3f}  "
                f"engine/seq {row['engine_vs_sequential']:.2f}",
                flush=True,
            )
    finally:
        await eng.close()
    return {
        "benchmark": "batching",
        "model": args.model,
        "prompt_tokens": args.prompt_len,
        "generated_tokens": args.tokens,
        "repeats": args.repeats,
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="engine vs raw BatchGenerator vs sequential")
    parser.add_argument("--model", default="tiny:gemma3-bench")
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, N=1,2, few tokens")
    parser.add_argument("--out", type=Path, default=RESULTS / "batching.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.ns, args.tokens, args.prompt_len, args.repeats = (
            "tiny:gemma3",
            [1, 2],
            8,
            16,
            1,
        )
    report = asyncio.run(run(args))
    write_report(report, args.out, plot)
    return report


def plot(report: dict, path: Path) -> Path:
    ns = [row["n"] for row in report["rows"]]

    def throughput(ax) -> None:
        for key, label in (
            ("engine", "agentkv engine"),
            ("raw", "raw BatchGenerator"),
            ("sequential", "sequential generate_step"),
        ):
            ax.plot(ns, [row[f"{key}_tps"] for row in report["rows"]], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title("continuous batching")
        ax.legend(fontsize=7)

    return save_plot(path, [throughput], f"{report['model']}, {report['date']}")


if __name__ == "__main__":
    main()
