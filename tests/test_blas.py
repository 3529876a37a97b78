import os
import subprocess
import sys

import pytest

from agentkv.models import blas

HAVE_OPENBLAS = sys.platform.startswith("linux") and any(os.path.exists(p) for p in blas.CANDIDATES)
needs_openblas = pytest.mark.skipif(not HAVE_OPENBLAS, reason="system OpenBLAS not installed")


def _probe(code: str, **env: str) -> str:
    """Run `code` in a fresh interpreter (import order matters) and return its stdout."""
    full_env = {k: v for k, v in os.environ.items() if k != blas.OPT_OUT_ENV} | env
    out = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


BLAS = "from agentkv.models import blas"
MAPPED = f"{BLAS}; print(any('openblas' in p for p in blas.mapped_blas_libraries()))"


@needs_openblas
def test_test_process_loaded_openblas_before_mlx():
    import mlx.core  # noqa: F401  (if no test has yet: the first import loads OpenBLAS first)

    assert blas.loaded_library() in blas.CANDIDATES
    assert any("openblas" in p for p in blas.mapped_blas_libraries())


@needs_openblas
@pytest.mark.parametrize(
    "entry", ["import agentkv.engine", "import agentkv", "import agentkv.server.cli"]
)
def test_project_import_paths_load_openblas(entry):
    assert _probe(f"{entry}; import mlx.core; {MAPPED}") == "True"


@needs_openblas
def test_opt_out_keeps_bundled_blas():
    code = f"import agentkv.engine, mlx.core; {BLAS}; print(blas.loaded_library()); {MAPPED}"
    assert _probe(code, **{blas.OPT_OUT_ENV: "1"}).splitlines() == ["None", "False"]


def test_importing_the_store_loads_no_blas_until_mlx_is_imported():
    code = (
        "import agentkv.store; from agentkv.models import blas; "
        "print(blas.loaded_library()); "
        "import mlx.core; print(blas.loaded_library() is not None)"
    )
    assert _probe(code).splitlines() == ["None", str(HAVE_OPENBLAS)]


def test_too_late_when_mlx_already_imported():
    code = f"import mlx.core; import agentkv.engine; {BLAS}; print(blas.loaded_library())"
    assert _probe(code) == "None"


@needs_openblas
def test_cores_shared_runs_openblas_on_its_callers_threads_while_any_is_inside():
    import threading

    import mlx.core as mx
    import numpy as np

    pool = blas.threads()
    a = mx.random.normal((384, 384))
    expected = np.array(a @ a)
    inside, out = threading.Event(), threading.Event()

    def other():  # a second thread inside at the same time, leaving last
        with blas.cores_shared():
            inside.set()
            assert out.wait(10)
            assert blas.threads() == 1

    thread = threading.Thread(target=other)
    with blas.cores_shared():
        thread.start()
        assert inside.wait(10) and blas.threads() == 1
        with blas.cores_shared():  # nested
            assert blas.threads() == 1
        assert blas.threads() == 1
        np.testing.assert_allclose(np.array(a @ a), expected, rtol=1e-5, atol=1e-4)
    assert blas.threads() == 1  # the other thread is still inside
    out.set()
    thread.join()
    assert blas.threads() == pool
