"""Does one heavy request stall the server's event loop for every other client?

``agentkv serve`` runs in a subprocess; this process pings it (``HEAD /``, every 5 ms, on a
connection of its own) and streams another agent's turns (the gaps between its pieces) while
it sends one heavy request at a time, to both APIs:

- at the limits (the server's defaults): a history of 9,999 messages (``--max-messages`` is
  10,000), and a system prompt of 5 MB, each sent by a stateless client and for a named agent;
  and a turn of an agent whose transcript holds 9,999 messages already;
- over them: a history of 40,000 messages (refused once parsed, 413) and one user message of
  5 MB.

On the tiny model every one of them is refused in the end as too long for its context, after
the work a request costs (parsing, matching its agent, storing it, rendering, tokenizing). A
ping's latency is how long the event loop kept it waiting; the target is a worst ping of at
most 50 ms. The baseline is the same pings with only the stream running.

Run: ``python -m benchmarks.bench_event_loop`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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

from agentkv.store import NewMessage, Registry
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"
PING_EVERY_S = 0.005
TARGET_MS = 50.0
ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}
AT_MESSAGES = 9_999
"""A history one message under ``agentkv serve``'s ``--max-messages`` (10,000)."""
OVER_MESSAGES = 40_000


@contextlib.contextmanager
def agentkv_serve(model: str, data_dir: Path, *options: str) -> Iterator[str]:
    """``agentkv serve`` in a subprocess on a free loopback port; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["serve", "--model", model, "--data-dir", str(data_dir), "--port", str(port)]
    args += options
    process = subprocess.Popen(
        [sys.executable, "-m", "agentkv.server.cli", *args],
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
    """Pings ``HEAD /`` every few milliseconds from a thread, keeping each latency; with
    ``stream``, also streams turns of another agent, keeping the gaps between its pieces."""

    def __init__(self, url: str, stream: bool = True):
        self._url = url
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ping, daemon=True)]
        if stream:
            self._threads.append(threading.Thread(target=self._stream, daemon=True))
        self.latencies: list[float] = []
        self.gaps: list[float] = []

    def _ping(self) -> None:
        with httpx.Client(base_url=self._url, timeout=60) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                client.head("/")
                self.latencies.append(time.perf_counter() - start)
                time.sleep(PING_EVERY_S)

    def _stream(self) -> None:
        body = {"model": "m", "max_tokens": 64, "stream": True, "messages": [_USER]}
        with httpx.Client(base_url=self._url, timeout=60) as client:
            while not self._stop.is_set():
                last = None
                with client.stream("POST", ROUTES["openai"], json=body, headers=STREAMER) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append(now - last)
                        last = now

    def __enter__(self) -> Pinger:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def summary(self) -> dict[str, Any]:
        gaps = self.gaps or [0.0]
        return {
            "pings": len(self.latencies),
            "worst_ms": round(max(self.latencies) * 1e3, 1),
            "median_ms": round(statistics.median(self.latencies) * 1e3, 1),
            "stream_worst_gap_ms": round(max(gaps) * 1e3, 1),
            "stream_median_gap_ms": round(statistics.median(gaps) * 1e3, 1),
        }


_USER = {"role": "user", "content": "Tell me about parcels."}
STREAMER = {"x-agent-id": "streamer"}
LONG_AGENT = "long"


def bodies(api: str, messages: int, megabytes: float) -> dict[str, bytes]:
    """The heavy requests in ``api``'s shape, encoded once (so encoding is not timed)."""

    def history(n: int) -> list[dict[str, str]]:
        return [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}
            for i in range(n - 1 + n % 2)  # an odd count ends on a user message
        ]

    big = "hello world " * int(megabytes * 1e6 / len("hello world "))
    head = {"model": "m", "max_tokens": 4} if api == "anthropic" else {"model": "m"}

    def body(system: str | None, chat: list[dict[str, str]]) -> dict[str, Any]:
        if system is None:
            return {**head, "messages": chat}
        if api == "anthropic":
            return {**head, "system": system, "messages": chat}
        return {**head, "messages": [{"role": "system", "content": system}, *chat]}

    return {
        "history at the limit": body(None, history(messages)),
        f"{megabytes:g} MB system prompt": body(big, [_USER]),
        "history over the limit": body(None, history(OVER_MESSAGES)),
        f"{megabytes:g} MB user message": body(None, [{"role": "user", "content": big}]),
    }


def measure(url: str, route: str, body: dict[str, Any], agent: str | None) -> dict[str, Any]:
    """Send one request while pinging: its status, wall time, the pings and the stream."""
    raw = json.dumps(body).encode()
    headers = {"content-type": "application/json"} | ({"x-agent-id": agent} if agent else {})
    with httpx.Client(base_url=url, timeout=600) as client, Pinger(url) as pinger:
        time.sleep(0.3)  # the stream runs before the request
        start = time.perf_counter()
        response = client.post(route, content=raw, headers=headers)
        wall = time.perf_counter() - start
        time.sleep(0.1)  # and after
    return {
        "body_mb": round(len(raw) / 1e6, 2),
        "status": response.status_code,
        "wall_s": round(wall, 3),
        **pinger.summary(),
    }


async def _long_agent(data_dir: Path, messages: int) -> None:
    """An agent whose transcript holds ``messages`` messages, put in the registry before the
    server starts (a long-lived agent: every turn of it reads them)."""
    async with await Registry.open(data_dir / "agentkv.sqlite") as registry:
        await registry.create_agent(LONG_AGENT)
        history = [
            NewMessage("user" if i % 2 == 0 else "assistant", f"message {i}")
            for i in range(messages - 1 + messages % 2 - 1)
        ]
        await registry.append_messages(LONG_AGENT, history)


def run_server(model: str, data_dir: Path, sizes: tuple[int, float]) -> list[dict[str, Any]]:
    """Rows: the pings with only the stream running, then each heavy request to each API
    (the ones at the limits from a stateless client and for a named agent), then a turn of
    an agent whose transcript is at the limit."""
    rows = []
    asyncio.run(_long_agent(data_dir, sizes[0]))
    with agentkv_serve(model, data_dir) as url:
        with Pinger(url) as idle:
            time.sleep(1.0)
        rows.append({"request": "baseline (a stream)", "limits": "baseline", **idle.summary()})
        for api, route in ROUTES.items():
            for kind, body in bodies(api, *sizes).items():
                limits = "at" if "at the limit" in kind or "system" in kind else "over"
                for agent in [None, f"named-{api}"] if limits == "at" else [None]:
                    who = "named" if agent else "stateless"
                    row = {"request": f"{api} {kind} ({who})", "limits": limits}
                    row |= measure(url, route, body, agent)
                    print(row, flush=True)
                    rows.append(row)
            row = {"request": f"{api} turn of a {sizes[0]:,}-message transcript", "limits": "at"}
            body = {"model": "m", "max_tokens": 4, "messages": [_USER]}
            row |= measure(url, route, body, LONG_AGENT)
            print(row, flush=True)
            rows.append(row)
    return rows


def plot(report: dict, path: Path) -> Path:
    def panel(ax: Any) -> None:
        rows = report["rows"]
        labels = [r["request"] for r in rows]
        ax.barh(labels, [r["stream_worst_gap_ms"] for r in rows], label="stream's worst gap")
        ax.barh(labels, [r["worst_ms"] for r in rows], label="worst ping", height=0.5)
        ax.barh(labels, [r["median_ms"] for r in rows], label="median ping", height=0.5)
        ax.axvline(TARGET_MS, color="red", linestyle="--", label=f"target {TARGET_MS:.0f} ms")
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.legend(fontsize=8)

    return save_plot(path, [panel], f"event-loop stalls, {report['machine']}", (9, 5.5))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:gemma3")
    parser.add_argument("--messages", type=int, default=AT_MESSAGES)
    parser.add_argument("--megabytes", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "event_loop.json")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.megabytes = 2_000, 0.2
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_server(args.model, Path(tmp), (args.messages, args.megabytes))
    worst = max(r["worst_ms"] for r in rows if r["limits"] != "baseline")
    report = {
        "benchmark": "event_loop",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
        "model": args.model,
        "messages": args.messages,
        "megabytes": args.megabytes,
        "worst_ms": worst,
        "worst_stream_gap_ms": max(r["stream_worst_gap_ms"] for r in rows),
        "target_ms": TARGET_MS,
        "target_met": worst <= TARGET_MS,
        "rows": rows,
    }
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
