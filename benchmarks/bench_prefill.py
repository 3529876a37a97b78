"""A long prompt joins agents that are decoding: their inter-token gaps and its prefill time.

    python -m benchmarks.bench_prefill [--model tiny:gemma3-bench] [--quick]

``--decoders`` agents (``--decoder-history`` tokens each) decode; after ``--warmup`` of their
tokens a ``--prompt``-token prompt arrives and prefills beside them. Measured, in one process on
one model:

- agentkv, for each ``--stalls`` value of ``EngineConfig.max_decode_stall``: the decoders'
  median gap before the prompt arrived (decode-only steps), their worst gap while it prefilled,
  and the prompt's prefill time (submit to first token);
- the same prompt prefilled alone on an idle engine (the baseline of its prefill time);
- mlx-lm's BatchGenerator as the engine drove it before (one decode step, then one
  ``prefill_step_size`` chunk of the prompt, per ``next()``): today's figures.

Writes benchmarks/results/prefill.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.request import GenerationRequest, PromptCache
from benchmarks.bench_batching import make_prompts
from benchmarks.plots import save_plot, write_report
from benchmarks.synthetic import synthetic_cache

RESULTS = Path(__file__).parent / "results"
FOREVER = 50_000  # longer than the prefill lasts; each decoder reserves its KV


def gaps(times: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive tokens whose later token came in ``(start, end]``."""
    return [b - a for a, b in itertools.pairwise(times) if start < b <= end]


def summary(decoders: list[list[float]], arrived: float, first_token: float, warmup: int) -> dict:
    settled = warmup // 4  # decode-only gaps after the decoders' first few tokens
    before = [g for t in decoders for g in gaps(t[settled:], 0.0, arrived)]
    during = [g for t in decoders for g in gaps(t, arrived, first_token)]
    median = statistics.median(before)
    return {
        "decode_median_ms": median * 1e3,
        "worst_gap_ms": max(during) * 1e3,
        "worst_vs_median": max(during) / median,
        "median_gap_during_ms": statistics.median(during) * 1e3,
        "prefill_s": first_token - arrived,
        "decoder_tokens_during": len(during),
    }


async def agentkv(
    eng: Engine, caches: list[PromptCache], prompt: list[int], warmup: int
) -> dict[str, float]:
    handles = [
        eng.submit(GenerationRequest([20 + i], max_tokens=FOREVER, ignore_eos=True, cache=c))
        for i, c in enumerate(caches)
    ]
    times: list[list[float]] = [[] for _ in handles]

    async def follow(i: int) -> None:
        async for _ in handles[i]:
            times[i].append(time.perf_counter())

    followers = [asyncio.ensure_future(follow(i)) for i in range(len(handles))]
    while min(len(t) for t in times) < warmup:
        await asyncio.sleep(0.01)
    arrived = time.perf_counter()
    joining = eng.submit(GenerationRequest(prompt, max_tokens=1, ignore_eos=True))
    result = await joining.result()
    first_token = result.stats.first_token_at
    counts = [len(t) for t in times]
    while min(len(t) - c for t, c in zip(times, counts, strict=True)) < 2:
        await asyncio.sleep(0.01)  # the gap that straddles the first token is counted
    for handle in handles:
        handle.cancel()
    await asyncio.gather(*followers)
    return summary(times, arrived, first_token, warmup)


async def alone(eng: Engine, prompt: list[int]) -> float:
    result = await eng.generate(GenerationRequest(prompt, max_tokens=1, ignore_eos=True))
    return result.stats.first_token_at - result.stats.submitted_at


def today(eng: Engine, caches: list[PromptCache], prompt: list[int], warmup: int) -> dict:
    """BatchGenerator: a decode step and a prompt chunk per next() (generation thread)."""
    cfg = eng.config
    gen = BatchGenerator(
        eng.model.model,
        completion_batch_size=cfg.completion_batch_size,
        prefill_batch_size=cfg.prefill_batch_size,
        prefill_step_size=cfg.prefill_step_size,
    )
    uids = gen.insert(
        [[20 + i] for i in range(len(caches))],
        max_tokens=[FOREVER] * len(caches),
        caches=[c.layers for c in caches],
        all_tokens=[list(c.tokens) for c in caches],
    )
    times: dict[int, list[float]] = {u: [] for u in uids}
    arrived = first_token = joining = None
    after = FOREVER  # decoders' tokens when the prompt's first token came
    while min(len(t) for t in times.values()) < after + 2:
        for r in gen.next_generated():
            now = time.perf_counter()
            if r.uid == joining:
                first_token = now
                after = min(len(t) for t in times.values())
            else:
                times[r.uid].append(now)
        if joining is None and min(len(t) for t in times.values()) >= warmup:
            arrived = time.perf_counter()
            (joining,) = gen.insert([prompt], max_tokens=[1])
    gen.close()
    return summary(list(times.values()), arrived, first_token, warmup)


async def run(args: argparse.Namespace) -> dict:
    rows = []
    base = EngineConfig(completion_batch_size=args.decoders + 1, speculative="off")
    eng = await Engine.open(args.model, base)
    try:
        vocab = eng.model.vocab_size
        (prompt,) = make_prompts(vocab, 1, args.prompt)
        caches = [
            await eng.run(synthetic_cache, eng.model.model, args.decoder_history, i, vocab)
            for i in range(args.decoders)
        ]
        await alone(eng, prompt[:64])  # warm up
        alone_s = await alone(eng, prompt)
        print(f"alone: prefill {alone_s:.2f} s", flush=True)
        row = await eng.run(today, eng, caches, prompt, args.warmup)
        rows.append({"engine": "BatchGenerator (before)", "max_decode_stall": None, **row})
        print(_fmt(rows[-1], alone_s), flush=True)
    finally:
        await eng.close()
    for stall in args.stalls:
        config = base.model_copy(update={"max_decode_stall": stall})
        eng = await Engine.open(args.model, config)
        try:
            caches = [
                await eng.run(synthetic_cache, eng.model.model, args.decoder_history, i, vocab)
                for i in range(args.decoders)
            ]
            await alone(eng, prompt[:64])
            row = await agentkv(eng, caches, prompt, args.warmup)
        finally:
            await eng.close()
        rows.append({"engine": "agentkv", "max_decode_stall": stall, **row})
        print(_fmt(rows[-1], alone_s), flush=True)
    for row in rows:
        row["prefill_vs_alone"] = row["prefill_s"] / alone_s
    return {
        "benchmark": "prefill",
        "model": args.model,
        "decoders": args.decoders,
        "decoder_history": args.decoder_history,
        "prompt_tokens": args.prompt,
        "alone_prefill_s": alone_s,
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


def _fmt(row: dict, alone_s: float) -> str:
    return (
        f"{row['engine']} (max_decode_stall {row['max_decode_stall']}): decoders' median gap "
        f"{row['decode_median_ms']:.0f} ms, worst while the prompt prefilled "
        f"{row['worst_gap_ms']:.0f} ms ({row['worst_vs_median']:.1f}x); prefill "
        f"{row['prefill_s']:.2f} s ({row['prefill_s'] / alone_s:.2f}x alone)"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="decoding agents while a long prompt joins")
    parser.add_argument("--model", default="tiny:gemma3-bench")
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--decoder-history", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16_384)
    parser.add_argument("--warmup", type=int, default=48, help="decode-only tokens first")
    parser.add_argument("--stalls", type=float, nargs="+", default=[2.0, 3.0])
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, tiny sizes")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.decoders, args.decoder_history = "tiny:gemma3", 3, 20
        args.prompt, args.warmup, args.stalls = 600, 8, [2.0]
    report = asyncio.run(run(args))
    write_report(report, args.out, plot)
    return report


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]
    labels = [
        "before" if r["max_decode_stall"] is None else f"stall {r['max_decode_stall']:g}"
        for r in rows
    ]

    def worst(ax) -> None:
        ax.bar(labels, [r["worst_vs_median"] for r in rows])
        ax.set_ylabel("worst gap / decode-only median")
        ax.set_title("decoders' worst inter-token gap")

    def prefill(ax) -> None:
        ax.bar(labels, [r["prefill_vs_alone"] for r in rows])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("prefill time / alone")
        ax.set_title(f"the {report['prompt_tokens']}-token prompt's prefill")

    title = f"{report['model']}, {report['decoders']} decoders, {report['date']}"
    return save_plot(path, [worst, prefill], title)


if __name__ == "__main__":
    main()
