"""Turns without ``max_tokens`` under a KV budget: each runs to the end of its context.

    python -m benchmarks.bench_no_max_tokens [--agents 64] [--fits 8] [--context 512] [--quick]

``--agents`` turns, each a ``--prompt``-token prompt and no ``max_tokens`` (end-of-sequence
ignored: every reply runs until the context is full, the longest a turn without a limit can
run), ask at once under a KV budget that holds ``--fits`` of them at full context (what
``Engine.kv_bytes_needed`` sets aside for one at its most). The model is ``--model`` with its
context cut to ``--context`` tokens (its ``config.json`` copied and edited), so that a CPU runs
the whole of it. A turn reserves its prompt and a buffer growth and more as it decodes
(``agentkv.engine.scheduler``); when the budget has no room for a turn's next growth, the turns last
in line are paused and rejoin where they were.

Every step, the benchmark reads the queue's head: a step after which the head would fit
beside the turns in the batch (a free slot and room for its reservation) but which still has
it waiting at the next step counts as a wait with room (want 0). It reports the turns
completed and refused, the tokens each generated (want: its context's rest), the most turns
in the batch at once against ``--fits``, the preemptions, the KV held and reserved against
the budget every step, and tokens/s, against the same turns run ``--fits`` at a time (each
whole, as when a turn set aside its whole ``max_tokens`` up front), in the same process.
Writes benchmarks/results/no_max_tokens.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.errors import KVBudgetError
from agentkv.engine.meter import StepRecord
from agentkv.engine.request import GenerationRequest
from agentkv.models.directory import resolve_model_path
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"


def short_context_model(model: str, context: int, into: Path) -> Path:
    """A copy of ``model``'s directory whose config says a context of ``context`` tokens."""
    source = resolve_model_path(model)
    target = into / "model"
    shutil.copytree(source, target)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = context
    config_path.write_text(json.dumps(config))
    return target


class Watch:
    """A step listener (generation thread): after each step, whether the queue's head would
    join the batch at the next one; at the next, whether it did."""

    def __init__(self, eng: Engine):
        self.scheduler = eng._thread.scheduler
        self.steps: list[StepRecord] = []
        self.waits_with_room = 0
        self._fits: object | None = None  # the head that fit after the last step

    def __call__(self, step: StepRecord) -> None:
        self.steps.append(step)
        s = self.scheduler
        if self._fits is not None and s.queue.peek() is self._fits:
            self.waits_with_room += 1
        head = s.queue.peek()
        slot = len(s.running) < s.config.completion_batch_size
        room = head is not None and s.reserved_bytes + s.need(head) <= s.budget_bytes
        self._fits = head if slot and room else None


async def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = short_context_model(args.model, args.context, Path(tmp))
        probe = await Engine.open(model)
        try:
            vocab = probe.model.vocab_size
            prompts = [
                [(31 * i + 7 * j) % (vocab - 16) + 16 for j in range(args.prompt)]
                for i in range(args.agents)
            ]
            whole = probe.kv_bytes_needed(GenerationRequest(prompts[0], None))
        finally:
            await probe.close()
        budget = args.fits * whole
        row = await ask(args, model, prompts, budget, args.agents)
        # The same turns with as many slots as the budget holds at full context: each runs
        # whole beside the others, as when a turn set aside its whole max_tokens up front.
        slots = await ask(args, model, prompts, budget, args.fits)
    row["in_slots_tokens_per_s"] = slots["tokens_per_s"]
    row["vs_slots"] = row["tokens_per_s"] / slots["tokens_per_s"]
    print(
        f"{args.agents} turns without max_tokens, budget for {args.fits} at a full "
        f"{args.context}-token context ({row['budget_mb']:.1f} MB): {row['completed']} "
        f"completed ({row['ran_to_the_context']} to the context's end), {row['refused']} "
        f"refused, {row['failed']} failed; up to {row['max_in_batch']} in the batch, "
        f"{row['preemptions']} preemptions, {row['waits_with_room']} waits with room; reserved "
        f"at most {row['max_reserved_mb']:.1f} MB; {row['tokens_per_s']:.0f} tok/s, "
        f"{row['vs_slots']:.2f}x {args.fits} slots"
    )
    return {
        "benchmark": "no_max_tokens",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "model": f"{args.model} (random weights), context cut to {args.context}",
        "command": "python -m benchmarks.bench_no_max_tokens" + (" --quick" if args.quick else ""),
        "target": "every turn completes, none refused, 0 waits with room",
        "row": row,
    }


async def ask(
    args: argparse.Namespace, model: Path, prompts: list[list[int]], budget: int, slots: int
) -> dict:
    """The turns at once, without max_tokens, under ``budget``, at most ``slots`` in the
    batch: what the batch did."""
    config = EngineConfig(
        completion_batch_size=slots,
        prefill_batch_size=slots,
        kv_budget_bytes=budget,
        speculative="off",
    )
    eng = await Engine.open(model, config)
    watch = Watch(eng)
    eng.add_step_listener(watch)
    refused = 0
    try:
        start = time.perf_counter()
        tasks = []
        for p in prompts:
            request = GenerationRequest(p, None, ignore_eos=True, return_cache=False)
            try:
                tasks.append(asyncio.ensure_future(eng.generate(request)))
            except KVBudgetError:
                refused += 1
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        stats = eng.stats()
    finally:
        await eng.close()
    steps, room = watch.steps, args.context - args.prompt
    return {
        "agents": args.agents,
        "fits_at_full_context": args.fits,
        "slots": slots,
        "context": args.context,
        "prompt": args.prompt,
        "budget_mb": budget / 2**20,
        "whole_turn_mb": budget / args.fits / 2**20,
        "completed": sum(r.error is None for r in results),
        "refused": refused,
        "failed": sum(r.error is not None for r in results),
        "ran_to_the_context": sum(
            len(r.token_ids) == room and r.finish_reason == "length" for r in results
        ),
        "max_in_batch": max(s.decode_rows + s.prefilling for s in steps),
        "preemptions": stats.preemptions,
        "waits_with_room": watch.waits_with_room,
        "max_reserved_mb": max(s.kv_reserved_bytes for s in steps) / 2**20,
        "max_held_mb": max(s.kv_held_bytes for s in steps) / 2**20,
        "under_budget_every_step": all(
            s.kv_held_bytes <= s.kv_reserved_bytes <= budget for s in steps
        ),
        "mean_reserved_share": sum(s.kv_reserved_bytes for s in steps) / len(steps) / budget,
        "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
        "steps": len(steps),
        "wall_s": wall,
        "in_batch_by_step": [s.decode_rows + s.prefilling for s in steps],
    }


def plot(report: dict, path: Path) -> Path:
    row = report["row"]

    def in_batch(ax) -> None:
        ax.plot(row["in_batch_by_step"], lw=1)
        ax.axhline(row["fits_at_full_context"], color="gray", ls="--", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("turns in the batch")
        ax.set_title(f"{row['agents']} turns, budget for {row['fits_at_full_context']} (dashed)")

    return save_plot(path, [in_batch], f"{report['model']}, {report['date']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:gemma3")
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--fits", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="16 turns, a 128-token context")
    parser.add_argument("--out", type=Path, default=RESULTS / "no_max_tokens.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.agents, args.fits, args.context, args.prompt = 16, 4, 128, 16
    report = asyncio.run(run(args))
    write_report(report, args.out, plot)
    return report


if __name__ == "__main__":
    main()
