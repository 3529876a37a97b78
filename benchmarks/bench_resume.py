"""Time to first token of resuming an agent vs re-prefilling its history, and decode speed
while caches are being saved, all through the real AgentRuntime.

    python -m benchmarks.bench_resume [--model tiny:gemma3-bench] [--histories 1024 2048 ...]
                                      [--quick]

For each kv_bits (None, 8, 4) a runtime gets one fresh agent per history length H; the agent's
history is imported with ``append_messages`` (random-word messages sized with ``count_tokens``
to about H tokens). Then, per agent:

- re-prefill: the first chat, which prefills the whole history (cache_source "rebuilt");
- hot resume: the next chat, cache in the hot tier (after ``flush``, so no save is in flight);
- disk resume: the runtime is closed (writes flushed) and reopened on the same data dir with the
  same kv_bits, and the agent chats again (cache_source "disk"; TTFT includes the cache load);
  repeated ``--repeats`` times, one reopen each;
- raw mlx-lm: after every phase the agent's current cache (the one the runtime just saved) is
  also written with ``mlx_lm.models.cache.save_prompt_cache``; next to the next disk resume, on
  the same engine's generation thread, ``load_prompt_cache`` + ``BatchGenerator.insert`` (as
  many new tokens as the runtime prefilled) + steps until the first token are timed. Raw goes
  after the disk resume on even reopens and before it on odd ones: the first after a reopen
  pays for cold allocations.

Every reopen starts with a warm-up turn (and a raw warm-up) on a small extra agent, so no
measured turn pays first-call costs. The runtime/raw ratio compares like with like for kv_bits
None (both files hold the exact cache); q8 and q4 trade load work for smaller files.

Decode under saving: ``--agents`` agents (history ``--concurrent-history``) chat at once,
``--tokens`` tokens each. A round right after another round decodes while the previous round's
saves are in flight (quantize on the generation thread, write on the writer thread); a round
after ``flush`` decodes with nothing to save. Aggregate decode tok/s (first to last token of the
round) of both are compared, pair by pair.

Writes benchmarks/results/resume.json and resume.png (or --out and its .png).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import statistics
import string
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from mlx_lm.utils import load_tokenizer

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.engine.config import EngineConfig
from agentkv.models.directory import resolve_model_path
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"
KV_BITS = {"none": None, "q8": 8, "q4": 4}
TARGETS = {"speedup_at_4096_min": 80.0, "none_vs_raw_max": 1.15, "saving_decode_ratio_min": 0.95}
TTFT_TOKENS = 4  # a resume turn only needs its first token; a few more exercise the save path


def words(rng: np.random.Generator, n: int) -> str:
    letters = np.array(list(string.ascii_lowercase))
    return " ".join("".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(n))


def chat_token_counter(model: str | Path) -> Callable[[list[dict]], int]:
    """Tokens of a conversation rendered with the model's chat template (a sync counter for
    :func:`sized_history`, outside any runtime)."""
    tokenizer = load_tokenizer(resolve_model_path(model))
    return lambda messages: len(tokenizer.apply_chat_template(messages, tokenize=True))


def sized_history(
    count_tokens: Callable[[list[dict]], int], tokens: int, seed: int, turn_words: int = 80
) -> list[dict]:
    """User/assistant messages whose rendering (as ``count_tokens`` counts it) is ``tokens``
    tokens or just under."""
    rng = np.random.default_rng(seed)
    messages: list[dict] = []
    while True:
        pair = [
            {"role": "user", "content": words(rng, turn_words)},
            {"role": "assistant", "content": words(rng, turn_words)},
        ]
        if count_tokens(messages + pair) > tokens:
            break
        messages += pair
    # The last pair takes as many words as still fit (binary search on the assistant's words).
    user = {"role": "user", "content": words(rng, 4)}
    reply = words(rng, 2 * turn_words).split()
    low, high = 0, len(reply)
    while low < high:
        mid = (low + high + 1) // 2
        candidate = [*messages, user, {"role": "assistant", "content": " ".join(reply[:mid])}]
        low, high = (mid, high) if count_tokens(candidate) <= tokens else (low, mid - 1)
    if low:
        messages += [user, {"role": "assistant", "content": " ".join(reply[:low])}]
    return messages


def raw_resume(model: Any, config: EngineConfig, path: str, tokens: list[int]) -> float:
    """mlx-lm alone: load a saved prompt cache, insert it with new tokens, run to one token."""
    gen = BatchGenerator(
        model,
        completion_batch_size=config.completion_batch_size,
        prefill_batch_size=config.prefill_batch_size,
        prefill_step_size=config.prefill_step_size,
    )
    try:
        start = time.perf_counter()
        cache = load_prompt_cache(path)
        gen.insert([tokens], max_tokens=[1], caches=[cache])
        while not gen.next_generated():
            pass
        return time.perf_counter() - start
    finally:
        gen.close()


class Bench:
    """Shared state of one benchmark run: arguments, data dirs, agents and samples."""

    def __init__(self, args: argparse.Namespace, root: Path):
        self.args = args
        self.root = root
        self.agents: dict[tuple[str, int | str], str] = {}  # (kv_bits name, H) -> agent id
        self.samples: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.prompt_tokens: dict[int, int] = {}
        self.file_bytes: dict[str, dict[int, int]] = defaultdict(dict)
        self.turn = 0
        self.count_tokens = chat_token_counter(args.model)
        self.reopens: dict[str, int] = defaultdict(int)
        self.prefilled: dict[int, int] = {}
        self.bytes_per_agent: dict[str, int] = {}  # the batch's layout (model precision)

    def config(
        self, name: str, data_dir: str | None = None, engine: EngineConfig | None = None
    ) -> RuntimeConfig:
        return RuntimeConfig(
            model=self.args.model,
            data_dir=self.root / (data_dir or name),
            kv_bits=KV_BITS[name],
            engine=engine or EngineConfig(speculative="off"),
        )

    def message(self) -> str:
        self.turn += 1
        return f"Turn {self.turn}: go on, briefly."

    def raw_file(self, name: str, key: str) -> Path:
        return self.root / "raw" / f"{name}-{key}.safetensors"

    async def chat(self, rt: AgentRuntime, agent_id: str, source: str) -> Any:
        reply = await rt.chat(agent_id, self.message(), max_tokens=TTFT_TOKENS)
        if reply.cache_source != source:
            raise RuntimeError(f"expected a {source!r} turn, got {reply.cache_source!r}")
        await rt.flush()  # nothing in flight while the next turn is measured
        return reply

    async def save_raw(self, rt: AgentRuntime, name: str, agent_id: str, key: str) -> None:
        """Write the agent's current (hot) cache, the one the runtime just saved, the mlx-lm way."""
        cache = await rt.export_cache(agent_id)
        path = self.raw_file(name, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        await rt.engine.run(save_prompt_cache, str(path), cache.layers)

    async def time_raw(self, rt: AgentRuntime, name: str, key: str, new_tokens: int) -> float:
        engine = rt.engine
        tokens = [16 + (7 * i) % 1000 for i in range(new_tokens)]
        path = str(self.raw_file(name, key))
        return await engine.run(raw_resume, engine.model.model, engine.config, path, tokens)

    async def warm_up(self, rt: AgentRuntime, name: str) -> None:
        """A throwaway turn and raw resume, so measured ones pay no first-call costs."""
        key = (name, "warm")
        if key not in self.agents:
            self.agents[key] = (await rt.create_agent()).id
        agent_id = self.agents[key]
        await rt.chat(agent_id, self.message(), max_tokens=TTFT_TOKENS)
        await rt.flush()
        await self.save_raw(rt, name, agent_id, "warm")
        await self.time_raw(rt, name, "warm", 8)

    async def build(self, name: str) -> None:
        """Fresh agents with imported histories: re-prefill turn, then hot turn."""
        async with await AgentRuntime.open(self.config(name)) as rt:
            layout = rt.engine._thread.runner.layout
            self.bytes_per_agent = {  # a recurrent state's do not grow with the history
                "kv_per_token": sum(layout.token_bytes),
                "recurrent_state": sum(layout.states),
            }
            await self.warm_up(rt, name)
            for h in self.args.histories:
                agent_id = (await rt.create_agent()).id
                self.agents[(name, h)] = agent_id
                await rt.append_messages(agent_id, sized_history(self.count_tokens, h, seed=h))
                first = await self.chat(rt, agent_id, "rebuilt")
                hot = await self.chat(rt, agent_id, "hot")
                self.samples["reprefill"][h].append(first.timings.ttft_s)
                self.samples["hot"][h].append(hot.timings.ttft_s)
                self.samples["hot_plan"][h].append(hot.timings.cache_load_s)
                self.prompt_tokens[h] = first.usage.prompt_tokens
                await self.save_raw(rt, name, agent_id, str(h))
                print(
                    f"[{name}] H={h}: prompt {first.usage.prompt_tokens} tokens, re-prefill "
                    f"{first.timings.ttft_s * 1e3:.0f} ms, hot {hot.timings.ttft_s * 1e3:.1f} ms",
                    flush=True,
                )

    async def resume(self, name: str) -> None:
        """Reopen on the same data dir: one disk resume and one raw resume per agent."""
        async with await AgentRuntime.open(self.config(name)) as rt:
            await self.warm_up(rt, name)
            # Whichever goes first after a reopen pays for cold allocations: alternate.
            raw_first = self.reopens[name] % 2 == 1
            self.reopens[name] += 1
            for h in self.args.histories:
                agent_id = self.agents[(name, h)]
                if raw_first:
                    raw = await self.time_raw(rt, name, str(h), self.prefilled.get(h, 16))
                reply = await self.chat(rt, agent_id, "disk")
                self.prefilled[h] = reply.usage.prefilled_tokens
                if not raw_first:
                    raw = await self.time_raw(rt, name, str(h), reply.usage.prefilled_tokens)
                self.samples[f"disk_{name}"][h].append(reply.timings.ttft_s)
                self.samples[f"load_{name}"][h].append(reply.timings.cache_load_s)
                self.samples["raw"][h].append(raw)
                self.samples[f"pair_{name}"][h].append(reply.timings.ttft_s / raw)
                info = await rt.cache_info(agent_id)  # its tail and block files
                self.file_bytes[name][h] = sum(f.stat().st_size for f in info.files)
                await self.save_raw(rt, name, agent_id, str(h))  # what the next reopen loads
                print(
                    f"[{name}] H={h}: disk resume {reply.timings.ttft_s * 1e3:.1f} ms "
                    f"(load {reply.timings.cache_load_s * 1e3:.1f}), raw mlx-lm {raw * 1e3:.1f} ms",
                    flush=True,
                )

    async def decode_round(self, rt: AgentRuntime, agents: list[str]) -> dict[str, float]:
        """All agents chat at once; aggregate decode tok/s from first to last token."""
        in_flight = rt.stats()["disk"]["saves_in_flight"]
        message = self.message()
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(rt.chat(a, message, max_tokens=self.args.tokens) for a in agents)
        )
        wall = time.perf_counter() - start
        first = min(r.timings.ttft_s for r in replies)
        last = max(r.timings.ttft_s + r.timings.decode_s for r in replies)
        return {
            "saves_in_flight_at_start": in_flight,
            "decode_tps": sum(r.usage.completion_tokens - 1 for r in replies) / (last - first),
            "wall_tps": sum(r.usage.completion_tokens for r in replies) / wall,
            "median_ttft_s": statistics.median(r.timings.ttft_s for r in replies),
            "completion_tokens": sum(r.usage.completion_tokens for r in replies),
        }

    async def decode_under_saving(self) -> dict[str, Any]:
        args = self.args
        name = {None: "none", 8: "q8", 4: "q4"}[args.concurrent_kv_bits]
        config = self.config(name, data_dir="concurrent")
        async with await AgentRuntime.open(config) as rt:
            agents = [(await rt.create_agent()).id for _ in range(args.agents)]
            for i, agent_id in enumerate(agents):
                history = sized_history(self.count_tokens, args.concurrent_history, seed=1000 + i)
                await rt.append_messages(agent_id, history)
            await self.decode_round(rt, agents)  # prefills every history
            await rt.flush()
            await self.decode_round(rt, agents)  # warm-up at the measured batch shape
            rounds: dict[str, list[dict]] = {"quiet": [], "saving": []}
            for _ in range(args.repeats):
                await rt.flush()
                rounds["quiet"].append(await self.decode_round(rt, agents))
                rounds["saving"].append(await self.decode_round(rt, agents))  # quiet's saves run
            await rt.flush()
        quiet = statistics.median(r["decode_tps"] for r in rounds["quiet"])
        saving = statistics.median(r["decode_tps"] for r in rounds["saving"])
        # Each saving round directly follows its quiet round: the ratio of a pair cancels drift.
        pairs = [b["decode_tps"] / a["decode_tps"] for a, b in zip(*rounds.values(), strict=True)]
        ttft = {k: statistics.median(r["median_ttft_s"] for r in v) for k, v in rounds.items()}
        ratio = statistics.median(pairs)
        print(
            f"decode, {args.agents} agents x {args.tokens} tokens ({name} saves): after flush "
            f"{quiet:.1f} tok/s, saves in flight {saving:.1f} tok/s, paired ratio {ratio:.3f}; "
            f"TTFT {ttft['quiet'] * 1e3:.0f} vs {ttft['saving'] * 1e3:.0f} ms",
            flush=True,
        )
        return {
            "agents": args.agents,
            "tokens": args.tokens,
            "history": args.concurrent_history,
            "kv_bits": args.concurrent_kv_bits,
            "quiet_decode_tps": quiet,
            "saving_decode_tps": saving,
            "ratio": ratio,
            "pair_ratios": pairs,
            "quiet_ttft_s": ttft["quiet"],
            "saving_ttft_s": ttft["saving"],
            "rounds": rounds,
        }


def summarize(bench: Bench, concurrent: dict) -> dict:
    med = {
        k: {h: statistics.median(v) for h, v in by_h.items()} for k, by_h in bench.samples.items()
    }
    rows = []
    for h in bench.args.histories:
        disk = {
            name: {
                "ttft_s": med[f"disk_{name}"][h],
                "cache_load_s": med[f"load_{name}"][h],
                "file_bytes": bench.file_bytes[name][h],
                "speedup_vs_reprefill": med["reprefill"][h] / med[f"disk_{name}"][h],
                # Median of (disk resume / the raw resume run right after it, same reopen).
                "vs_raw": med[f"pair_{name}"][h],
                "vs_raw_of_medians": med[f"disk_{name}"][h] / med["raw"][h],
            }
            for name in KV_BITS
        }
        rows.append(
            {
                "history": h,
                "prompt_tokens": bench.prompt_tokens[h],
                "reprefill_ttft_s": med["reprefill"][h],
                "hot_ttft_s": med["hot"][h],
                "hot_plan_s": med["hot_plan"][h],
                "raw_mlx_lm_ttft_s": med["raw"][h],
                "disk": disk,
            }
        )
    targets_met = {
        "none_vs_raw": all(r["disk"]["none"]["vs_raw"] <= TARGETS["none_vs_raw_max"] for r in rows),
        "saving_decode_ratio": concurrent["ratio"] >= TARGETS["saving_decode_ratio_min"],
    }
    at_4k = [r for r in rows if r["history"] == 4096]
    if at_4k:
        speedup = at_4k[0]["disk"]["none"]["speedup_vs_reprefill"]
        targets_met["speedup_at_4096"] = speedup >= TARGETS["speedup_at_4096_min"]
    return {
        "benchmark": "resume",
        "model": bench.args.model,
        "histories": bench.args.histories,
        "repeats": bench.args.repeats,
        "ttft_tokens": TTFT_TOKENS,
        "bytes_per_agent": bench.bytes_per_agent
        | {f"kv_at_{h}": bench.bytes_per_agent["kv_per_token"] * h for h in bench.args.histories},
        "machine": f"{platform.machine()} {platform.system()}, {mx.default_device()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
        "concurrent": concurrent,
        "samples": {k: {str(h): v for h, v in by_h.items()} for k, by_h in bench.samples.items()},
        "targets": TARGETS,
        "targets_met": targets_met,
    }


def print_table(report: dict) -> None:
    print(f"{report['model']}: TTFT in ms (medians), speedup = re-prefill / disk resume")
    print(
        f"{'H':>6}{'prompt':>8}{'re-prefill':>11}{'hot':>8}{'raw':>8}"
        + "".join(f"{'disk ' + n:>10}{'x':>6}{'/raw':>6}" for n in KV_BITS)
    )
    for row in report["rows"]:
        line = (
            f"{row['history']:>6}{row['prompt_tokens']:>8}{row['reprefill_ttft_s'] * 1e3:>11.0f}"
            f"{row['hot_ttft_s'] * 1e3:>8.1f}{row['raw_mlx_lm_ttft_s'] * 1e3:>8.1f}"
        )
        for name in KV_BITS:
            d = row["disk"][name]
            line += (
                f"{d['ttft_s'] * 1e3:>10.1f}{d['speedup_vs_reprefill']:>6.0f}{d['vs_raw']:>6.2f}"
            )
        print(line)
    sizes = report["bytes_per_agent"]
    print(
        f"bytes per agent: KV {sizes['kv_per_token']} a token, recurrent state "
        f"{sizes['recurrent_state']} whatever the history"
    )
    print(f"targets met: {report['targets_met']}", flush=True)


def plot(report: dict, path: Path) -> Path:
    hs = [row["history"] for row in report["rows"]]
    lines = {
        "re-prefill": [row["reprefill_ttft_s"] for row in report["rows"]],
        "hot resume": [row["hot_ttft_s"] for row in report["rows"]],
        "raw mlx-lm load+insert": [row["raw_mlx_lm_ttft_s"] for row in report["rows"]],
        **{
            f"disk resume ({name})": [row["disk"][name]["ttft_s"] for row in report["rows"]]
            for name in KV_BITS
        },
    }

    def ttft(ax) -> None:
        for label, values in lines.items():
            ax.plot(hs, [v * 1e3 for v in values], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(hs, [str(h) for h in hs])
        ax.set_xlabel("history tokens")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title("resume vs re-prefill")
        ax.legend(fontsize=7)

    def decode(ax) -> None:
        c = report["concurrent"]
        bars = ax.bar(
            ["after flush", "saves in flight"], [c["quiet_decode_tps"], c["saving_decode_tps"]]
        )
        bar_labels(ax, bars, "{:.1f}")
        ax.set_ylabel("aggregate decode tok/s")
        ax.set_title(f"{c['agents']} agents x {c['tokens']} tokens")

    title = f"{report['model']}, {report['date']}"
    return save_plot(path, [ttft, decode], title)


async def run(args: argparse.Namespace, root: Path) -> dict:
    bench = Bench(args, root)
    for name in KV_BITS:
        await bench.build(name)
    for _ in range(args.repeats):  # interleaved so drift hits every kv_bits alike
        for name in KV_BITS:
            await bench.resume(name)
    concurrent = await bench.decode_under_saving()
    return summarize(bench, concurrent)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="resume TTFT vs re-prefill; decode while saving")
    parser.add_argument("--model", default="tiny:gemma3-bench")
    parser.add_argument("--histories", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=5, help="disk resumes and decode rounds")
    parser.add_argument("--agents", type=int, default=8, help="agents decoding concurrently")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per concurrent turn")
    parser.add_argument("--concurrent-history", type=int, default=1024)
    parser.add_argument(
        "--concurrent-kv-bits",
        type=int,
        choices=[0, 8, 4],
        default=8,
        help="kv_bits of the concurrent runtime (0: unquantized)",
    )
    parser.add_argument("--data-dir", type=Path, help="parent of the temp data dir")
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3, tiny sizes")
    parser.add_argument("--out", type=Path, default=RESULTS / "resume.json")
    parser.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.histories, args.repeats = "tiny:gemma3", [128, 256], 1
        args.agents, args.tokens, args.concurrent_history = 4, 8, 64
    args.concurrent_kv_bits = args.concurrent_kv_bits or None
    root = Path(tempfile.mkdtemp(prefix="agentkv-resume-", dir=args.data_dir))
    try:
        report = asyncio.run(run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(report)
    write_report(report, args.out, plot, args.plot)
    return report


if __name__ == "__main__":
    main()
