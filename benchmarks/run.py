"""Run the benchmark suite: ``make bench`` (full) or ``python -m benchmarks.run --quick``.

Each benchmark writes JSON (and a PNG where it has a plot) under benchmarks/results/; this
runner also writes benchmarks/results/summary.md with one table per benchmark.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import (
    bench_batch_kv,
    bench_batching,
    bench_blocks,
    bench_budget,
    bench_event_loop,
    bench_fan_out,
    bench_fidelity,
    bench_load,
    bench_mixed,
    bench_peer,
    bench_policies,
    bench_prefill,
    bench_ready,
    bench_reasoning,
    bench_resume,
    bench_roundtrip,
    bench_soak,
    bench_stall,
    bench_stateless,
)

RESULTS = Path(__file__).parent / "results"
SUITE = {
    "batching": bench_batching,
    "mixed": bench_mixed,
    "budget": bench_budget,
    "batch_kv": bench_batch_kv,
    "prefill": bench_prefill,
    "policies": bench_policies,
    "roundtrip": bench_roundtrip,
    "load": bench_load,
    "resume": bench_resume,
    "blocks": bench_blocks,
    "fan_out": bench_fan_out,
    "peer": bench_peer,
    "stall": bench_stall,
    "event_loop": bench_event_loop,
    "soak": bench_soak,
    "stateless": bench_stateless,
    "fidelity": bench_fidelity,
    "ready": bench_ready,
    "reasoning": bench_reasoning,
}


def flatten(row: dict, prefix: str = "") -> dict:
    """Nested result dicts as dotted scalar columns: {"disk": {"q8": {"ttft_s": 1}}} ->
    {"disk.q8.ttft_s": 1}."""
    flat = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= flatten(value, f"{name}.")
        elif not isinstance(value, list):
            flat[name] = value
    return flat


def markdown(name: str, report: dict) -> str:
    """One markdown section: the report's scalar fields, then its rows as a table."""
    rows = [flatten(r) for r in report.get("rows") or []]
    meta = {k: v for k, v in report.items() if not isinstance(v, (list, dict))}
    text = f"## {name}\n\n" + ", ".join(f"{k}: {v}" for k, v in meta.items()) + "\n\n"
    if rows:
        keys = list(rows[0])
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
        text += "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
        text += "".join("| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |\n" for r in rows)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="run every benchmark")
    parser.add_argument("--quick", action="store_true", help="tiny model, tiny sizes (smoke run)")
    parser.add_argument("--only", nargs="+", choices=sorted(SUITE), default=list(SUITE))
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sections = [
        f"# agentkv benchmarks ({time.strftime('%Y-%m-%d')}{', quick' if args.quick else ''})\n"
    ]
    for name in args.only:
        print(f"== {name} ==", flush=True)
        extra = ["--quick"] if args.quick else []
        report = SUITE[name].main([*extra, "--out", str(args.out_dir / f"{name}.json")])
        sections.append(markdown(name, report))
    (args.out_dir / "summary.md").write_text("\n".join(sections))
    print(f"wrote {args.out_dir / 'summary.md'}")


if __name__ == "__main__":
    main()
