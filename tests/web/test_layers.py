"""web/ reaches data only through app.services: no database, table, backend or GPU-runtime imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WEB = Path(__file__).resolve().parents[2] / "web"
FORBIDDEN = ("app.db", "app.tables", "app.backends", "sqlalchemy", "gpu_runtime", "torch")


def runtime_imports(path: Path) -> list[str]:
    """Modules `path` imports when it runs (imports under `if TYPE_CHECKING:` are for annotations only)."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
               for node in ast.walk(block)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted(WEB.glob("*.py")), ids=lambda p: p.name)
def test_web_module_stays_off_the_database_and_backends(path: Path) -> None:
    bad = [name for name in runtime_imports(path) if name.startswith(FORBIDDEN)]
    assert bad == []
