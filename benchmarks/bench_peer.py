"""agentkv vs mlx-lm's own server, side by side: N agents with long histories, both servers
restarted, then one more turn per agent.

    python -m benchmarks.bench_peer [--model tiny:gemma3-bench] [--agents 4] [--history 2048]
                                    [--quick]

Both servers run as subprocesses on 127.0.0.1, one at a time (never both at once, so neither
steals the other's cores), on the same local model directory:

- agentkv: ``python -m server.cli serve --model DIR --data-dir TMP --kv-bits 8`` (as shipped);
- mlx_lm.server: ``python -c "import agentkv.engine; ...; runpy.run_module('mlx_lm.server')"
  --model DIR``. The wrapper only imports ``engine`` first, which preloads the system OpenBLAS
  exactly as agentkv does for itself (without it mlx-cpu uses its bundled reference BLAS, ~30x
  slower matmuls), and restores the default SIGINT handler (a process started from a background
  job inherits SIGINT ignored). ``--prompt-cache-size`` is raised to fit every conversation
  (its default, 10, would start evicting past 4 agents). Readiness is polled on /health: its
  /v1/models scans the Hugging Face cache and fails (empty 200) when there is none. The BLAS
  libraries mapped into each server process are read from /proc and recorded; the run fails
  if only one of them maps OpenBLAS.

Every request is the same for both servers: the official ``openai`` SDK, streaming,
``temperature=0``, ``user=<agent id>`` (agentkv's agent identity; mlx_lm.server ignores it),
the whole conversation as ``messages`` (agentkv ignores the history of a known agent and uses
its own transcript). Each server keeps its own copy of every conversation (its own replies).

Sessions, each started fresh and stopped with SIGINT (graceful: agentkv flushes its cache
writes, mlx_lm.server drops its in-memory prompt cache; each exit status is recorded:
mlx-lm 0.32.2 aborts on the way out, status -6), each beginning with a throwaway
warm-up turn on another conversation so no measured turn pays model loading or first calls:

1. ``cold`` + ``hot``: each agent's first request carries a synthetic history of about
   ``--history`` tokens (random-word user/assistant pairs sized with the model's own chat
   template and tokenizer); both servers prefill it (cold). Then each agent sends one more turn
   in the same process (hot: agentkv's hot tier, mlx_lm.server's in-memory LRU prompt cache).
2. ``restart``: fresh processes; one more turn per agent, agents one after another.
3. ``restart_concurrent`` (unless ``--no-concurrent``): fresh processes again; one more turn for
   all agents at once.

TTFT is the time from sending the request to the first chunk with content (or a finish reason,
if the reply is empty); total is until the stream ends. ``cached_tokens`` is what each server
reports in ``usage.prompt_tokens_details`` of its final usage chunk
(``stream_options={"include_usage": True}``). Nothing is retried; a server that fails to start
or answers with an error fails the run (its log tail is in the error).

Writes benchmarks/results/peer.json and peer.png (or --out and its .png).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import mlx_lm
import numpy as np
from openai import AsyncOpenAI

from agentkv.models.directory import resolve_model_path
from benchmarks.bench_resume import chat_token_counter, sized_history
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("agentkv", "mlx_lm")
PHASES = ("cold", "hot", "restart", "restart_concurrent")
MLX_LM_WRAPPER = (
    # agentkv.engine first: the same OpenBLAS preload as agentkv
    "import agentkv.engine, runpy, signal, sys; "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = ['mlx_lm.server', *sys.argv[1:]]; "
    "runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)"
)


class BenchError(RuntimeError):
    """A server failed to start, stop or answer: the comparison cannot be made."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mapped_blas(pid: int) -> list[str]:
    """BLAS shared objects mapped into a process (Linux; empty elsewhere)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sorted({ln.split()[-1] for ln in f if "blas" in ln.lower() and "/" in ln})
    except OSError:
        return []


@dataclass(slots=True)
class ServerProcess:
    """One server subprocess in its own process group, its output in a log file."""

    name: str
    argv: list[str]
    ready_path: str  # GET answers 200 once the server is up
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    cwd: Path = ROOT

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def fail(self, what: str) -> BenchError:
        return BenchError(f"{self.name} {what}; log {self.log_path}:\n{self.log_tail()}")

    def start(self, timeout_s: float) -> float:
        """Start and wait until ``ready_path`` answers; seconds until it did."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        start = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: kill() reaches any children
            )
        while time.perf_counter() - start < timeout_s:
            if self.proc.poll() is not None:
                raise self.fail(f"exited with status {self.proc.returncode} while starting")
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=2).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise self.fail(f"did not answer GET {self.ready_path} within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 120) -> float:
        """SIGINT (graceful shutdown) and wait; seconds it took to exit."""
        assert self.proc is not None
        start = time.perf_counter()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self.fail(f"did not exit within {timeout_s:.0f} s of SIGINT") from None
        return time.perf_counter() - start

    def kill(self) -> None:
        """SIGKILL the process group if it still runs (cleanup after a failure)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@dataclass(slots=True)
class TurnResult:
    """One measured streamed turn."""

    agent: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the server did not report prompt_tokens_details
    finish_reason: str | None
    text: str


@dataclass(slots=True)
class Session:
    """What one server start measured besides turns."""

    phase: str
    ready_s: float
    warmup_s: float
    stop_s: float = 0.0
    exit_status: int | None = None  # after SIGINT; negative: killed by that signal
    blas: list[str] = field(default_factory=list)


@dataclass
class Streamed:
    """One streamed chat completion as read: when its first token (or finish) and its end came
    (``time.perf_counter``), its text pieces, and what its last chunks carried."""

    first_at: float | None
    end_at: float
    pieces: list[str]
    usage: Any
    finish: str | None
    timings: dict | None  # agentkv's split of the turn (``timings`` beside ``usage``)


async def stream_chat(
    client: AsyncOpenAI, model: str, agent: str, messages: list[dict], max_tokens: int
) -> Streamed:
    """Stream one greedy completion for ``agent`` (``user``), asking for usage."""
    first_at = usage = finish = timings = None
    pieces: list[str] = []
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        user=agent,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        usage = chunk.usage or usage
        timings = (chunk.model_extra or {}).get("timings", timings)
        for choice in chunk.choices:
            if first_at is None and (choice.delta.content or choice.finish_reason):
                first_at = time.perf_counter()
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return Streamed(first_at, time.perf_counter(), pieces, usage, finish, timings)


async def stream_turn(
    client: AsyncOpenAI, model: str, agent: str, messages: list[dict], max_tokens: int
) -> TurnResult:
    start = time.perf_counter()
    got = await stream_chat(client, model, agent, messages, max_tokens)
    if got.first_at is None or got.usage is None:
        raise BenchError(f"agent {agent}: the stream ended without a finish reason or usage")
    details = got.usage.prompt_tokens_details
    return TurnResult(
        agent=agent,
        ttft_s=got.first_at - start,
        total_s=got.end_at - start,
        prompt_tokens=got.usage.prompt_tokens,
        completion_tokens=got.usage.completion_tokens,
        cached_tokens=details.cached_tokens if details is not None else None,
        finish_reason=got.finish,
        text="".join(got.pieces),
    )


class Bench:
    """State of one run: the conversations each server holds and everything measured."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, root: Path):
        self.args = args
        self.model = str(model_dir)
        self.root = root
        self.data_dir = root / "agentkv-data"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        count = chat_token_counter(model_dir)
        self.agents = [f"agent-{i}" for i in range(args.agents)]
        histories = [sized_history(count, args.history, seed=i) for i in range(args.agents)]
        self.history_tokens = [count(h) for h in histories]
        self.history_messages = {a: len(h) for a, h in zip(self.agents, histories, strict=True)}
        # Each server's own copy: the same history, then its own replies.
        self.conversations = {
            s: {a: list(h) for a, h in zip(self.agents, histories, strict=True)} for s in SERVERS
        }
        self.warmup = {s: [] for s in SERVERS}
        self.turns: dict[str, dict[str, list[TurnResult]]] = {p: {} for p in PHASES}
        self.sessions: dict[str, list[Session]] = {s: [] for s in SERVERS}
        self.walls: dict[str, dict[str, float]] = {p: {} for p in PHASES}
        self.argv: dict[str, list[str]] = {}

    def server(self, name: str) -> ServerProcess:
        port = free_port()
        common = ["--model", self.model, "--host", "127.0.0.1", "--port", str(port)]
        if name == "agentkv":
            argv = [sys.executable, "-m", "agentkv.server.cli", "serve", *common]
            argv += ["--data-dir", str(self.data_dir), "--kv-bits", self.args.kv_bits]
            ready = "/v1/models"
        else:
            # Enough LRU slots for every conversation (default 10), so eviction is not measured.
            argv = [sys.executable, "-c", MLX_LM_WRAPPER, *common]
            argv += ["--prompt-cache-size", str(max(10, 2 * self.args.agents + 2))]
            # Its /v1/models scans the Hugging Face cache and fails when there is none.
            ready = "/health"
        self.argv[name] = [a if a != str(port) else "PORT" for a in argv]
        return ServerProcess(name, argv, ready, port, self.logs / f"{name}.log")

    async def turn(self, client: AsyncOpenAI, server: str, agent: str) -> TurnResult:
        """One more user turn in the agent's conversation, recorded with the reply."""
        conversation = self.conversations[server][agent]
        n = (len(conversation) - self.history_messages[agent]) // 2 + 1  # same for both servers
        messages = [*conversation, {"role": "user", "content": f"Turn {n}: go on, briefly."}]
        result = await stream_turn(client, self.model, agent, messages, self.args.max_tokens)
        conversation[:] = [*messages, {"role": "assistant", "content": result.text}]
        return result

    async def measure(
        self, phase: str, server: str, client: AsyncOpenAI, concurrent: bool = False
    ) -> None:
        start = time.perf_counter()
        if concurrent:
            results = await asyncio.gather(*(self.turn(client, server, a) for a in self.agents))
        else:
            results = [await self.turn(client, server, a) for a in self.agents]
        self.walls[phase][server] = time.perf_counter() - start
        self.turns[phase][server] = list(results)
        for r in results:
            print(
                f"[{server}] {phase} {r.agent}: prompt {r.prompt_tokens}, cached "
                f"{r.cached_tokens}, TTFT {r.ttft_s * 1e3:.0f} ms, total {r.total_s * 1e3:.0f} ms",
                flush=True,
            )

    async def session(self, server_name: str, phases: list[str], concurrent: bool) -> None:
        """Start the server, warm it up, measure ``phases`` in turn, stop it (killed on any
        failure)."""
        server = self.server(server_name)
        try:
            ready = server.start(self.args.start_timeout)
            session = Session(phases[0], ready, warmup_s=0.0, blas=mapped_blas(server.proc.pid))
            try:
                async with AsyncOpenAI(
                    base_url=server.base_url + "/v1",
                    api_key="unused",
                    max_retries=0,  # a failed request fails the run; no retries in timings
                    timeout=httpx.Timeout(self.args.request_timeout, connect=10),
                ) as client:
                    start = time.perf_counter()
                    warm = [{"role": "user", "content": "Hello."}]
                    warmup_id = f"bench-warmup-{len(self.sessions[server_name])}"
                    result = await stream_turn(client, self.model, warmup_id, warm, 2)
                    session.warmup_s = time.perf_counter() - start
                    self.warmup[server_name].append(asdict(result))
                    for phase in phases:
                        await self.measure(phase, server_name, client, concurrent)
            except Exception as exc:
                raise server.fail(f"failed in phase {phases}: {exc!r}") from exc
            session.stop_s = server.stop()
            session.exit_status = server.proc.returncode
            self.sessions[server_name].append(session)
        finally:
            server.kill()

    async def run(self) -> None:
        sessions = [(["cold", "hot"], False), (["restart"], False)]
        if self.args.concurrent:
            sessions.append((["restart_concurrent"], True))
        for phases, concurrent in sessions:
            for server in SERVERS:  # one server at a time: neither competes for the cores
                await self.session(server, phases, concurrent)
        self.check_blas()

    def check_blas(self) -> None:
        uses = {s: any("openblas" in p for p in self.sessions[s][0].blas) for s in SERVERS}
        if len(set(uses.values())) > 1:
            raise BenchError(f"unfair run: OpenBLAS mapped into {uses}; see sessions[].blas")


def ratio(peer: float, ours: float) -> float:
    return peer / ours if ours > 0 else float("inf")


def summarize(bench: Bench) -> dict:
    args = bench.args
    phases = [p for p in PHASES if bench.turns[p]]
    by = {p: {s: {r.agent: r for r in bench.turns[p][s]} for s in SERVERS} for p in phases}
    rows = []
    for agent, history_tokens in zip(bench.agents, bench.history_tokens, strict=True):
        row: dict[str, Any] = {"agent": agent, "history_tokens": history_tokens}
        for p in phases:
            ours, peer = by[p]["agentkv"][agent], by[p]["mlx_lm"][agent]
            row[p] = {
                "ttft_s": {"agentkv": ours.ttft_s, "mlx_lm": peer.ttft_s},
                "total_s": {"agentkv": ours.total_s, "mlx_lm": peer.total_s},
                "prompt_tokens": {"agentkv": ours.prompt_tokens, "mlx_lm": peer.prompt_tokens},
                "cached_tokens": {"agentkv": ours.cached_tokens, "mlx_lm": peer.cached_tokens},
                "ttft_ratio": ratio(peer.ttft_s, ours.ttft_s),
            }
        rows.append(row)
    totals = {}
    for p in phases:
        t = {
            s: {
                "ttft_s": sum(r.ttft_s for r in bench.turns[p][s]),
                "total_s": sum(r.total_s for r in bench.turns[p][s]),
                "wall_s": bench.walls[p][s],
                "cached_tokens": sum(r.cached_tokens or 0 for r in bench.turns[p][s]),
                "prompt_tokens": sum(r.prompt_tokens for r in bench.turns[p][s]),
            }
            for s in SERVERS
        }
        t["ttft_ratio"] = ratio(t["mlx_lm"]["ttft_s"], t["agentkv"]["ttft_s"])
        t["wall_ratio"] = ratio(t["mlx_lm"]["wall_s"], t["agentkv"]["wall_s"])
        totals[p] = t
    restart = bench.turns["restart"]["agentkv"]
    return {
        "benchmark": "peer",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "model": args.model,
        "model_dir": bench.model,
        "agents": args.agents,
        "history": args.history,
        "max_tokens": args.max_tokens,
        "kv_bits": args.kv_bits,
        "agentkv_resumed_from_disk": all((r.cached_tokens or 0) > 0 for r in restart),
        "versions": {
            "agentkv": importlib.metadata.version("agentkv"),
            "mlx_lm": mlx_lm.__version__,
            "mlx": importlib.metadata.version("mlx"),
            "openai": importlib.metadata.version("openai"),
            "python": platform.python_version(),
        },
        "servers": {
            s: {"argv": bench.argv[s], "sessions": [asdict(x) for x in bench.sessions[s]]}
            for s in SERVERS
        },
        "rows": rows,
        "totals": totals,
        "turns": {p: {s: [asdict(r) for r in bench.turns[p][s]] for s in SERVERS} for p in phases},
        "warmup": bench.warmup,
    }


def print_table(report: dict) -> None:
    print(
        f"{report['model']} ({report['model_dir']}): {report['agents']} agents x "
        f"{report['history']} tokens; TTFT / total in ms; ratio = mlx_lm / agentkv TTFT"
    )
    head = "".join(f"{c:>8}" for c in ("prompt", "TTFT", "total", "cached"))
    for phase, total in report["totals"].items():
        print(f"-- {phase}\n{'':>10}{'agentkv':>32}{'mlx_lm':>32}")
        print(f"{'agent':>10}{head}{head}{'ratio':>8}")
        lines = [(row["agent"], row[phase], row[phase]["ttft_ratio"]) for row in report["rows"]]
        sums = {k: {s: total[s][k] for s in SERVERS} for k in ("prompt_tokens", "cached_tokens")}
        sums |= {k: {s: total[s][k] for s in SERVERS} for k in ("ttft_s", "total_s")}
        for name, r, ratio_ in [*lines, ("sum", sums, total["ttft_ratio"])]:
            line = f"{name:>10}"
            for s in SERVERS:
                line += f"{r['prompt_tokens'][s]:>8}{r['ttft_s'][s] * 1e3:>8.0f}"
                line += f"{r['total_s'][s] * 1e3:>8.0f}{r['cached_tokens'][s]!s:>8}"
            print(line + f"{ratio_:>8.1f}")
        walls = ", ".join(f"{s} {total[s]['wall_s']:.2f} s" for s in SERVERS)
        print(f"{'':>10}wall: {walls} (ratio {total['wall_ratio']:.1f})")
    print(f"agentkv resumed from disk: {report['agentkv_resumed_from_disk']}", flush=True)


def plot(report: dict, path: Path) -> Path:
    agents = [row["agent"] for row in report["rows"]]
    x = np.arange(len(agents))

    def per_agent(phase: str, title: str):
        def draw(ax) -> None:
            for i, server in enumerate(SERVERS):
                ttft = [row[phase]["ttft_s"][server] * 1e3 for row in report["rows"]]
                bars = ax.bar(x + (i - 0.5) * 0.4, ttft, 0.4, label=server)
                bar_labels(ax, bars, "{:.0f}")
            ax.set_xticks(x, agents)
            ax.set_yscale("log")
            ax.set_ylabel("time to first token (ms)")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=7)

        return draw

    def by_phase(ax) -> None:
        phases = list(report["totals"])
        px = np.arange(len(phases))
        for i, server in enumerate(SERVERS):
            mean = [report["totals"][p][server]["ttft_s"] / len(agents) * 1e3 for p in phases]
            bars = ax.bar(px + (i - 0.5) * 0.4, mean, 0.4, label=server)
            bar_labels(ax, bars, "{:.0f}")
        ax.set_xticks(px, [p.replace("_", "\n") for p in phases], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("mean TTFT per agent (ms)")
        ax.set_title("every phase", fontsize=9)
        ax.legend(fontsize=7)

    panels = [per_agent("restart", "after restart, one agent at a time")]
    if "restart_concurrent" in report["totals"]:
        panels.append(per_agent("restart_concurrent", "after restart, all agents at once"))
    panels.append(by_phase)
    title = (
        f"agentkv vs mlx_lm.server: {report['model']}, {report['agents']} agents x "
        f"{report['history']} tokens, {report['date']}"
    )
    return save_plot(path, panels, title)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="agentkv vs mlx_lm.server across a restart")
    parser.add_argument("--model", default="tiny:gemma3-bench", help="tiny:<name> or a model dir")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--history", type=int, default=2048, help="history tokens per agent")
    parser.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn")
    parser.add_argument("--kv-bits", choices=("8", "4", "none"), default="8", help="agentkv's")
    parser.add_argument("--no-concurrent", dest="concurrent", action="store_false")
    parser.add_argument("--start-timeout", type=float, default=180, help="seconds per start")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds per turn")
    parser.add_argument("--data-dir", type=Path, help="parent of the temp dir (data, logs)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (data, logs)")
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, 2 agents x 128")
    parser.add_argument("--out", type=Path, default=RESULTS / "peer.json")
    parser.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.agents, args.history, args.max_tokens = "tiny:gemma3", 2, 128, 8
    model_dir = resolve_model_path(args.model)
    root = Path(tempfile.mkdtemp(prefix="agentkv-peer-", dir=args.data_dir))
    try:
        bench = Bench(args, model_dir, root)
        asyncio.run(bench.run())
    except BaseException:
        print(f"bench_peer failed; server logs kept in {root / 'logs'}", file=sys.stderr)
        raise
    if args.keep:
        print(f"kept {root} (agentkv data dir, server logs)")
    else:
        shutil.rmtree(root, ignore_errors=True)
    report = summarize(bench)
    print_table(report)
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
