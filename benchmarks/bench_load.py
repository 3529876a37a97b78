"""Cache load speed: agentkv's paged load path against the previous ones and raw mlx-lm.

For a cache shaped like ``tiny:gemma3-bench``'s (12 layers: 10 sliding-window layers of 512
positions and 2 global ones, 1 KV head x 128, float32) at each history length, each storage
variant (exact, q8, q4) is written, then loaded repeatedly, the variants interleaved:

- ``agentkv``: what a resume does: the tail and blocks of 256 tokens (``encode_paged``) read
  straight into MLX with ``decode_paged`` (``mx.load``; XXH3-128 checksums and shapes verified
  from that memory; join per layer; float32 dequantization), the blocks in one segment file
  (a history saved at once);
- ``turns``: the same with a segment per ``--blocks-per-turn`` blocks (a history built by
  turns of about that many blocks each: more files);
- ``perblock``: the same with one file per block (how blocks were stored before segments);
- ``single``: the same cache as one file (format 1, before paging): ``read_cache_file``,
  dequantization in numpy, ``decode_cache``;
- ``previous``: one file through the load path before XXH3 (read, ``safetensors.numpy.load``
  copy, SHA-256 verification);
- ``raw mlx-lm``: ``save_prompt_cache`` / ``load_prompt_cache`` of the same layers, evaluated
  (unquantized only: mlx-lm cannot store rotating layers quantized).

Figures are milliseconds per load (median) and GB of file per second. Run:
``python -m benchmarks.bench_load`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import safetensors.numpy
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

from agentkv.engine.kv.encoded import EncodedCache
from agentkv.engine.kv.quant import dequantize_on_host
from agentkv.engine.kv.whole import decode_cache, encode_cache
from agentkv.engine.request import PromptCache
from agentkv.store import cache_files
from agentkv.store.cache_files import read_cache_file, write_cache_file
from benchmarks.paged_io import load_paged, save_paged
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"
VARIANTS = {"none": None, "q8": 8, "q4": 4}


def synthetic_cache(history: int, layers: int, window: int, head_dim: int) -> PromptCache:
    """Random keys/values in the layout a Gemma-3-style model leaves after ``history`` tokens:
    every sixth layer global, the rest sliding windows (wrapped when history > window)."""
    rng = np.random.default_rng(history)
    out = []
    for i in range(layers):
        is_global = i % 6 == 5
        layer = KVCache() if is_global else RotatingKVCache(max_size=window, keep=0)
        for start in range(0, history, 512):
            n = min(512, history - start)
            k, v = (
                mx.array(rng.standard_normal((1, 1, n, head_dim), dtype=np.float32)) for _ in "kv"
            )
            layer.update_and_fetch(k, v)
        mx.eval(layer.keys, layer.values)
        out.append(layer)
    return PromptCache(out, rng.integers(0, 32768, history).tolist())


def write_paged(
    root: Path, cache: PromptCache, bits: int | None, blocks_per_file: int | None = None
) -> list[Path]:
    """The cache as segment files and a tail (the tail last), as agentkv stores it."""
    return save_paged(root, cache, bits, 64, blocks_per_file=blocks_per_file)


def agentkv_load(paths: list[Path]) -> PromptCache:
    return load_paged(paths)


def single_load(path: Path) -> PromptCache:
    file = read_cache_file(path)
    return decode_cache(dequantize_on_host(EncodedCache(file.tensors, file.metadata)))


def previous_load(path: Path) -> PromptCache:
    """The load path before XXH3 and zero-copy reads, step for step."""
    data = path.read_bytes()
    header = cache_files._parse_header(path, data)
    tensors = safetensors.numpy.load(data)  # a second copy of every tensor
    metadata = dict(header["__metadata__"])
    metadata.pop(cache_files.CHECKSUM_KEY)
    # Its SHA-256 pass (not compared: these files carry XXH3 checksums; the cost is the same).
    cache_files._checksum(metadata, tensors, legacy=True)
    return decode_cache(dequantize_on_host(EncodedCache(tensors, metadata)))


def raw_load(path: Path) -> list[Any]:
    cache = load_prompt_cache(str(path))
    mx.eval(*(x for layer in cache for x in (layer.keys, layer.values)))
    return cache


def same_cache(a: PromptCache, b: PromptCache) -> bool:
    """Both loads rebuilt the same tokens and bit-identical keys and values."""
    return a.tokens == b.tokens and all(
        mx.array_equal(x, y).item()
        for la, lb in zip(a.layers, b.layers, strict=True)
        for x, y in ((la.keys, lb.keys), (la.values, lb.values))
    )


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(dir=args.data_dir) as tmp:
        root = Path(tmp)
        for history in args.histories:
            cache = synthetic_cache(history, args.layers, args.window, args.head_dim)
            files, paged, layouts = {}, {}, {}
            for name, bits in VARIANTS.items():
                encoded = encode_cache(cache, bits, 64)
                files[name] = write_cache_file(
                    root / f"{history}-{name}.safetensors", encoded.tensors, encoded.metadata
                )
                (root / f"{history}-{name}").mkdir()
                paged[name] = write_paged(root / f"{history}-{name}", cache, bits)
                for layout, per_file in (("turns", args.blocks_per_turn), ("perblock", 1)):
                    layouts[layout, name] = write_paged(
                        root / f"{history}-{name}-{layout}", cache, bits, per_file
                    )
            raw_path = root / f"{history}-raw.safetensors"
            save_prompt_cache(str(raw_path), cache.layers)
            samples: dict[str, list[float]] = {}
            for _ in range(args.repeats):  # interleaved, so drift hits every path alike
                for name, info in files.items():
                    samples.setdefault(f"agentkv.{name}", []).append(
                        timed(agentkv_load, paged[name])
                    )
                    for layout in ("turns", "perblock"):
                        samples.setdefault(f"{layout}.{name}", []).append(
                            timed(agentkv_load, layouts[layout, name])
                        )
                    samples.setdefault(f"single.{name}", []).append(timed(single_load, info.path))
                    samples.setdefault(f"previous.{name}", []).append(
                        timed(previous_load, info.path)
                    )
                samples.setdefault("raw.none", []).append(timed(raw_load, raw_path))
            row: dict[str, Any] = {
                "history": history,
                "same_cache": all(
                    same_cache(agentkv_load(paged[name]), previous_load(info.path))
                    and same_cache(agentkv_load(layouts["turns", name]), previous_load(info.path))
                    and same_cache(single_load(info.path), previous_load(info.path))
                    for name, info in files.items()
                ),
            }
            for key, values in samples.items():
                path, variant = key.split(".")
                if path == "agentkv":
                    nbytes = sum(p.stat().st_size for p in paged[variant])
                elif path in ("turns", "perblock"):
                    nbytes = sum(p.stat().st_size for p in layouts[path, variant])
                else:
                    nbytes = (raw_path if path == "raw" else files[variant].path).stat().st_size
                ms = statistics.median(values) * 1e3
                row[key] = {
                    "ms": round(ms, 2),
                    "mb": round(nbytes / 1e6, 2),
                    "gb_per_s": round(nbytes / 1e9 / (ms / 1e3), 3),
                }
            row["agentkv_vs_raw_none"] = round(row["agentkv.none"]["ms"] / row["raw.none"]["ms"], 3)
            row["turns_vs_raw_none"] = round(row["turns.none"]["ms"] / row["raw.none"]["ms"], 3)
            row["perblock_vs_raw_none"] = round(
                row["perblock.none"]["ms"] / row["raw.none"]["ms"], 3
            )
            row["files"] = {
                "agentkv": len(paged["none"]),
                "turns": len(layouts["turns", "none"]),
                "perblock": len(layouts["perblock", "none"]),
            }
            row["previous_vs_agentkv_q8"] = round(
                row["previous.q8"]["ms"] / row["agentkv.q8"]["ms"], 2
            )
            print(
                f"H={history}: "
                + ", ".join(
                    f"{k} {v['ms']:.1f} ms"
                    for k, v in row.items()
                    if isinstance(v, dict) and "ms" in v
                ),
                flush=True,
            )
            rows.append(row)
    return {
        "benchmark": "load",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "shape": f"{args.layers} layers, window {args.window}, 1 KV head x {args.head_dim}, fp32",
        "repeats": args.repeats,
        "rows": rows,
    }


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]
    keys = [k for k, v in rows[0].items() if isinstance(v, dict) and "ms" in v]

    def panel(ax: Any) -> None:
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            xs = [i + j * width for i in range(len(rows))]
            bars = ax.bar(xs, [r[key]["ms"] for r in rows], width, label=key)
            bar_labels(ax, bars, "{:.0f}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels([f"{r['history']} tokens" for r in rows])
        ax.set_ylabel("ms per load (median)")
        ax.legend(fontsize=6)

    return save_plot(path, [panel], f"cache load, {report['machine']}", panel_size=(9, 4))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--blocks-per-turn", type=int, default=5, help="blocks per segment file for 'turns'"
    )
    parser.add_argument("--data-dir", default=None, help="parent of the temp dir")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.histories, args.repeats, args.layers, args.window = [1024], 2, 6, 64
        args.blocks_per_turn = 2
    report = run(args)
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
