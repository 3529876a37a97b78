"""Nothing acknowledged is lost, across workers: a soak of racing first turns.

    python -m benchmarks.bench_soak [--agents 500] [--shared-turns 400] [--postgres] [--quick]

Two ``agentkv serve`` workers (``agentkv.server.scaleout.local``: ``w1`` and ``w2``) share one
registry (a SQLite file, ``--db-url``, or with ``--postgres`` a throwaway PostgreSQL server started
from the Debian binaries, as the tests start theirs) and one cache directory. This process sends
requests straight to each worker, with no router in between, so that they race:

- **first turns**: for each of ``--agents`` new agent ids, one request to each worker at once
  (``x-agent-id``, created on first use), in random order and a few milliseconds apart;
- **shared agents**: ``--shared-turns`` turns spread over a few agents, sent to either worker
  at random, many at once.

A share of the clients (``--disconnect``) go away early: a stream closed after its first
piece, or a request abandoned after a few milliseconds. A turn is *acknowledged* when its
client read the whole answer. At the end every agent's transcript is read back: each
acknowledged turn must be stored exactly once, its reply right after its message; nothing
may answer 500, and no request that creates its agent may be told the agent does not exist.

Writes benchmarks/results/soak.json (or ``--out``). Needs ``haproxy`` (the cluster launcher
starts it, unused here) and, with ``--postgres``, PostgreSQL's server binaries.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv.server.scaleout.local import local_cluster
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"
ROUTE = "/v1/chat/completions"


@dataclass
class Sent:
    """One request and what its client saw."""

    agent: str
    text: str
    worker: str
    leaves: bool
    status: int | None = None
    reply: str | None = None  # the whole answer, read to its end: acknowledged
    error: str = ""


@dataclass
class Tally:
    sent: list[Sent] = field(default_factory=list)

    @property
    def statuses(self) -> Counter[int | None]:
        return Counter(s.status for s in self.sent)


async def send(http: httpx.AsyncClient, url: str, sent: Sent, rng: random.Random) -> None:
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": sent.text}],
        "stream": rng.random() < 0.5,
    }
    headers = {"x-agent-id": sent.agent}
    try:
        if body["stream"]:
            async with http.stream("POST", f"{url}{ROUTE}", json=body, headers=headers) as r:
                sent.status = r.status_code
                if r.status_code != 200:
                    sent.error = (await r.aread()).decode(errors="replace")[:300]
                    return
                pieces = []
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    if sent.leaves:
                        return  # the client goes after the first piece
                    event = json.loads(line[5:])
                    if "choices" not in event:  # an error event: the turn failed midway
                        sent.error = line[:300]
                        return
                    pieces.append(event["choices"][0]["delta"].get("content") or "")
                sent.reply = "".join(pieces)
            return
        request = http.post(f"{url}{ROUTE}", json=body, headers=headers)
        if sent.leaves:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rng.uniform(0.001, 0.05)):
                    response = await request
                    sent.status = response.status_code
            return
        response = await request
        sent.status = response.status_code
        if response.status_code == 200:
            sent.reply = response.json()["choices"][0]["message"]["content"]
        else:
            sent.error = response.text[:300]
    except httpx.TransportError as exc:
        sent.error = f"transport: {exc}"


async def soak(urls: dict[str, str], agents: int, shared_turns: int, leave: float, seed: int):
    rng = random.Random(seed)
    tally = Tally()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:

        async def race(i: int) -> None:
            workers = list(urls)
            rng.shuffle(workers)
            tasks = []
            for k, worker in enumerate(workers):
                sent = Sent(f"race-{i}", f"turn {k} of agent {i}", worker, rng.random() < leave)
                tally.sent.append(sent)
                tasks.append(asyncio.ensure_future(send(http, urls[worker], sent, rng)))
                await asyncio.sleep(rng.choice([0, 0.005, 0.015]))
            await asyncio.gather(*tasks)

        # Racing first turns, a few dozen agents at a time.
        for start in range(0, agents, 32):
            await asyncio.gather(*(race(i) for i in range(start, min(agents, start + 32))))

        async def shared(n: int) -> None:
            worker = rng.choice(list(urls))
            sent = Sent(f"shared-{n % 6}", f"shared turn {n}", worker, rng.random() < leave)
            tally.sent.append(sent)
            await send(http, urls[worker], sent, rng)

        for start in range(0, shared_turns, 48):
            await asyncio.gather(*(shared(n) for n in range(start, min(shared_turns, start + 48))))

        # Read every transcript back (from either worker: they share the registry).
        lost, duplicated, misplaced = 0, 0, 0
        any_url = next(iter(urls.values()))
        for agent in sorted({s.agent for s in tally.sent}):
            response = await http.get(f"{any_url}/v1/agents/{agent}/messages?limit=1000")
            stored = response.json()["data"] if response.status_code == 200 else []
            pairs = [(m["role"], m["content"]) for m in stored]
            for s in tally.sent:
                if s.agent != agent or s.reply is None:
                    continue
                count = pairs.count(("user", s.text))
                if count == 0:
                    lost += 1
                elif count > 1:
                    duplicated += 1
                else:
                    at = pairs.index(("user", s.text))
                    if at + 1 >= len(pairs) or pairs[at + 1] != ("assistant", s.reply):
                        misplaced += 1
    return tally, {"lost": lost, "duplicated": duplicated, "misplaced": misplaced}


def run(db_url: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    with local_cluster(root, db_url, 2, args.model, log_requests=False) as cluster:
        urls = {w.id: w.url for w in cluster.workers}
        start = time.perf_counter()
        tally, checked = asyncio.run(
            soak(urls, args.agents, args.shared_turns, args.disconnect, args.seed)
        )
        seconds = time.perf_counter() - start
    wrong_404 = [s for s in tally.sent if s.status == 404]
    return {
        "backend": "postgresql" if db_url.startswith("postgresql") else "sqlite",
        "requests": len(tally.sent),
        "racing_first_turns": 2 * args.agents,
        "shared_turns": args.shared_turns,
        "acknowledged": sum(s.reply is not None for s in tally.sent),
        "client_left": sum(s.leaves for s in tally.sent),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items(), key=str)},
        "server_errors": sum(1 for s in tally.sent if s.status is not None and s.status >= 500),
        "wrong_404": len(wrong_404),
        "examples": [s.error for s in tally.sent if s.error][:5],
        **checked,
        "seconds": round(seconds, 1),
    }


@contextlib.contextmanager
def postgres_url() -> Iterator[str]:
    from tests.postgres import PostgresServer  # the tests' throwaway server

    server = PostgresServer.start()
    try:
        yield server.create_database()
    finally:
        server.stop()


def plot(report: dict, path: Path) -> Path:
    def panel(ax: Any) -> None:
        rows = report["rows"]
        kinds = ["acknowledged", "lost", "duplicated", "server_errors", "wrong_404"]
        for k, row in enumerate(rows):
            xs = [i + 0.4 * k for i in range(len(kinds))]
            bars = ax.bar(xs, [row[kind] for kind in kinds], width=0.4, label=row["backend"])
            bar_labels(ax, bars, "{:.0f}")
        ax.set_xticks([i + 0.2 for i in range(len(kinds))], kinds, fontsize=8)
        ax.legend(fontsize=8)

    title = f"soak: two workers, racing turns, {report['machine']}, {report['date']}"
    return save_plot(path, [panel], title, (7, 3.6))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:gemma3")
    parser.add_argument("--agents", type=int, default=500, help="racing first turns: twice it")
    parser.add_argument("--shared-turns", type=int, default=400)
    parser.add_argument("--disconnect", type=float, default=0.3, help="share of clients leaving")
    parser.add_argument("--seed", type=int, default=53)
    parser.add_argument("--db-url", help="the shared registry (default: a SQLite file)")
    parser.add_argument("--postgres", action="store_true", help="also on a throwaway PostgreSQL")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.agents, args.shared_turns = 12, 24
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = args.db_url or f"sqlite+aiosqlite:///{Path(tmp) / 'agentkv.sqlite'}"
        (Path(tmp) / "a").mkdir()
        rows.append(run(sqlite, Path(tmp) / "a", args))
        print(rows[-1], flush=True)
        if args.postgres:
            (Path(tmp) / "b").mkdir()
            with postgres_url() as url:
                rows.append(run(url, Path(tmp) / "b", args))
            print(rows[-1], flush=True)
    report = {
        "benchmark": "soak",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
        "model": args.model,
        "disconnect": args.disconnect,
        "nothing_lost": all(
            r["lost"] == r["duplicated"] == r["misplaced"] == r["server_errors"] == 0
            and r["wrong_404"] == 0
            for r in rows
        ),
        "rows": rows,
    }
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
