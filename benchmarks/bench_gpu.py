"""The standard benchmark set in one process, on whatever device MLX has, on a model with
Gemma 3 12B's shapes: ``make bench-gpu OUT=dir`` on an accelerator machine.

    python -m benchmarks.bench_gpu OUT_DIR [--quick] [--parts batching batch_kv ...]
                                   [--budget-s 420] [--model SPEC]

First the model is built on this machine by agentkv's own tiny-model code (``tiny:gemma3-12b``:
48 layers, hidden 3840, 16 query heads, 8 KV heads x 256, MLP 15360, a 1024-token sliding
window in 5 of every 6 layers, random 4-bit weights in groups of 64, bfloat16; its vocabulary
kept at 32,768 to save build time). Nothing is downloaded. Then the parts of
``benchmarks.gpu_parts.PARTS`` run in order, most valuable first: batching, batch_kv
(quantized KV in the batch), mixed, resume, prefill, and the speculative-decoding slot. Sizes
are ``benchmarks.gpu_sizes.FULL``; ``--quick`` runs ``QUICK`` (the tiny float32 Gemma 3, a
few tokens) on a CPU in seconds.

Invariants:

- Each part runs guarded: an exception is recorded in the summary (status "failed", the
  error) with what the part measured before it, and the next part runs.
- A part starts only while the budget (``--budget-s``, counted from the start, the build
  included) has time left, and parts after it are recorded "skipped". A running part's loop
  stops between its sizes or rounds once it is spent (``cut_short``); ``prefill`` has no
  such loop and runs whole, so a run can overrun the budget by the part running then.
- ``OUT_DIR/summary.json`` is rewritten after every part (parts not yet run: "queued"), so a
  run killed midway leaves what it measured. ``OUT_DIR/<part>.json`` holds a part's rows and
  ``ratios``, with the date, the device, the model's shape, the command and its sizes.
- Progress lines carry the clock time and the seconds since the start, flushed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib.metadata
import io
import json
import platform
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TextIO

import mlx.core as mx

from agentkv.models.directory import resolve_model_path
from agentkv.models.tiny import get_tiny_spec, models_home
from benchmarks.gpu_parts import PARTS, Context, PartPending
from benchmarks.gpu_sizes import FULL, QUICK, Sizes

GEMMA3_VOCAB = 262_144


class Clock(io.TextIOBase):
    """Seconds since the run started; as ``sys.stdout`` during a run, it stamps every line
    printed (the reused benchmarks' too) with the clock time and those seconds, and flushes."""

    def __init__(self, out: TextIO) -> None:
        self.started = time.perf_counter()
        self._out = out
        self._pending = ""

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._out.write(f"[{time.strftime('%H:%M:%S')} +{self.elapsed():6.1f}s] {line}\n")
        self._out.flush()
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def log(self, message: str) -> None:
        self.write(message + "\n")


def device() -> dict:
    """The device MLX runs on (``mx.device_info()``), the host and the library versions."""
    info = {
        k: v if isinstance(v, (bool, int, float, str)) else str(v)
        for k, v in mx.device_info().items()
    }
    versions = {}
    for name in ("mlx", "mlx-lm", "agentkv"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "default_device": str(mx.default_device()),
        **info,
        "host": f"{platform.machine()} {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": versions,
    }


def build(spec: str, clock: Clock) -> tuple[Path, dict]:
    """Build (or find, when built before) the model here: its directory and the build's
    seconds, peak MLX memory and weights' size."""
    before = {p.name for p in models_home().glob("*")} if spec.startswith("tiny:") else None
    mx.reset_peak_memory()
    start = time.perf_counter()
    path = resolve_model_path(spec)
    seconds = time.perf_counter() - start
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    built = before is not None and path.name not in before
    clock.log(
        f"model {spec}: {'built' if built else 'found'} in {seconds:.1f} s, weights "
        f"{weights / 2**30:.2f} GiB, peak MLX memory {mx.get_peak_memory() / 2**30:.2f} GiB"
    )
    mx.clear_cache()
    return path, {
        "built_here": built,
        "seconds": round(seconds, 2),
        "peak_memory_mb": round(mx.get_peak_memory() / 2**20, 1),
        "weights_mb": round(weights / 2**20, 1),
    }


def describe_model(spec: str, path: Path) -> dict:
    """The model's shape as its ``config.json`` says, and what its weights are."""
    config = json.loads((path / "config.json").read_text())
    pattern = config.get("sliding_window_pattern")
    quantization = config.get("quantization") or {}
    tiny = spec.startswith("tiny:")
    shape = {
        "spec": spec,
        "description": get_tiny_spec(spec).description if tiny else None,
        "model_type": config.get("model_type"),
        "layers": config.get("num_hidden_layers"),
        "hidden": config.get("hidden_size"),
        "attention_heads": config.get("num_attention_heads"),
        "kv_heads": config.get("num_key_value_heads"),
        "head_dim": config.get("head_dim"),
        "intermediate": config.get("intermediate_size"),
        "sliding_window": config.get("sliding_window"),
        "layer_pattern": f"{pattern - 1} sliding : 1 global" if pattern else None,
        "vocab": config.get("vocab_size"),
        "dtype": config.get("torch_dtype"),
        "weight_bits": quantization.get("bits"),
        "weight_group_size": quantization.get("group_size"),
        "weights": "random (untrained): times the machinery, says nothing of quality"
        if tiny
        else "as loaded",
    }
    if config.get("model_type") == "gemma3_text" and shape["vocab"] < GEMMA3_VOCAB:
        shape["vocab_note"] = (
            f"vocabulary {shape['vocab']:,} where Gemma 3's is {GEMMA3_VOCAB:,}: smaller to "
            "save build time (it sizes only the embedding, tied to the output head)"
        )
    return shape


def run_part(name: str, ctx: Context, header: dict, out_dir: Path) -> dict:
    """Run one part guarded; write its JSON (also when it failed midway). Its summary entry."""
    ctx.report = {"cut_short": False}
    start = time.perf_counter()
    entry: dict = {}
    try:
        asyncio.run(PARTS[name](ctx))
        entry["status"] = "ok"
    except PartPending as exc:
        entry = {"status": "pending", "reason": str(exc)}
    except (Exception, SystemExit) as exc:  # recorded; the next part still runs
        entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        entry["traceback"] = traceback.format_exc().splitlines()[-12:]
        ctx.log(f"{name} failed: {entry['error']}")
    finally:
        gc.collect()
        mx.clear_cache()  # MLX's buffer cache would shrink the next engine's default budget
    entry["seconds"] = round(time.perf_counter() - start, 1)
    if entry["status"] != "pending":
        report = {**header, "part": name, "sizes": ctx.sizes.of(name), **entry, **ctx.report}
        (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
        entry["json"] = f"{name}.json"
        entry["ratios"] = ctx.report.get("ratios")
        entry["cut_short"] = ctx.report["cut_short"]
    ctx.log(f"{name}: {entry['status']} in {entry['seconds']} s")
    return entry


def main(argv: list[str] | None = None) -> dict:
    clock = Clock(sys.stdout)
    with contextlib.redirect_stdout(clock):
        return run(clock, sys.argv[1:] if argv is None else argv)


def run(clock: Clock, argv: list[str]) -> dict:
    """Build the model, run the chosen parts, write the summary; the summary."""
    parser = argparse.ArgumentParser(description="the standard benchmark set on this device")
    parser.add_argument("out_dir", type=Path, help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="CPU-sized smoke run")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--budget-s", type=float, help="wall seconds for the whole run")
    parser.add_argument("--model", help="another model (default: the mode's)")
    args = parser.parse_args(argv)
    sizes: Sizes = QUICK if args.quick else FULL
    if args.budget_s is not None:
        sizes = dataclasses.replace(sizes, budget_s=args.budget_s)
    if args.model:
        sizes = dataclasses.replace(sizes, model=args.model)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "benchmark": "gpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mode": "quick" if args.quick else "full",
        "command": shlex.join(["python", "-m", "benchmarks.bench_gpu", *argv]),
        "device": device(),
        "budget_s": sizes.budget_s,
        "complete": False,
        "parts": {
            name: {"status": "queued" if name in args.parts else "not selected"} for name in PARTS
        },
    }

    def write_summary() -> None:
        summary["elapsed_s"] = round(clock.elapsed(), 1)
        (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    clock.log(
        f"{summary['mode']} run on {summary['device']['default_device']}: {summary['command']}"
    )
    write_summary()
    try:
        path, summary["build"] = build(sizes.model, clock)
        summary["model"] = describe_model(sizes.model, path)
    except Exception as exc:  # no model: every part is skipped, the summary says why
        summary["build"] = {"error": f"{type(exc).__name__}: {exc}"}
        clock.log(f"model build failed: {summary['build']['error']}")
        path = None
    write_summary()
    header = {k: summary.get(k) for k in ("benchmark", "date", "mode", "command", "device")}
    header["model"] = summary.get("model")
    deadline = None if sizes.budget_s is None else clock.started + sizes.budget_s
    scratch = Path(tempfile.mkdtemp(prefix="agentkv-bench-gpu-"))
    try:
        for name in (n for n in PARTS if n in args.parts):
            if path is None:
                summary["parts"][name] = {"status": "skipped", "reason": "no model"}
            elif deadline is not None and time.perf_counter() >= deadline:
                reason = f"budget of {sizes.budget_s:g} s spent"
                summary["parts"][name] = {"status": "skipped", "reason": reason}
                clock.log(f"{name}: skipped ({reason})")
            else:
                clock.log(f"== {name} ==")
                ctx = Context(str(path), sizes, scratch / name, deadline, clock.log)
                ctx.scratch.mkdir()
                summary["parts"][name] = run_part(name, ctx, header, args.out_dir)
            write_summary()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary["complete"] = True
    write_summary()
    for name, entry in summary["parts"].items():
        clock.log(f"{name:12} {entry['status']:13} {json.dumps(entry.get('ratios'))}")
    return summary


if __name__ == "__main__":
    result = main()
    failed = [n for n, p in result["parts"].items() if p["status"] == "failed"]
    raise SystemExit(bool(failed) or "error" in result["build"])
