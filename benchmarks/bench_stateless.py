"""Endless stateless traffic: do agents, memory and disk level off?

    python -m benchmarks.bench_stateless [--model tiny:gemma3] [--requests 1000] [--quick]

A real ``agentkv serve`` (a subprocess on 127.0.0.1, default settings: the stateless cap, TTL
and budgets it resolves itself) gets ``--requests`` Anthropic requests that name no agent, from
``--concurrency`` clients at once: every other one is the same request (one question under a
shared system prompt), the others each a new conversation (under the same system prompt). After
every ``--every`` requests it samples the stateless agents (``GET /v1/agents``), the server's
resident memory (``ps``), the bytes under its data directory (all of it, and of that the SQLite
files), the cache bytes on disk and in memory (``/metrics``) and the block's latencies.

A series levels off when it grew by at most 5% of its final value over the last third of the
run. Any request that does not answer 200 is counted as failed (the run must have none).
Writes benchmarks/results/stateless.json and .png (or --out and its .png).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.bench_peer import ServerProcess, free_port
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"
LEVEL_TOLERANCE = 0.05  # growth over the last third, as a share of the final value
SERIES = ("agents", "rss_mb", "disk_mb")
COLUMNS = (
    "requests",
    "agents",
    "rss_mb",
    "disk_mb",
    "db_mb",
    "cache_mb",
    "hot_mb",
    "ms_p50",
    "ms_max",
)


def body(i: int, system: str, max_tokens: int) -> dict[str, Any]:
    """Request ``i``: the same question when ``i`` is even, a new one when it is odd."""
    question = "Where is my parcel?" if i % 2 == 0 else f"Question {i}: what comes after {i}?"
    return {
        "model": "m",
        "max_tokens": max_tokens,
        "system": system,
        "messages": [{"role": "user", "content": question}],
    }


def rss_bytes(pid: int) -> int:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip()) * 1024


def bytes_under(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


def stateless_agents(http: httpx.Client) -> int:
    count, params = 0, {"limit": 1000}
    while True:
        page = http.get("/v1/agents", params=params).raise_for_status().json()
        count += sum(a["id"].startswith("stateless-") for a in page["data"])
        if not page["has_more"]:
            return count
        params["after_id"] = page["last_id"]


def metrics(http: httpx.Client) -> dict[tuple[str, str], float]:
    """/metrics samples by (name, value of their one label or "")."""
    text = http.get("/metrics").raise_for_status().text
    return {
        (s.name, "".join(s.labels.values())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def levels_off(rows: list[dict], key: str) -> bool:
    last = rows[-1]
    third = next(r for r in rows if r["requests"] >= last["requests"] * 2 / 3)
    return last[key] - third[key] <= LEVEL_TOLERANCE * last[key]


def run(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "agentkv.server.cli", "serve", "--model", args.model]
    argv += ["--data-dir", str(data_dir), "--port", str(port), *args.serve_args]
    server = ServerProcess("agentkv", argv, "/v1/models", port, data_dir.parent / "serve.log")
    system = " ".join(f"Rule {i}: answer briefly about parcels." for i in range(args.rules))
    rows: list[dict] = []
    failed: list[str] = []
    try:
        ready_s = server.start(timeout_s=300)
        assert server.proc is not None
        limits = httpx.Limits(max_connections=args.concurrency)
        with httpx.Client(base_url=server.base_url, timeout=300, limits=limits) as http:

            def ask(i: int) -> float:
                start = time.perf_counter()
                try:
                    response = http.post("/v1/messages", json=body(i, system, args.max_tokens))
                except httpx.HTTPError as exc:
                    failed.append(f"request {i}: {exc!r}")
                else:
                    if response.status_code != 200:
                        failed.append(f"request {i}: {response.status_code} {response.text}")
                return time.perf_counter() - start

            print(" ".join(f"{k:>9}" for k in COLUMNS), flush=True)
            with ThreadPoolExecutor(args.concurrency) as pool:
                for done in range(0, args.requests, args.every):
                    block = range(done, min(done + args.every, args.requests))
                    latencies = sorted(pool.map(ask, block))
                    db_files = list(data_dir.glob("agentkv.sqlite*"))
                    m = metrics(http)
                    rows.append(
                        {
                            "requests": block[-1] + 1,
                            "agents": stateless_agents(http),
                            "rss_mb": round(rss_bytes(server.proc.pid) / 1e6, 1),
                            "disk_mb": round(bytes_under(data_dir) / 1e6, 2),
                            "db_mb": round(sum(f.stat().st_size for f in db_files) / 1e6, 2),
                            "cache_mb": round(m["agentkv_cache_disk_bytes", ""] / 1e6, 2),
                            "hot_mb": round(m["agentkv_cache_hot_bytes", ""] / 1e6, 2),
                            "ms_p50": round(statistics.median(latencies) * 1e3, 1),
                            "ms_max": round(latencies[-1] * 1e3, 1),
                        }
                    )
                    print(" ".join(f"{v:>9}" for v in rows[-1].values()), flush=True)
            final = metrics(http)
        server.stop()
    finally:
        server.kill()
    log = server.log_tail(100_000).splitlines()
    return {
        "ready_s": round(ready_s, 1),
        "budgets": next((line for line in log if "budget" in line), ""),
        "failed": len(failed),
        "failures": failed[:10],
        "cache_sources": {
            source: int(final["agentkv_turns_total", source])
            for source in ("hot", "disk", "prefix", "rebuilt", "none")
        },
        "prefix_hits": int(final["agentkv_cache_prefix_hits", ""]),
        "rows": rows,
        "levels_off": {key: levels_off(rows, key) for key in SERIES},
    }


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]
    xs = [r["requests"] for r in rows]

    def panel(key: str, ylabel: str):
        def draw(ax: Any) -> None:
            ax.plot(xs, [r[key] for r in rows], marker="o", markersize=3)
            ax.set_xlabel("stateless requests")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)

        return draw

    return save_plot(
        path,
        [
            panel("agents", "stateless agents"),
            panel("rss_mb", "server RSS (MB)"),
            panel("disk_mb", "data directory (MB)"),
        ],
        f"{report['requests']} stateless requests (half identical), {report['model']}, "
        f"{report['machine']}",
        (4.5, 3.4),
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:gemma3")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50, help="sample after this many requests")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rules", type=int, default=40, help="sentences of the system prompt")
    parser.add_argument(
        "--serve-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="the rest goes to agentkv serve (e.g. --max-stateless-agents 64)",
    )
    parser.add_argument("--quick", action="store_true", help="40 requests (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "stateless.json")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.every, args.concurrency = 40, 10, 2
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp) / "data")
    for key in SERIES:
        print(f"{key}: {'levels off' if result['levels_off'][key] else 'still growing'}")
    print(f"failed requests: {result['failed']}")
    report = {
        "benchmark": "stateless",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}",
        "model": args.model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        **result,
    }
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
