"""A follow-up turn in a conversation that holds images costs what it costs without them.

    python -m benchmarks.bench_images [--model tiny:gemma3-bench-vl] [--images 4]
                                      [--beside-model tiny:gemma3-tower-vl] [--beside-images 1]
                                      [--beside-tokens 400] [--repeats 3] [--quick]

Two agents of a vision-language model get the same first message, one with ``--images``
screenshot-sized images (random pixels, PNG) before its text and one without; each answers,
then gets a follow-up. The follow-up's time to first token is measured with the cache in
memory (hot) and, after a restart of the runtime, from disk. The images' tokens are their own
(``agentkv.engine.models.vision``), so a follow-up resumes them with the rest of the history
and the vision tower does not run again: the target is a follow-up with images within 1.2x of
one without. The first turn's time (vision tower and the images' prefill) is reported beside
it. Runs alternate between the two agents; medians of ``--repeats`` runs, each with a data
directory of its own.

Beside it, a turn decoding while another agent's first turn shows ``--beside-images`` new
images to ``--beside-model`` (a tower of seconds on a CPU): the vision tower runs on a thread
of its own, so the turn's pace while the tower runs is measured against its pace alone (a
batch that ran the tower between its steps would decode nothing meanwhile), with its longest
gap between tokens and the tower's time beside the batch and alone. Writes
benchmarks/results/images.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import platform
import statistics
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.engine.models.vision import MAX_IMAGE_NUMBER, image_token
from agentkv.engine.request import GenerationRequest
from benchmarks.plots import bar_labels, save_plot, write_report

RESULTS = Path(__file__).parent / "results"
SYSTEM = "You look at screenshots of a web application and say what to do next."
FIRST = (
    "These are the screens of the checkout flow after the last deploy. The payment step shows "
    "an empty card form and the button is greyed out. What should I check first?"
)
FOLLOW_UP = "And after that?"
TARGET = 1.2


def screenshots(n: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct 1280x800 PNGs of random blocks (a screenshot's size and entropy)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        blocks = rng.integers(0, 256, (50, 80, 3), dtype=np.uint8)
        image = Image.fromarray(blocks.repeat(16, axis=0).repeat(16, axis=1))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


async def one_run(model: str, images: list[bytes], tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = RuntimeConfig(model=model, data_dir=Path(tmp))
        out: dict = {}
        async with await AgentRuntime.open(config) as rt:
            agents = {}
            for kind, shown in (("images", images), ("text", [])):
                agent = await rt.create_agent(system_prompt=SYSTEM)
                first = await rt.chat(agent.id, FIRST, images=shown, max_tokens=tokens)
                agents[kind] = agent.id
                out[kind] = {"first_s": first.timings.total_s, "prompt": first.usage.prompt_tokens}
            for kind, agent_id in agents.items():
                hot = await rt.chat(agent_id, FOLLOW_UP, max_tokens=tokens)
                assert hot.cache_source == "hot", hot.cache_source
                out[kind] |= {
                    "hot_ttft_s": hot.timings.ttft_s,
                    "hot_cached": hot.usage.cached_tokens,
                }
            out["encoded"] = rt.engine.model.vision.encoded
        async with await AgentRuntime.open(config) as rt:
            for kind, agent_id in agents.items():
                disk = await rt.chat(agent_id, FOLLOW_UP, max_tokens=tokens)
                assert disk.cache_source == "disk", disk.cache_source
                out[kind] |= {
                    "disk_ttft_s": disk.timings.ttft_s,
                    "disk_cached": disk.usage.cached_tokens,
                }
            out["encoded_after_restart"] = rt.engine.model.vision.encoded
        return out


async def beside(model: str, images: list[bytes], tokens: int = 96) -> dict:
    """A ``tokens``-token reply, alone and while another agent's first turn shows ``images``
    (submitted at its 8th token): its pace while the vision tower runs on them, against its
    pace alone, its longest gap between tokens; the tower's time on them with the batch idle."""
    with tempfile.TemporaryDirectory() as tmp:
        async with await AgentRuntime.open(RuntimeConfig(model=model, data_dir=Path(tmp))) as rt:
            engine, vision = rt.engine, rt.engine.model.vision
            warm = await rt.create_agent(system_prompt=SYSTEM)  # tower loaded, kernels warm
            await rt.chat(warm.id, FIRST, images=screenshots(1, seed=99), max_tokens=2)
            request = GenerationRequest(engine.tokenizer.encode(FIRST), tokens, ignore_eos=True)
            alone = await _decoded(engine.submit(request))
            agent, before, shown = await rt.create_agent(system_prompt=SYSTEM), vision.encoded, []

            def show() -> None:
                shown.append(
                    asyncio.ensure_future(rt.chat(agent.id, FIRST, images=images, max_tokens=4))
                )

            encoded = lambda: vision.encoded - before >= len(images)  # noqa: E731
            times = await _decoded(engine.submit(request), show, encoded)
            reply = await shown[0]
            began = time.perf_counter()  # the tower alone, on the same images as new ones
            for i, data in enumerate(images):
                done = threading.Event()
                vision.encode(image_token(MAX_IMAGE_NUMBER - i), data, lambda _, d=done: d.set())
                await asyncio.to_thread(done.wait)
            tower_alone = time.perf_counter() - began
    tpot = statistics.mean(np.diff(alone[7:]))
    t0, t1 = times["shown"], times["encoded"]
    during = sum(t0 < t <= t1 for t in times["tokens"])
    return {
        "alone_tpot_s": tpot,
        "alone_longest_gap_s": float(max(np.diff(alone[7:]))),
        "tower_beside_s": t1 - t0,
        "tower_alone_s": tower_alone,
        "tokens_while_encoding": during,
        "pace_while_encoding": during * tpot / (t1 - t0),
        "longest_gap_s": float(max(np.diff(times["tokens"][7:]))),
        "image_turn_s": reply.timings.total_s,
    }


async def _decoded(handle, beside=None, done=None) -> list[float] | dict:
    """When each token of a streamed reply came; with ``beside`` (called at its 8th token):
    those, when it was called and the first token after ``done()`` held."""
    times, at = [], {}
    async for _ in handle:
        times.append(time.perf_counter())
        if len(times) == 8 and beside is not None:
            at["shown"] = times[-1]
            beside()
        if "shown" in at and "encoded" not in at and done():
            at["encoded"] = times[-1]
    if not at:
        return times
    if "encoded" not in at:
        raise RuntimeError("the reply ended before the vision tower did: raise --beside-tokens")
    return at | {"tokens": times}


async def run(args: argparse.Namespace) -> dict:
    images = screenshots(args.images)
    await one_run(args.model, images[:1], args.tokens)  # warm-up: kernels, model files
    runs = [await one_run(args.model, images, args.tokens) for _ in range(args.repeats)]
    shown = screenshots(args.beside_images, seed=1)
    besides = [
        await beside(args.beside_model, shown, args.beside_tokens) for _ in range(args.repeats)
    ]

    def median(kind: str, key: str) -> float:
        return statistics.median(r[kind][key] for r in runs)

    rows = {kind: {key: median(kind, key) for key in runs[0][kind]} for kind in ("images", "text")}
    hot = rows["images"]["hot_ttft_s"] / rows["text"]["hot_ttft_s"]
    disk = rows["images"]["disk_ttft_s"] / rows["text"]["disk_ttft_s"]
    return {
        "benchmark": "images",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "model": args.model,
        "weights": "random" if args.model.startswith("tiny:") else "trained",
        "images": args.images,
        "image_bytes": [len(i) for i in images],
        "repeats": args.repeats,
        "rows": rows,
        "runs": runs,
        "follow_up_hot_ratio": hot,
        "follow_up_disk_ratio": disk,
        "vision_runs": [r["encoded"] for r in runs],  # a run shows each image once
        "vision_runs_after_restart": max(r["encoded_after_restart"] for r in runs),
        "target": f"follow-up with images <= {TARGET}x without (hot)",
        "target_met": hot <= TARGET,
        "beside": {
            "model": args.beside_model,
            "images": args.beside_images,
            "reply_tokens": args.beside_tokens,
            **{key: statistics.median(b[key] for b in besides) for key in besides[0]},
            "runs": besides,
        },
        "command": "python -m benchmarks.bench_images" + (" --quick" if args.quick else ""),
    }


def plot(report: dict, path: Path) -> Path:
    rows = report["rows"]

    def ttft(ax):
        kinds = ["hot_ttft_s", "disk_ttft_s"]
        x = np.arange(len(kinds))
        for i, kind in enumerate(("images", "text")):
            bars = ax.bar(x + i * 0.4, [rows[kind][k] * 1000 for k in kinds], 0.4, label=kind)
            bar_labels(ax, bars, "{:.0f}")
        ax.set_xticks(x + 0.2, ["follow-up (hot)", "follow-up (disk)"])
        ax.set_ylabel("time to first token (ms)")
        ax.legend(
            title=f"first turn with {report['images']} images or none",
            fontsize=8,
            loc="lower center",
        )

    def first(ax):
        bars = ax.bar(["images", "text"], [rows[k]["first_s"] for k in ("images", "text")])
        bar_labels(ax, bars, "{:.2f}")
        ax.set_ylabel("first turn (s): vision tower and prefill")

    def decoding(ax):
        b = report["beside"]
        bars = ax.bar(
            ["alone", "while a tower runs"],
            [1.0 / b["alone_tpot_s"], b["pace_while_encoding"] / b["alone_tpot_s"]],
        )
        bar_labels(ax, bars, "{:.1f}")
        ax.set_ylabel("a turn's decode (tok/s)")
        ax.set_title(f"beside {b['model']} encoding an image", fontsize=9)

    title = f"{report['model']} ({report['weights']} weights), {report['date']}"
    return save_plot(path, [ttft, first, decoding], title)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:gemma3-bench-vl")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--beside-model", default="tiny:gemma3-tower-vl")
    parser.add_argument("--beside-images", type=int, default=1)
    parser.add_argument("--beside-tokens", type=int, default=400)
    parser.add_argument("--quick", action="store_true", help="tiny:gemma3-vl, 2 images, 1 run")
    parser.add_argument("--out", type=Path, default=RESULTS / "images.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.images, args.repeats, args.tokens = "tiny:gemma3-vl", 2, 1, 4
        args.beside_model, args.beside_tokens = "tiny:gemma3-vl", 64
    report = asyncio.run(run(args))
    write_report(report, args.out, plot)
    return report


if __name__ == "__main__":
    main()
