"""Does one heavy request stall the server's event loop for every other client?

``agentkv serve`` runs in a subprocess. Two probes run in processes of their own: one pings it
(``GET /v1/models``, every 20 ms, on a connection of its own), the other streams another
agent's turns (the gaps between its pieces), while this process sends one heavy request at a
time:

- at the limits (the server's defaults), to both chat APIs: a history of 9,999 messages
  (``--max-messages`` is 10,000) and a system prompt of 5 MB, each sent by a stateless client
  and for a named agent; a turn of an agent whose transcript holds 9,999 messages already;
  Anthropic's ``count_tokens`` of the 9,999 messages (answered); a new agent with the 5 MB
  system prompt (agents API);
- over them: a history of 40,000 messages (refused once parsed, 413) and one user message of
  5 MB.

On the tiny model every chat request is refused in the end as too long for its context, after
the work a request costs (parsing, matching its agent, storing it, rendering, tokenizing). A
ping's latency is how long the event loop kept it waiting; the targets are a worst ping of at
most 50 ms and a worst gap in the other stream of at most 100 ms. Each request is sent
``--repeats`` times (3), the probes started afresh each time: a row's worst is the worst of
all its runs, and each run's worst is listed beside it. The baseline is the probes with nothing
else sent, as often: on a machine shared with other work, it shows what the machine itself
adds.

Run: ``python -m benchmarks.bench_event_loop`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from agentkv.store import NewMessage, Registry
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"
PING_EVERY_S = 0.02
TARGET_MS = 50.0
STREAM_TARGET_MS = 100.0
ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}
COUNT_TOKENS, AGENTS = "/v1/messages/count_tokens", "/v1/agents"
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


class Probes:
    """Two processes of their own (so that this one's work never delays them): one pings
    ``GET /v1/models`` every few milliseconds, keeping each latency; the other streams turns
    of another agent, keeping the gaps between its pieces (a turn's first piece is not timed
    from the one before)."""

    def __init__(self, url: str):
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._ready = [context.Event(), context.Event()]
        self._pipes = [context.Pipe(duplex=False) for _ in range(2)]
        probes = zip((_ping, _stream), self._ready, self._pipes, strict=True)
        self._processes = [
            context.Process(target=probe, args=(url, self._stop, ready, send), daemon=True)
            for probe, ready, (_, send) in probes
        ]
        self.latencies: list[float] = []
        self.gaps: list[float] = []

    def __enter__(self) -> Probes:
        for process in self._processes:
            process.start()
        deadline = time.monotonic() + 120
        while not all(ready.is_set() for ready in self._ready):
            if time.monotonic() > deadline or not all(p.is_alive() for p in self._processes):
                self._stop.set()
                raise RuntimeError("a probe did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.latencies, self.gaps = (receive.recv() for receive, _ in self._pipes)
        for process in self._processes:
            process.join(60)


def summary(runs: list[Probes]) -> dict[str, Any]:
    """The probes' figures over ``runs`` (each a repeat): the worst and median ping and gap of
    them all, and each repeat's worst."""
    latencies = [x for probes in runs for x in probes.latencies]
    gaps = [x for probes in runs for x in probes.gaps] or [0.0]
    return {
        "pings": len(latencies),
        "worst_ms": round(max(latencies) * 1e3, 1),
        "median_ms": round(statistics.median(latencies) * 1e3, 1),
        "worst_ms_by_repeat": [round(max(r.latencies) * 1e3, 1) for r in runs],
        "stream_gaps": sum(len(r.gaps) for r in runs),
        "stream_worst_gap_ms": round(max(gaps) * 1e3, 1),
        "stream_median_gap_ms": round(statistics.median(gaps) * 1e3, 1),
        "stream_worst_gap_ms_by_repeat": [round(max(r.gaps or [0]) * 1e3, 1) for r in runs],
    }


def _ping(url: str, stop: Any, ready: Any, out: Any) -> None:
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get("/v1/models").raise_for_status()
            latencies.append(time.perf_counter() - start)
            ready.set()
            time.sleep(PING_EVERY_S)
    out.send(latencies)


def _stream(url: str, stop: Any, ready: Any, out: Any) -> None:
    body = {"model": "m", "max_tokens": 64, "stream": True, "messages": [_USER]}
    gaps = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            last = None
            with client.stream("POST", ROUTES["openai"], json=body, headers=STREAMER) as r:
                for line in r.iter_lines():
                    if stop.is_set():
                        break
                    if not line.startswith("data:"):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                        ready.set()
                    last = now
    out.send(gaps)


_USER = {"role": "user", "content": "Tell me about parcels."}
STREAMER = {"x-agent-id": "streamer"}
LONG_AGENT = "long"


def bodies(api: str, messages: int, megabytes: float) -> dict[str, bytes]:
    """The heavy requests in ``api``'s shape, encoded once (so encoding is not timed)."""

    def history(n: int) -> list[dict[str, str]]:
        return [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}"}
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


def measure(
    url: str, route: str, body: dict[str, Any], agent: str | None, repeats: int
) -> dict[str, Any]:
    """Send the request ``repeats`` times, each while the probes run (started afresh): its
    status, median wall time, the pings and the stream."""
    raw = json.dumps(body).encode()
    headers = {"content-type": "application/json"} | ({"x-agent-id": agent} if agent else {})
    runs, statuses, walls = [], set(), []
    for _ in range(repeats):
        with httpx.Client(base_url=url, timeout=600) as client, Probes(url) as probes:
            time.sleep(0.3)  # the stream runs before the request
            start = time.perf_counter()
            response = client.post(route, content=raw, headers=headers)
            walls.append(time.perf_counter() - start)
            time.sleep(0.1)  # and after
        runs.append(probes)
        statuses.add(response.status_code)
    return {
        "body_mb": round(len(raw) / 1e6, 2),
        "status": statuses.pop() if len(statuses) == 1 else sorted(statuses),
        "wall_s": round(statistics.median(walls), 3),
        **summary(runs),
    }


async def _long_agent(data_dir: Path, messages: int) -> None:
    """An agent whose transcript holds ``messages`` messages, put in the registry before the
    server starts (a long-lived agent: every turn of it reads them)."""
    async with await Registry.open(data_dir / "agentkv.sqlite") as registry:
        await registry.create_agent(LONG_AGENT)
        history = [
            NewMessage("user" if i % 2 == 0 else "assistant", f"{i}")
            for i in range(messages - 1 + messages % 2 - 1)
        ]
        await registry.append_messages(LONG_AGENT, history)


def requests(sizes: tuple[int, float]) -> Iterator[tuple[str, str, str, Any, str | None]]:
    """(request, limits, route, body, agent) of every heavy request: each body to each API
    (the ones at the limits from a stateless client and for a named agent), a turn of an
    agent whose transcript is at the limit; Anthropic's token count of the history at the
    limit; the agents API's new agent with the big system prompt."""
    for api, route in ROUTES.items():
        for kind, body in bodies(api, *sizes).items():
            limits = "at" if "at the limit" in kind or "system" in kind else "over"
            for agent in [None, f"named-{api}"] if limits == "at" else [None]:
                who = "named" if agent else "stateless"
                yield f"{api} {kind} ({who})", limits, route, body, agent
        body = {"model": "m", "max_tokens": 4, "messages": [_USER]}
        yield f"{api} turn of a {sizes[0]:,}-message transcript", "at", route, body, LONG_AGENT
    body = bodies("anthropic", *sizes)["history at the limit"]
    yield "anthropic count_tokens of the history at the limit", "at", COUNT_TOKENS, body, None
    big = bodies("anthropic", *sizes)[f"{sizes[1]:g} MB system prompt"]["system"]
    body = {"system_prompt": big}  # (each repeat a new agent, its id made by the server)
    yield f"agents API: new agent, {sizes[1]:g} MB system prompt", "at", AGENTS, body, None


def run_server(
    model: str, data_dir: Path, sizes: tuple[int, float], repeats: int
) -> list[dict[str, Any]]:
    """Rows: the probes with nothing else sent, then one row a heavy request."""
    rows = []
    asyncio.run(_long_agent(data_dir, sizes[0]))
    with agentkv_serve(model, data_dir) as url:
        idle = []
        for _ in range(repeats):
            with Probes(url) as probes:
                time.sleep(1.0)
            idle.append(probes)
        rows.append({"request": "baseline (a stream)", "limits": "baseline", **summary(idle)})
        for request, limits, route, body, agent in requests(sizes):
            row = {"request": request, "limits": limits}
            row |= measure(url, route, body, agent, repeats)
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
        ax.axvline(TARGET_MS, color="red", linestyle="--", label=f"ping target {TARGET_MS:.0f} ms")
        ax.axvline(STREAM_TARGET_MS, color="purple", linestyle=":", label="gap target 100 ms")
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.legend(fontsize=8)

    met = "met" if report["target_met"] else "not met"
    title = (
        f"python -m benchmarks.bench_event_loop: {report['model']} (random weights), "
        f"{report['machine']}, {report['date']}\nworst of {report['repeats']} runs each; "
        f"targets (ping {TARGET_MS:g} ms, gap {STREAM_TARGET_MS:g} ms) {met}"
    )
    return save_plot(path, [panel], title, (9, 5.5))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:gemma3")
    parser.add_argument("--messages", type=int, default=AT_MESSAGES)
    parser.add_argument("--megabytes", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each request")
    parser.add_argument("--quick", action="store_true", help="small sizes, one run each")
    parser.add_argument("--out", type=Path, default=RESULTS / "event_loop.json")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.megabytes, args.repeats = 2_000, 0.2, 1
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_server(args.model, Path(tmp), (args.messages, args.megabytes), args.repeats)
    heavy = [r for r in rows if r["limits"] != "baseline"]
    worst = max(r["worst_ms"] for r in heavy)
    worst_gap = max(r["stream_worst_gap_ms"] for r in heavy)
    report = {
        "benchmark": "event_loop",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
        "model": args.model,
        "messages": args.messages,
        "megabytes": args.megabytes,
        "repeats": args.repeats,
        "worst_ms": worst,
        "worst_stream_gap_ms": worst_gap,
        "target_ms": TARGET_MS,
        "stream_target_ms": STREAM_TARGET_MS,
        "target_met": worst <= TARGET_MS and worst_gap <= STREAM_TARGET_MS,
        "rows": rows,
    }
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
