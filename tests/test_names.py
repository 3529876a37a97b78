"""Every dotted name the docs and docstrings cite (``agentkv.engine.batch.quantized``,
``agentkv.caches.tiers.CacheTiers``) is one a reader can import: a module of the installed
package, or a name defined in one. Names are written as installed (``agentkv.``), never by
the repo's folders (an ``engine.`` name would not import)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"`{1,2}(agentkv(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?`{1,2}")
BY_FOLDER = re.compile(
    r"(?<![\w.`/])`{1,2}(?:engine|agents|store|server|migrations)\.[A-Za-z_][\w.]*`{1,2}"
)


def sources() -> list[Path]:
    folders = ("engine", "agents", "store", "server", "migrations", "benchmarks", "tests")
    files = [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]
    return [*files, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def resolves(name: str) -> bool:
    """Whether ``name`` is a module, or a module's attribute (or an attribute's)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


FILES = ("sqlite", "json", "py", "safetensors", "md", "toml")
"""Last parts that make a cited name a file's (``agentkv.sqlite``)."""


def test_every_cited_name_imports():
    cited = {
        (name, str(path.relative_to(ROOT)))
        for path in sources()
        for name in CITED.findall(path.read_text())
        if name.rsplit(".", 1)[1] not in FILES
    }
    assert len(cited) > 100  # (the check sees the citations)
    broken = sorted(f"{where}: {name}" for name, where in cited if not resolves(name))
    assert broken == []


def test_names_are_cited_as_installed_not_by_folder():
    found = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in sources()
        for m in BY_FOLDER.finditer(path.read_text())
    ]
    assert found == []
