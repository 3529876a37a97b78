"""The packages' layering, read from their imports: each imports only its own layer and the
ones below (server -> agents -> store -> engine -> engine.errors), and the light entry points
import no MLX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Highest first. engine.errors is the root of every package's errors: it imports nothing.
LAYERS = ["server", "agents", "store", "engine", "engine.errors"]
PACKAGES = {"server": "server", "agents": "agents", "store": "store", "migrations": "store"}


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a module of this project (None: not one of ours)."""
    if module == "engine.errors":
        return LAYERS.index("engine.errors")
    top = module.split(".")[0]
    if top == "engine":
        return LAYERS.index("engine")
    return LAYERS.index(PACKAGES[top]) if top in PACKAGES else None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, those under TYPE_CHECKING included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from engine import errors`` imports the module engine.errors
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def modules() -> list[tuple[str, Path]]:
    out = []
    for package in ["server", "agents", "store", "migrations", "engine"]:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).with_suffix("")
            out.append((".".join(relative.parts).removesuffix(".__init__"), path))
    return out


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, path in modules():
        mine = layer_of(module)
        for line, imported in imports(path):
            theirs = layer_of(imported)
            if theirs is None or imported.split(".")[0] == module.split(".")[0]:
                continue
            if theirs < mine:
                where = f"{path.relative_to(ROOT)}:{line}"
                wrong.append(f"{where} ({LAYERS[mine]}) imports {imported} ({LAYERS[theirs]})")
    assert wrong == []


def test_the_error_root_imports_nothing_of_the_project():
    assert [m for _, m in imports(ROOT / "engine" / "errors.py") if layer_of(m) is not None] == []


def test_the_layer_test_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from server.app import create_app\nfrom engine import errors\n")
    assert [layer_of(m) for _, m in imports(bad)] == [0, 0, 3, 4]


@pytest.mark.parametrize(
    "statement",
    [
        "import store",
        "from agents import RuntimeConfig, AgentKVError, EngineConfig",
        "import engine.errors, engine.kv.encoded, engine.config",
    ],
)
def test_light_entry_points_load_no_mlx_and_no_blas(statement):
    code = (
        f"import sys; {statement}; from engine.models import blas; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')), "
        "blas.loaded_library())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[] None"


def test_every_folder_of_modules_is_a_package():
    """pyproject finds packages by their __init__.py: a folder without one would be left out
    of the wheel."""
    folders = {
        path.parent
        for package in PACKAGES.keys() | {"engine"}
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = [f.relative_to(ROOT) for f in folders if not (f / "__init__.py").exists()]
    assert missing == []


def test_the_lazy_names_of_agents_are_listed_and_importable():
    import agents

    assert set(agents.__all__) <= set(dir(agents))
    assert all(getattr(agents, name) is not None for name in agents.__all__)
