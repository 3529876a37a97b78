"""Quantized KV in the running batch and the hot tier (``batch_kv_bits``): how many
long-history agents one KV budget lets decode together, and how fast, and how many one hot-tier
budget holds, in the model's precision, q8 and q4, and against float16.

    python -m benchmarks.bench_batch_kv [--model tiny:gemma3-bench] [--fits 4]
        [--agents N] [--group-size 128] [--no-float16] [--layer-dtype bfloat16]
        [--prefill 4096] [--quick]

The budget is what ``--fits`` agents of ``--history`` tokens set aside in the model's
precision. ``8 * --fits`` such agents (synthetic caches, see ``benchmarks.synthetic``) ask for
``--tokens`` each, once per precision, same process: the most agents in the batch at once, the
KV held at most, generated tokens per second over the run and in the steps that only
decoded (the median; free of joins and of a GPU's first compilation of each kernel), and each
against the model's precision. Then, per precision, the same agents' finished caches (as the
engine hands them back: packed when quantized) go one by one into a ``HotTier`` whose budget
holds ``--fits`` of them in the model's precision: the agents it holds at the end and its
bytes per token. And, per precision, the seconds one ``--prefill`` -token prompt takes to
prefill in a fresh engine (``prefill_s``, against the model's precision: ``prefill_vs_model``).
The capacity baseline is float16 (unless ``--no-float16``): the model's weights cast to
float16 in a temporary copy, KV in float16, in the same two budgets (``3 * --fits`` agents ask
for 2 tokens each: only the counts are wanted; float16 is emulated and slow on CPU), and each
row's agents against its count (``agents_vs_float16``, ``hot_agents_vs_float16``); q8 and q4
are counted on that float16 model too (``float16.quantized``: their float positions float16,
as on a float16 or bfloat16 model). q8 and q4
quantize in groups of ``--group-size`` (``batch_kv_group_size``; default: each precision's
own, 128 for both; q4's keys are per channel in 5-bit codes over 32 positions whatever it
is).
Last, one attention layer shaped as a Gemma 3 12B global layer (``--layer``: key-value
heads, query heads, head size), ``--fits`` rows of about ``--history`` positions (padded to
each other, masked): its decode step in
``--layer-dtype`` (default float32, the CPU models'), q8 and q4 as ``agentkv.engine.attention`` runs
them (their float positions in that dtype), and q4 with its
keys expanded (as attention read them before folding each group's scales into the query):
milliseconds a step (the best of ``STEPS``) and the step's working set (MLX's peak memory
above what the buffer holds). And the same layer's prompt chunk: one row of ``--history / 2``
positions attended by a ``--chunk`` -token chunk written after them (``chunk``), per precision,
its time and working set; on a CPU also q8 with its words read by ``mx.quantized_matmul`` as
a decode step reads them (``q8 quantized matmul``: how chunks were read before they were
expanded, see ``agentkv.engine.attention.words.EXPANDED_ROWS``).
Writes benchmarks/results/batch_kv.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from agentkv.caches.hot import HotTier
from agentkv.engine.attention import words
from agentkv.engine.attention.dense import decode_attention
from agentkv.engine.attention.quantized import quantized_attention
from agentkv.engine.batch.buffers import GroupKVCache
from agentkv.engine.batch.channel import channel_buffer
from agentkv.engine.batch.packing import Packing
from agentkv.engine.batch.quantized import quantized_buffer
from agentkv.engine.batch.rows import channel_row
from agentkv.engine.codes import hadamard
from agentkv.engine.config import EngineConfig, choose_group_size, group_size_for
from agentkv.engine.engine import Engine
from agentkv.engine.request import GenerationRequest
from agentkv.engine.scheme import LayerScheme
from agentkv.models.directory import resolve_model_path
from benchmarks.bench_budget import PRECISIONS, ask, group_size
from benchmarks.plots import bar_labels, save_plot, write_report
from benchmarks.synthetic import synthetic_cache

RESULTS = Path(__file__).parent / "results"


async def need_bytes(args: argparse.Namespace) -> int:
    """What one agent sets aside in the model's precision."""
    eng = await Engine.open(args.model, EngineConfig(speculative="off"))
    try:
        cache = await eng.run(synthetic_cache, eng.model.model, args.history, 0, 1000)
        request = GenerationRequest([20], max_tokens=args.tokens, cache=cache)
        return eng.kv_bytes_needed(request)
    finally:
        await eng.close()


async def hot_held(args: argparse.Namespace, bits: int | None, budget: int) -> dict:
    """The agents' finished caches (``--history`` tokens and one more), put one by one into a
    hot tier of ``budget`` bytes: what it holds at the end."""
    eng = await Engine.open(
        args.model, EngineConfig(batch_kv_bits=bits, speculative="off", **group_size(args))
    )
    try:
        vocab = eng.model.vocab_size
        hot = HotTier(budget)
        for i in range(args.agents):
            cache = await eng.run(synthetic_cache, eng.model.model, args.history, i, vocab)
            result = await eng.generate(GenerationRequest([20 + i], max_tokens=1, cache=cache))
            del cache
            hot.put(f"agent-{i}", result.cache, 1, "")
            del result
        report = hot.report()
    finally:
        await eng.close()
    (held,) = report["by_precision"].values()
    return {
        "hot_budget_mb": budget / 2**20,
        "hot_agents": report["agents"],
        "hot_bytes": report["bytes"],
        "hot_token_bytes": held["token_bytes"],
    }


async def prefill_seconds(args: argparse.Namespace, bits: int | None) -> float:
    """Seconds to prefill one ``--prefill`` -token prompt (no cache) and sample a token, the
    best of two, after a short prompt has compiled the engine's kernels."""
    eng = await Engine.open(
        args.model, EngineConfig(batch_kv_bits=bits, speculative="off", **group_size(args))
    )
    try:
        vocab = eng.model.vocab_size
        tokens = [(7 * i) % (vocab - 16) + 16 for i in range(args.prefill)]
        await eng.generate(GenerationRequest(tokens[:64], max_tokens=1))
        best = math.inf
        for _ in range(2):
            start = time.perf_counter()
            await eng.generate(GenerationRequest(tokens, max_tokens=1))
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        await eng.close()


def float16_copy(spec: str, root: Path) -> Path:
    """The model ``spec`` names with its floating-point weights cast to float16, written under
    ``root`` (its config and tokenizer files copied as they are)."""
    source = resolve_model_path(spec)
    target = root / f"{source.name}-float16"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    for path in source.glob("*.safetensors"):
        weights = mx.load(str(path))
        cast = {
            k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
        mx.save_safetensors(str(target / path.name), cast, metadata={"format": "mlx"})
    return target


def _rate(tps: float | None) -> str:
    return "none" if tps is None else f"{tps:.1f}"


def show(name: str, row: dict) -> None:
    prefill = (
        f"; a {row['prefill_tokens']}-token prompt prefilled in {row['prefill_s']:.2f} s"
        if "prefill_s" in row
        else ""
    )
    print(
        f"{name:>7}: at most {row['max_in_batch']} of {row['agents']} in the batch, KV held "
        f"at most {row['max_held_mb']:.1f} of {row['budget_mb']:.1f} MB, "
        f"{row['tokens_per_s']:.1f} tok/s ({_rate(row['decode_tokens_per_s'])} in decode-only "
        f"steps), {row['completed']} completed; a hot tier of "
        f"{row['hot_budget_mb']:.1f} MB holds {row['hot_agents']} "
        f"({row['hot_token_bytes']:.0f} bytes a token){prefill}",
        flush=True,
    )


async def float16_row(args: argparse.Namespace, budget: int, hot_budget: int) -> dict:
    """The capacity baseline: the model cast to float16, KV in float16, in the same budgets.
    ``3 * --fits`` agents ask for 2 tokens each (more than fit: only the count is wanted; its
    tok/s is float16 on this device, emulated and slow on CPU). Asking for 2 tokens rather
    than ``--tokens`` each reserves up to 14 positions fewer of 8K: it can only favour
    float16. The same float16 model with q8 and q4 in the batch (``--agents`` asking for
    ``--tokens`` each, so that none finishes before the batch fills; counts only) gives
    ``quantized``: their float positions are float16 there, as on a float16 or bfloat16
    model, where on the float32 model they are float32."""
    with tempfile.TemporaryDirectory() as root:
        spec = str(float16_copy(args.model, Path(root)))
        asking = argparse.Namespace(
            **{**vars(args), "model": spec, "agents": 3 * args.fits, "tokens": 2}
        )
        row, need = await ask(asking, budget, None)
        row |= await hot_held(asking, None, hot_budget)
        quantized = {}
        for name, bits in PRECISIONS.items():
            if bits is None:
                continue
            asking.agents, asking.tokens = args.agents, args.tokens
            held, _ = await ask(asking, budget, bits)
            held |= await hot_held(asking, bits, hot_budget)
            quantized[name] = {
                "max_in_batch": held["max_in_batch"],
                "hot_agents": held["hot_agents"],
                "agents_vs_float16": round(held["max_in_batch"] / row["max_in_batch"], 3),
                "hot_agents_vs_float16": round(held["hot_agents"] / row["hot_agents"], 3),
            }
    return row | {"need_mb": need / 2**20, "quantized": quantized}


async def run(args: argparse.Namespace) -> dict:
    budget = args.fits * await need_bytes(args)
    # The hot tier's budget: what --fits agents' caches hold in the model's precision.
    one = await hot_held(argparse.Namespace(**{**vars(args), "agents": 1}), None, 1 << 62)
    hot_budget = args.fits * one["hot_bytes"]
    rows = {}
    for name, bits in PRECISIONS.items():
        row, need = await ask(args, budget, bits)
        row |= await hot_held(args, bits, hot_budget)
        row["prefill_s"] = round(await prefill_seconds(args, bits), 3)
        row["prefill_tokens"] = args.prefill
        rows[name] = row | {"need_mb": need / 2**20}
        show(name, rows[name])
    float16 = None
    if args.float16:
        float16 = await float16_row(args, budget, hot_budget)
        show("float16", float16)
    base = rows["model"]
    for row in rows.values():
        row["agents_vs_model"] = round(row["max_in_batch"] / base["max_in_batch"], 3)
        row["tps_vs_model"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        decode, base_decode = row["decode_tokens_per_s"], base["decode_tokens_per_s"]
        row["decode_tps_vs_model"] = (
            round(decode / base_decode, 3) if decode and base_decode else None
        )
        row["hot_agents_vs_model"] = round(row["hot_agents"] / base["hot_agents"], 3)
        row["prefill_vs_model"] = round(row["prefill_s"] / base["prefill_s"], 3)
        if float16 is not None:
            row["agents_vs_float16"] = round(row["max_in_batch"] / float16["max_in_batch"], 3)
            row["hot_agents_vs_float16"] = round(row["hot_agents"] / float16["hot_agents"], 3)
    if float16 is not None:
        for name in ("q8", "q4"):
            same = float16["quantized"][name]
            print(
                f"{name}: {rows[name]['agents_vs_float16']:.3f}x the float16 agents in the "
                f"batch, {rows[name]['hot_agents_vs_float16']:.3f}x in the hot tier; on the "
                f"float16 model {same['agents_vs_float16']:.3f}x and "
                f"{same['hot_agents_vs_float16']:.3f}x",
                flush=True,
            )
    return {
        "benchmark": "batch_kv",
        "model": args.model,
        "history": args.history,
        "tokens": args.tokens,
        "fits": args.fits,
        "group_size": args.group_size
        or "q8 128, q4 128 (5-bit keys per channel over 32 positions)",
        "float16": float16,
        "budget_mb": budget / 2**20,
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


STEPS = 5


def attention_steps(
    history: int,
    rows: int,
    layer: tuple[int, int, int],
    group: int | None = None,
    dtype: mx.Dtype = mx.float32,
) -> dict:
    """One attention layer's decode step over ``rows`` histories of about ``history``
    positions (row ``b``: ``5 * b`` fewer, so the group pads them), masked as the engine masks
    a padded group, per precision (in groups of ``group``, else of each one's own; q8's keys
    rotated as the batch holds them; q4 reading each row's first position in float), the
    unquantized row and the float positions in
    ``dtype``: ``ms`` (the best of :data:`STEPS`) and ``working_set_mb``."""
    kv_heads, q_heads, dim = layer
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    scale = dim**-0.5

    def float_rows() -> list[KVCache]:
        out = []
        for b in range(rows):
            row = KVCache()
            shape = (1, kv_heads, history - 5 * b, dim)  # padded, groups out of phase
            row.update_and_fetch(
                mx.random.normal(shape, dtype, key=mx.random.key(2 * b)),
                mx.random.normal(shape, dtype, key=mx.random.key(2 * b + 1)),
            )
            mx.eval(row.keys, row.values)
            out.append(row)
        return out

    # (as the batch chooses: another size where the preferred one does not divide the heads)
    g8, g4 = (choose_group_size(dim, group_size_for(bits, group)) for bits in (8, 4))
    scheme = LayerScheme(8, g8, rotated_keys=dim & (dim - 1) == 0)
    q8 = Packing(8, (scheme,), ((dim, dim),), dtype)

    def attend(name: str, fetched: tuple, q: mx.array, mask: mx.array) -> mx.array:
        if name in ("q8", "q4"):
            return quantized_attention(q, fetched[0], scale, mask, None)
        if name == "q4 keys expanded":
            keys, values = fetched[0].expanded()
        else:
            keys, values = fetched
        if on_cpu and isinstance(keys, mx.array):
            out = decode_attention(q, keys, values, scale, mask)
        else:
            # (no cache: a quantized buffer's ``bits`` would send mlx-lm down its quantized path)
            out = scaled_dot_product_attention(q, keys, values, None, scale=scale, mask=mask)
        return out if name == "model" else hadamard(out)

    results = {}
    for name in ("model", "q8", "q4", "q4 keys expanded"):
        if name == "model":
            buffer = GroupKVCache.merge(float_rows())
        elif name == "q8":
            rows_ = [q8.pack(0, r) for r in float_rows()]
            buffer = quantized_buffer(rows_, None, 8, g8, q8.keys_rotated(0))
        else:  # (each row reading its first position in float, as the engine's do)
            packed_rows = []
            for r in float_rows():
                packed_rows.append(channel_row(r, g4))
                packed_rows[-1].first_kv = (r.keys[..., :1, :], r.values[..., :1, :])
            buffer = channel_buffer(packed_rows, None, g4)
            del packed_rows
        mx.eval(buffer.state, getattr(buffer, "first_kv", None) or [])
        times, peaks = [], []
        for step in range(STEPS):
            k, v, q = (
                mx.random.normal(
                    (rows, heads, 1, dim), dtype, key=mx.random.key(100 + 3 * step + i)
                )
                for i, heads in enumerate((kv_heads, kv_heads, q_heads))
            )
            mask = buffer.make_mask(1)
            fetched = buffer.update_and_fetch(k, v)
            held = fetched[0]
            if name == "model":
                mx.eval(mask, fetched)
            else:
                mx.eval(mask, held.keys, held.values, held.recent)
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            start = time.perf_counter()
            mx.eval(attend(name, fetched, q, mask))
            times.append(time.perf_counter() - start)
            peaks.append(mx.get_peak_memory() - before)
            del fetched, held, mask
        results[name] = {
            "ms": round(1000 * min(times), 2),
            "working_set_mb": round(max(peaks) / 2**20, 1),
        }
        del buffer
    base = results["model"]
    for row in results.values():
        row["ms_vs_model"] = round(row["ms"] / base["ms"], 3)
    return {
        "history": history,
        "rows": rows,
        "layer": list(layer),
        "dtype": str(dtype),
        "by_precision": results,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="quantized KV in the batch: agents per budget")
    parser.add_argument("--model", default="tiny:gemma3-bench")
    parser.add_argument("--fits", type=int, default=4, help="agents the budget holds unquantized")
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--agents", type=int, help="agents asking (default: 8 x --fits)")
    parser.add_argument(
        "--layer",
        type=int,
        nargs=3,
        default=(8, 16, 256),
        metavar=("KV_HEADS", "Q_HEADS", "DIM"),
        help="the attention layer timed (default: a Gemma 3 12B global layer)",
    )
    parser.add_argument(
        "--layer-dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="the timed layer's unquantized keys and values, and the quantized ones' float "
        "positions (default float32, the CPU models' precision)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        choices=(32, 64, 128),
        help="batch_kv_group_size of the q8 and q4 rows (default: each precision's own)",
    )
    parser.add_argument(
        "--no-float16",
        dest="float16",
        action="store_false",
        help="skip the float16 capacity baseline (the model cast to float16)",
    )
    parser.add_argument(
        "--prefill", type=int, default=4096, help="the prompt whose prefill is timed (tokens)"
    )
    parser.add_argument(
        "--chunk", type=int, default=512, help="the timed layer's prompt chunk (tokens)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, 1000-token histories")
    parser.add_argument("--out", type=Path, default=RESULTS / "batch_kv.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.fits, args.history, args.tokens = "tiny:gemma3", 2, 1000, 4
        args.prefill, args.chunk = 256, 64
        args.layer = (2, 4, 64)
    args.agents = args.agents or 8 * args.fits
    report = asyncio.run(run(args))
    report["attention"] = attention_steps(
        args.history, args.fits, tuple(args.layer), args.group_size, getattr(mx, args.layer_dtype)
    )
    for name, row in report["attention"]["by_precision"].items():
        print(
            f"attention, one {args.layer_dtype} layer {tuple(args.layer)}, {args.fits} x "
            f"{args.history}: {name}: "
            f"{row['ms']:.1f} ms a step ({row['ms_vs_model']:.2f}x), working set "
            f"{row['working_set_mb']:.1f} MB",
            flush=True,
        )
    report["chunk"] = attention_chunk(
        args.history // 2,
        args.chunk,
        tuple(args.layer),
        args.group_size,
        getattr(mx, args.layer_dtype),
    )
    for name, row in report["chunk"]["by_precision"].items():
        print(
            f"attention, the same layer's {args.chunk}-token chunk over {args.history // 2} "
            f"positions: {name}: {row['ms']:.1f} ms ({row['ms_vs_model']:.2f}x), working set "
            f"{row['working_set_mb']:.1f} MB",
            flush=True,
        )
    write_report(report, args.out, plot)
    return report


def attention_chunk(
    history: int,
    chunk: int,
    layer: tuple[int, int, int],
    group: int | None = None,
    dtype: mx.Dtype = mx.float32,
) -> dict:
    """One attention layer's prompt chunk: ``chunk`` tokens written after a row of ``history``
    positions and attended causally over all of them, per precision as
    :func:`attention_steps` holds them (on a CPU also q8 read through the quantized matmul,
    as a decode step reads it): ``ms`` (the best of :data:`CHUNK_RUNS`) and ``working_set_mb``
    (MLX's peak memory above what the buffer and the queries hold)."""
    kv_heads, q_heads, dim = layer
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    scale = dim**-0.5
    shape = (1, kv_heads, history + chunk, dim)
    keys, values = (mx.random.normal(shape, dtype, key=mx.random.key(i)) for i in (1, 2))
    q = mx.random.normal((1, q_heads, chunk, dim), dtype, key=mx.random.key(3))
    mx.eval(keys, values, q)
    g8, g4 = (choose_group_size(dim, group_size_for(bits, group)) for bits in (8, 4))
    scheme = LayerScheme(8, g8, rotated_keys=dim & (dim - 1) == 0)
    q8 = Packing(8, (scheme,), ((dim, dim),), dtype)
    old = tuple(x[..., :history, :] for x in (keys, values))
    new = tuple(x[..., history:, :] for x in (keys, values))

    def timed(name: str) -> dict:
        row = KVCache()
        row.update_and_fetch(*old)
        if name == "model":
            buffer = GroupKVCache.merge([row])
        elif name == "q8":
            buffer = quantized_buffer([q8.pack(0, row)], None, 8, g8, q8.keys_rotated(0))
        else:
            packed = channel_row(row, g4)
            packed.first_kv = (old[0][..., :1, :], old[1][..., :1, :])
            buffer = channel_buffer([packed], None, g4)
        mask = buffer.make_mask(chunk)
        fetched = buffer.update_and_fetch(*new) if name == "model" else buffer.write(*new)
        mx.eval(mask, fetched if name == "model" else fetched[0].keys)
        best, peak = math.inf, 0
        for _ in range(CHUNK_RUNS):
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            start = time.perf_counter()
            if name == "model":
                out = scaled_dot_product_attention(q, *fetched, None, scale=scale, mask=mask)
            else:
                out = quantized_attention(q, fetched[0], scale, mask, None)
            mx.eval(out)
            best = min(best, time.perf_counter() - start)
            peak = max(peak, mx.get_peak_memory() - before)
            del out
        return {"ms": round(1000 * best, 1), "working_set_mb": round(peak / 2**20, 1)}

    results = {}
    saved = words.DEVICE.cpu, words.EXPANDED_ROWS
    words.DEVICE.cpu = on_cpu  # (as install() sets it for a model)
    try:
        for name in ("model", "q8", "q4"):
            results[name] = timed(name)
        if on_cpu:
            words.EXPANDED_ROWS = math.inf  # every read through the quantized matmul
            results["q8 quantized matmul"] = timed("q8")
    finally:
        words.DEVICE.cpu, words.EXPANDED_ROWS = saved
    for row in results.values():
        row["ms_vs_model"] = round(row["ms"] / results["model"]["ms"], 3)
    return {"history": history, "chunk": chunk, "layer": list(layer), "by_precision": results}


CHUNK_RUNS = 3


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]
    names = list(rows)

    def agents(ax) -> None:
        bars = ax.bar(names, [r["max_in_batch"] for r in rows.values()])
        bar_labels(ax, bars, "{:.0f}")
        ax.set_ylabel("agents decoding together at most")
        ax.set_title(f"one budget ({report['budget_mb']:.0f} MB)")

    def hot(ax) -> None:
        bars = ax.bar(names, [r["hot_agents"] for r in rows.values()])
        bar_labels(ax, bars, "{:.0f}")
        ax.set_ylabel("agents held")
        ax.set_title(f"one hot-tier budget ({rows['model']['hot_budget_mb']:.0f} MB)")

    def speed(ax) -> None:  # (the quantity the README's decode ratio is of)
        bars = ax.bar(names, [r["decode_tokens_per_s"] for r in rows.values()])
        bar_labels(ax, bars, "{:.0f}")
        ax.set_ylabel("tok/s of the decode-only steps (median)")
        ax.set_title("decode")

    title = (
        f"{report['model']} (random weights), {report['history']}-token histories, "
        f"{report['tokens']} tokens an agent, {report['date']}"
    )
    return save_plot(path, [agents, hot, speed], title)


if __name__ == "__main__":
    main()
