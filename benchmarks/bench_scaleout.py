"""Aggregate throughput through the router: one worker against two.

    python -m benchmarks.bench_scaleout [--model tiny:gemma3] [--clients 16] [--quick]

For each worker count, ``agentkv serve`` workers sharing one registry (a SQLite file, or
``--db-url``) and one cache directory run behind HAProxy with the shipped config
(``agentkv.server.scaleout.local``, all on this machine). ``--clients`` clients each talk to an
agent of their own (``x-agent-id``) through the router, ``--turns`` turns one after another, every
turn generating exactly ``--max-tokens`` tokens (the model's end tokens are banned). Throughput is
the generated tokens of all turns over the wall time from the first request to the last reply;
``two_vs_one`` is the two-worker figure over the one-worker one, measured in the same run.
Workers on one machine share its cores: the ratio says what a second process adds there, not
what a second machine would. Any turn that does not answer 200 is counted (there must be none).

Writes benchmarks/results/scaleout.json and .png (or --out and its .png). Needs ``haproxy``.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentkv.server.scaleout.local import Cluster, local_cluster
from agentkv.server.worker import WORKER_HEADER
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"
NO_EOS = {"1": -100, "5": -100}  # tiny:gemma3's end tokens


def drive(cluster: Cluster, model: str, clients: int, turns: int, max_tokens: int) -> dict:
    """Every client's turns through the router; the totals."""

    def one_client(n: int) -> tuple[int, int, dict[str, int]]:
        generated, failed, workers = 0, 0, {}
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "logit_bias": NO_EOS}
        with cluster.http(timeout=300) as http:
            for i in range(turns):
                body["messages"] = [{"role": "user", "content": f"client {n}, turn {i}"}]
                agent = f"{len(cluster.workers)}w-client-{n}"  # new agents in each run
                response = http.post(
                    "/v1/chat/completions", json=body, headers={"x-agent-id": agent}
                )
                if response.status_code != 200:
                    failed += 1
                    continue
                generated += response.json()["usage"]["completion_tokens"]
                worker = response.headers[WORKER_HEADER]
                workers[worker] = workers.get(worker, 0) + 1
        return generated, failed, workers

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one_client, range(clients)))
    seconds = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    by_worker: dict[str, int] = {}
    for _, _, workers in results:
        for worker, count in workers.items():
            by_worker[worker] = by_worker.get(worker, 0) + count
    return {
        "workers": len(cluster.workers),
        "turns": clients * turns,
        "failed": sum(r[1] for r in results),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "turns_by_worker": dict(sorted(by_worker.items())),
    }


def plot(report: dict, path: Path) -> Path:
    def panel(ax: Any) -> None:
        rows = report["rows"]
        bars = ax.bar(
            [f"{r['workers']} worker(s)" for r in rows], [r["tokens_per_s"] for r in rows]
        )
        bar_labels(ax, bars, "{:.0f}")
        ax.set_ylabel("generated tokens / s through HAProxy")

    title = f"scale-out, {report['model']}, {report['cpus']} CPUs, {report['date']}"
    return save_plot(path, [panel], title, (5.5, 3.6))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:gemma3")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--db-url", help="the shared registry (default: a SQLite file per run)")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "scaleout.json")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.turns, args.max_tokens = 4, 2, 8
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            root = Path(tmp) / f"{workers}-workers"
            root.mkdir()
            db_url = args.db_url or f"sqlite+aiosqlite:///{root / 'agentkv.sqlite'}"
            with local_cluster(root, db_url, workers, args.model, log_requests=False) as cluster:
                rows.append(drive(cluster, args.model, args.clients, args.turns, args.max_tokens))
    report = {
        "benchmark": "scaleout",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}",
        "cpus": os.cpu_count(),
        "model": args.model,
        "clients": args.clients,
        "turns_per_client": args.turns,
        "max_tokens": args.max_tokens,
        "two_vs_one": round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3),
        "rows": rows,
    }
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
