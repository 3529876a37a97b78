"""Load the system OpenBLAS before MLX so Linux CPU matmuls use it.

The ``mlx[cpu]`` wheel links a reference BLAS (~7 fp32 GFLOP/s on two cores). Loading Debian's
OpenBLAS with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported makes MLX resolve its BLAS
symbols there instead (~213 GFLOP/s measured). ``engine/__init__.py`` calls
:func:`load_before_mlx`: the library is loaded when ``mlx`` is first imported, not before, so
importing a part of agentkv that needs no MLX (the store, the error classes) loads nothing;
every package that touches MLX imports ``engine`` before ``mlx``.

Set ``AGENTKV_NO_OPENBLAS=1`` to opt out. No effect on macOS (MLX uses Accelerate there).

OpenBLAS's thread pool serves one call at a time: matrix products from two threads (the batch's
step and a vision tower on its own thread) queue behind each other, a decode step behind every
product of the tower. :func:`cores_shared` runs each call on its caller's thread meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.abc
import logging
import os
import sys
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

OPT_OUT_ENV = "AGENTKV_NO_OPENBLAS"
PATH_ENV = "AGENTKV_OPENBLAS_PATH"
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_loaded_path: str | None = None
_attempted = False
_hook_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_sharing_lock = threading.Lock()
_shared = 0  # callers inside cores_shared()
_pool = 0  # OpenBLAS's threads before the first of them went in


def loaded_library() -> str | None:
    """The path of the BLAS library this process preloaded, or None if none was."""
    return _loaded_path


def opted_out() -> bool:
    return os.environ.get(OPT_OUT_ENV, "").strip() not in ("", "0")


def installed() -> str | None:
    """The OpenBLAS library :func:`load` would load (``$AGENTKV_OPENBLAS_PATH`` or the first of
    :data:`CANDIDATES` that exists), or None."""
    override = os.environ.get(PATH_ENV)
    return next((p for p in ((override,) if override else CANDIDATES) if os.path.exists(p)), None)


def wanted_but_missing() -> bool:
    """On Linux, not opted out, and no OpenBLAS installed: ``make`` should install it."""
    return sys.platform.startswith("linux") and not opted_out() and installed() is None


def load() -> str | None:
    """Preload OpenBLAS with ``RTLD_GLOBAL`` if we are on Linux and it is installed.

    Idempotent. Returns the loaded path, or None when skipped (opt-out, not Linux, not found,
    or MLX already imported so it is too late to matter).
    """
    global _loaded_path, _attempted
    if _attempted:
        return _loaded_path
    _attempted = True
    if not sys.platform.startswith("linux"):
        return None
    if opted_out():
        log.debug("OpenBLAS preload disabled by %s", OPT_OUT_ENV)
        return None
    if "mlx.core" in sys.modules:
        log.warning("mlx.core was imported before engine; OpenBLAS not preloaded (slow CPU matmul)")
        return None
    override = os.environ.get(PATH_ENV)
    for path in (override,) if override else CANDIDATES:
        if not os.path.exists(path):
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            log.debug("could not load %s: %s", path, exc)
            continue
        _loaded_path = path
        log.debug("BLAS in use: %s", path)
        return path
    log.debug("BLAS in use: the one bundled with mlx (no system OpenBLAS found)")
    return None


def threads() -> int | None:
    """The threads the preloaded OpenBLAS runs a call on (None: it is not loaded)."""
    lib = _openblas()
    return None if lib is None else lib.openblas_get_num_threads()


@contextlib.contextmanager
def cores_shared() -> Iterator[None]:
    """While any thread is inside: the preloaded OpenBLAS runs each call on its caller's
    thread alone, so that two threads' products run side by side, one core each, where its
    pool would run them one after the other (on two cores, a 16-row product beside a
    vision tower's took 1.6x its time alone, not 100x). Nests; no effect without OpenBLAS."""
    global _shared, _pool
    lib = _openblas()
    if lib is None:
        yield
        return
    with _sharing_lock:
        if not _shared:
            _pool = lib.openblas_get_num_threads()
            lib.openblas_set_num_threads(1)
        _shared += 1
    try:
        yield
    finally:
        with _sharing_lock:
            _shared -= 1
            if not _shared:
                lib.openblas_set_num_threads(_pool)


def _openblas() -> ctypes.CDLL | None:
    global _library
    if _library is None and _loaded_path is not None:
        try:
            lib = ctypes.CDLL(_loaded_path)
            lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
            lib.openblas_get_num_threads.restype = ctypes.c_int
            _library = lib
        except (OSError, AttributeError):  # a BLAS that is not OpenBLAS
            log.debug("%s: no OpenBLAS thread control", _loaded_path)
    return _library


class _BeforeMLX(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first import of ``mlx`` it loads the BLAS; then it stays
    in ``sys.meta_path`` as a no-op (removing it while the import system walks that list
    would make it skip the next finder)."""

    fired = False

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if not self.fired and (fullname == "mlx" or fullname.startswith("mlx.")):
            self.fired = True
            load()
        return None


def load_before_mlx() -> None:
    """Load the BLAS just before ``mlx`` is first imported (now, if it already is: too late,
    :func:`load` says so). Idempotent."""
    if "mlx" in sys.modules:
        load()
        return
    with _hook_lock:
        if not any(isinstance(f, _BeforeMLX) for f in sys.meta_path):
            sys.meta_path.insert(0, _BeforeMLX())


def mapped_blas_libraries() -> list[str]:
    """BLAS shared objects actually mapped into this process (Linux, from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
    except OSError:
        return []
    return sorted(paths)
