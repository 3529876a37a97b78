"""An agentic multi-turn benchmark: agentkv, mlx_lm.server and llama.cpp's server side by side
on the same model, then every server restarted and each conversation continued.

    python -m benchmarks.bench_agents [--model gemma3-270m] [--conversations 4] [--clients 2]
                                      [--rounds 3] [--after-restart 2] [--servers S,S] [--quick]

The workload is the same requests, in the same order, for every server (each keeps its own copy
of every conversation, with its own replies):

- every conversation starts with the same system prompt (``--prefix`` tokens: an agent's
  instructions and its tools) and a task of its own (``--first`` tokens of context);
- then ``--rounds`` rounds, alternately a tool round and a follow-up. A tool round is two
  requests: the client writes the model's reply as a tool call
  (``<tool_call>{"name": "read_file", ...}</tool_call>``, the assistant's message as an agent
  loop rewrites it) and sends the tool's result (``--tool`` tokens) as the next message: the
  text protocol agents use with a model without native tool calls, which every server renders
  with the model's own chat template. A follow-up is a user message of ``--follow`` tokens;
- ``--clients`` clients take conversations from a queue, each running one conversation's
  requests in order, so that many requests are in flight at once;
- then each server is stopped (SIGINT) and started again on the same data, and every
  conversation is continued for ``--after-restart`` more rounds (not started over).

Servers, one at a time on 127.0.0.1 (never two at once: none takes another's cores):

- ``agentkv``: ``agentkv serve --model DIR --data-dir D`` (as shipped);
- ``mlx_lm``: ``mlx_lm.server --model DIR`` with OpenBLAS preloaded as agentkv does
  (``benchmarks.bench_peer``), its prompt cache sized to hold every conversation;
- ``llama_cpp``: llama-cpp-python's OpenAI server (the ``peers`` extra:
  ``CMAKE_ARGS=-DGGML_NATIVE=OFF pip install -e '.[peers]'``, built for any x86-64 CPU with
  AVX2 rather than for this one) on the GGUF file
  the model directory was converted from (the packaged model's own Q4_K_M file, or
  ``--gguf``), requests queued rather than cut short by the next one. Its own prompt reuse:
  a request resumes the longest prefix it shares with the previous one, in the one context
  the server keeps. Its prompt caches are off by default (``--llama-cache none``): in
  llama-cpp-python 0.3.36 on this model the cache in memory (``ram``) took the server down
  mid-run in both runs tried (its process gone, no error logged), and the one
  on disk (``disk``) never served a prompt (every lookup a miss) while each request still
  paid to save its state.

Every request: the official ``openai`` SDK, streaming, ``temperature=0``, ``max_tokens``
``--max-tokens``, ``user=<conversation>`` (agentkv's agent identity; the others ignore it), the
whole conversation as ``messages``. Each session begins with a throwaway request on another
conversation. Per request the JSON records when it started, its time to first token (queueing
and prefill: what a client cannot tell apart; agentkv's last chunk splits it: its
``timings``), the rest of its stream (decoding), the tokens
each server reports (prompt, cached where it reports them, completion; chunks counted where it
reports none), how many other requests were in flight when it started, and whether the server
dropped its stream (sent again once, its time counted from the first attempt; a second drop
fails the run). Per server and phase
(``steady``: the first session; ``restart``: after the restart): TTFT and TPOT percentiles,
requests per second (requests over the phase's wall time), the cached share of prompt tokens
where reported, and the phase's time summed over requests: waiting for the first token,
decoding, and where the server splits it (``server_split_s``) finding caches, queueing,
prefill and decoding.

Writes benchmarks/results/agentic.json and .png (or --out and its .png).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from openai import APIConnectionError, AsyncOpenAI

from agentkv.models.directory import resolve_model_path
from agentkv.models.packaged import PACKAGED_MODELS
from benchmarks.bench_peer import (
    MLX_LM_WRAPPER,
    BenchError,
    ServerProcess,
    free_port,
    mapped_blas,
    stream_chat,
)
from benchmarks.bench_resume import chat_token_counter, words
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"
SERVERS = ("agentkv", "mlx_lm", "llama_cpp")
PHASES = ("steady", "restart")
TOOL_CALL = (
    '<tool_call>{{"name": "read_file", "arguments": {{"path": "src/part_{}.py"}}}}</tool_call>'
)


@dataclass(slots=True)
class Request:
    """One measured streamed request."""

    conversation: str
    round: int
    kind: str  # first, tool_call, tool_result, follow_up
    start_s: float  # from the phase's start
    ttft_s: float
    decode_s: float
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None  # None: the server does not report them
    completion_tokens: int
    in_flight: int  # other requests in flight when this one started
    retried: int  # the server dropped its stream and it was sent again (0 or 1)
    text: str
    server_timings: dict | None = None  # the server's split of the turn (agentkv's ``timings``)


class Workload:
    """The conversations' texts, seeded: the same for every server."""

    def __init__(self, args: argparse.Namespace, model_dir: Path):
        count = chat_token_counter(model_dir)
        rng = np.random.default_rng(0)
        self.system = self._sized(count, rng, args.prefix)
        self.tasks = [self._sized(count, rng, args.first) for _ in self.names(args)]
        rounds = args.rounds + args.after_restart + 1  # (a tool result for round n at [n])
        self.tools = [
            [self._sized(count, rng, args.tool) for _ in range(rounds)] for _ in self.names(args)
        ]
        self.follow = [self._sized(count, rng, args.follow) for _ in self.names(args)]

    @staticmethod
    def names(args: argparse.Namespace) -> list[str]:
        return [f"conv-{i}" for i in range(args.conversations)]

    @staticmethod
    def _sized(count: Any, rng: np.random.Generator, tokens: int) -> str:
        """Random words, ``tokens`` tokens of them or just under (as the model's template
        counts a user message of them, less the template's own)."""
        empty = count([{"role": "user", "content": ""}])
        pool = words(rng, 2 * tokens).split()
        low, high = 1, len(pool)
        while low < high:
            mid = (low + high + 1) // 2
            text = " ".join(pool[:mid])
            low, high = (
                (mid, high)
                if count([{"role": "user", "content": text}]) - empty <= tokens
                else (low, mid - 1)
            )
        return " ".join(pool[:low])

    def opening(self, i: int) -> list[dict]:
        return [
            {"role": "system", "content": self.system},
            {
                "role": "user",
                "content": f"Task {i}: summarize what this code does.\n{self.tasks[i]}",
            },
        ]


class Run:
    """One server's sessions: its copy of every conversation and every request measured."""

    def __init__(self, name: str, bench: Bench):
        self.name, self.bench, self.args = name, bench, bench.args
        work = bench.work
        self.conversations = {c: work.opening(i) for i, c in enumerate(work.names(self.args))}
        self.rounds = dict.fromkeys(self.conversations, 0)
        self.requests: dict[str, list[Request]] = {p: [] for p in PHASES}
        self.walls: dict[str, float] = {}
        self.sessions: list[dict] = []
        self.argv: list[str] = []
        self._phase_start = 0.0
        self._in_flight = 0

    def server(self) -> ServerProcess:
        port, data = free_port(), self.bench.root / self.name
        data.mkdir(exist_ok=True)
        common = ["--host", "127.0.0.1", "--port", str(port)]
        model = str(self.bench.model_dir)
        if self.name == "agentkv":
            argv = [sys.executable, "-m", "agentkv.server.cli", "serve", "--model", model]
            argv += [*common, "--data-dir", str(data), *self.args.agentkv_args.split()]
            ready = "/v1/models"
        elif self.name == "mlx_lm":
            argv = [sys.executable, "-c", MLX_LM_WRAPPER, "--model", model, *common]
            argv += ["--prompt-cache-size", str(2 * self.args.conversations + 2)]
            ready = "/health"
        else:
            gguf = str(self.bench.gguf)
            argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, *common]
            argv += ["--n_ctx", str(self.args.context), "--n_threads", str(os.cpu_count())]
            if self.args.llama_cache != "none":
                argv += ["--cache", "true", "--cache_type", self.args.llama_cache]
            # Queued, not cut short by the next request; its chat template's format.
            argv += ["--interrupt_requests", "false", "--chat_format", self.args.llama_format]
            ready = "/v1/models"
        self.argv = [a if a != str(port) else "PORT" for a in argv]
        log = self.bench.root / f"{self.name}.log"
        # (cwd: llama-cpp-python keeps its disk cache under the working directory)
        return ServerProcess(self.name, argv, ready, port, log, cwd=data)

    async def session(self, phase: str, rounds: int) -> None:
        """Start the server, warm it up, run ``rounds`` more rounds of every conversation with
        the clients, stop it (killed on any failure)."""
        server = self.server()
        try:
            ready = server.start(self.args.start_timeout)
            record = {"phase": phase, "ready_s": ready, "blas": mapped_blas(server.proc.pid)}
            try:
                async with AsyncOpenAI(
                    base_url=server.base_url + "/v1",
                    api_key="unused",
                    max_retries=0,  # a failed request fails the run; no retries in timings
                    timeout=httpx.Timeout(self.args.request_timeout, connect=10),
                ) as client:
                    warm = [{"role": "user", "content": "Hello."}]
                    await self.request(client, f"warmup-{phase}", 0, "warmup", warm, None)
                    self._phase_start = time.perf_counter()
                    queue: asyncio.Queue[str] = asyncio.Queue()
                    for name in self.conversations:
                        queue.put_nowait(name)
                    clients = range(self.args.clients)
                    await asyncio.gather(
                        *(self.client(client, queue, phase, rounds) for _ in clients)
                    )
                    self.walls[phase] = time.perf_counter() - self._phase_start
            except Exception as exc:
                raise server.fail(f"failed in phase {phase}: {exc!r}") from exc
            record["stop_s"] = server.stop()
            record["exit_status"] = server.proc.returncode
            self.sessions.append(record)
        finally:
            server.kill()

    async def client(self, client: AsyncOpenAI, queue: asyncio.Queue, phase: str, rounds: int):
        """Run conversations from ``queue``, each for ``rounds`` rounds (its opening first)."""
        while not queue.empty():
            name = queue.get_nowait()
            messages = self.conversations[name]
            index = int(name.split("-")[1])
            if self.rounds[name] == 0:
                await self.turn(client, name, phase, "first", messages)
            for _ in range(rounds):
                self.rounds[name] += 1
                n = self.rounds[name]
                if n % 2:  # a tool round: the reply as the call, then the tool's result
                    await self.turn(client, name, phase, "tool_call", messages)
                    messages[-1] = {"role": "assistant", "content": TOOL_CALL.format(n)}
                    result = self.bench.work.tools[index][n]
                    messages.append({"role": "user", "content": f"Tool result:\n{result}"})
                    await self.turn(client, name, phase, "tool_result", messages, added=False)
                else:
                    await self.turn(client, name, phase, "follow_up", messages)

    async def turn(
        self, client: AsyncOpenAI, name: str, phase: str, kind: str, messages: list, added=True
    ) -> None:
        """One request on the conversation (a new user message first unless ``added``), its
        reply appended."""
        if kind in ("tool_call", "follow_up") and added:
            index = int(name.split("-")[1])
            text = self.bench.work.follow[index] if kind == "follow_up" else "Read the next part."
            messages.append({"role": "user", "content": f"{text} (round {self.rounds[name]})"})
        got = await self.request(client, name, self.rounds[name], kind, messages, phase)
        messages.append({"role": "assistant", "content": got.text})

    async def request(
        self,
        client: AsyncOpenAI,
        name: str,
        round_: int,
        kind: str,
        messages: list[dict],
        phase: str | None,
    ) -> Request:
        in_flight, self._in_flight = self._in_flight, self._in_flight + 1
        start = time.perf_counter()
        retried, model = 0, str(self.bench.model_dir)
        max_tokens = self.args.max_tokens if phase else 2
        try:
            while True:
                try:
                    got = await stream_chat(client, model, name, messages, max_tokens)
                    break
                except APIConnectionError:  # (a stream the server dropped: sent again, once;
                    if retried:  # its time counts from the first attempt)
                        raise
                    retried += 1
        finally:
            self._in_flight -= 1
        if got.first_at is None:
            raise BenchError(f"{self.name} {name}: the stream ended without a token or finish")
        ttft, total, usage = got.first_at - start, got.end_at - start, got.usage
        details = getattr(usage, "prompt_tokens_details", None)
        request = Request(
            conversation=name,
            round=round_,
            kind=kind,
            start_s=start - self._phase_start,
            ttft_s=ttft,
            decode_s=total - ttft,
            total_s=total,
            prompt_tokens=usage.prompt_tokens if usage else None,
            cached_tokens=getattr(details, "cached_tokens", None),
            completion_tokens=usage.completion_tokens if usage else len(got.pieces),
            in_flight=in_flight,
            retried=retried,
            text="".join(got.pieces),
            server_timings=got.timings,
        )
        if phase is not None:
            self.requests[phase].append(request)
            print(
                f"[{self.name}] {phase} {name} r{round_} {kind}: prompt {request.prompt_tokens}, "
                f"cached {request.cached_tokens}, TTFT {ttft * 1e3:.0f} ms, "
                f"{request.completion_tokens} tokens in {total * 1e3:.0f} ms",
                flush=True,
            )
        return request


class Bench:
    """The workload, the servers' runs, where they run."""

    def __init__(self, args: argparse.Namespace, root: Path):
        self.args, self.root = args, root
        self.model_dir = resolve_model_path(args.model)
        self.work = Workload(args, self.model_dir)
        if "llama_cpp" in args.servers and importlib.util.find_spec("llama_cpp") is None:
            raise BenchError(
                "llama_cpp: llama-cpp-python is not installed (pip install -e '.[peers]'); "
                "or leave it out: --servers agentkv,mlx_lm"
            )
        self.gguf = self.find_gguf() if "llama_cpp" in args.servers else None
        self.runs = {name: Run(name, self) for name in args.servers}

    def find_gguf(self) -> Path:
        """The GGUF file for llama.cpp: ``--gguf``, or the packaged model's own."""
        if self.args.gguf is not None:
            return self.args.gguf
        packaged = PACKAGED_MODELS.get(self.args.model)
        if packaged is None:
            raise BenchError(f"llama_cpp needs --gguf for {self.args.model!r}")
        module = importlib.import_module(packaged.module)  # (resolve_model_path installed it)
        return Path(module.assemble(self.root / "model.gguf"))

    async def run(self) -> None:
        for _name, run in self.runs.items():  # one server at a time
            await run.session("steady", self.args.rounds)
        for _name, run in self.runs.items():
            await run.session("restart", self.args.after_restart)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def phase_summary(run: Run, phase: str) -> dict:
    requests = run.requests[phase]
    ttft = [r.ttft_s for r in requests]
    tpot = [r.decode_s / (r.completion_tokens - 1) for r in requests if r.completion_tokens > 1]
    reported = [r for r in requests if r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in reported)
    return {
        "requests": len(requests),
        "wall_s": run.walls[phase],
        "requests_per_s": len(requests) / run.walls[phase],
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p90_s": percentile(tpot, 90),
        "cached_share": sum(r.cached_tokens for r in reported) / prompt if prompt else None,
        "completion_tokens": sum(r.completion_tokens for r in requests),
        "retried": sum(r.retried for r in requests),
        "waiting_for_first_token_s": sum(ttft),
        "decoding_s": sum(r.decode_s for r in requests),
        "server_split_s": server_split(requests),
    }


def server_split(requests: list[Request]) -> dict | None:
    """The phase's time summed over the turns the server split (agentkv): finding caches,
    waiting to join the batch (behind other turns' steps), prefill (in the batch, beside other
    turns), decoding; None where the server reports no split."""
    spent = [r.server_timings for r in requests if r.server_timings]
    if not spent:
        return None
    keys = ("cache_load_s", "queue_s", "prefill_s", "decode_s")
    return {k: sum(t[k] for t in spent) for k in keys} | {"turns": len(spent)}


def summarize(bench: Bench) -> dict:
    args = bench.args
    versions = {"python": platform.python_version()}
    for package in ("agentkv", "mlx", "mlx-lm", "llama-cpp-python", "openai"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    servers = {
        name: {
            "argv": run.argv,
            "sessions": run.sessions,
            "phases": {p: phase_summary(run, p) for p in PHASES},
            "requests": {p: [asdict(r) for r in run.requests[p]] for p in PHASES},
        }
        for name, run in bench.runs.items()
    }
    ratios = {}
    if "agentkv" in servers:
        ours = servers["agentkv"]["phases"]
        for peer in (s for s in servers if s != "agentkv"):
            theirs = servers[peer]["phases"]
            ratios[peer] = {
                p: {
                    key: theirs[p][key] / ours[p][key]
                    for key in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s")
                    if theirs[p][key] and ours[p][key]
                }
                | {"requests_per_s": ours[p]["requests_per_s"] / theirs[p]["requests_per_s"]}
                for p in PHASES
            }
    return {
        "benchmark": "agents",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "model": args.model,
        "model_dir": str(bench.model_dir),
        "gguf": str(bench.gguf) if bench.gguf else None,
        "workload": {
            k: getattr(args, k)
            for k in (
                "conversations",
                "clients",
                "rounds",
                "after_restart",
                "prefix",
                "first",
                "tool",
                "follow",
                "max_tokens",
                "llama_cache",
            )
        },
        "versions": versions,
        "servers": servers,
        "ratios": ratios,
        "command": "python -m benchmarks.bench_agents " + " ".join(bench.args.argv),
    }


def print_table(report: dict) -> None:
    print(f"{report['model']}: p50/p90 in ms, requests/s, cached share of prompt tokens")
    for phase in PHASES:
        print(f"-- {phase}")
        for name, server in report["servers"].items():
            s = server["phases"][phase]
            cached = "-" if s["cached_share"] is None else f"{s['cached_share']:.0%}"
            print(
                f"{name:>10}: TTFT {s['ttft_p50_s'] * 1e3:7.0f} / {s['ttft_p90_s'] * 1e3:7.0f}"
                f"  TPOT {(s['tpot_p50_s'] or 0) * 1e3:5.0f} / {(s['tpot_p90_s'] or 0) * 1e3:5.0f}"
                f"  {s['requests_per_s']:.3f} req/s  cached {cached}",
                flush=True,
            )
            if split := s["server_split_s"]:
                parts = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in split.items() if k != "turns")
                print(f"{'':>10}  summed over its turns: {parts}", flush=True)


def plot(report: dict, path: Path) -> Path:
    names = list(report["servers"])
    x = np.arange(len(PHASES))

    def bars(key: str, label: str, scale: float = 1e3):
        def draw(ax) -> None:
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                values = [(report["servers"][name]["phases"][p][key] or 0) * scale for p in PHASES]
                drawn = ax.bar(x + (i - (len(names) - 1) / 2) * width, values, width, label=name)
                bar_labels(ax, drawn, "{:.0f}" if scale > 1 else "{:.3f}")
            ax.set_xticks(x, PHASES)
            ax.set_ylabel(label)
            ax.legend(fontsize=7)

        return draw

    panels = [
        bars("ttft_p50_s", "TTFT p50 (ms)"),
        bars("ttft_p90_s", "TTFT p90 (ms)"),
        bars("tpot_p50_s", "TPOT p50 (ms)"),
        bars("requests_per_s", "requests / s", scale=1.0),
    ]
    w = report["workload"]
    title = (
        f"agentic multi-turn: {report['model']}, {w['conversations']} conversations, "
        f"{w['clients']} clients, {report['machine']}, {report['date']}"
    )
    return save_plot(path, panels, title)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--gguf", type=Path, help="llama.cpp's model file (packaged: its own)")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds after the opening")
    parser.add_argument("--after-restart", type=int, default=2, help="rounds after the restart")
    parser.add_argument("--prefix", type=int, default=200, help="shared system prompt tokens")
    parser.add_argument("--first", type=int, default=800, help="each task's context tokens")
    parser.add_argument("--tool", type=int, default=300, help="each tool result's tokens")
    parser.add_argument("--follow", type=int, default=100, help="each follow-up's tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192, help="llama.cpp's n_ctx")
    parser.add_argument("--llama-cache", choices=("none", "ram", "disk"), default="none")
    parser.add_argument(
        "--llama-format", default="gemma", help="llama-cpp-python's chat format (the model's)"
    )
    parser.add_argument("--agentkv-args", default="", help="more `agentkv serve` arguments")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--request-timeout", type=float, default=900)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (data, logs)")
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, agentkv and mlx_lm")
    parser.add_argument("--out", type=Path, default=RESULTS / "agentic.json")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.model, args.servers, args.conversations, args.clients = (
            "tiny:gemma3",
            "agentkv,mlx_lm",
            2,
            2,
        )
        args.rounds, args.after_restart, args.first, args.tool, args.max_tokens = 2, 1, 96, 48, 4
        args.prefix, args.follow = 32, 16
    args.servers = [s for s in args.servers.split(",") if s]
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    root = Path(tempfile.mkdtemp(prefix="agentkv-agents-"))
    try:
        bench = Bench(args, root)
        asyncio.run(bench.run())
    except BaseException:
        print(f"bench_agents failed; server logs kept in {root}", file=sys.stderr)
        raise
    if args.keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    report = summarize(bench)
    print_table(report)
    write_report(report, args.out, plot)
    return report


if __name__ == "__main__":
    main()
