"""Shared fixtures. `engine` is imported first so OpenBLAS is preloaded before mlx.core."""

import agentkv.engine  # noqa: F401  (side effect: OpenBLAS preload, must precede any mlx import)

# isort: split
import contextvars
import json
import os
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from agentkv.engine.sampling import SamplingParams
from agentkv.models.tiny import tiny_model_dir
from agentkv.server import turns
from tests.harmony_model import build_harmony_model, js_tiktoken
from tests.postgres import PostgresServer, PostgresUnavailable

TOOLS_MODEL = "tiny:tools"  # the tiny model with a tool-call format (Hermes-style <tool_call>)


class ForcedTokens:
    """A logits processor that makes the model emit the given tokens, one per step."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if not self.tokens:
            return logits
        forced = mx.full(logits.shape, -1e9, dtype=logits.dtype)
        forced[..., self.tokens.pop(0)] = 0.0
        return forced


_FORCED: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("forced", default=None)


def scripted_tool_replies(
    monkeypatch, model: str, end: str | None = "<|im_end|>", tools_only: bool = True
):
    """``say(text)``: the next request with tools (any request, ``tools_only=False``) to a
    server of ``model`` (a tiny model's name or a model directory) is answered ``text``
    (forced token by token), then ``end`` (ChatML's by default; None: the text ends itself). A
    context variable carries the tokens from the request's turn to its logits processors, so
    concurrent requests (Claude Code's title requests) are left alone."""
    tokenizer = load_tokenizer(Path(model) if Path(model).is_dir() else tiny_model_dir(model))
    scripts: list[list[int]] = []
    make_processors, events = SamplingParams.make_logits_processors, turns._events

    def processors(self: SamplingParams, vocab_size: int) -> list:
        forced = _FORCED.get()
        _FORCED.set(None)
        return ([ForcedTokens(forced)] if forced else []) + make_processors(self, vocab_size)

    def forcing_events(state, claim, request):
        if (request.tools or not tools_only) and scripts:
            _FORCED.set(scripts.pop(0))
        return events(state, claim, request)

    monkeypatch.setattr(SamplingParams, "make_logits_processors", processors)
    monkeypatch.setattr(turns, "_events", forcing_events)

    def say(reply: str) -> None:
        tokens = tokenizer.encode(reply, add_special_tokens=False)
        scripts.append([*tokens, *([tokenizer.convert_tokens_to_ids(end)] if end else [])])

    say.scripts = scripts  # what is left unsaid
    return say


@pytest.fixture
def force_tool_call(monkeypatch):
    """``force_tool_call(name, arguments)``: the next request with tools is answered with that
    tool call (forced token by token); see :func:`scripted_tool_replies`."""
    say = scripted_tool_replies(monkeypatch, TOOLS_MODEL)

    def force(name: str, arguments: dict, text: str = "") -> None:
        # Compact, as the grammar of a forced tool_choice writes it (no blank between tokens).
        call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
        say(f"{text}<tool_call>\n{call}\n</tool_call>")

    force.say = say  # ``force_tool_call.say(text)``: the next such request answers ``text``
    return force


# ---- databases ---------------------------------------------------------------------------

DATABASES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgresql),
]
"""The registry's backends, for ``parametrize(..., DATABASES, indirect=True)`` and fixtures."""


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test session (tests/postgres.py), stopped at its end.

    Tests using it skip when PostgreSQL is not installed, saying how to install it; with
    ``CI=true`` they fail instead (CI installs it, so its absence is a broken CI).
    """
    try:
        server = PostgresServer.start()
    except PostgresUnavailable as exc:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI=true, but no PostgreSQL server could be started: {exc}")
        pytest.skip(f"no PostgreSQL server: {exc}")
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """The ``postgresql+asyncpg://`` URL of a new, empty database, dropped after the test
    (with the connections still open to it). For more, ``postgres_server.create_database()``."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)


@pytest.fixture(params=DATABASES)
def registry_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a test's registry lives, once per backend: a SQLite file path (not created yet)
    in the test's temp dir, or the URL of a new PostgreSQL database (``postgres_url``).

    Narrow a test to one backend with ``@pytest.mark.parametrize("registry_url", ["sqlite"],
    indirect=True)``.
    """
    if request.param == "sqlite":
        return str(tmp_path / "state" / "agentkv.sqlite")
    return request.getfixturevalue("postgres_url")


# ---- models ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight gpt-oss model with the real o200k_harmony tokenizer
    (tests/harmony_model.py), built once per session. Its directory also holds
    ``o200k_base.tiktoken``, for openai-harmony's ``TIKTOKEN_ENCODINGS_BASE``.

    Tests using it skip when js-tiktoken, whose ranks the tokenizer is built from, is not
    installed.
    """
    if js_tiktoken() is None:
        pytest.skip(
            "js-tiktoken (npm install -g js-tiktoken@1.0.21) is not installed: the harmony "
            "model's tokenizer is built from its o200k_base ranks"
        )
    return build_harmony_model(tmp_path_factory.mktemp("harmony") / "gpt-oss")
