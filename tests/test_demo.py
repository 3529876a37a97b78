import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_end_to_end(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "demo_full_stack.py"),
            "--model",
            "tiny:gemma3",  # the default, gemma3-270m, takes minutes on CPU
            "--rounds",
            "2",
            "--max-tokens",
            "8",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "agentkv demo: model tiny:gemma3" in out
    # Each round prints every agent's reply.
    assert len(re.findall(r"^ +planner: ", out, flags=re.M)) == 2
    assert re.search(r"resumed from disk after restart\s+4/4", out)
    assert "round 2: 4 agents concurrently" in out
    cached = int(out.split("HTTP turn: cached input tokens")[1].split()[0])
    assert cached > 0
    # One tail per agent; the blocks they list are shared under caches/_blocks.
    assert len(list((tmp_path / "caches").glob("*/*.safetensors"))) == 4
