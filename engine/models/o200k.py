"""The o200k vocabulary (``o200k_base.tiktoken``), written from a gpt-oss tokenizer.

``openai-harmony`` reads the vocabulary of OpenAI's o200k encoding from a file, which it
downloads unless the folder ``TIKTOKEN_ENCODINGS_BASE`` names holds it. A gpt-oss tokenizer is
that vocabulary as byte-level BPE (its first 199,998 tokens are o200k's ranks, the special
tokens follow): :func:`write_vocab` writes the file from it, checked against the published
file's SHA-256, so a model on disk needs no download.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_TOKENS = 199_998  # ranks 0..199997
VOCAB_ENV = "TIKTOKEN_ENCODINGS_BASE"


def _hf(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer of an mlx-lm TokenizerWrapper (or the one given)."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return tokenizer
    return getattr(tokenizer, "_tokenizer", tokenizer)


def ids_of(tokenizer: Any, tokens: list[str]) -> list[Any]:
    """The ids of ``tokens`` in a tokenizer (None, or its unknown token's, for one it lacks)."""
    try:
        return list(_hf(tokenizer).convert_tokens_to_ids(tokens))
    except (AttributeError, TypeError):
        return [None] * len(tokens)


def write_vocab(tokenizer: Any, folder: Path) -> bool:
    """Write o200k_base.tiktoken from a gpt-oss tokenizer (byte-level BPE: its first
    199,998 tokens are o200k's ranks); False when the result is not the published file."""
    decoder = {char: byte for byte, char in _byte_chars().items()}
    try:
        pieces = _hf(tokenizer).convert_ids_to_tokens(list(range(VOCAB_TOKENS)))
        lines = [
            base64.b64encode(bytes(decoder[c] for c in piece)).decode() + f" {rank}\n"
            for rank, piece in enumerate(pieces)
        ]
    except (KeyError, TypeError, AttributeError):
        return False
    data = "".join(lines).encode()
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{VOCAB_FILE}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / VOCAB_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's characters for bytes (GPT-2's table: printable bytes stand for
    themselves, the others for code points from 256 up)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
