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
