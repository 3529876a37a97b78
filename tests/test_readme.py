"""The examples of the README and the docs run as written (paths and ports aside)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv import RuntimeConfig
from agentkv.server.background import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    block
    for page in PAGES
    for block in re.findall(r"```(\w+)\n(.*?)```", page.read_text(), flags=re.S)
]
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code for lang, code in BLOCKS if lang == "bash"]


def test_python_api_example(tmp_path):
    (api,) = [code for code in PYTHON if "AgentRuntime.open" in code]
    proc = subprocess.run(
        [sys.executable, "-c", api], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r" (stop|length) none$", proc.stdout, flags=re.M)
    assert (tmp_path / "data" / "agentkv.sqlite").exists()


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    config = RuntimeConfig(model="tiny:gemma3", data_dir=tmp_path_factory.mktemp("readme"))
    with serve_in_thread(config, api_key="sk-local") as url:
        yield url


def test_sdk_examples(server_url):
    (sdk,) = [code for code in PYTHON if "anthropic.Anthropic" in code]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(sdk.replace("http://127.0.0.1:8000", server_url), {})
    numbers = re.findall(r"^\d+$", out.getvalue(), flags=re.M)
    assert numbers[0] == "0"  # alice's first turn: nothing cached yet
    assert int(numbers[-1]) == 0  # bob's first turn


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_examples(server_url):
    port = server_url.rsplit(":", 1)[1]
    (curls,) = [code for code in BASH if "curl" in code]
    for command in re.split(r"\n(?=curl)", curls.strip()):
        command = command.replace("localhost:8000", f"127.0.0.1:{port}").replace("\\\n", " ")
        proc = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert '"usage"' in proc.stdout or "[DONE]" in proc.stdout


def test_cli_examples(tmp_path):
    (cli,) = [code for code in BASH if "agentkv list-tiny" in code]
    bindir = Path(sys.executable).parent
    for line in cli.strip().splitlines():
        command = shlex.split(line.split("#")[0])
        command[0] = str(bindir / command[0])
        proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (line, proc.stderr)
    assert (tmp_path / "tiny-gemma3" / "config.json").exists()
