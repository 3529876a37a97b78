"""agentkv installs beside the OpenAI Agents SDK, whichever goes in first.

Both used to install a top-level ``agents`` package: the second install overwrote the first's
``agents/__init__.py``, and uninstalling one deleted the other's. agentkv now installs the one
name ``agentkv``. Here its wheel (built from this checkout) and the SDK's (the version installed
for the tests, fetched from the package index) go into fresh virtual environments in both
orders, without dependencies: the files each leaves must be its own, both must import in one
process (the dependencies come from this environment), and uninstalling the SDK must leave
agentkv whole.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SDK = "openai-agents"


def run(*args: str | Path, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out, source = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("source") / "src"
    skip = shutil.ignore_patterns(".*", "build", "data", "__pycache__", "*.egg-info", "site")
    shutil.copytree(ROOT, source, ignore=skip)  # (a build writes into its source tree)
    pip = [sys.executable, "-m", "pip"]
    run(*pip, "wheel", "--no-deps", "-q", "-w", out, source, timeout=300)
    version = importlib.metadata.version(SDK)
    run(*pip, "download", "--no-deps", "-q", "-d", out, f"{SDK}=={version}", timeout=300)
    found = {w.name.split("-")[0]: w for w in out.glob("*.whl")}
    return {"agentkv": found["agentkv"], SDK: found["openai_agents"]}


def site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def top_level(env: Path, dist: str) -> set[str]:
    """The top-level names a distribution installed into ``env``, from its RECORD."""
    record = next(site_packages(env).glob(f"{dist.replace('-', '_')}-*.dist-info/RECORD"))
    names = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    return {n for n in names if not n.endswith(".dist-info") and n not in ("..", "")}


@pytest.mark.parametrize("first", ["agentkv", SDK])
def test_agentkv_and_the_agents_sdk_install_side_by_side_in_either_order(first, wheels, tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    pip = [env / "bin" / "python", "-m", "pip", "install", "--no-deps", "-q"]
    second = SDK if first == "agentkv" else "agentkv"
    for dist in (first, second):
        run(*pip, wheels[dist], timeout=300)
    assert top_level(env, "agentkv") == {"agentkv"}
    assert "agents" in top_level(env, SDK) and "agentkv" not in top_level(env, SDK)

    # Both in one process, from the new environment (their dependencies from this one).
    probe = (
        "import agents, agentkv, agentkv.engine.errors; "
        "from agents import Agent, Runner; from agentkv import AgentRuntime; "
        "print(agents.__file__); print(agentkv.__file__)"
    )
    paths = {"PYTHONPATH": str(site_packages(env)), "PATH": "/usr/bin:/bin"}
    shown = run(sys.executable, "-c", probe, cwd=tmp_path, env=paths).stdout.split()
    assert all(Path(p).is_relative_to(site_packages(env)) for p in shown), shown

    run(env / "bin" / "python", "-m", "pip", "uninstall", "-y", "-q", SDK, timeout=120)
    assert (site_packages(env) / "agentkv" / "__init__.py").is_file()
    assert not (site_packages(env) / "agents").exists()
    shown = run(
        sys.executable,
        "-c",
        "import agentkv.runtime, agentkv; print(agentkv.__file__)",
        cwd=tmp_path,
        env=paths,
    ).stdout.split()
    assert Path(shown[0]).is_relative_to(site_packages(env))
