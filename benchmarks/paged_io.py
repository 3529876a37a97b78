"""Save and load a prompt cache as the runtime stores it (format 2, or 3 with q8's rotated
keys): blocks of 256 tokens in segment files (the blocks one save added) and a tail, each a
checksummed safetensors file, read back with ``decode_paged`` (``mx.load``, every file
verified from that memory, blocks joined, float32 dequantization). Generation thread."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from agentkv.engine.batch.packing import Packing
from agentkv.engine.config import group_size_for
from agentkv.engine.kv.assemble import assemble_paged
from agentkv.engine.kv.encoded import DEFAULT_BLOCK_TOKENS, EncodedCache
from agentkv.engine.kv.load import LoadedFile, decode_paged
from agentkv.engine.kv.paged import encode_paged, split_blocks, token_slice
from agentkv.engine.request import PromptCache
from agentkv.store.cache_files import load_into_mlx, verify_checksum, write_cache_file


def save_paged(
    directory: Path,
    cache: PromptCache,
    kv_bits: int | None,
    group_size: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    blocks_per_file: int | None = None,
) -> list[Path]:
    """Write the cache's blocks and tail under ``directory``: their paths, the tail last
    (quantized in groups of ``group_size``, None: ``kv_bits``' own, as the runtime's default).

    ``blocks_per_file`` None: all blocks in one segment, as a save of the whole history writes
    them; N: segments of N blocks, as a history built by turns of about N blocks each leaves.
    """
    directory.mkdir(parents=True, exist_ok=True)
    paged = encode_paged(cache, kv_bits, group_size_for(kv_bits, group_size), block_tokens)
    paths = []
    for first, segment in paged.segments.items():
        count = segment.num_tokens // block_tokens
        step = blocks_per_file or count
        for k in range(0, count, step):
            part = token_slice(segment, k * block_tokens, min(k + step, count) * block_tokens)
            path = directory / f"segment-{first + k}.safetensors"
            paths.append(write_cache_file(path, part.tensors, part.metadata).path)
    tail = paged.tail
    paths.append(write_cache_file(directory / "tail.safetensors", tail.tensors, tail.metadata).path)
    return paths


def verify_loaded(files: list[LoadedFile]) -> None:
    """What a resume checks before it uses the files: checksums, and that they fit together."""
    encoded = []
    for path, tensors, meta in files:
        verify_checksum(Path(path), tensors, meta)
        encoded.append(EncodedCache(tensors, meta))
    *segments, tail = encoded
    block_tokens = int(tail.metadata["block_tokens"])
    blocks = [b for segment in segments for b in split_blocks(segment, block_tokens)]
    assemble_paged(tail, blocks, join=False)


def load_paged(
    paths: list[Path],
    packing: Packing | None = None,
    first_positions: Callable[[int], list] | None = None,
) -> PromptCache:
    """Read back what :func:`save_paged` wrote, as a resume does (``packing``: into a batch
    holding KV quantized so, ``Engine.packing``; ``first_positions``: ``Engine.first_positions``,
    as a resume reads a dequantized layer's first position)."""
    *segments, tail = paths
    on_gpu = mx.default_device() == mx.gpu
    blocks = [str(b) for b in segments]
    return decode_paged(
        load_into_mlx, str(tail), blocks, on_gpu, verify_loaded, packing, first_positions
    )


def nbytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)
