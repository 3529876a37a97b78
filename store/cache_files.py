"""KV cache files: safetensors with a checksum, written atomically and verified on read.

Tensors are numpy arrays in host memory; this module never touches MLX, so the cache writer
thread may call it. A file is one safetensors blob whose ``__metadata__`` holds the caller's
string metadata plus ``checksum``: an XXH3-128 digest (``xxh3-128:<hex>``) over the rest of
the metadata and every tensor's name, dtype, shape and bytes. XXH3 hashes at memory speed
(~30 GB/s against SHA-256's ~0.6 GB/s here), so verifying never dominates a load; files written
with the earlier SHA-256 checksum (64 hex digits, no prefix) still verify. A reader therefore
either gets exactly what was written or a :class:`~store.errors.CacheFileCorruptError`; a crash
mid-write leaves the previous file.

Reading is one ``readinto`` of the file into a buffer the returned arrays are views of: no
second copy of the data.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import xxhash
from safetensors import SafetensorError

from agentkv.store.errors import CacheFileCorruptError, CacheFileMissingError, Corruption

CHECKSUM_KEY = "checksum"
"""Metadata key holding the file's checksum; reserved, callers may not set it."""
SUPPORTED_DTYPES = frozenset(
    {
        *("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"),
        *("float16", "float32", "float64", "complex64"),
    }
)
"""numpy dtype names that safetensors both writes and reads back as numpy."""
_HEADER_LENGTH = struct.Struct("<Q")
_XXH3_PREFIX = "xxh3-128:"
_DTYPE_CODES = {
    "BOOL": "bool",
    **{f"I{b}": f"int{b}" for b in (8, 16, 32, 64)},
    **{f"U{b}": f"uint{b}" for b in (8, 16, 32, 64)},
    **{f"F{b}": f"float{b}" for b in (16, 32, 64)},
    "C64": "complex64",
}


@dataclass(frozen=True, slots=True)
class CacheFileInfo:
    """What :func:`write_cache_file` wrote: record ``nbytes`` and ``checksum`` in the registry."""

    path: Path
    nbytes: int
    checksum: str


@dataclass(frozen=True, slots=True, eq=False)
class CacheFile:
    """A verified cache file as read by :func:`read_cache_file`.

    Attributes:
        tensors: Name to array; writable views of one buffer owned by the caller.
        metadata: The caller's metadata, without ``checksum``.
        checksum: The verified checksum.
        nbytes: Size of the file in bytes.
    """

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]
    checksum: str
    nbytes: int


def write_cache_file(
    path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]
) -> CacheFileInfo:
    """Write tensors and metadata to ``path`` atomically, replacing any file there.

    The bytes go to ``.<name>.tmp-<random>`` next to ``path``, are fsynced, renamed over
    ``path``, and the directory is fsynced. If anything fails before the rename the temporary
    file is removed and ``path`` is untouched. Parent directories are created.

    Args:
        path: Destination file.
        tensors: Name (non-empty, not ``__metadata__``) to array of a dtype in
            :data:`SUPPORTED_DTYPES`; any memory layout or byte order.
        metadata: String keys and values, stored in the header; ``checksum`` is reserved.

    Returns:
        The path, the file size and the checksum.

    Raises:
        TypeError: A tensor is not an ``np.ndarray`` or metadata is not ``str`` to ``str``.
        ValueError: A tensor name, dtype or metadata entry is not allowed.
        OSError: The file could not be written (e.g. a full disk); ``path`` is untouched.
            Only a failing directory fsync, after the rename, leaves the new file in place.
    """
    path = Path(path)
    arrays = {name: _normalized(name, array) for name, array in tensors.items()}
    header = _checked_metadata(metadata)
    checksum = _checksum(header, arrays)
    try:
        blob = safetensors.numpy.save(arrays, metadata={**header, CHECKSUM_KEY: checksum})
    except SafetensorError as exc:  # inputs are checked above, so this is unexpected
        raise ValueError(f"safetensors refused to serialize {path}: {exc}") from exc

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(blob)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    # Makes the rename itself durable; without it a crash could bring back the old file.
    _fsync_directory(path.parent)
    return CacheFileInfo(path=path, nbytes=len(blob), checksum=checksum)


def read_cache_file(path: Path, *, expected_checksum: str | None = None) -> CacheFile:
    """Read and verify a cache file written by :func:`write_cache_file`.

    Args:
        path: The file.
        expected_checksum: The checksum the registry recorded for it, if known.

    Returns:
        The tensors, the metadata (without ``checksum``), the checksum and the file size.

    Raises:
        CacheFileMissingError: No file at ``path``.
        CacheFileCorruptError: The file is truncated, not safetensors, has no checksum, or its
            content or ``expected_checksum`` does not match the stored checksum.
        OSError: The file exists but cannot be read (e.g. permissions).
    """
    try:
        data = _read_whole(Path(path))
    except FileNotFoundError as exc:
        raise CacheFileMissingError(path) from exc
    header = _parse_header(path, data)
    tensors = _tensor_views(path, header, data)
    metadata = dict(header.get("__metadata__") or {})
    stored = verify_checksum(path, tensors, metadata, expected_checksum=expected_checksum)
    return CacheFile(tensors=tensors, metadata=metadata, checksum=stored, nbytes=len(data))


def load_into_mlx(paths: Sequence[str]) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """Read cache files straight into MLX memory, each file once (``mx.load``, as mlx-lm's own
    ``load_prompt_cache`` does): each file's arrays and metadata, checksum still in it, to
    verify with :func:`verify_checksum` from zero-copy numpy views. On the CPU stream: host
    memory, which numpy reads without moving it off a GPU. Call it on the generation thread.

    Raises:
        ValueError, RuntimeError: MLX cannot read a file (missing, truncated, not safetensors).
    """
    import mlx.core as mx  # here, not at the top: ``import store`` loads no MLX

    loaded = [mx.load(path, return_metadata=True, stream=mx.cpu) for path in paths]
    mx.eval([x for arrays, _ in loaded for x in arrays.values()])
    return loaded


def verify_checksum(
    path: Path,
    tensors: Mapping[str, np.ndarray],
    metadata: dict[str, str],
    *,
    expected_checksum: str | None = None,
) -> str:
    """Check tensors and metadata read from ``path`` (by any reader) against the checksum in
    the metadata, which is popped from ``metadata``. Returns it.

    Raises:
        CacheFileCorruptError: no checksum, or the content or ``expected_checksum`` does not
            match it.
    """
    stored = metadata.pop(CHECKSUM_KEY, None)
    if not isinstance(stored, str):
        raise CacheFileCorruptError(
            path, Corruption.NO_CHECKSUM, "the header has no checksum; not written by agentkv"
        )
    legacy = not stored.startswith(_XXH3_PREFIX)
    computed = _checksum(metadata, tensors, legacy=legacy)
    if computed != stored:
        raise CacheFileCorruptError(
            path, Corruption.CHECKSUM_MISMATCH, f"stored {stored}, content hashes to {computed}"
        )
    if expected_checksum is not None and expected_checksum != stored:
        raise CacheFileCorruptError(
            path,
            Corruption.CHECKSUM_MISMATCH,
            f"the registry expects {expected_checksum}, the file has {stored}",
        )
    return stored


def remove_cache_file(path: Path) -> None:
    """Delete a cache file; a file that is already gone is not an error."""
    with suppress(FileNotFoundError):
        os.unlink(path)


def _normalized(name: object, array: object) -> np.ndarray:
    """``array`` as C-contiguous little-endian, the layout safetensors stores."""
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise ValueError(f"tensor name {name!r}: expected a non-empty str other than __metadata__")
    if not isinstance(array, np.ndarray):
        raise TypeError(f"tensor {name!r} is a {type(array).__name__}, expected np.ndarray")
    if array.dtype.name not in SUPPORTED_DTYPES:
        raise ValueError(
            f"tensor {name!r} has dtype {array.dtype}; use one of {sorted(SUPPORTED_DTYPES)}"
        )
    little = array.dtype.newbyteorder("<")
    # safetensors 0.8 writes raw memory from the data pointer: a strided view would be garbage.
    if array.dtype != little or not array.flags.c_contiguous:
        array = np.array(array, dtype=little, order="C")
    return array


def _checked_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    header = dict(metadata)
    for key, value in header.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata {key!r}: {value!r}: keys and values must be str")
        if key == CHECKSUM_KEY:
            raise ValueError(f"metadata key {CHECKSUM_KEY!r} is reserved for the file checksum")
        try:
            (key + value).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"metadata {key!r}: not encodable as UTF-8 ({exc})") from exc
    return header


def _checksum(
    metadata: Mapping[str, str], tensors: Mapping[str, np.ndarray], *, legacy: bool = False
) -> str:
    """``xxh3-128:<hex>`` (``legacy``: SHA-256 hex) over canonical metadata, then each tensor
    in name order.

    Every part is a JSON line (no raw newlines inside) and each tensor's bytes follow a line
    that states their length, so no two different inputs produce the same stream.
    """
    digest = hashlib.sha256() if legacy else xxhash.xxh3_128()
    digest.update(_json_line(dict(sorted(metadata.items()))))
    for name in sorted(tensors):
        array = tensors[name]
        # The JSON line [name, dtype, shape, nbytes], formatted by hand (dtype names are plain
        # ASCII): json.dumps per tensor was a third of a block read's Python time.
        shape = ",".join(map(str, array.shape))
        line = f'[{json.dumps(name)},"{array.dtype.name}",[{shape}],{array.nbytes}]\n'
        digest.update(line.encode())
        digest.update(array.reshape(-1).view(np.uint8))
    return digest.hexdigest() if legacy else _XXH3_PREFIX + digest.hexdigest()


def _read_whole(path: Path) -> memoryview:
    """The file's bytes in a writable buffer, read once (``np.empty``: no zero-filling pass)."""
    with open(path, "rb") as file:
        buffer = np.empty(os.fstat(file.fileno()).st_size, np.uint8)
        read = file.readinto(buffer)
    return memoryview(buffer)[:read]


def _tensor_views(path: Path, header: dict[str, Any], data: memoryview) -> dict[str, np.ndarray]:
    """Each tensor as a view of ``data``, its dtype, shape and byte range checked."""
    start = _HEADER_LENGTH.size + _HEADER_LENGTH.unpack_from(data)[0]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_DTYPE_CODES[entry["dtype"]]).newbyteorder("<")
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
            if min(shape, default=0) < 0 or not 0 <= begin <= end:
                raise ValueError(f"negative size or offsets {shape} {begin}..{end}")
            if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
                raise ValueError(f"{end - begin} bytes cannot hold {dtype}{list(shape)}")
            array = np.frombuffer(
                data, dtype, count=(end - begin) // dtype.itemsize, offset=start + begin
            ).reshape(shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheFileCorruptError(
                path, Corruption.NOT_SAFETENSORS, f"tensor {name!r}: {exc}"
            ) from exc
        tensors[name] = array
    return tensors


def _json_line(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"


def _parse_header(path: Path, data: bytes | memoryview) -> dict[str, Any]:
    """The header JSON, after checking the file is long enough for it and for its data."""
    if len(data) < _HEADER_LENGTH.size:
        raise CacheFileCorruptError(
            path, Corruption.TRUNCATED, f"{len(data)} bytes, less than the 8-byte header length"
        )
    (length,) = _HEADER_LENGTH.unpack_from(data)
    end = _HEADER_LENGTH.size + length
    if end > len(data):
        # A file cut inside its header still starts like one; random bytes rarely do.
        looks_cut = b'{"'.startswith(bytes(data[8:10]))
        kind = Corruption.TRUNCATED if looks_cut else Corruption.NOT_SAFETENSORS
        raise CacheFileCorruptError(
            path, kind, f"header of {length} bytes announced, file has {len(data)}"
        )
    try:
        header = json.loads(bytes(data[_HEADER_LENGTH.size : end]))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise CacheFileCorruptError(path, Corruption.NOT_SAFETENSORS, f"header: {exc}") from exc
    if not isinstance(header, dict):
        raise CacheFileCorruptError(path, Corruption.NOT_SAFETENSORS, "header is not an object")
    data_end = end + _declared_data_size(header)
    if data_end > len(data):
        raise CacheFileCorruptError(
            path, Corruption.TRUNCATED, f"data ends at byte {data_end}, file has {len(data)}"
        )
    return header


def _declared_data_size(header: dict[str, Any]) -> int:
    """Largest data offset the header names; 0 when malformed (safetensors then rejects it)."""
    ends = [0]
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if name != "__metadata__" and isinstance(offsets, list) and len(offsets) == 2:
            ends.append(offsets[1] if isinstance(offsets[1], int) else 0)
    return max(ends)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
