"""Does one huge request stall the server's event loop for every other client?

``agentkv serve`` runs in a subprocess; this process pings it (``HEAD /``, every 5 ms, on a
connection of its own) while it sends one big request at a time, to both APIs:

- ``messages``: a history of N short user/assistant messages (40,000 by default);
- ``megabytes``: one user message of M megabytes (5 by default).

Each is refused: with the server's default limits a history over ``--max-messages`` (10,000) as
soon as it is parsed (413), anything else once tokenized as too long for the tiny model's
context (400). A second server, its ``--max-messages`` above N, takes the history the whole way
(rendering, tokenizing). A ping's latency is how long the event loop kept it waiting; the
target is a worst ping of at most 50 ms under the default limits. The baseline is the same
pings with nothing else sent.

Run: ``python -m benchmarks.bench_event_loop`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"
PING_EVERY_S = 0.005
TARGET_MS = 50.0
ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


@contextlib.contextmanager
def agentkv_serve(model: str, data_dir: Path, *options: str) -> Iterator[str]:
    """``agentkv serve`` in a subprocess on a free loopback port; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["serve", "--model", model, "--data-dir", str(data_dir), "--port", str(port)]
    args += options
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.head(url, timeout=5).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("agentkv serve did not start")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(60)


class Pinger:
    """Pings ``HEAD /`` every few milliseconds from a thread, keeping each latency."""

    def __init__(self, url: str):
        self._url = url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.latencies: list[float] = []

    def _run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=60) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                client.head("/")
                self.latencies.append(time.perf_counter() - start)
                time.sleep(PING_EVERY_S)

    def __enter__(self) -> Pinger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        return {
            "pings": len(self.latencies),
            "worst_ms": round(max(self.latencies) * 1e3, 1),
            "median_ms": round(statistics.median(self.latencies) * 1e3, 1),
        }


def bodies(api: str, messages: int, megabytes: float) -> dict[str, bytes]:
    """The two big requests in ``api``'s shape, encoded once (so encoding is not timed)."""
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} of a history"}
        for i in range(messages - 1 + messages % 2)  # an odd count ends on a user message
    ]
    words = int(megabytes * 1e6 / len("hello world "))
    big = [{"role": "user", "content": "hello world " * words}]
    head = {"model": "m", "max_tokens": 4} if api == "anthropic" else {"model": "m"}
    return {
        "messages": json.dumps({**head, "messages": history}).encode(),
        "megabytes": json.dumps({**head, "messages": big}).encode(),
    }


def measure(url: str, route: str, body: bytes) -> dict[str, Any]:
    """Send one request while pinging: its status, wall time and the pings' latencies."""
    with httpx.Client(base_url=url, timeout=600) as client, Pinger(url) as pinger:
        time.sleep(0.05)  # some pings before the request
        start = time.perf_counter()
        response = client.post(route, content=body, headers={"content-type": "application/json"})
        wall = time.perf_counter() - start
        time.sleep(0.05)  # and after
    return {
        "body_mb": round(len(body) / 1e6, 2),
        "status": response.status_code,
        "wall_s": round(wall, 3),
        **pinger.summary(),
    }


def run_server(
    model: str, data_dir: Path, limits: str, sizes: tuple[int, float], *options: str
) -> list[dict[str, Any]]:
    """Rows of one server: its idle pings, then each big request to each API."""
    rows = []
    with agentkv_serve(model, data_dir, *options) as url:
        with Pinger(url) as idle:
            time.sleep(0.5)
        rows.append({"request": f"idle ({limits})", "limits": limits, **idle.summary()})
        for api, route in ROUTES.items():
            for kind, body in bodies(api, *sizes).items():
                if limits != "default" and kind != "messages":
                    continue
                row = {"request": f"{api} {kind} ({limits})", "limits": limits}
                row |= measure(url, route, body)
                print(row, flush=True)
                rows.append(row)
    return rows


def plot(report: dict, path: Path) -> Path:
    def panel(ax: Any) -> None:
        labels = [r["request"] for r in report["rows"]]
        ax.barh(labels, [r["worst_ms"] for r in report["rows"]], label="worst ping")
        ax.barh(labels, [r["median_ms"] for r in report["rows"]], label="median ping")
        ax.axvline(TARGET_MS, color="red", linestyle="--", label=f"target {TARGET_MS:.0f} ms")
        ax.set_xlabel("ms")
        ax.legend(fontsize=8)

    return save_plot(path, [panel], f"event-loop stalls, {report['machine']}", (8, 3.5))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:gemma3")
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--megabytes", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "event_loop.json")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.megabytes = 2_000, 0.2
    sizes = (args.messages, args.megabytes)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_server(args.model, Path(tmp) / "a", "default", sizes)
        raised = ("--max-messages", str(args.messages + 1))
        rows += run_server(args.model, Path(tmp) / "b", "raised", sizes, *raised)
    worst = max(r["worst_ms"] for r in rows if r["limits"] == "default" and "status" in r)
    report = {
        "benchmark": "event_loop",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}",
        "model": args.model,
        "messages": args.messages,
        "megabytes": args.megabytes,
        "worst_ms": worst,
        "target_ms": TARGET_MS,
        "target_met": worst <= TARGET_MS,
        "rows": rows,
    }
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
