"""A fan-out: new agents handed one brief, each with a task of its own, on a sliding-window model.

    python -m benchmarks.bench_fan_out [--model gemma3-270m] [--agents 16] [--brief 4000]
                                       [--task 200] [--quick]

Each of ``--agents`` new agents has the same short system prompt and a first message made of
one ``--brief``-token brief (text of benchmarks/data) and a ``--task``-token task of its own
(a passage only it gets), and answers in one token: the prefill is what is measured. Three runs
in one process, each with a data directory of its own: prefixes not shared
(``share_prefixes=False``: every agent prefills its whole prompt, the baseline), shared with
the agents asking one after another, and shared with all of them asking at once. Each reports
the tokens prefilled in all against the ideal (the shared start once, plus each agent's own
tokens), the tokens each agent resumed, where its cache came from, and the wall time of all
the turns against the baseline's. Then, after a restart of the runtime that shared them one
after another, as many new agents with tasks of their own ask one after another: what they
resume from disk (their ideal: their own tokens only).

Gemma 3's sliding-window layers hold only their last 512 positions: a cache cannot be cut back
where two conversations part, so shared starts are kept where a conversation parts from
another, from the snapshots the first kept at its last block boundaries
(``agentkv.caches.tiers``); each run reports how many the first agent kept and their bytes.
Writes benchmarks/results/fan_out.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from datetime import date
from pathlib import Path

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.messages import common_prefix
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"
TEXT = Path(__file__).parent / "data" / "alice_ch1_2.txt"
SYSTEM = "You are one worker of a team. Answer the task at the end of the brief."


def passages(tokenizer, brief: int, task: int, agents: int) -> tuple[str, list[str]]:
    """A brief of about ``brief`` tokens and ``agents`` tasks of about ``task`` tokens each,
    cut from the text at word boundaries (the text repeated where it runs out)."""
    words = TEXT.read_text().split()
    per_token = len(words) / len(tokenizer.encode(" ".join(words)))  # words a token

    def take(start: int, tokens: int) -> tuple[str, int]:
        count = max(1, round(tokens * per_token))
        picked = [words[(start + i) % len(words)] for i in range(count)]
        return " ".join(picked), start + count

    text, at = take(0, brief)
    tasks = []
    for i in range(agents):
        piece, at = take(at, task)
        tasks.append(f"Task {i + 1}: {piece}")
    return f"Brief: {text}\n\n", tasks


async def run_agents(rt: AgentRuntime, brief: str, tasks: list[str], together: bool) -> dict:
    first: list[str] = []

    async def ask(task: str):
        agent = await rt.create_agent(system_prompt=SYSTEM)
        first.append(agent.id)
        return await rt.chat(agent.id, brief + task, max_tokens=1)

    began = time.perf_counter()
    if together:
        replies = await asyncio.gather(*(ask(task) for task in tasks))
    else:
        replies = [await ask(task) for task in tasks]
    wall = time.perf_counter() - began
    await rt.flush()
    # What the first agent's cache in memory keeps for others to part from: its snapshots
    # (the sliding windows at its last block boundaries), against its whole KV.
    hot = rt._caches.hot.get(first[0])
    points = [c for c in hot.cache.checkpoints if not (c.head or c.prompt_end)] if hot else []
    return {
        "snapshots": len(points),
        "snapshot_bytes": points[0].nbytes if points else 0,
        "first_cache_bytes": hot.cache.nbytes if hot else 0,
        "wall_s": round(wall, 3),
        "prompt_tokens": sum(r.usage.prompt_tokens for r in replies),
        "prefilled_tokens": sum(r.usage.prefilled_tokens for r in replies),
        "cached_tokens": [r.usage.cached_tokens for r in replies],
        "sources": [r.cache_source for r in replies],
    }


async def run(args: argparse.Namespace) -> dict:
    def config(data_dir: Path, share: bool) -> RuntimeConfig:
        return RuntimeConfig(model=args.model, data_dir=data_dir, share_prefixes=share)

    with tempfile.TemporaryDirectory() as tmp:
        runs, shared_start = {}, 0
        async with await AgentRuntime.open(config(Path(tmp) / "alone", False)) as rt:
            tokenizer = rt.engine.model.tokenizer
            brief, tasks = passages(tokenizer, args.brief, args.task, 2 * args.agents)
            tasks, later = tasks[: args.agents], tasks[args.agents :]  # later: after a restart
            prompts = [
                list(
                    tokenizer.apply_chat_template(
                        [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": brief + t},
                        ],
                        add_generation_prompt=True,
                    )
                )
                for t in tasks[:2]
            ]
            shared_start = common_prefix(prompts[0], prompts[1])
            runs["not shared"] = await run_agents(rt, brief, tasks, together=False)
        for name, together in (("one after another", False), ("all at once", True)):
            data_dir = Path(tmp) / name.replace(" ", "-")
            async with await AgentRuntime.open(config(data_dir, True)) as rt:
                runs[name] = await run_agents(rt, brief, tasks, together)
            if not together:  # new agents after a restart resume from disk
                async with await AgentRuntime.open(config(data_dir, True)) as rt:
                    runs["after a restart"] = await run_agents(rt, brief, later, together)
    base_wall = runs["not shared"]["wall_s"]
    for name, row in runs.items():
        own = row["prompt_tokens"] - args.agents * shared_start
        # After a restart the shared start is on disk: the ideal is each agent's own tokens.
        row["ideal_prefilled_tokens"] = own + (0 if name == "after a restart" else shared_start)
        row["vs_ideal"] = round(row["prefilled_tokens"] / row["ideal_prefilled_tokens"], 3)
        row["wall_vs_not_shared"] = round(row["wall_s"] / base_wall, 3)
    return {
        "benchmark": "fan_out",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "model": args.model,
        "command": "python -m benchmarks.bench_fan_out" + (" --quick" if args.quick else ""),
        "agents": args.agents,
        "shared_start_tokens": shared_start,
        "target": "prefilled in all <= 1.25x the ideal (the shared start once + own tokens)",
        "rows": [{"run": name, **row} for name, row in runs.items()],
    }


def plot(report: dict, path: Path) -> Path:
    runs = {row["run"]: row for row in report["rows"]}
    names = list(runs)

    def prefilled(ax) -> None:
        values = [runs[n]["prefilled_tokens"] for n in names]
        ideal = [runs[n]["ideal_prefilled_tokens"] for n in names]
        bars = ax.bar(range(len(names)), values, color="tab:blue")
        ax.scatter(range(len(names)), ideal, color="black", marker="_", s=400, label="ideal")
        ax.bar_label(bars, labels=[f"{v:,}" for v in values], fontsize=8)
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
        ax.set_ylabel("tokens prefilled, all agents")
        ax.legend(fontsize=8)

    def wall(ax) -> None:
        values = [runs[n]["wall_s"] for n in names]
        bars = ax.bar(range(len(names)), values, color="tab:orange")
        ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], fontsize=8)
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
        ax.set_ylabel("wall time of all turns (s)")

    title = f"fan-out of {report['agents']}: {report['model']}, {report['date']}"
    return save_plot(path, [prefilled, wall], title)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--brief", type=int, default=4000)
    parser.add_argument("--task", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, 4 agents, short")
    parser.add_argument("--out", type=Path, default=RESULTS / "fan_out.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.agents, args.brief, args.task = "tiny:gemma3", 4, 700, 40
    report = asyncio.run(run(args))
    write_report(report, args.out, plot)
    print(json.dumps({row["run"]: row["vs_ideal"] for row in report["rows"]}))
    return report


if __name__ == "__main__":
    main()
