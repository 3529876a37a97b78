"""The packages' shape, read from their files: each layer imports only itself and the layers
below, never a peer; no import cycle, not even one for type hints; no module past
:data:`MAX_LINES` but those named with a reason; one installed name, ``agentkv``; and the light
entry points import no MLX."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {  # the repo's folders and the names they install as
    "server": "agentkv.server",
    "agents": "agentkv",
    "store": "agentkv.store",
    "migrations": "agentkv.migrations",
    "engine": "agentkv.engine",
}
# Highest first: (layer, the modules it holds). A module belongs to the layer of its longest
# prefix here. Layers of one rank are peers: neither imports the other.
LAYERS: list[list[tuple[str, tuple[str, ...]]]] = [
    [("cli", ("agentkv.server.cli",))],
    [("server", ("agentkv.server",))],
    [("agents", ("agentkv",))],
    [("cache store", ("agentkv.caches",))],
    [("kv codec", ("agentkv.engine.kv",)), ("registry", ("agentkv.store", "agentkv.migrations"))],
    [("engine", ("agentkv.engine",))],
    [("model loading", ("agentkv.engine.models",))],
    [("model tooling", ("agentkv.models",))],
    [("errors", ("agentkv.engine.errors",))],
]
MAX_LINES = 400
LONGER = {  # module -> why it stays longer than MAX_LINES
    "agents/runtime.py": "AgentRuntime is the public Python API: one class whose methods and "
    "docstrings are its reference; the work is in turns, chat_turn, conversations and caches",
    "store/registry.py": "Registry is the store's API: one class, one transaction a method; rows "
    "and records convert in records.py, the cache index and leases are classes of their own",
    "demo_full_stack.py": "the demo is one script, read top to bottom beside its output",
    "agents/models/tiny.py": "the tiny models' table of definitions (each architecture's fields) "
    "beside the builder that writes them; the tokenizer and chat formats are modules of their own",
}


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
            # ``from agentkv.engine import errors`` imports the module agentkv.engine.errors
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def modules() -> list[tuple[str, Path]]:
    """(installed name, file) of every module of the packages."""
    out = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            out.append((".".join((package, *parts)).removesuffix(".__init__"), path))
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
        "from agentkv.server.app import create_app\n"  # up
        "from agentkv.store import Registry\n"  # a peer
        "from agentkv.engine.kv.encoded import FORMAT_VERSION\n"  # its own layer
        "from agentkv.engine import errors\n"  # down
    )
    found = wrong_imports("agentkv.engine.kv.bad", bad)
    assert [w.split(" imports ")[1] for w in found] == [
        "agentkv.server.app (server)",
        "agentkv.server.app.create_app (server)",
        "agentkv.store (registry)",
        "agentkv.store.Registry (registry)",
    ]
    assert layer_of("agentkv.engine.kv_batch") == (5, "engine")  # a prefix ends at a dot


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a name imported from a package counts as
    its module when there is one, else the package). A package does not count as importing
    its own modules: its ``__init__`` re-exports them."""
    known = {m for m, _ in modules()}
    graph: dict[str, set[str]] = {}
    for module, path in modules():
        targets = set()
        for _, imported in imports(path):
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != module:
                targets.add(imported)
        if path.name == "__init__.py":
            targets = {t for t in targets if not t.startswith(module + ".")}
        graph[module] = targets
    return graph


def test_no_import_cycle_not_even_one_for_type_hints():
    assert cycles(import_graph()) == []


def test_the_cycle_test_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_cache_file_codec_reads_no_batch_buffer():
    """engine.kv writes and reads the words a layer's scheme names (engine.codes,
    engine.scheme, and how a finished row is packed), never the batch's buffers."""
    buffers = ("buffers", "quantized", "channel", "groups", "layout", "budget")
    banned = tuple(f"agentkv.engine.batch.{m}" for m in buffers)
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for module, path in modules()
        if module.startswith("agentkv.engine.kv")
        for _, name in imports(path)
        if name.startswith(banned)
    ]
    assert found == []


MLX_LM_PRIVATE = re.compile(
    r"\._(idx|offset|temporal_order)\b|\.__class__\s*=[^=]|\bscaled_dot_product_attention\s*=[^=]"
)
"""mlx-lm's private fields agentkv reads and writes, and the patches it makes: only
``agentkv.engine.mlxlm`` does (``tests/test_mlxlm_contract.py`` checks them there)."""


def test_mlx_lms_private_names_and_patches_are_in_the_adapter_only():
    files = [p for _, p in modules()] + [*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    allowed = {ROOT / "engine" / "mlxlm.py", ROOT / "tests" / "test_mlxlm_contract.py"}
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        if path not in allowed and path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if MLX_LM_PRIVATE.search(line.split("#")[0])
    ]
    assert found == []


def test_the_server_reads_the_runtime_through_its_api_not_its_engine():
    """The routes ask the runtime (``AgentRuntime``'s properties and methods), never reach
    through it into the engine it drives."""
    reached = [
        f"{path.relative_to(ROOT)}:{n}"
        for name, path in modules()
        if name.startswith("agentkv.server")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"runtime\.engine\b", line)
    ]
    assert reached == []


def test_the_server_imports_only_public_names():
    """The server builds on what agentkv offers its users: the ``agentkv`` package and its
    runtime's own modules (messages, tool calls, configuration), the registry's package
    (``agentkv.store``, not its modules) and the model tooling (``agentkv.models``), never the
    engine, the cache store or a private name."""
    runtime_modules = {
        f"agentkv.{p.stem}" for p in (ROOT / "agents").glob("*.py") if p.stem != "__init__"
    }

    def public(module: str) -> bool:
        if module.rsplit(".", 1)[-1].startswith("_"):
            return False
        return (
            module in ("agentkv", "agentkv.store", "agentkv.models")
            or module in runtime_modules
            or module.startswith(("agentkv.server.", "agentkv.models."))
        )

    found = []
    for name, path in modules():
        if not name.startswith("agentkv.server"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if not node.module.startswith("agentkv"):
                    continue
                if not public(node.module) or any(a.name.startswith("_") for a in node.names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {targets[0]}")
            elif isinstance(node, ast.Import):
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name.startswith("agentkv") and not public(a.name)
                ]
    assert found == []


def test_no_module_is_longer_than_the_limit_without_a_reason():
    files = [p for _, p in modules()] + [ROOT / "demo_full_stack.py"]
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    assert {f: n for f, n in lengths.items() if n > MAX_LINES and f not in LONGER} == {}
    assert [f for f in LONGER if lengths.get(f, 0) <= MAX_LINES] == []  # no stale reasons


def test_nothing_imports_the_folders_by_their_own_names():
    """The folders install under ``agentkv``: ``import engine`` would be a second copy of the
    module (or, installed beside another project, someone else's)."""
    files = [p for _, p in modules()]
    files += [*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    files.append(ROOT / "demo_full_stack.py")
    bare = [
        f"{p.relative_to(ROOT)}:{line} {name}"
        for p in files
        for line, name in imports(p)
        if name.split(".")[0] in FOLDERS
    ]
    assert bare == []


@pytest.mark.parametrize(
    "statement",
    [
        "import agentkv.store",
        "from agentkv import RuntimeConfig, AgentKVError, EngineConfig",
        "import agentkv.engine.errors, agentkv.engine.kv.encoded, agentkv.engine.config",
    ],
)
def test_light_entry_points_load_no_mlx_and_no_blas(statement):
    code = (
        f"import sys; {statement}; from agentkv.models import blas; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')), "
        "blas.loaded_library())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[] None"


def test_every_folder_of_modules_is_a_package_the_wheel_lists():
    """pyproject lists the packages: a folder without an ``__init__.py``, or one it does not
    list, would be left out of the wheel."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        path.parent
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = [f.relative_to(ROOT) for f in folders if not (f / "__init__.py").exists()]
    assert missing == []
    packages = {m for m, p in modules() if p.name == "__init__.py"}
    assert packages == listed


def test_the_lazy_names_of_agentkv_are_listed_and_importable():
    import agentkv

    assert set(agentkv.__all__) <= set(dir(agentkv))
    assert all(getattr(agentkv, name) is not None for name in agentkv.__all__)
