"""Event-loop stalls under huge requests: does one big import or count stall everyone else?

Two measurements, each while a probe measures how late the event loop wakes it (runtime) or
how long a tiny request takes (server):

- ``import``: ``AgentRuntime.append_messages`` of N user/assistant messages (the history a
  stateless client imports), worst event-loop stall and wall time;
- ``count_tokens``: ``POST /v1/messages/count_tokens`` of a multi-megabyte conversation on a
  real server, while a second client pings ``GET /v1/models``: the slowest and median ping,
  and the answer (a count, or 400 "prompt is too long" when the text cannot fit the context).

Run: ``python -m benchmarks.bench_stall`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.server.background import serve_in_thread
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"
PROBE_S = 0.005


async def _worst_stall(stop: asyncio.Event) -> float:
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        worst = max(worst, time.perf_counter() - start - PROBE_S)
    return worst


async def import_stall(model: str, messages: int, data_dir: Path) -> dict[str, Any]:
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}
        for i in range(messages)
    ]
    async with await AgentRuntime.open(RuntimeConfig(model=model, data_dir=data_dir)) as rt:
        await rt.create_agent("big")
        stop = asyncio.Event()
        probe = asyncio.create_task(_worst_stall(stop))
        start = time.perf_counter()
        await rt.append_messages("big", history)
        wall = time.perf_counter() - start
        stop.set()
        worst = await probe
        stored = await rt.message_count("big")
    assert stored == messages
    return {"messages": messages, "wall_s": round(wall, 3), "worst_stall_s": round(worst, 3)}


def count_stall(model: str, megabytes: float, data_dir: Path) -> dict[str, Any]:
    words = int(megabytes * 1e6 / len("hello world "))
    body = {"model": "m", "messages": [{"role": "user", "content": "hello world " * words}]}
    pings: list[float] = []
    with serve_in_thread(RuntimeConfig(model=model, data_dir=data_dir)) as url:
        done = threading.Event()

        def ping() -> None:
            with httpx.Client(base_url=url, timeout=60) as client:
                while not done.is_set() or not pings:  # one ping at least, however quick
                    start = time.perf_counter()
                    client.get("/v1/models")
                    pings.append(time.perf_counter() - start)
                    time.sleep(0.01)

        with httpx.Client(base_url=url, timeout=600) as client:
            client.get("/v1/models")
            pinger = threading.Thread(target=ping)
            pinger.start()
            start = time.perf_counter()
            response = client.post("/v1/messages/count_tokens", json=body)
            wall = time.perf_counter() - start
            done.set()
            pinger.join()
    if response.status_code not in (200, 400):
        response.raise_for_status()
    answer = response.json()
    return {
        "body_mb": round(len(httpx.Request("POST", "/", json=body).content) / 1e6, 2),
        "status": response.status_code,
        "input_tokens": answer.get("input_tokens"),
        "error": answer.get("error", {}).get("message", "")[:80] or None,
        "wall_s": round(wall, 3),
        "pings": len(pings),
        "ping_max_ms": round(max(pings) * 1e3, 1),
        "ping_median_ms": round(statistics.median(pings) * 1e3, 1),
    }


def plot(report: dict, path: Path) -> Path:
    def panel(ax: Any) -> None:
        labels = ["import: worst stall", "count_tokens: slowest ping", "count_tokens: median"]
        values = [
            report["import.worst_stall_s"] * 1e3,
            report["count_tokens.ping_max_ms"],
            report["count_tokens.ping_median_ms"],
        ]
        ax.barh(labels, values)
        ax.set_xlabel("ms")

    return save_plot(path, [panel], f"event-loop stalls, {report['machine']}", (8, 3))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:gemma3")
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--megabytes", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "stall.json")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.megabytes = 2_000, 0.2
    with tempfile.TemporaryDirectory() as tmp:
        rows = {
            "import": asyncio.run(import_stall(args.model, args.messages, Path(tmp) / "a")),
            "count_tokens": count_stall(args.model, args.megabytes, Path(tmp) / "b"),
        }
    for name, row in rows.items():
        print(name, row, flush=True)
    report = {
        "benchmark": "stall",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}",
        "model": args.model,
        **{f"{name}.{key}": value for name, row in rows.items() for key, value in row.items()},
    }
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
