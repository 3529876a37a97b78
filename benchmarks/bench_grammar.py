"""What constrained decoding (a reply held to a JSON Schema, ``agentkv.engine.grammar``) costs, the
constrained sequence and its unconstrained neighbours in the batch, same model, same process.

    python -m benchmarks.bench_grammar [--model gemma3-270m] [--batch 8] [--quick]

Rounds alternate, ``--repeats`` times each (medians reported):

- ``free``: ``--batch`` unconstrained sequences, ``--tokens`` each (end-of-sequence ignored);
- ``mixed``: the same, one of them replaced by a constrained one (a JSON object whose string
  field may run to ``--tokens``): the unconstrained neighbours' tok/s against ``free``;
- ``half``: the same, half of them constrained: the whole batch's tok/s against ``free``;
- ``alone``: one constrained sequence against one unconstrained one: ms per token.

Also the time to compile the schema, and how long the tokenizer's index (built in the
background when the engine opens) was still to wait for. Writes
benchmarks/results/grammar.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.request import GenerationRequest
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"


def schema(tokens: int) -> dict:
    """Notes at least 4 characters a token long: the reply runs to ``tokens`` (no model ends
    it sooner), so it is timed over as many tokens as an unconstrained one."""
    return {
        "type": "object",
        "properties": {"notes": {"type": "string", "minLength": 4 * tokens}},
        "required": ["notes"],
        "additionalProperties": False,
    }


def prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    return [[(31 * i + 7 * j) % (vocab - 16) + 16 for j in range(length)] for i in range(n)]


async def timed(engine: Engine, requests: list[GenerationRequest]) -> tuple[float, list]:
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    return time.perf_counter() - start, results


async def run(args: argparse.Namespace) -> dict:
    engine = await Engine.open(args.model, EngineConfig(speculative="off"))
    try:
        start = time.perf_counter()
        await asyncio.to_thread(engine.grammars.warm)  # (begun in the background at open)
        warm_s = time.perf_counter() - start
        start = time.perf_counter()
        grammar = await asyncio.to_thread(engine.grammars.json_schema, schema(args.tokens))
        compile_ms = (time.perf_counter() - start) * 1e3
        vocab = engine.model.vocab_size
        batch = prompts(vocab, args.batch, args.prompt_len)

        def free(tokens: list[int]) -> GenerationRequest:
            return GenerationRequest(tokens, max_tokens=args.tokens, ignore_eos=True)

        def held(tokens: list[int]) -> GenerationRequest:
            return GenerationRequest(tokens, max_tokens=args.tokens, grammar=grammar)

        await timed(engine, [free(p) for p in batch])  # warm-up
        await timed(engine, [held(batch[0])])
        rounds: dict[str, list[float]] = {
            k: [] for k in ("free", "mixed", "half", "held", "single")
        }
        held_tokens = []
        for _ in range(args.repeats):
            wall, _ = await timed(engine, [free(p) for p in batch])
            rounds["free"].append(args.tokens * args.batch / wall)
            mixed = [held(batch[0]), *(free(p) for p in batch[1:])]
            wall, _ = await timed(engine, mixed)
            # The neighbours' tokens over the time the whole batch took.
            rounds["mixed"].append(args.tokens * (args.batch - 1) / wall)
            half = args.batch // 2
            wall, results = await timed(
                engine, [*(held(p) for p in batch[:half]), *(free(p) for p in batch[half:])]
            )
            rounds["half"].append(sum(len(r.token_ids) for r in results) / wall)
            wall, [one] = await timed(engine, [held(batch[0])])
            held_tokens.append(len(one.token_ids))
            rounds["held"].append(wall * 1e3 / len(one.token_ids))
            wall, _ = await timed(engine, [free(batch[0])])
            rounds["single"].append(wall * 1e3 / args.tokens)
    finally:
        await engine.close()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    share = med["free"] * (args.batch - 1) / args.batch  # the neighbours' part of a free batch
    return {
        "model": args.model,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}",
        "batch": args.batch,
        "tokens": args.tokens,
        "tokenizer_ready_wait_s": round(warm_s, 2),
        "compile_ms": round(compile_ms, 1),
        "free_tps": round(med["free"], 1),
        "mixed_neighbours_tps": round(med["mixed"], 1),
        "neighbours_vs_free": round(med["mixed"] / share, 3),
        "half_constrained_tps": round(med["half"], 1),
        "half_vs_free": round(med["half"] / med["free"], 3),
        "held_ms_per_token": round(med["held"], 2),
        "single_ms_per_token": round(med["single"], 2),
        "held_vs_single": round(med["held"] / med["single"], 3),
        "held_tokens": held_tokens,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="cost of constrained decoding")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, a batch of 2")
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.tokens, args.prompt_len, args.repeats = (
            "tiny:gemma3",
            2,
            8,
            16,
            1,
        )
    report = asyncio.run(run(args))
    print(report)
    write_report(report, args.out, plot)
    return report


def plot(report: dict, path: Path) -> Path:
    def per_token(ax) -> None:
        names = ["unconstrained", "JSON Schema"]
        values = [report["single_ms_per_token"], report["held_ms_per_token"]]
        bar_labels(ax, ax.bar(names, values), "{:.2f}")
        ax.set_ylabel("ms per token, one sequence")
        ax.set_title("a constrained sequence")

    def neighbours(ax) -> None:
        share = report["free_tps"] * (report["batch"] - 1) / report["batch"]
        names = ["all free", "one constrained"]
        bar_labels(ax, ax.bar(names, [share, report["mixed_neighbours_tps"]]), "{:.0f}")
        ax.set_ylabel(f"tok/s of {report['batch'] - 1} unconstrained sequences")
        ax.set_title("its neighbours in the batch")

    def half(ax) -> None:
        names = ["all free", "half constrained"]
        values = [report["free_tps"], report["half_constrained_tps"]]
        bar_labels(ax, ax.bar(names, values), "{:.0f}")
        ax.set_ylabel(f"tok/s of a batch of {report['batch']}")
        ax.set_title("the whole batch")

    panels = [per_token, neighbours, half]
    return save_plot(path, panels, f"{report['model']}, {report['date']}")


if __name__ == "__main__":
    main()
