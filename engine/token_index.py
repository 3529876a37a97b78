"""The tokenizer's index constrained decoding needs (llguidance's ``LLTokenizer``), kept on disk
per tokenizer so that a start after the first builds it in a fraction of the time.

llguidance builds its index from a fast tokenizer's serialized form: seconds for a large
vocabulary (about 4 s for Gemma 3's 262,144 tokens on 2 CPU cores: serializing the tokenizer,
then reading every token), holding the GIL throughout. What it reads from that is each token's
bytes and which tokens are special; those are saved after the first build, under
``$AGENTKV_HOME/token-index`` and a hash of the tokenizer's files, and a later start gives
llguidance the saved tokens instead (its ``TokenizerWrapper`` protocol, strings tokenized by the
same tokenizer): under a second for the same vocabulary, and the same index (the same token
bytes, special tokens and end token; tests compare the masks). A missing, stale or unreadable
file is built again; a file is written whole or not at all.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from agentkv.models.tiny import agentkv_home

log = logging.getLogger(__name__)

FORMAT = 1
"""Bumped when what a saved index holds changes."""
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def token_index(hf: Any) -> Any:
    """llguidance's index of the Hugging Face (fast) tokenizer ``hf``: from the tokens an
    earlier build of the same tokenizer saved, else built (and saved)."""
    import llguidance
    import llguidance.hf

    path = _saved_path(hf)
    saved = _read(path) if path is not None else None
    if saved is not None:
        return llguidance.LLTokenizer(_SavedTokens(hf, *saved))
    built = llguidance.hf.from_tokenizer(hf)
    if path is not None:
        _write(path, built, hf)
    return built


class _SavedTokens:
    """A tokenizer as llguidance's ``TokenizerWrapper`` protocol describes one: every token's
    bytes, the special tokens, the end and start tokens, and a call that tokenizes a string."""

    is_tokenizer_wrapper = True

    def __init__(self, hf: Any, tokens: list[bytes], special: list[int], ends: tuple[int, int]):
        self._hf = hf
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id, bos = ends
        self.bos_token_id = None if bos < 0 else bos

    def __call__(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)


def _saved_path(hf: Any) -> Path | None:
    """Where the index of ``hf`` is saved: named by a hash of its files and of what else
    shapes the index (None: a tokenizer with no files to hash)."""
    folder = Path(getattr(hf, "name_or_path", "") or ".")
    files = [folder / name for name in _TOKENIZER_FILES if (folder / name).is_file()]
    if not files:
        return None
    digest = hashlib.sha256()
    for part in (FORMAT, importlib.metadata.version("llguidance"), hf.eos_token_id, len(hf)):
        digest.update(f"{part}\n".encode())
    for file in files:
        digest.update(f"{file.name}\n".encode())
        digest.update(file.read_bytes())
    return agentkv_home() / "token-index" / f"{digest.hexdigest()[:32]}.npz"


def _read(path: Path) -> tuple[list[bytes], list[int], tuple[int, int]] | None:
    try:
        with open(path, "rb") as file, np.load(file, allow_pickle=False) as saved:
            lengths, data = saved["lengths"], saved["data"].tobytes()
            special, ends = saved["special"].tolist(), saved["ends"].tolist()
    except FileNotFoundError:
        return None
    except Exception as exc:  # (a damaged file: built again)
        log.warning("token index %s unreadable (%s); building it again", path, exc)
        return None
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist()
    if offsets[-1] != len(data) or len(ends) != 2:
        log.warning("token index %s is inconsistent; building it again", path)
        return None
    tokens = [data[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
    return tokens, special, (ends[0], ends[1])


def _write(path: Path, built: Any, hf: Any) -> None:
    tokens = [built.decode_bytes([i]) for i in range(built.vocab_size)]
    special = [i for i in range(built.vocab_size) if built.is_special_token(i)]
    bos = hf.bos_token_id if hf.bos_token_id is not None else -1
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            np.savez(
                out,
                lengths=np.array([len(t) for t in tokens], dtype=np.uint32),
                data=np.frombuffer(b"".join(tokens), dtype=np.uint8),
                special=np.array(special, dtype=np.int64),
                ends=np.array([built.eos_token, bos], dtype=np.int64),
            )
        os.chmod(tmp, 0o644)  # (mkstemp's is owner-only)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:  # (a read-only home: every start builds it)
        log.warning("token index not saved to %s: %s", path, exc)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
