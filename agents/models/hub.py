"""Hugging Face ids → model directories in the local Hugging Face cache, downloading when online.

A spec such as ``mlx-community/Qwen3-0.6B-4bit`` (optionally ``@<revision>``: a branch, tag or
commit) names a model repository, as every MLX tool names it. The local Hugging Face cache is
looked in first (``HF_HUB_CACHE`` / ``HF_HOME``, as ``huggingface_hub`` reads them), so a model
already there loads without touching the network; otherwise it is downloaded with
``huggingface_hub.snapshot_download`` (the files ``mlx_lm.load`` reads), unless
``HF_HUB_OFFLINE=1``. The directory returned is the snapshot of one commit
(``models--org--name/snapshots/<commit>``), which :func:`commit_of` reads back.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from agentkv.engine.errors import ModelNotFoundError

log = logging.getLogger(__name__)

# What mlx_lm.load reads from a repository (the patterns mlx-lm itself downloads).
MODEL_FILES = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_HUB_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
_SNAPSHOT = re.compile(r"models--[\w.-]+--[\w.-]+/snapshots/(?P<commit>[0-9a-f]{40})")


def parse_hub_spec(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` is written as a Hugging Face id, else None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    match = _HUB_SPEC.fullmatch(spec)
    if match is None:
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    return match["repo"], match["revision"]


def commit_of(path: Path) -> str | None:
    """The commit a Hugging Face cache snapshot directory holds (None: not such a directory)."""
    match = _SNAPSHOT.search(path.as_posix())
    return match["commit"] if match else None


def hub_model_dir(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` (None: ``main``), from the local
    Hugging Face cache or, when online, downloaded into it.

    Raises:
        ModelNotFoundError: Not in the cache and offline (or the hub unreachable), no such
            repository or revision, or a snapshot without config.json and weights; the message
            names the id, the cache looked in and what to do.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo_id if revision is None else f"{repo_id}@{revision}"
    cache = constants.HF_HUB_CACHE
    try:
        local = Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=MODEL_FILES, local_files_only=True
            )
        )
        if _missing(local) is None:
            return local
    except (LocalEntryNotFoundError, FileNotFoundError):
        local = None
    except ValueError as exc:  # a revision huggingface_hub refuses
        raise ModelNotFoundError(f"model {name!r}: {_reason(exc)}") from exc
    if constants.HF_HUB_OFFLINE:
        missing = "is not in" if local is None else f"is incomplete in ({_missing(local)})"
        raise ModelNotFoundError(
            f"model {name!r} {missing} the local Hugging Face cache {cache} and HF_HUB_OFFLINE "
            f"is set; download it once online (hf download {repo_id}"
            f"{'' if revision is None else f' --revision {revision}'}) or unset HF_HUB_OFFLINE"
        )
    log.info("downloading %s into %s", name, cache)
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILES))
    except GatedRepoError as exc:
        raise ModelNotFoundError(
            f"model {name!r} is gated on the Hugging Face hub: accept its terms on the hub and "
            f"log in (hf auth login, or HF_TOKEN) ({_reason(exc)})"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(
            f"model {name!r}: no such repository on the Hugging Face hub (or it is private: log "
            f"in with hf auth login, or HF_TOKEN), and it is not in the local cache {cache}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(
            f"model {name!r}: the repository has no revision {revision!r}"
        ) from exc
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(
            f"model {name!r} is not in the local Hugging Face cache {cache} and could not be "
            f"downloaded ({_reason(exc)}); connect to the hub or copy the model into that cache "
            f"(or pass a local model directory)"
        ) from exc
    missing = _missing(path)
    if missing is not None:
        raise ModelNotFoundError(f"model {name!r} ({path}) is not an MLX model: {missing}")
    return path


def _missing(path: Path) -> str | None:
    """What an mlx-lm model directory lacks (None: nothing)."""
    if not (path / "config.json").is_file():
        return "no config.json"
    if not any(path.glob("model*.safetensors")):
        return "no model*.safetensors weights"
    return None


def _reason(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
