"""Claude Code and Codex against a harmony model (a tiny gpt-oss, ``tests/harmony_model.py``):
the analysis shown as thinking, a tool the model calls run by the CLI, every follow-up resumed
from the cache.

The model's replies to the requests with tools are scripted (a random tiny model neither
reasons nor calls tools on its own), written as gpt-oss writes them; everything else is real:
the CLIs, the server on 127.0.0.1, openai-harmony, the tool runs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from agentkv import RuntimeConfig
from agentkv.server.background import serve_in_thread
from tests.conftest import scripted_tool_replies
from tests.test_harmony import answer, call
from tests.test_reasoning_clients import resumed_whole, turns


@pytest.fixture(scope="module")
def server(harmony_model, tmp_path_factory) -> Iterator[str]:
    data = tmp_path_factory.mktemp("harmony-clients")
    with serve_in_thread(RuntimeConfig(model=str(harmony_model), data_dir=data)) as url:
        yield url


@pytest.fixture
def say(monkeypatch, harmony_model):
    return scripted_tool_replies(monkeypatch, str(harmony_model), end=None)


@pytest.mark.skipif(shutil.which("claude") is None, reason="the claude CLI is not installed")
def test_claude_code_shows_the_analysis_runs_the_called_tool_and_resumes(
    server, say, tmp_path, caplog
):
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("the answer is 42\n")
    (tmp_path / "home").mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path),
        "ANTHROPIC_BASE_URL": server,
        "ANTHROPIC_API_KEY": "sk-local",
    }
    caplog.set_level(logging.INFO, logger="agentkv")
    say(call("I should read the file.", "Read", {"file_path": str(project / "notes.txt")}))
    say(answer("The file holds the answer.", "The file says the answer is 42."))
    say(answer("They ask again.", "Still 42."))

    def claude(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["claude", "-p", "--output-format", "stream-json", "--verbose", *args],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    first = claude("What is in notes.txt?")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr
    again = claude("--continue", "And again?")
    assert again.returncode == 0, again.stderr
    assert say.scripts == []
    lines = [json.loads(line) for run in (first, again) for line in run.stdout.splitlines()]
    blocks = [
        block
        for line in lines
        if line.get("type") == "assistant"
        for block in line["message"]["content"]
    ]
    assert [b["thinking"] for b in blocks if b["type"] == "thinking"] == [
        "I should read the file.",
        "The file holds the answer.",
        "They ask again.",
    ]
    (use,) = [b for b in blocks if b["type"] == "tool_use"]
    assert use["name"] == "Read" and use["input"] == {"file_path": str(project / "notes.txt")}
    results = [
        block["content"]
        for line in lines
        if line.get("type") == "user"
        for block in line["message"]["content"]
        if isinstance(block, dict) and block.get("type") == "tool_result"
    ]
    assert len(results) == 1 and "the answer is 42" in str(results[0])
    assert [line["result"] for line in lines if line.get("type") == "result"] == [
        "The file says the answer is 42.",
        "Still 42.",
    ]
    main = [t for t in turns(caplog) if t["agent"].startswith("claude-code-")]
    main = [t for t in main if t["agent"] == main[0]["agent"]]
    assert len(main) == 3 and main[0]["cached"] == 0
    resumed_whole(main)


@pytest.mark.skipif(shutil.which("codex") is None, reason="the codex CLI is not installed")
def test_codex_shows_the_analysis_runs_the_called_command_and_resumes(
    server, say, tmp_path, caplog
):
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("the answer is 42\n")
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "agentkv"\n\n[model_providers.agentkv]\n'
        f'name = "agentkv"\nbase_url = "{server}/v1"\nwire_api = "responses"\n'
        'env_key = "AGENTKV_API_KEY"\n'
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "AGENTKV_API_KEY": "sk-local"}
    caplog.set_level(logging.INFO, logger="agentkv")
    say(call("I should read the file.", "exec_command", {"cmd": "cat notes.txt"}))
    say(answer("The file holds the answer.", "The file says the answer is 42."))
    say(answer("They ask again.", "Still 42."))

    def codex(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["codex", "exec", "--skip-git-repo-check", "--json", *args],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    first = codex("What is in notes.txt?")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr
    again = codex("resume", "--last", "And again?")
    assert again.returncode == 0, again.stderr
    assert say.scripts == []
    items = [
        json.loads(line)["item"]
        for run in (first, again)
        for line in run.stdout.splitlines()
        if json.loads(line).get("type") == "item.completed"
    ]
    assert [i["text"] for i in items if i["type"] == "reasoning"] == [
        "I should read the file.",
        "The file holds the answer.",
        "They ask again.",
    ]
    (command,) = [i for i in items if i["type"] == "command_execution"]
    assert "cat notes.txt" in command["command"] and command["exit_code"] == 0
    assert command["aggregated_output"] == "the answer is 42\n"
    assert [i["text"] for i in items if i["type"] == "agent_message"] == [
        "The file says the answer is 42.",
        "Still 42.",
    ]
    main = [t for t in turns(caplog) if t["agent"].startswith("session-")]
    assert len(main) == 3 and main[0]["cached"] == 0
    resumed_whole(main)
