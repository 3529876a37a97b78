"""Models named by Hugging Face id, resolved offline from a Hugging Face cache the tests lay out.

The cache is laid out as ``huggingface_hub`` writes it (``models--org--name/blobs``,
``refs/<branch>``, ``snapshots/<commit>/<file>`` linked to its blob), holding a tiny model that
mlx-lm loads; nothing here reaches a network (an unreachable hub is a closed local port).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from agentkv.config import RuntimeConfig
from agentkv.engine.errors import ModelNotFoundError
from agentkv.engine.models.loading import load_model
from agentkv.models.directory import model_fingerprint, resolve_model_path
from agentkv.models.hub import parse_hub_spec
from agentkv.models.tiny import tiny_model_dir
from agentkv.runtime import AgentRuntime

REPO = "mlx-community/tiny-llama-test"
MAIN = "a" * 40
DEV = "b" * 40


def lay_out(cache: Path, repo: str, commit: str, source: Path, refs: tuple[str, ...]) -> Path:
    """A snapshot of ``source``'s files as ``huggingface_hub`` caches them; its directory."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline Hugging Face cache holding REPO at MAIN (refs/main) and DEV (refs/dev)."""
    cache = tmp_path / "hf" / "hub"
    lay_out(cache, REPO, MAIN, tiny_model_dir("tiny:llama"), ("main",))
    lay_out(cache, REPO, DEV, tiny_model_dir("tiny:gemma3"), ("dev",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_specs_are_told_from_paths():
    assert parse_hub_spec("mlx-community/Qwen3-0.6B-4bit") == (
        "mlx-community/Qwen3-0.6B-4bit",
        None,
    )
    assert parse_hub_spec("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_hub_spec("org/name@refs/pr/3") == ("org/name", "refs/pr/3")
    for not_an_id in ("name", "./org/name", "/abs/org", "a/b/c", "org--x/name", "org/name.git", ""):
        assert parse_hub_spec(not_an_id) is None, not_an_id


def test_a_cached_id_loads_offline_at_its_refs_and_commits(hub_cache):
    main = load_model(REPO)
    assert main.path == hub_cache / "models--mlx-community--tiny-llama-test" / "snapshots" / MAIN
    assert main.spec == REPO
    assert main.tokenizer.encode("abc")  # mlx_lm.load read the snapshot's files through links
    assert resolve_model_path(f"{REPO}@main") == main.path
    assert resolve_model_path(f"{REPO}@{MAIN}") == main.path
    dev = load_model(f"{REPO}@dev")
    assert dev.path.name == DEV
    assert type(dev.model).__module__ == "mlx_lm.models.gemma3_text"
    # The commit is part of the fingerprint: the same files at another commit are another model.
    assert main.fingerprint == model_fingerprint(main.path)
    assert main.fingerprint != load_model("tiny:llama").fingerprint


def test_an_unknown_id_offline_names_the_id_and_the_cache(hub_cache):
    with pytest.raises(ModelNotFoundError) as missing:
        resolve_model_path("mlx-community/absent")
    message = str(missing.value)
    assert "'mlx-community/absent' is not in the local Hugging Face cache" in message
    assert str(hub_cache) in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelNotFoundError, match=f"'{REPO}@nope' is not in"):
        resolve_model_path(f"{REPO}@nope")


def test_a_snapshot_without_weights_is_incomplete(hub_cache):
    snapshot = lay_out(hub_cache, "org/partial", "c" * 40, tiny_model_dir("tiny:llama"), ("main",))
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=r"incomplete in \(no model\*\.safetensors"):
        resolve_model_path("org/partial")


def test_a_local_directory_named_like_an_id_wins(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "mlx-community" / "tiny-llama-test"
    local.parent.mkdir()
    local.symlink_to(tiny_model_dir("tiny:gemma3"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(REPO) == tiny_model_dir("tiny:gemma3").resolve()


def test_an_unreachable_hub_is_a_clear_error_from_the_cli(tmp_path):
    env = os.environ | {
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing listens: the hub is unreachable
        "HF_HUB_ETAG_TIMEOUT": "2",
        "HF_HUB_DOWNLOAD_TIMEOUT": "2",
    }
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "agentkv.server.cli", "fingerprint", "org/absent"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "'org/absent' is not in the local Hugging Face cache" in proc.stderr
    assert "could not be downloaded" in proc.stderr and str(tmp_path / "hub") in proc.stderr


async def test_a_runtime_chats_with_a_model_named_by_id(hub_cache, tmp_path):
    config = RuntimeConfig(model=REPO, data_dir=tmp_path / "data")
    async with await AgentRuntime.open(config) as runtime:
        await runtime.create_agent("a")
        reply = await runtime.chat("a", "hello", max_tokens=3)
    assert len(reply.token_ids) == 3
    assert runtime.engine.model.path.name == MAIN
    async with await AgentRuntime.open(config) as runtime:
        again = await runtime.chat("a", "more", max_tokens=2)
    assert again.cache_source == "disk"
