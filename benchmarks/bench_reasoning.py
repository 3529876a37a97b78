"""Turn N+1 of a thinking conversation: how much of its prompt comes from the cache.

    python -m benchmarks.bench_reasoning [--turns 8] [--thinking 300] [--answer 60] [--quick]

A client resends the whole conversation each turn (``AgentRuntime.respond``, as the Chat
Completions and Responses routes do) and sends each answer back without its reasoning, as
OpenAI-compatible clients do; the template (``tiny:thinking``: Qwen3's) drops earlier
reasoning anyway. The model's replies are scripted (a random tiny model does not think on its
own): ``--thinking`` tokens between ``<think>`` and ``</think>``, then ``--answer`` tokens; the
system prompt is ``--system`` tokens of agent instructions, each user message ``--question``.

Two runs, same conversation:

- ``kept``: the reasoning is kept apart from the answer (``agentkv.reasoning``), so the reply
  the model generated is recognised in the resent conversation and spliced back in;
- ``mixed``: the model's thinking markers are not read (the runtime as it was before it knew
  them): the answer the client sends back differs from the reply the cache holds, and the
  turn resumes from the checkpoint where that reply began.

Per turn: prompt tokens, cached tokens and their share. Writes
benchmarks/results/reasoning.json and .png (or --out and its .png).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.engine.sampling import SamplingParams
from benchmarks.plots import save_plot, write_report

RESULTS = Path(__file__).parent / "results"
MODEL = "tiny:thinking"
WORDS = ("agent", "tool", "file", "patch", "test", "build", "run", "check", "list", "read")


class Scripted:
    """A logits processor that makes the model emit the given tokens, one per step."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)

    def __call__(self, context: Any, logits: Any) -> Any:
        import mlx.core as mx

        if not self.tokens:
            return logits
        forced = mx.full(logits.shape, -1e9, dtype=logits.dtype)
        forced[..., self.tokens.pop(0)] = 0.0
        return forced


def words(tokenizer: Any, n: int, rng: random.Random) -> str:
    """About ``n`` tokens of words."""
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < n:
        text += " ".join(rng.choice(WORDS) for _ in range(8)) + ". "
    return text.strip()


async def conversation(args: argparse.Namespace, mode: str, data: Path) -> list[dict[str, int]]:
    rng = random.Random(0)
    make = SamplingParams.make_logits_processors
    scripts: list[list[int]] = []

    def processors(self: SamplingParams, vocab_size: int) -> list:
        return ([Scripted(scripts.pop(0))] if scripts else []) + make(self, vocab_size)

    SamplingParams.make_logits_processors = processors  # the model's replies, scripted
    rows = []
    try:
        async with await AgentRuntime.open(RuntimeConfig(model=MODEL, data_dir=data)) as rt:
            if mode == "mixed":
                rt._turns.reasoning = None  # its thinking markers not read
            tokenizer = rt.engine.tokenizer
            end = tokenizer.convert_tokens_to_ids("<|im_end|>")
            messages = [
                {"role": "system", "content": words(tokenizer, args.system, rng)},
                {"role": "user", "content": words(tokenizer, args.question, rng)},
            ]
            await rt.create_agent("thinker")
            for _ in range(args.turns):
                thinking = words(tokenizer, args.thinking, rng)
                answer = words(tokenizer, args.answer, rng)
                reply_text = f"<think>\n{thinking}\n</think>\n\n{answer}"
                scripts.append([*tokenizer.encode(reply_text, add_special_tokens=False), end])
                reply = None
                async for event in rt.respond("thinker", messages, max_tokens=4096):
                    reply = event
                u = reply.usage
                rows.append(
                    {
                        "prompt": u.prompt_tokens,
                        "cached": u.cached_tokens,
                        "generated": u.completion_tokens,
                        "share": round(u.cached_tokens / u.prompt_tokens, 4),
                    }
                )
                sent = answer if mode == "mixed" else reply.text  # the answer, no reasoning
                messages += [
                    {"role": "assistant", "content": sent},
                    {"role": "user", "content": words(tokenizer, args.question, rng)},
                ]
    finally:
        SamplingParams.make_logits_processors = make
    return rows


def plot(report: dict, path: Path) -> Path:
    def draw(ax: Any) -> None:
        for mode in ("kept", "mixed"):
            turns = report["runs"][mode]["turns"]
            ax.plot(range(1, len(turns) + 1), [t["share"] for t in turns], marker="o", label=mode)
        ax.set_xlabel("turn")
        ax.set_ylabel("share of the prompt from cache")
        ax.set_ylim(0, 1.05)
        ax.legend()

    title = f"{report['model']}: answers sent back without their reasoning ({report['date']})"
    return save_plot(path, [draw], title)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=1500, help="system prompt tokens")
    parser.add_argument("--question", type=int, default=40, help="tokens of each user message")
    parser.add_argument("--thinking", type=int, default=300, help="tokens of each reply's thinking")
    parser.add_argument("--answer", type=int, default=60, help="tokens of each reply's answer")
    parser.add_argument("--quick", action="store_true", help="3 short turns (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "reasoning.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.system, args.thinking, args.answer = 3, 200, 40, 10
    runs = {}
    for mode in ("kept", "mixed"):
        with tempfile.TemporaryDirectory() as tmp:
            turns = asyncio.run(conversation(args, mode, Path(tmp)))
        follow_ups = [t["share"] for t in turns[1:]]
        runs[mode] = {
            "turns": turns,
            "follow_up_share_mean": round(statistics.mean(follow_ups), 4),
            "follow_up_share_min": round(min(follow_ups), 4),
        }
        print(
            f"{mode}: turn N+1 cached share mean {runs[mode]['follow_up_share_mean']:.3f}, "
            f"min {runs[mode]['follow_up_share_min']:.3f}"
        )
    report = {
        "benchmark": "reasoning",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()}",
        "model": MODEL,
        "command": "python -m benchmarks.bench_reasoning" + (" --quick" if args.quick else ""),
        "turns": args.turns,
        "system_tokens": args.system,
        "question_tokens": args.question,
        "thinking_tokens": args.thinking,
        "answer_tokens": args.answer,
        "runs": runs,
    }
    write_report(report, args.out, plot)
    return report


if __name__ == "__main__":
    main()
