"""A third-party CLI that sends no ``max_tokens`` gets the whole reply: Simon Willison's
``llm`` (installed in a virtual environment of its own) against a real server, its reply
scripted well past the 512 tokens a default used to cut it at."""

from __future__ import annotations

import os
import subprocess
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from agentkv import RuntimeConfig
from agentkv.models.tiny import tiny_model_dir
from agentkv.server.background import serve_in_thread
from tests.conftest import scripted_tool_replies

MODEL = "tiny:tools"
LLM = "llm==0.36"


@pytest.fixture(scope="module")
def llm_cli(tmp_path_factory) -> Path:
    """The ``llm`` command, in a virtual environment of its own (its dependencies are not
    this project's)."""
    env = tmp_path_factory.mktemp("llm") / "env"
    venv.create(env, with_pip=True)
    done = subprocess.run(
        [env / "bin" / "python", "-m", "pip", "install", "-q", LLM],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0 and not os.environ.get("CI"):
        pytest.skip(f"could not install {LLM}: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return env / "bin" / "llm"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path_factory.mktemp("no-limits"))
    with serve_in_thread(config) as url:
        yield url


def test_llm_without_max_tokens_gets_the_whole_reply(llm_cli, server, monkeypatch, tmp_path):
    say = scripted_tool_replies(monkeypatch, MODEL, tools_only=False)
    reply = " ".join(
        f"Line {i}: the edit keeps every line of the file as it was." for i in range(60)
    )
    tokens = load_tokenizer(tiny_model_dir(MODEL)).encode(reply, add_special_tokens=False)
    assert len(tokens) > 1000  # twice what a 512-token default let through
    say(reply)
    home = tmp_path / "llm"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: agentkv\n  model_name: tiny\n  api_base: {server}/v1\n"
    )
    env = os.environ | {"LLM_USER_PATH": str(home), "OPENAI_API_KEY": "sk-local"}
    done = subprocess.run(
        [llm_cli, "-m", "agentkv", "--no-log", "Rewrite the file."],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == reply
