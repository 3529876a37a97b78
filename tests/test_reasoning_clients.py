"""Claude Code and Codex against reasoning models in both formats: tiny:thinking (Qwen3's
template, thinking between <think> and </think>, Qwen 3.5's XML tool calls) and a tiny gpt-oss
(OpenAI's harmony, ``tests/harmony_model.py``): the thinking shown as thinking, a tool the model
calls run by the CLI, and every follow-up resumed from the cache.

The model's replies to the requests with tools are scripted (a random tiny model does not
think or call tools on its own); everything else is real: the CLIs, the server on 127.0.0.1,
the tool runs.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentkv import RuntimeConfig
from agentkv.server.background import serve_in_thread
from tests.conftest import scripted_tool_replies

MODEL = "tiny:thinking"
TURN_LINE = re.compile(
    r"agent '(?P<agent>[^']+)': cache (?P<source>\w+), prompt (?P<prompt>\d+) tokens "
    r"\((?P<cached>\d+) cached, \d+ prefilled\), (?P<generated>\d+) generated"
)


def thought(thinking: str, answer: str) -> str:
    return f"<think>\n{thinking}\n</think>\n\n{answer}"


def xml_call(name: str, **arguments: str) -> str:
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def xml_thought(thinking: str, name: str, arguments: dict) -> str:
    return thought(thinking, xml_call(name, **arguments))


@dataclass(frozen=True)
class Format:
    """A model and how it writes a reply (``answer(thinking, text)``) and a call after its
    thinking (``call(thinking, name, arguments)``); ``end``: the token scripts end with."""

    model: str
    answer: Callable[[str, str], str]
    call: Callable[[str, str, dict], str]
    end: str | None


@pytest.fixture(scope="module", params=["qwen3", "harmony"])
def form(request) -> Format:
    if request.param == "qwen3":
        return Format(MODEL, thought, xml_thought, "<|im_end|>")
    from tests.test_harmony import answer, call

    return Format(str(request.getfixturevalue("harmony_model")), answer, call, None)


@pytest.fixture(scope="module")
def server(form, tmp_path_factory) -> Iterator[str]:
    data = tmp_path_factory.mktemp("thinking-clients")
    with serve_in_thread(RuntimeConfig(model=form.model, data_dir=data)) as url:
        yield url


@pytest.fixture
def say(monkeypatch, form):
    return scripted_tool_replies(monkeypatch, form.model, form.end)


def turns(caplog) -> list[dict]:
    """The server's per-turn lines so far, with their token counts."""
    found = [TURN_LINE.search(r.getMessage()) for r in caplog.records]
    counts = ("prompt", "cached", "generated")
    return [m.groupdict() | {k: int(m[k]) for k in counts} for m in found if m is not None]


def resumed_whole(seen: list[dict]) -> None:
    """Each turn after the first resumed everything its agent held: the turn before's prompt
    and reply; the new messages alone were prefilled (at least 95% of each prompt cached)."""
    for earlier, later in itertools.pairwise(seen):
        assert later["agent"] == earlier["agent"] and later["source"] == "hot", seen
        assert later["cached"] == earlier["prompt"] + earlier["generated"], (earlier, later)
        assert later["cached"] / later["prompt"] >= 0.95, later


@pytest.mark.skipif(shutil.which("claude") is None, reason="the claude CLI is not installed")
def test_claude_code_shows_thinking_runs_the_called_tool_and_resumes(
    form, server, say, tmp_path, caplog
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
    say(form.call("I should read the file.", "Read", {"file_path": str(project / "notes.txt")}))
    say(form.answer("The file holds the answer.", "The file says the answer is 42."))
    say(form.answer("They ask again.", "Still 42."))

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
    assert first.returncode == 0, first.stderr
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
    # Thinking shown as thinking, the call as a tool_use, the answer as text.
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
    # The tool result's turn and the --continue turn resumed all the agent held.
    main = [t for t in turns(caplog) if t["agent"].startswith("claude-code-")]
    main = [t for t in main if t["agent"] == main[0]["agent"]]
    assert len(main) == 3 and main[0]["cached"] == 0
    resumed_whole(main)


@pytest.mark.skipif(shutil.which("codex") is None, reason="the codex CLI is not installed")
def test_codex_shows_reasoning_runs_the_called_command_and_resumes(
    form, server, say, tmp_path, caplog
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
    say(form.call("I should read the file.", "exec_command", {"cmd": "cat notes.txt"}))
    say(form.answer("The file holds the answer.", "The file says the answer is 42."))
    say(form.answer("They ask again.", "Still 42."))

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
    assert first.returncode == 0, first.stderr
    again = codex("resume", "--last", "And again?")
    assert again.returncode == 0, again.stderr
    assert say.scripts == []
    items = [
        json.loads(line)["item"]
        for run in (first, again)
        for line in run.stdout.splitlines()
        if json.loads(line).get("type") == "item.completed"
    ]
    # Reasoning shown as reasoning (Codex asks for summaries: the reasoning, whole).
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


def test_the_scripted_calls_are_what_the_template_writes():
    # The calls scripted above are written as Qwen 3.5's template writes them.
    from mlx_lm.utils import load_tokenizer

    from agentkv.models.tiny import tiny_model_dir

    tokenizer = load_tokenizer(tiny_model_dir(MODEL))
    call = {"type": "function", "function": {"name": "Read", "arguments": {"file_path": "/x"}}}
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ],
        tokenize=False,
    )
    assert xml_call("Read", file_path=Path("/x")) in rendered
