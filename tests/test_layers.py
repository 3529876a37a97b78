"""The packages' layering, read from their imports: each layer imports only itself and the
layers below, never a peer, and the light entry points import no MLX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Highest first: (layer, the modules it holds). A module belongs to the layer of its longest
# prefix here. Layers of one rank are peers: neither imports the other.
LAYERS: list[list[tuple[str, tuple[str, ...]]]] = [
    [("cli", ("server.cli", "server.__main__"))],
    [("server", ("server",))],
    [("agents", ("agents",))],
    [("cache store", ("agents.caches",))],
    [("kv codec", ("engine.kv",)), ("registry", ("store", "migrations"))],
    [("engine", ("engine",))],
    [("model loading", ("engine.models",))],
    [("errors", ("engine.errors",))],
]


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, layer) of a module of this project (None: not one of ours)."""
    matches = [
        (len(prefix), rank, name)
        for rank, peers in enumerate(LAYERS)
        for name, prefixes in peers
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1:] if matches else None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, those under TYPE_CHECKING and
    inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from engine import errors`` imports the module engine.errors
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


PACKAGES = ["server", "agents", "store", "migrations", "engine"]


def modules() -> list[tuple[str, Path]]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).with_suffix("")
            out.append((".".join(relative.parts).removesuffix(".__init__"), path))
    return out


def wrong_imports(module: str, path: Path) -> list[str]:
    mine = layer_of(module)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    wrong = []
    for line, imported in imports(path):
        theirs = layer_of(imported)
        if theirs is None or theirs == mine:
            continue
        if theirs[0] <= mine[0]:  # a higher layer, or a peer
            wrong.append(f"{where}:{line} ({mine[1]}) imports {imported} ({theirs[1]})")
    return wrong


def test_every_import_goes_down_the_layers():
    assert [w for module, path in modules() for w in wrong_imports(module, path)] == []


def test_every_module_has_a_layer():
    assert [m for m, _ in modules() if layer_of(m) is None] == []


def test_the_error_root_imports_nothing_of_the_project():
    assert [m for _, m in imports(ROOT / "engine" / "errors.py") if layer_of(m) is not None] == []


def test_the_layer_test_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "engine" / "kv" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "from server.app import create_app\n"  # up
        "from store import Registry\n"  # a peer
        "from engine.kv.encoded import FORMAT_VERSION\n"  # its own layer
        "from engine import errors\n"  # down
    )
    found = wrong_imports("engine.kv.bad", bad)
    assert [w.split(" imports ")[1] for w in found] == [
        "server.app (server)",
        "server.app.create_app (server)",
        "store (registry)",
        "store.Registry (registry)",
    ]
    assert layer_of("engine.kv_batch") == (5, "engine")  # a prefix ends at a dot


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
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = [f.relative_to(ROOT) for f in folders if not (f / "__init__.py").exists()]
    assert missing == []


def test_the_lazy_names_of_agents_are_listed_and_importable():
    import agents

    assert set(agents.__all__) <= set(dir(agents))
    assert all(getattr(agents, name) is not None for name in agents.__all__)
