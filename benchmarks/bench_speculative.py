"""Speculative decoding in the batch: decode speed with drafts from each agent's history
against without, on a trained model, where replies restate the history and where they do not.

    python -m benchmarks.bench_speculative [--model gemma3-270m] [--agents 1 4 16]
                                           [--tokens 128] [--quick]

Two workloads, each an agent's prompt and a greedy reply of ``--tokens`` tokens (its end
tokens ignored, so every reply is as long):

- ``restating``: the agent read a file (a Python module of ``--lines`` functions) and writes it
  again with one name changed, as an edit tool's ``old_string`` / ``new_string`` or a whole-file
  rewrite copies it; then a tool call repeating the file's path and a call id from its history;
- ``novel``: prose to continue (a chapter of *Alice's Adventures in Wonderland*, each agent its
  own passage), whose continuation the history does not hold.

For N = each of ``--agents``, N agents (each its own variant) decode together, once with
``EngineConfig(speculative="off")`` and once with ``"lookup"``, one engine each, alternating
and repeated ``--repeats`` times; the figure is the median decode tok/s of all agents together
(generated tokens over the time from the first token to the last) and the ratio lookup / off,
with the drafts fed and kept (the acceptance rate). Both runs generate the same tokens (checked).
Writes benchmarks/results/speculative.json and .png.

With ``--draft-model SPEC`` (or ``--draft-layers L``: the model's first L layers, its own
embedding and head, a draft that costs what they cost and drafts what they predict), each N
also runs ``"draft"``: drafts from the history, else the draft model's
(``agentkv.engine.drafter``), reported beside the others (``draft_tps``, ``draft_speedup``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.request import GenerationRequest
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"
ALICE = Path(__file__).parent / "data" / "alice_ch1_2.txt"
TARGETS = {"restating_n1": 2.0, "restating_n4": 1.5, "novel_min": 0.97}


def module_source(agent: int, lines: int) -> str:
    """A small Python module, its names and numbers the agent's own."""
    out = [f'"""Helpers for report {agent}."""', "", "import json", "from pathlib import Path", ""]
    for i in range(lines):
        out += [
            f"def load_section_{agent}_{i}(path: Path, limit: int = {10 + i}) -> list[dict]:",
            f'    """Read section {i} of the report at ``path``, at most ``limit`` rows."""',
            "    rows = json.loads(path.read_text())",
            f'    return [row for row in rows if row.get("section") == {i}][:limit]',
            "",
        ]
    return "\n".join(out)


def restating(agent: int, lines: int) -> str:
    source = module_source(agent, lines)
    path = f"/work/reports/report_{agent}.py"
    return (
        f"Tool call read_file(path={path!r}) returned (call id call_{agent:04d}a7f3):\n\n"
        f"{source}\n\n"
        f"The user asked to rename load_section_{agent}_0 to read_section_{agent}_0. "
        f"Here is {path} again, rewritten whole with the new name:\n\n"
        + source.split("\n\n", 1)[0]
        + "\n\n"
    )


def novel(agent: int, text: str) -> str:
    words = text.split()
    start = (agent * 997) % max(1, len(words) - 600)
    return " ".join(words[start : start + 450])


async def decode(
    model: str, mode: str, prompts: list[list[int]], tokens: int
) -> tuple[float, list[list[int]], int, int]:
    """Decode tok/s of all agents together, their tokens, drafts fed and kept."""
    drafter = None
    if mode.startswith("draft:"):
        mode, drafter = "draft", mode.removeprefix("draft:")
    config = EngineConfig(
        speculative=mode, draft_model=drafter, completion_batch_size=max(16, len(prompts))
    )
    eng = await Engine.open(model, config)
    try:
        requests = [GenerationRequest(p, max_tokens=tokens, ignore_eos=True) for p in prompts]
        results = await asyncio.gather(*(eng.generate(r) for r in requests))
        stats = eng.stats()
    finally:
        await eng.close()
    first = min(r.stats.first_token_at for r in results)
    last = max(r.stats.finished_at for r in results)
    generated = sum(len(r.token_ids) - 1 for r in results)
    tps = generated / (last - first)
    return tps, [r.token_ids for r in results], stats.drafted_tokens, stats.accepted_tokens


async def run(args: argparse.Namespace) -> dict:
    probe = await Engine.open(args.model)
    try:
        tokenizer = probe.tokenizer
    finally:
        await probe.close()
    alice = ALICE.read_text(encoding="utf-8")
    workloads = {
        "restating": lambda a: restating(a, args.lines),
        "novel": lambda a: novel(a, alice),
    }
    rows = []
    for name, make in workloads.items():
        for n in args.agents:
            prompts = [tokenizer.encode(make(a)) for a in range(n)]
            runs = {"off": [], "lookup": [], "draft": []}
            same = True
            drafted = accepted = drafted_d = accepted_d = 0
            for _ in range(args.repeats):
                off, off_tokens, _, _ = await decode(args.model, "off", prompts, args.tokens)
                on, on_tokens, fed, kept = await decode(args.model, "lookup", prompts, args.tokens)
                runs["off"].append(off)
                runs["lookup"].append(on)
                same = same and on_tokens == off_tokens
                drafted, accepted = drafted + fed, accepted + kept
                if args.draft_model:
                    mode = f"draft:{args.draft_model}"
                    tps, got, fed, kept = await decode(args.model, mode, prompts, args.tokens)
                    runs["draft"].append(tps)
                    same = same and got == off_tokens
                    drafted_d, accepted_d = drafted_d + fed, accepted_d + kept
            row = {
                "workload": name,
                "agents": n,
                "prompt_tokens": round(statistics.mean(len(p) for p in prompts)),
                "off_tps": statistics.median(runs["off"]),
                "lookup_tps": statistics.median(runs["lookup"]),
                "same_tokens": same,
                "drafted": drafted,
                "accepted": accepted,
                "acceptance": accepted / drafted if drafted else 0.0,
                "kept_per_token": accepted / (args.repeats * n * (args.tokens - 1)),
            }
            row["speedup"] = row["lookup_tps"] / row["off_tps"]
            if runs["draft"]:
                row["draft_tps"] = statistics.median(runs["draft"])
                row["draft_speedup"] = row["draft_tps"] / row["off_tps"]
                row["draft_drafted"], row["draft_accepted"] = drafted_d, accepted_d
                print(f"  with the draft model: {row['draft_speedup']:.2f}x", flush=True)
            rows.append(row)
            print(
                f"{name:>9} N={n:>2}: {row['off_tps']:.1f} -> {row['lookup_tps']:.1f} tok/s "
                f"({row['speedup']:.2f}x), drafts kept {row['acceptance']:.0%} "
                f"({row['kept_per_token']:.0%} of the tokens), same tokens: {same}",
                flush=True,
            )
    by = {(r["workload"], r["agents"]): r["speedup"] for r in rows}
    met = {
        "restating_n1": by.get(("restating", 1), 0) >= TARGETS["restating_n1"],
        "restating_n4": by.get(("restating", 4), 0) >= TARGETS["restating_n4"],
        "novel_min": min(v for (w, _), v in by.items() if w == "novel") >= TARGETS["novel_min"],
    }
    return {
        "benchmark": "speculative",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "model": args.model,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "command": " ".join(["python -m benchmarks.bench_speculative", *args.argv]),
        "draft_model": args.draft_label,
        "targets": TARGETS,
        "targets_met": met,
        "rows": rows,
    }


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]

    def speedups(ax) -> None:
        labels = [f"{r['workload']}\nN={r['agents']}" for r in rows]
        bars = ax.bar(labels, [r["speedup"] for r in rows])
        bar_labels(ax, bars, "{:.2f}x")
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_ylabel("decode tok/s, drafts / none")
        ax.set_title("speed with drafts from the agent's history")

    def acceptance(ax) -> None:
        labels = [f"{r['workload']}\nN={r['agents']}" for r in rows]
        bars = ax.bar(labels, [100 * r["kept_per_token"] for r in rows])
        bar_labels(ax, bars, "{:.0f}%")
        ax.set_ylabel("tokens that came as kept drafts (%)")
        ax.set_title("drafts kept")

    title = f"{report['model']}, {report['tokens']} tokens a reply, {report['date']}"
    return save_plot(path, [speedups, acceptance], title)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--lines", type=int, default=6, help="functions in the file read")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny:llama, N = 1 and 2, 24 tokens")
    parser.add_argument("--draft-model", help="also run with this draft model")
    parser.add_argument("--draft-layers", type=int, help="draft: the model's first L layers")
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.draft_label = args.draft_model
    if args.quick:
        args.model, args.agents, args.tokens, args.repeats, args.lines = (
            "tiny:llama",
            [1, 2],
            24,
            1,
            2,
        )
    with tempfile.TemporaryDirectory() as scratch:
        if args.draft_layers:
            args.draft_model = str(first_layers(args.model, args.draft_layers, Path(scratch)))
            args.draft_label = f"{args.model}, its first {args.draft_layers} layers"
        report = asyncio.run(run(args))
    write_report(report, args.out, plot)
    return report


def first_layers(spec: str, layers: int, out: Path) -> Path:
    """A copy of ``spec``'s model keeping its first ``layers`` decoder layers (and its
    embedding, final norm and head): a draft model of its tokenizer."""
    import mlx.core as mx

    from agentkv.models.directory import resolve_model_path

    source = Path(resolve_model_path(spec))
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    text = config.get("text_config", config)
    text["num_hidden_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(config))
    weights = {}
    for path in sorted(source.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
    kept = {
        name: w
        for name, w in weights.items()
        if not (m := re.search(r"layers\.(\d+)\.", name)) or int(m.group(1)) < layers
    }
    mx.save_safetensors(str(out / "model.safetensors"), kept)
    return out


if __name__ == "__main__":
    main()
