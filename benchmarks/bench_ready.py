"""How soon ``agentkv serve`` is ready, against ``mlx_lm.load`` of the same model, and where the
time goes.

    python -m benchmarks.bench_ready [--model gemma3-270m] [--repeats 3] [--quick]

First one ``agentkv serve`` start with the model's saved tokenizer index deleted (a
tokenizer's first start: the index is built and saved; ``first_ready_s``). Then each repeat,
interleaved: a fresh ``agentkv serve`` subprocess (an empty data directory) timed
from its start until ``GET /ready`` answers 200; and a fresh Python process that imports mlx-lm
and calls ``mlx_lm.load`` on the same model directory, timed from its start until it exits
(the time any MLX tool takes before it can generate). Then one process times the steps a
server takes before it is ready, one after another: imports, ``mlx_lm.load`` (its weights and
its tokenizer apart), the batch's probes (``ModelRunner``), the constrained-decoding index
(``Grammars.warm``: read back from disk) and the registry. Figures are medians, in seconds.
``--quick``: tiny:llama, once.
Writes benchmarks/results/ready.json and .png (or --out and its .png).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_peer import ServerProcess, free_port
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"

# The steps, timed in one child process (stdout: one JSON object of seconds by step).
STEPS = r"""
import json, sys, time, asyncio, tempfile
took = {}
start = time.perf_counter()
import agentkv.engine
import agentkv.server.app, agentkv.runtime, uvicorn
took["imports"] = time.perf_counter() - start
from pathlib import Path
from mlx_lm.utils import load_model, load_tokenizer
from agentkv.models.directory import model_fingerprint, resolve_model_path
from agentkv.engine.runner import ModelRunner
from agentkv.engine.grammar import Grammars
from agentkv.store.registry import Registry
def timed(name, fn):
    t = time.perf_counter(); out = fn(); took[name] = time.perf_counter() - t; return out
path = timed("resolve", lambda: resolve_model_path(sys.argv[1]))
timed("fingerprint", lambda: model_fingerprint(path))
model, config = timed("mlx_lm weights", lambda: load_model(Path(path)))
tokenizer = timed("mlx_lm tokenizer", lambda: load_tokenizer(Path(path)))
timed("batch probes", lambda: ModelRunner(model))
timed("grammar index", lambda: Grammars(tokenizer, config["vocab_size"]).warm())
async def registry():
    db = await Registry.open("sqlite+aiosqlite:///" + tempfile.mkdtemp() + "/r.sqlite")
    await db.close()
timed("registry", lambda: asyncio.run(registry()))
print(json.dumps(took))
"""


def time_load(path: Path) -> float:
    """Seconds for a fresh process to import mlx-lm and load the model."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", f"import mlx_lm; mlx_lm.load({str(path)!r})"],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def time_serve(model: str, logs: Path) -> float:
    """Seconds from starting ``agentkv serve`` until /ready answers 200."""
    data, port = Path(tempfile.mkdtemp(dir=logs)), free_port()
    argv = [sys.executable, "-m", "agentkv.server.cli", "serve", "--model", model]
    argv += ["--data-dir", str(data), "--port", str(port)]
    server = ServerProcess("agentkv serve", argv, "/ready", port, logs / f"serve-{port}.log")
    try:
        return server.start(timeout_s=300)
    finally:
        if server.proc is not None:
            server.stop()


def forget_token_index(path: Path) -> None:
    """Delete the model's saved tokenizer index (``agentkv.engine.token_index``), so that the
    next start builds it as a tokenizer's first start does."""
    from transformers import AutoTokenizer

    from agentkv.engine.token_index import _saved_path

    saved = _saved_path(AutoTokenizer.from_pretrained(str(path)))
    if saved is not None:
        saved.unlink(missing_ok=True)


def steps(model: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", STEPS, model], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(report: dict, path: Path) -> Path:
    def totals(ax) -> None:
        bars = ax.bar(["mlx_lm.load", "serve /ready"], [report["load_s"], report["ready_s"]])
        bar_labels(ax, bars, "{:.1f}s")
        ax.set_ylabel("seconds from process start (median)")
        ax.set_title(f"ready / load = {report['ratio']:.2f}", fontsize=9)

    def parts(ax) -> None:
        names, values = list(report["steps_s"]), list(report["steps_s"].values())
        bars = ax.barh(names, values)
        ax.bar_label(bars, labels=[f"{v:.2f}s" for v in values], fontsize=8)
        ax.invert_yaxis()
        ax.set_title("steps before ready, one after another", fontsize=9)

    title = f"agentkv serve ready: {report['model']}, {report['machine']}, {report['date']}"
    return save_plot(path, [totals, parts], title)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "ready.json")
    parser.add_argument("--quick", action="store_true", help="tiny:llama, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.repeats = "tiny:llama", 1

    from agentkv.models.directory import resolve_model_path

    path = resolve_model_path(args.model)  # installed or converted before anything is timed
    ready, load = [], []
    with tempfile.TemporaryDirectory() as logs:
        forget_token_index(path)  # the tokenizer's first start: its index built and saved
        first = time_serve(args.model, Path(logs))
        print(f"first start (the token index built): serve ready {first:.2f} s")
        for i in range(args.repeats):
            ready.append(time_serve(args.model, Path(logs)))
            load.append(time_load(path))
            print(f"repeat {i + 1}: serve ready {ready[-1]:.2f} s, mlx_lm.load {load[-1]:.2f} s")
    runs = [steps(args.model) for _ in range(args.repeats)]
    report = {
        "model": args.model,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
        "command": "python -m benchmarks.bench_ready " + " ".join(argv or sys.argv[1:]),
        "first_ready_s": first,
        "ready_s": statistics.median(ready),
        "load_s": statistics.median(load),
        "ready_runs_s": ready,
        "load_runs_s": load,
        "steps_s": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
    }
    report["ratio"] = report["ready_s"] / report["load_s"]
    print(json.dumps({k: report[k] for k in ("ready_s", "load_s", "ratio", "steps_s")}, indent=1))
    write_report(report, args.out, plot)
    return report


if __name__ == "__main__":
    main()
