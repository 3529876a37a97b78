"""The files of the project a turn runs code in, by thread: a warm turn (cache in the hot
tier) and a cold one (cache read from disk), through the real AgentRuntime.

    python -m benchmarks.turn_path [--model tiny:gemma3]

A profiler (``sys.setprofile`` and ``threading.setprofile``) records every call into a file of
``agents/``, ``engine/``, ``store/`` or ``server/`` while one ``chat`` runs, from the call to its
reply (the save it schedules runs afterwards and is not counted). The event loop is
``MainThread``, the generation thread ``agentkv-generation``, ``asyncio`` the worker threads
(rendering, tokenizing). Nothing here is timed; it shows how long a turn's path is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(str(ROOT / p) + os.sep for p in ("agents", "engine", "store", "server"))


async def record(model: str, data_dir: Path, cold: bool) -> dict[str, set[str]]:
    from agentkv import AgentRuntime, RuntimeConfig

    files: dict[str, set[str]] = defaultdict(set)
    recording = False

    def profile(frame, event, arg) -> None:
        if recording and event == "call" and frame.f_code.co_filename.startswith(PACKAGES):
            thread = threading.current_thread().name.split("_")[0]
            files[os.path.relpath(frame.f_code.co_filename, ROOT)].add(thread)

    threading.setprofile(profile)  # threads started from now on (the generation thread)
    sys.setprofile(profile)
    try:
        async with await AgentRuntime.open(RuntimeConfig(model=model, data_dir=data_dir)) as rt:
            await rt.create_agent("a", system_prompt="You are terse.")
            await rt.chat("a", "Hello there, how are you?", max_tokens=4)
            await rt.flush()
            if cold:
                await rt.unload("a")
            recording = True
            reply = await rt.chat("a", "And again?", max_tokens=4)
            recording = False
            assert reply.cache_source == ("disk" if cold else "hot"), reply.cache_source
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:gemma3")
    args = parser.parse_args()
    for cold in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            files = asyncio.run(record(args.model, Path(tmp), cold))
        print(f"{'cold' if cold else 'warm'} turn: {len(files)} files")
        for path in sorted(files):
            print(f"  {path:34} {', '.join(sorted(files[path]))}")


if __name__ == "__main__":
    main()
