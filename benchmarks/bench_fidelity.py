"""Fidelity of resumed KV caches on a trained model and real English text, across a restart.

    python -m benchmarks.bench_fidelity [--model gemma3-270m] [--histories 1024 4096] [--quick]

The text is benchmarks/data/alice_ch1_2.txt (Lewis Carroll, *Alice's Adventures in Wonderland*,
chapters I-II, public domain). For each history length H, one engine prefills the first H tokens
(``make_prompt_cache``: ``KVCache`` for global layers, ``RotatingKVCache`` for Gemma's sliding
ones, so a 4K history is well past the 512-token window) and teacher-forces the next
``--continuation`` tokens of the text on a copy of that cache: the uninterrupted reference. It
saves the cache three ways (``none``: exact, ``q8``, ``q4``: keys per channel, values
Hadamard-rotated, ``agentkv.engine.kv.quant``) as the runtime stores caches (blocks and a tail:
``benchmarks.paged_io``) and closes. A fresh engine (the restart) reads
them back as a resume does (``decode_paged``: a layer dequantized from q8 or q4 words holds its
first position as the model computes it for the first token,
``agentkv.engine.batch.layout.first_positions``) and teacher-forces the same tokens. Reported per
variant: argmax agreement with the reference (and its 95% Wilson interval over the
continuation's tokens: at the default 1,024 and 98%, about 97.0-98.7%, so a target a point
away is told apart; 256 tokens could not), mean and max KL(reference || resumed), perplexity
of the continuation, bytes on disk. ``none`` must be token-identical (every log-probability equal).

In the batch (``batch_kv_bits``): ``batch-q8`` and ``batch-q4`` read the q8 / q4 files as a
batch holding KV quantized does (``Engine.packing``: q8's stored words packed as they are, no
dequantize; q4's expanded, then held as the batch holds q4: keys per channel, values rotated,
the newest positions in float, and a global layer's first position as the engine computes it,
``agentkv.engine.batch.layout.first_positions``) into its group buffers (``KVLayout.buffers``), and
teacher-force the same tokens through them in chunks of ``--chunk``, as a prompt is fed: the
history as held, every fed token's keys and values held as the batch writes them (q8: each
position reads the 16 before it in float, back to the history's end or the last multiple of
``--block-tokens``, as the runtime's batch does).
``decode-q8`` and ``decode-q4`` feed them one a step, as generation decodes (each token's keys
held as the batch holds a decoded token's before it is attended); ``decode-exact``, the batch in
the model's precision fed the same way, is their control (a step's attention computes in
another order than a chunk's, which can flip near-ties on its own).
Perplexity of the history itself comes from the prefill. Every MLX op runs on the engine's
generation thread. Writes benchmarks/results/fidelity.json and fidelity.png.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from agentkv.engine.batch.layout import KVLayout, first_positions
from agentkv.engine.batch.quantized import QuantizedLayer
from agentkv.engine.batch.rows import is_packed
from agentkv.engine.config import group_size_for
from agentkv.engine.engine import Engine
from agentkv.engine.kv.encoded import DEFAULT_BLOCK_TOKENS
from agentkv.engine.request import PromptCache
from benchmarks.bench_roundtrip import compare, next_token_logprobs
from benchmarks.paged_io import load_paged, nbytes, save_paged
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"
TEXT = Path(__file__).parent / "data" / "alice_ch1_2.txt"
VARIANTS = {"none": None, "q8": 8, "q4": 4}  # name -> kv_bits
# name -> (batch_kv_bits, reading the file of those bits, and whether the tokens are fed in
# chunks of --chunk, as a prompt is, or one a step, as generation decodes them)
BATCH = {
    "batch-q8": (8, True),
    "batch-q4": (4, True),
    "decode-exact": (None, False),  # the control: the batch in the model's precision
    "decode-q8": (8, False),
    "decode-q4": (4, False),
}
TARGETS = {
    "q8_agreement_min": 0.99,
    "q4_agreement_min": 0.98,  # at 4K-token histories and longer, as the batch targets
    "batch_q8_agreement_min": 0.99,
    "batch_q4_agreement_min": 0.98,
}


def prefill(model: object, tokens: list[int], chunk: int) -> tuple[PromptCache, float]:
    """The model's cache after ``tokens`` and the summed NLL of tokens[1:] (one pass)."""
    from mlx_lm.models.cache import make_prompt_cache

    layers = make_prompt_cache(model)
    nll = 0.0
    for i in range(0, len(tokens), chunk):
        part = tokens[i : i + chunk]
        logits = model(mx.array(part)[None], cache=layers)[0].astype(mx.float32)
        targets = mx.array(tokens[i + 1 : i + 1 + len(part)])
        logprobs = logits[: targets.shape[0]] - mx.logsumexp(
            logits[: targets.shape[0]], axis=-1, keepdims=True
        )
        nll -= mx.sum(mx.take_along_axis(logprobs, targets[:, None], axis=-1)).item()
    mx.eval(*(x for layer in layers for x in (layer.keys, layer.values)))
    return PromptCache(layers, list(tokens)), nll


def continuation_perplexity(logprobs: mx.array, fed: list[int]) -> float:
    """Perplexity of fed[1:] under the distributions after fed[:-1] (teacher-forced)."""
    picked = mx.take_along_axis(logprobs[:-1], mx.array(fed[1:])[:, None], axis=-1)
    return math.exp(-mx.mean(picked).item())


def wilson(agreement: float, n: int) -> list[float]:
    """The 95% Wilson score interval of an agreement measured over ``n`` tokens."""
    z = 1.96
    centre = (agreement + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(agreement * (1 - agreement) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(centre - half, 4), round(min(1.0, centre + half), 4)]


def flip_gaps(reference: mx.array, other: mx.array) -> list[float]:
    """Where the top-1 tokens differ: how far (nats, under the reference) the resumed cache's
    top-1 token was behind the reference's. Small gaps mean near-ties flipped."""
    ref_top, other_top = mx.argmax(reference, axis=-1), mx.argmax(other, axis=-1)
    gaps = mx.take_along_axis(reference, ref_top[:, None], axis=-1) - mx.take_along_axis(
        reference, other_top[:, None], axis=-1
    )
    flipped = np.array(ref_top != other_top)
    return [round(float(g), 4) for g in np.array(gaps[:, 0])[flipped]]


def save(cache: PromptCache, kv_bits: int | None, group_size: int, path: Path) -> tuple[list, int]:
    paths = save_paged(path, cache, kv_bits, group_size)
    return paths, nbytes(paths)


def load(path: Path, paths: list[Path], first_positions: Callable) -> PromptCache:
    return load_paged(paths, None, first_positions)


class Fenced:
    """A batch layer as the engine steps it: a quantized one is written with each position's
    fence (where it joined, or the last multiple of ``block`` tokens, the stored blocks'
    boundaries a cache may start from), as ``agentkv.engine.runner`` gives it; the rest as it is."""

    def __init__(self, layer: object, joined: int, block: int | None):
        self.layer, self.joined, self.block = layer, joined, block

    def __getattr__(self, name: str) -> object:
        return getattr(self.layer, name)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        if not isinstance(self.layer, QuantizedLayer):
            return self.layer.update_and_fetch(keys, values)
        first = self.layer.lengths[0]
        fences = [
            max(self.joined, p // self.block * self.block if self.block else 0)
            for p in range(first, first + keys.shape[2])
        ]
        return self.layer.write(keys, values, [fences])


def batch_logprobs(
    model: object,
    layout: KVLayout,
    cache: PromptCache,
    tokens: list[int],
    chunk: int,
    block: int | None,
) -> tuple[mx.array, int]:
    """Log-probabilities (T, vocab) after each of ``tokens`` fed through the batch's group
    buffers made from ``cache`` (fenced at multiples of ``block``), and how many of its layers
    came in packed."""
    first = None  # q4's global layers read it, as the engine's rows do
    if layout.reads_first_positions:
        first = first_positions(model, cache.tokens[0])
    layers = [Fenced(x, cache.num_tokens, block) for x in layout.buffers(cache.layers, first)]
    parts = []
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[i : i + chunk])[None], cache=layers)[0].astype(mx.float32)
        parts.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(parts[-1])
    return mx.concatenate(parts, axis=0), sum(is_packed(x) for x in cache.layers)


async def before_restart(args: argparse.Namespace, cache_dir: Path) -> tuple[dict, dict]:
    """Tokenize, prefill, teacher-force the reference, save every variant; then close."""
    eng = await Engine.open(args.model)
    runs = {}
    try:
        model = eng.model.model
        ids = eng.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
        info = {"text_tokens": len(ids), "sliding_window": eng.model.sliding_window}
        needed = max(args.histories) + args.continuation
        if len(ids) < needed:
            raise SystemExit(f"{TEXT.name} has {len(ids)} tokens; this run needs {needed}")
        for h in args.histories:
            history, fed = ids[:h], ids[h : h + args.continuation]
            start = time.perf_counter()
            cache, nll = await eng.run(prefill, model, history, args.chunk)
            prefill_s = time.perf_counter() - start
            reference = await eng.run(next_token_logprobs, model, cache, fed, args.chunk)
            files = {}
            for name, bits in VARIANTS.items():
                path = cache_dir / f"h{h}-{name}"
                group = group_size_for(bits, args.group_size)
                files[name] = (path, *await eng.run(save, cache, bits, group, path))
            runs[h] = {
                "fed": fed,
                "reference": await eng.run(np.array, reference),  # host memory across restart
                "files": files,
                "history_perplexity": math.exp(nll / (h - 1)),
                "prefill_s": prefill_s,
            }
            del cache, reference
    finally:
        await eng.close()
    return info, runs


async def after_restart(args: argparse.Namespace, runs: dict) -> list[dict]:
    """A fresh engine loads every saved file and teacher-forces the same tokens."""
    eng = await Engine.open(args.model)
    rows = []
    try:
        model = eng.model.model
        for h, run in runs.items():
            fed = run["fed"]
            reference = await eng.run(mx.array, run["reference"])
            row = {
                "history": h,
                "continuation": len(fed),
                "history_perplexity": run["history_perplexity"],
                "reference_perplexity": await eng.run(continuation_perplexity, reference, fed),
                "prefill_s": run["prefill_s"],
                "variants": {},
            }
            for name, (path, paths, file_bytes) in run["files"].items():
                start = time.perf_counter()
                cache = await eng.run(load, path, paths, eng.first_positions)
                load_s = time.perf_counter() - start
                logprobs = await eng.run(next_token_logprobs, model, cache, fed, args.chunk)
                stats = await eng.run(compare, reference, logprobs)
                stats["perplexity"] = await eng.run(continuation_perplexity, logprobs, fed)
                stats["flip_gaps_nats"] = await eng.run(flip_gaps, reference, logprobs)
                stats["agreement_95"] = wilson(stats["agreement"], len(fed))
                row["variants"][name] = stats | {"file_bytes": file_bytes, "load_s": load_s}
                del cache, logprobs
            for name, (bits, chunked) in BATCH.items():
                group = group_size_for(bits, args.group_size)
                layout = await eng.run(KVLayout.of, model, bits, group)
                _, paths, file_bytes = run["files"]["none" if bits is None else f"q{bits}"]
                cache = await eng.run(load_paged, paths, layout.packing, eng.first_positions)
                chunk = args.chunk if chunked else 1
                logprobs, packed = await eng.run(
                    batch_logprobs, model, layout, cache, fed, chunk, args.block_tokens
                )
                stats = await eng.run(compare, reference, logprobs)
                stats["perplexity"] = await eng.run(continuation_perplexity, logprobs, fed)
                stats["flip_gaps_nats"] = await eng.run(flip_gaps, reference, logprobs)
                stats["agreement_95"] = wilson(stats["agreement"], len(fed))
                row["variants"][name] = stats | {
                    "file_bytes": file_bytes,
                    "packed_layers": packed,
                    "batch_token_bytes": sum(layout.token_bytes),
                }
                del cache, logprobs
            rows.append(row)
            del reference
    finally:
        await eng.close()
    return rows


async def run(args: argparse.Namespace, cache_dir: Path) -> dict:
    info, runs = await before_restart(args, cache_dir)
    rows = await after_restart(args, runs)
    q8 = min(row["variants"]["q8"]["agreement"] for row in rows)
    long = {  # the least agreement at 4K-token histories and longer (None: none was run)
        name: min(row["variants"][name]["agreement"] for row in rows if row["history"] >= 4096)
        if max(args.histories) >= 4096
        else None
        for name in ("q4", "batch-q8", "batch-q4", "decode-q8", "decode-q4")
    }
    exact = all(
        row["variants"]["none"]["max_abs_logprob_diff"] == 0.0
        and row["variants"]["none"]["agreement"] == 1.0
        for row in rows
    )
    return {
        "benchmark": "fidelity",
        "model": args.model,
        "text": f"{TEXT.name} ({info['text_tokens']} tokens)",
        "sliding_window": info["sliding_window"],
        "histories": args.histories,
        "continuation_tokens": args.continuation,
        "group_size": args.group_size
        or "q8 128, q4 128 (5-bit keys per channel over 32 positions)",
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "exact_is_identical": exact,
        "rows": rows,
        "targets": TARGETS,
        "targets_met": {
            "q8_agreement": q8 >= TARGETS["q8_agreement_min"],
            "exact": exact,
            **{
                f"{name.replace('-', '_')}_agreement": None
                if long[name] is None
                else long[name] >= TARGETS[f"{_target(name)}_agreement_min"]
                for name in long
            },
        },
    }


def _target(name: str) -> str:
    """The target a variant is held to (fed a step at a time, as in chunks)."""
    return name.replace("decode-", "batch-").replace("-", "_")


def print_table(report: dict) -> None:
    print(
        f"{report['model']} on {report['text']}, window {report['sliding_window']}, "
        f"{report['continuation_tokens']} teacher-forced tokens after a restart, "
        f"group size {report['group_size']}"
    )
    print(
        f"{'history':>8}{'ppl hist':>10}{'variant':>13}{'agree':>9}{'95% interval':>17}"
        f"{'mean KL':>11}{'max KL':>10}"
        f"{'ppl cont':>10}{'MiB':>8}  top-1 flips: gap (nats) behind the reference's top-1"
    )
    for row in report["rows"]:
        for name, v in row["variants"].items():
            print(
                f"{row['history']:>8}{row['history_perplexity']:>10.2f}{name:>13}"
                f"{v['agreement']:>9.4f}{'{:.4f}-{:.4f}'.format(*v['agreement_95']):>17}"
                f"{v['mean_kl']:>11.2e}{v['max_kl']:>10.2e}"
                f"{v['perplexity']:>10.3f}{v['file_bytes'] / 2**20:>8.1f}  "
                f"{len(v['flip_gaps_nats'])} flips, largest gap "
                f"{max(v['flip_gaps_nats'], default=0):.3f}"
            )
    print(f"targets met: {report['targets_met']}", flush=True)


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]
    names = [*VARIANTS, *BATCH]
    x = np.arange(len(names))
    width = 0.8 / len(rows)

    def panel(key: str, label: str, fmt: str, log: bool = False):
        def draw(ax) -> None:
            for i, row in enumerate(rows):
                values = [row["variants"][n][key] for n in names]
                # An exact resume has KL 0, which a log axis cannot draw: a stub, labelled 0.
                heights = [max(v, 1e-7) if log else v for v in values]
                bars = ax.bar(x + (i - (len(rows) - 1) / 2) * width, heights, width)
                bars.set_label(f"history {row['history']}")
                ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
            ax.set_xticks(x, names)
            ax.set_ylabel(label)
            if log:
                ax.set_yscale("log")
            else:
                ax.set_ylim(0, 1.3)  # room for the legend above the bars
            ax.legend(fontsize=8, loc="upper left")

        return draw

    title = (
        f"{report['model']}: resumed after restart vs uninterrupted, "
        f"{report['continuation_tokens']} teacher-forced tokens, {report['date']}"
    )
    return save_plot(
        path,
        [
            panel("agreement", "top-1 agreement", "{:.4f}"),
            panel("mean_kl", "mean KL (nats, log scale)", "{:.1e}", log=True),
        ],
        title,
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="fidelity of resumed caches on a trained model")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--histories", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--continuation", type=int, default=1024, help="teacher-forced tokens")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per forward pass")
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="the stored blocks' size: the batch (q8) reads no float copy across a multiple",
    )
    parser.add_argument(
        "--group-size", type=int, choices=(32, 64, 128), help="default: each precision's own"
    )
    parser.add_argument("--cache-dir", type=Path, help="where to write files (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="histories 64 and 600, 32 tokens")
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity.json")
    parser.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    args = parser.parse_args(argv)
    if args.quick:
        args.histories, args.continuation = [64, 600], 32
    if min(args.histories) < 2 or args.continuation < 2 or args.chunk < 1:
        parser.error("histories and --continuation need at least 2 tokens, --chunk at least 1")
    with tempfile.TemporaryDirectory(prefix="agentkv-fidelity-", dir=args.cache_dir) as tmp:
        report = asyncio.run(run(args, Path(tmp)))
    print_table(report)
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
