"""An encoded cache (host-memory numpy arrays plus string metadata, ready for a safetensors
file), the format versions, and the quantization group sizes. Numpy only: any thread, and no
MLX import (the runtime's configuration reads the defaults from here)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from agentkv.engine.config import (  # noqa: F401  (this module's names for them)
    FALLBACK_GROUP_SIZES,
    GROUP_SIZES,
    choose_group_size,
)
from agentkv.engine.errors import CacheFormatError

FORMAT_VERSION = 1
# Paged files with q8 keys rotated (a layer's layout says ``rotated_keys``,
# ``agentkv.engine.kv.quant``) are written as format 3: an agentkv that reads only format 2 would
# read such keys as they are, so it refuses these files instead (the agent is rebuilt from its
# transcript). Files without rotated keys (exact, q4, unquantized layers) stay format 2, which every
# version reads.
PAGED_FORMAT_VERSION = 3
PAGED_FORMAT_VERSIONS = (2, 3)  # read


def paged_format_of(layouts: list[dict]) -> int:
    """The format a paged file of these layer layouts is written as."""
    return PAGED_FORMAT_VERSION if any(x.get("rotated_keys") for x in layouts) else 2


def is_paged_format(meta: dict[str, str], kind: str) -> bool:
    """Whether a file's metadata says it is a paged ``kind`` ("tail" or "block") this agentkv
    reads."""
    versions = {str(v) for v in PAGED_FORMAT_VERSIONS}
    return meta.get("format_version") in versions and meta.get("kind") == kind


DEFAULT_BLOCK_TOKENS = 256


@dataclass(slots=True, frozen=True)
class EncodedCache:
    """A prompt cache as plain arrays and strings, ready for a safetensors file.

    Attributes:
        tensors: Host-memory, C-contiguous arrays by name, including ``tokens`` (int32, 1-D).
        metadata: Everything else needed to rebuild the cache (``agentkv.engine.kv.whole`` and
            ``agentkv.engine.kv.paged`` describe the two formats).
    """

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]

    @property
    def num_tokens(self) -> int:
        return int(self.tensors["tokens"].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def kv_bits(self) -> int | None:
        return parse_int(self.metadata, "kv_bits", (4, 8))

    @property
    def group_size(self) -> int | None:
        return parse_int(self.metadata, "group_size", GROUP_SIZES)

    @property
    def block_tokens(self) -> int:
        return block_tokens_of(self.metadata)


def block_tokens_of(metadata: dict[str, str], where: str = "tail") -> int:
    """A paged file's tokens per block; CacheFormatError (naming ``where``) when the metadata
    lacks it."""
    try:
        return int(metadata["block_tokens"])
    except (KeyError, ValueError) as exc:
        raise CacheFormatError(f"{where}: metadata 'block_tokens': {exc}") from exc


def consecutive_runs(indexes: Iterable[int]) -> list[range]:
    """Ascending ``indexes`` as runs of consecutive ones: [1, 2, 4] -> [range(1, 3), range(4, 5)]"""
    runs: list[range] = []
    for i in indexes:
        if runs and runs[-1].stop == i:
            runs[-1] = range(runs[-1].start, i + 1)
        else:
            runs.append(range(i, i + 1))
    return runs


def tensor(encoded: EncodedCache, name: str, shape: tuple | None, dtype: type) -> np.ndarray:
    x = encoded.tensors.get(name)
    if x is None:
        raise CacheFormatError(f"tensor {name!r} is missing")
    if x.dtype != dtype or (shape is not None and x.shape != tuple(shape)):
        raise CacheFormatError(
            f"tensor {name!r} is {x.dtype}{list(x.shape)}, expected "
            f"{np.dtype(dtype)}{'' if shape is None else list(shape)}"
        )
    return x


def parse_int(metadata: dict[str, str], key: str, allowed: tuple[int, ...]) -> int | None:
    raw = metadata.get(key)
    if raw == "none":
        return None
    if raw not in {str(a) for a in allowed}:
        raise CacheFormatError(f"metadata {key!r} is {raw!r}; expected 'none' or one of {allowed}")
    return int(raw)
