"""An encoded cache (host-memory numpy arrays plus string metadata, ready for a safetensors
file), the format versions, and the quantization group sizes. Numpy only: any thread, and no
MLX import (the runtime's configuration reads the defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import CacheFormatError

FORMAT_VERSION = 1
PAGED_FORMAT_VERSION = 2
DEFAULT_BLOCK_TOKENS = 256
GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts
# 32 rather than mlx-lm's 64: on a trained model (gemma3-270m, 4K history) q8 keeps 99.2% of
# teacher-forced top-1 tokens against 98.4% at 64, for 6% more bytes (q8 0.5625x of float16).
DEFAULT_GROUP_SIZE = 32
FALLBACK_GROUP_SIZES = (64, 32, 128)  # tried in this order after the preferred one


@dataclass(slots=True, frozen=True)
class EncodedCache:
    """A prompt cache as plain arrays and strings, ready for a safetensors file.

    Attributes:
        tensors: Host-memory, C-contiguous arrays by name, including ``tokens`` (int32, 1-D).
        metadata: Everything else needed to rebuild the cache (``engine.kv.whole`` and
            ``engine.kv.paged`` describe the two formats).
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


def check_group_size(head_dim: int, group_size: int) -> None:
    """Raise ValueError (naming both) unless ``mx.quantize`` can quantize rows of ``head_dim``.

    Pure arithmetic, so any thread may call it; tests pin it to what ``mx.quantize`` accepts.
    """
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size {group_size} is not supported; use one of {GROUP_SIZES}")
    if head_dim % group_size:
        raise ValueError(
            f"head_dim {head_dim} is not divisible by group_size {group_size}; "
            f"pick a group size from {GROUP_SIZES} that divides {head_dim}"
        )


def choose_group_size(head_dim: int, preferred: int = 64) -> int | None:
    """The quantization group size for rows of ``head_dim``: ``preferred`` if it divides them,
    else the first of 64, 32, 128 that does; None when none does (store the layer unquantized).
    """
    for group_size in (preferred, *FALLBACK_GROUP_SIZES):
        if group_size in GROUP_SIZES and head_dim % group_size == 0:
            return group_size
    return None


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
