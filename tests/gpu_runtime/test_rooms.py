"""The runtime's three rooms (docs/ARCHITECTURE.md) and the layers around them, read from the source's own imports:
no import cycle anywhere (type-only imports included), `app` reaches the runtime only through its contract, its
client and its errors, `client` stays torch-free and beneath the engine, and `compute` never imports `engine`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "gpu_runtime", "rewardsignal", "web")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "rewardsignal" and len(parts) > 1 and parts[1] == "rewardsignal":
        parts = parts[1:]  # the SDK's own distribution: rewardsignal/rewardsignal/…
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "build" in path.parts or "tests" in path.relative_to(ROOT).parts[1:]:
                continue
            found[module_name(path)] = path
    return found


MODULES = sources()


def imports_of(name: str, path: Path) -> set[str]:
    """Every project module `name` imports, anywhere in its body (inside functions and `if TYPE_CHECKING:` too):
    `from a.b import c` is a.b.c when that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_the_walk_sees_the_rooms() -> None:
    assert {"gpu_runtime.engine.engine", "gpu_runtime.compute.lora.layer", "gpu_runtime.client.runtime_client",
            "app.server", "rewardsignal.sync_client"} <= set(MODULES)
    assert "gpu_runtime.compute.pool" in GRAPH["gpu_runtime.engine.residency"]


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a cycle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for child in GRAPH.get(node, ()):
            # A package's __init__ is imported with each of its modules; only its own imports count here.
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_type_only_included() -> None:
    assert cycles() == []


@pytest.mark.parametrize(("room", "may_import"), [
    ("app", ("app", "web", "gpu_runtime.contract", "gpu_runtime.client", "gpu_runtime.errors", "rewardsignal",
             "gpu_runtime")),
    ("web", ("web", "app", "gpu_runtime.contract", "gpu_runtime.errors", "gpu_runtime")),
    ("gpu_runtime.client", ("gpu_runtime.client", "gpu_runtime.contract", "gpu_runtime.errors", "gpu_runtime")),
    ("gpu_runtime.contract", ("gpu_runtime.contract", "gpu_runtime.errors", "gpu_runtime")),
    ("gpu_runtime.compute", ("gpu_runtime.compute", "gpu_runtime.client", "gpu_runtime.contract", "gpu_runtime.errors",
                             "gpu_runtime")),
    ("gpu_runtime.engine", ("gpu_runtime.engine", "gpu_runtime.compute", "gpu_runtime.client", "gpu_runtime.contract",
                            "gpu_runtime.errors", "gpu_runtime")),
    ("rewardsignal", ("rewardsignal",)),
], ids=["app", "web", "client", "contract", "compute-never-engine", "engine", "sdk"])
def test_each_room_imports_only_what_it_may(room: str, may_import: tuple[str, ...]) -> None:
    def allowed(target: str) -> bool:
        # "gpu_runtime" alone is the package's empty __init__, which every submodule import passes through.
        return any(target == a if a == "gpu_runtime" else in_room(target, a) for a in may_import)

    offenders = {name: sorted(t for t in targets if not allowed(t))
                 for name, targets in GRAPH.items() if in_room(name, room)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_server_side_of_the_runtime_imports_no_torch() -> None:
    code = ("import sys\nimport gpu_runtime.client.runtime_client, gpu_runtime.client.persistence, "
            "gpu_runtime.client.run_files, gpu_runtime.client.modal_names, gpu_runtime.contract\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)\nassert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


WIRES = ("app.openai", "app.tinker", "app.schema")


@pytest.mark.parametrize("wire", WIRES)
def test_no_wire_imports_another(wire: str) -> None:
    """Each wire (/v1, /api/v1, GraphQL) stands on app/services alone: what two wires share (bearer parsing, tinker://
    paths) lives below them, in app/security.py and app/services/."""
    others = [other for other in WIRES if other != wire]
    offenders = {name: sorted(t for t in targets if any(in_room(t, other) for other in others))
                 for name, targets in GRAPH.items() if in_room(name, wire)}
    assert {k: v for k, v in offenders.items() if v} == {}
