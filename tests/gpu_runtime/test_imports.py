"""gpu_runtime stays off the web stack; what the server imports from it stays off torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpu_runtime"
WEB_STACK = {"starlette", "strawberry", "sqlalchemy", "app", "web", "uvicorn", "alembic"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_gpu_runtime_imports_nothing_from_the_web_stack() -> None:
    sources = sorted(PACKAGE.rglob("*.py"))
    assert sources
    offenders = {str(p.relative_to(PACKAGE)): imported_modules(p) & WEB_STACK for p in sources}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_package_init_is_light() -> None:
    assert imported_modules(PACKAGE / "__init__.py") <= {"__future__"}


def test_worker_client_and_errors_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import gpu_runtime.client.runtime_client, gpu_runtime.errors, gpu_runtime.client.protocol, gpu_runtime.client.allocation\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'numpy', 'safetensors') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
