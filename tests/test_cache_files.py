"""KV cache files on a real filesystem: round trips, corruption of every kind, atomic replace."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agentkv.store import cache_files
from agentkv.store.cache_files import (
    CacheFileInfo,
    read_cache_file,
    remove_cache_file,
    write_cache_file,
)
from agentkv.store.errors import (
    CacheFileCorruptError,
    CacheFileError,
    CacheFileMissingError,
    Corruption,
    StoreError,
)

METADATA = {"format_version": "1", "model": "tiny-gemma", "layers": "2"}


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "layer.0.keys": rng.standard_normal((1, 2, 5, 4)).astype(np.float32),
        "layer.0.values": rng.standard_normal((1, 2, 5, 4)).astype(np.float16),
        "layer.1.keys.q": rng.integers(0, 2**32, (2, 3), dtype=np.uint32),
        "layer.1.offset": np.array([-3, 2**31 - 1], dtype=np.int32),
        "tokens": np.array([0, 1, 65535], dtype=np.uint16),
    }


def header_end(path: Path) -> int:
    """Byte offset where the tensor data starts (8-byte length + header JSON)."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        assert (actual[name].dtype, actual[name].shape) == (array.dtype, array.shape), name
        assert actual[name].tobytes() == array.tobytes(), name


def corrupt(path: Path, match: str | None = None) -> CacheFileCorruptError:
    with pytest.raises(CacheFileCorruptError, match=match) as info:
        read_cache_file(path)
    assert info.value.path == str(path) and str(path) in str(info.value)
    return info.value


@pytest.fixture
def written(tmp_path: Path) -> CacheFileInfo:
    return write_cache_file(tmp_path / "a" / "cache.safetensors", sample_tensors(), METADATA)


def test_round_trip_keeps_bytes_dtypes_and_metadata(written: CacheFileInfo) -> None:
    loaded = read_cache_file(written.path, expected_checksum=written.checksum)

    assert_same(loaded.tensors, sample_tensors())
    assert loaded.metadata == METADATA
    assert loaded.checksum == written.checksum
    assert re.fullmatch(r"xxh3-128:[0-9a-f]{32}", written.checksum)
    assert loaded.nbytes == written.nbytes == written.path.stat().st_size
    header = json.loads(written.path.read_bytes()[8 : header_end(written.path)])
    assert header["__metadata__"] == {**METADATA, "checksum": written.checksum}
    loaded.tensors["tokens"][0] = 9  # the caller owns writable copies


def test_strided_big_endian_and_scalar_tensors_round_trip(tmp_path: Path) -> None:
    # safetensors 0.8 writes raw memory from the data pointer; a strided view must be copied.
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {
        "transposed": base.T,
        "sliced": base[:, ::2],
        "big_endian": np.arange(5, dtype=">i4"),
        "scalar": np.array(2.5, dtype=np.float16),
        "empty": np.zeros((0, 3), dtype=np.uint16),
        "mask": np.array([True, False, True]),
    }
    info = write_cache_file(tmp_path / "c.safetensors", tensors, {})
    loaded = read_cache_file(info.path).tensors
    for name, array in tensors.items():
        assert np.array_equal(loaded[name], array), name
        assert loaded[name].shape == array.shape
    assert loaded["big_endian"].dtype == np.dtype("<i4")


def test_same_content_gives_the_same_checksum(tmp_path: Path) -> None:
    first = write_cache_file(tmp_path / "1.safetensors", sample_tensors(), METADATA)
    reordered = dict(reversed(list(sample_tensors().items())))
    second = write_cache_file(
        tmp_path / "2.safetensors", reordered, dict(reversed(METADATA.items()))
    )
    other = write_cache_file(tmp_path / "3.safetensors", sample_tensors(), {**METADATA, "x": ""})
    assert first.checksum == second.checksum != other.checksum


def test_files_with_the_earlier_sha256_checksum_still_verify(tmp_path: Path) -> None:
    """Files written before the switch to XXH3 carry a bare SHA-256 hex checksum."""
    tensors = sample_tensors()
    digest = hashlib.sha256()
    digest.update(json.dumps(dict(sorted(METADATA.items())), separators=(",", ":")).encode())
    digest.update(b"\n")
    for name in sorted(tensors):
        array = tensors[name]
        line = [name, array.dtype.name, list(array.shape), array.nbytes]
        digest.update(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        digest.update(array.tobytes())
    legacy = digest.hexdigest()
    path = tmp_path / "old.safetensors"
    path.write_bytes(safetensors.numpy.save(tensors, metadata={**METADATA, "checksum": legacy}))
    loaded = read_cache_file(path, expected_checksum=legacy)
    assert loaded.checksum == legacy
    assert_same(loaded.tensors, tensors)
    tampered = {**tensors, "tokens": np.array([0, 1, 65534], dtype=np.uint16)}
    path.write_bytes(safetensors.numpy.save(tampered, metadata={**METADATA, "checksum": legacy}))
    assert corrupt(path, "checksum mismatch").kind == Corruption.CHECKSUM_MISMATCH


def test_overwrite_replaces_and_creates_parents(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "c.safetensors"
    write_cache_file(path, sample_tensors(), METADATA)
    newer = write_cache_file(path, {"only": np.ones(3, np.float32)}, {"v": "2"})
    loaded = read_cache_file(path, expected_checksum=newer.checksum)
    assert_same(loaded.tensors, {"only": np.ones(3, np.float32)})
    assert loaded.metadata == {"v": "2"}
    assert os.listdir(path.parent) == ["c.safetensors"]


def test_truncated_anywhere_is_corrupt(written: CacheFileInfo) -> None:
    data = written.path.read_bytes()
    start = header_end(written.path)
    cuts = [0, 1, 7, 8, 9, 20, start - 1, start, start + 1, (start + len(data)) // 2, len(data) - 1]
    for cut in cuts:
        written.path.write_bytes(data[:cut])
        assert corrupt(written.path, "truncated").kind == Corruption.TRUNCATED, cut


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_data_byte_fails_the_checksum(written: CacheFileInfo, where: str) -> None:
    data = bytearray(written.path.read_bytes())
    start = header_end(written.path)
    index = {"first": start, "middle": (start + len(data)) // 2, "last": len(data) - 1}[where]
    data[index] ^= 0x01
    written.path.write_bytes(bytes(data))
    error = corrupt(written.path, "checksum mismatch")
    assert error.kind == Corruption.CHECKSUM_MISMATCH


def test_every_flipped_header_byte_is_detected(written: CacheFileInfo) -> None:
    data = written.path.read_bytes()
    for index in range(header_end(written.path)):
        flipped = bytearray(data)
        flipped[index] ^= 0xFF
        written.path.write_bytes(bytes(flipped))
        with pytest.raises(CacheFileCorruptError):
            read_cache_file(written.path)


@pytest.mark.parametrize(
    ("old", "new"),
    [(b'"tiny-gemma"', b'"tiny-gemmb"'), (b'"layer.0.keys"', b'"layer.0.kezs"')],
)
def test_an_edited_header_value_fails_the_checksum(
    written: CacheFileInfo, old: bytes, new: bytes
) -> None:
    data = written.path.read_bytes()
    assert data.count(old) == 1
    written.path.write_bytes(data.replace(old, new))
    assert corrupt(written.path).kind == Corruption.CHECKSUM_MISMATCH


def test_garbage_and_foreign_files_are_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(np.random.default_rng(1).bytes(4096))
    assert corrupt(path, "not safetensors").kind == Corruption.NOT_SAFETENSORS
    path.write_bytes(struct.pack("<Q", 4) + b"[1] ")
    assert corrupt(path, "not an object").kind == Corruption.NOT_SAFETENSORS
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    assert corrupt(path).kind == Corruption.NOT_SAFETENSORS
    header = b'{"t":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    assert corrupt(path, "F99").kind == Corruption.NOT_SAFETENSORS
    path.write_bytes(safetensors.numpy.save({"t": np.zeros(2, np.float32)}, {"k": "v"}))
    assert corrupt(path, "no checksum").kind == Corruption.NO_CHECKSUM


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "gone.safetensors"
    with pytest.raises(CacheFileMissingError, match="does not exist") as info:
        read_cache_file(path)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, CacheFileError)
    assert isinstance(info.value, StoreError)
    assert (info.value.errno, info.value.path) == (errno.ENOENT, str(path))


def test_unexpected_checksum_is_corrupt(written: CacheFileInfo) -> None:
    with pytest.raises(CacheFileCorruptError, match=r"registry expects 0{64}") as info:
        read_cache_file(written.path, expected_checksum="0" * 64)
    assert info.value.kind == Corruption.CHECKSUM_MISMATCH


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_a_failed_write_leaves_the_previous_file(
    written: CacheFileInfo, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    before = written.path.read_bytes()
    seen: list[str] = []

    def fail(*args: object) -> None:
        seen.extend(str(arg) for arg in args)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_files.os, failing, fail)
    with pytest.raises(OSError, match="No space left"):
        write_cache_file(written.path, {"new": np.ones(4, np.float32)}, {"v": "2"})
    monkeypatch.undo()

    assert written.path.read_bytes() == before
    assert os.listdir(written.path.parent) == [written.path.name]
    if failing == "replace":
        temp = Path(seen[0])
        assert temp.parent == written.path.parent
        assert temp.name.startswith(".cache.safetensors.tmp-")
    assert read_cache_file(written.path).checksum == written.checksum


@pytest.mark.parametrize(
    ("tensors", "metadata", "error", "match"),
    [
        ({"t": np.array(["a"])}, {}, ValueError, "dtype <U1"),
        ({"t": np.zeros(2, dtype=object)}, {}, ValueError, "dtype object"),
        ({"t": [1.0, 2.0]}, {}, TypeError, "is a list"),
        ({"": np.zeros(1)}, {}, ValueError, "tensor name ''"),
        ({"__metadata__": np.zeros(1)}, {}, ValueError, "tensor name"),
        ({"t": np.zeros(1)}, {"checksum": "x"}, ValueError, "reserved"),
        ({"t": np.zeros(1)}, {"n": 1}, TypeError, "must be str"),
        ({"t": np.zeros(1)}, {"s": "\ud800"}, ValueError, "UTF-8"),
    ],
)
def test_bad_input_is_refused_and_touches_nothing(
    written: CacheFileInfo, tensors: dict, metadata: dict, error: type, match: str
) -> None:
    before = written.path.read_bytes()
    with pytest.raises(error, match=match):
        write_cache_file(written.path, tensors, metadata)
    assert written.path.read_bytes() == before
    assert os.listdir(written.path.parent) == [written.path.name]


def test_remove_ignores_a_missing_file(written: CacheFileInfo) -> None:
    remove_cache_file(written.path)
    assert not written.path.exists()
    remove_cache_file(written.path)


DTYPES = st.sampled_from(
    ["float32", "float16", "float64", "int8", "int32", "uint16", "uint32", "int64", "bool"]
)
ARRAYS = DTYPES.flatmap(
    lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0))
)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    tensors=st.dictionaries(st.text(min_size=1, max_size=8), ARRAYS, max_size=4).filter(
        lambda tensors: "__metadata__" not in tensors
    ),
    metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=3).filter(
        lambda metadata: "checksum" not in metadata
    ),
)
def test_random_tensors_round_trip(
    tmp_path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]
) -> None:
    # tmp_path is shared by all examples; each write replaces the last one.
    info = write_cache_file(tmp_path / "p.safetensors", tensors, metadata)
    loaded = read_cache_file(info.path, expected_checksum=info.checksum)
    assert_same(loaded.tensors, tensors)
    assert loaded.metadata == metadata
