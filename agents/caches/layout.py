"""Where caches live under the cache root and what their files are called: paths, file names
and block keys (see ``agentkv.caches`` for the layout)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from agentkv.engine.config import KEY_BITS, KEY_GROUP_SIZE
from agentkv.store import StoredBlock
from agentkv.store.cache_files import remove_cache_file

log = logging.getLogger(__name__)

BLOCKS_DIR = "_blocks"  # agent ids start with a letter or digit: no agent has this directory

# What saves name tails (``<message count>-<hex>.safetensors``) and the writer's temp files.
WRITTEN_NAME = re.compile(r"\.?\d{6,}-[0-9a-f]+\.safetensors(\.tmp-\w+)?")
# Segment, window and (older) block files, and their temp files.
BLOCK_NAME = re.compile(
    r"\.?([0-9a-f]{32})(-\d+(?:-[0-9a-f]{8})?|\.window)?\.safetensors(\.tmp-\w+)?"
)


def segment_name(keys: Sequence[str]) -> str:
    """A new segment's name: its last block's key, its count of blocks, 8 random hex digits."""
    return f"{keys[-1]}-{len(keys)}-{secrets.token_hex(4)}"


def names_segment_of(name: str, keys: Sequence[str]) -> bool:
    """Whether ``name`` (no suffix) is that of a file holding ``keys``: a segment's (with or
    without its random part) or, for one key, an older block file's."""
    if name == keys[-1]:
        return True
    base = f"{keys[-1]}-{len(keys)}"
    return name == base or re.fullmatch(re.escape(base) + r"-[0-9a-f]{8}", name) is not None


def chain_keys(seed: bytes, tokens: Sequence[int], block_tokens: int) -> list[str]:
    """The key of each full block of ``tokens``: XXH3-128 of the previous key (``seed`` for
    the first) and the block's tokens as little-endian int32, in hex."""
    array = np.asarray(tokens, dtype="<i4")
    keys, previous = [], seed
    for start in range(0, len(array) - block_tokens + 1, block_tokens):
        digest = xxhash.xxh3_128(previous)
        digest.update(array[start : start + block_tokens].tobytes())
        previous = digest.digest()
        keys.append(digest.hexdigest())
    return keys


class CacheLayout:
    """The cache root of one model and storage setting: its paths and block keys."""

    def __init__(
        self,
        root: Path,
        fingerprint: str,
        kv_bits: int | None,
        group_size: int,
        block_tokens: int,
    ):
        self.root = root
        self.fingerprint = fingerprint
        self.kv_bits = kv_bits
        self.group_size = group_size
        self.block_tokens = block_tokens
        # q4 blocks hold keys per channel over KEY_GROUP_SIZE positions at KEY_BITS and q8
        # blocks keys rotated (engine.kv.quant): keyed apart from the ones stored before.
        q4 = f"4-channels-{KEY_GROUP_SIZE}-{KEY_BITS}"
        bits = {4: q4, 8: "8-rotated-keys"}.get(kv_bits, str(kv_bits))
        parts = ("agentkv-blocks-v2", fingerprint, bits, str(group_size), str(block_tokens))
        self.seed = "|".join(parts).encode()

    def keys(self, tokens: Sequence[int]) -> list[str]:
        """The block keys of ``tokens`` (one per full block) under this model and settings."""
        return chain_keys(self.seed, tokens, self.block_tokens)

    def block_path(self, key: str, window: bool = False) -> Path:
        """A block's window file, or (``window`` False) the file of a block stored before
        segments."""
        suffix = ".window.safetensors" if window else ".safetensors"
        return self.root / BLOCKS_DIR / key[:2] / f"{key}{suffix}"

    def segment_path(self, name: str) -> Path:
        return self.root / BLOCKS_DIR / name[:2] / f"{name}.safetensors"

    def file_of(self, key: str, where: StoredBlock) -> Path:
        """The file holding block ``key``."""
        return self.block_path(key) if where.segment is None else self.segment_path(where.segment)

    def is_stored(self, key: str, known: dict[str, StoredBlock], window: bool = False) -> bool:
        """Whether block ``key`` (or its window) is recorded and its file is there (a load
        removes a corrupt one). Touches the filesystem: not on the event loop."""
        where = known.get(key)
        if where is None or (window and not where.window):
            return False
        return (self.block_path(key, True) if window else self.file_of(key, where)).exists()


def remove_quietly(path: Path) -> None:
    """Remove a file; one that cannot be removed is logged (the sweep retries it at open)."""
    try:
        remove_cache_file(path)
    except OSError as exc:
        log.warning("could not remove cache file %s: %s", path, exc)


def remove_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            remove_cache_file(path)


def link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        shutil.copy2(source, target)  # another filesystem, or links not supported
