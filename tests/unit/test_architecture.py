"""The shape of the code: no import circle anywhere, no generic import name, and a shard domain that knows
no wire type (docs/architecture.md). Which package may import which: test_package_layout.py."""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]

#: Folder -> the import name it installs as (pyproject.toml's package-dir and packages).
PACKAGES = {
    "ps_common": "ps_common",
    "ps_server": "ps_server",
    "worker_client": "worker_client",
    "ps_tools": "ps_tools",
    "ps_serve": "ps_serve",
    "protos/ps": "ps_proto",
    "models": "ps_models",
    "bench": "ps_bench",
}

#: Import names that a user's own code commonly has: nothing of ours may be imported by them.
GENERIC_NAMES = {"models", "protos", "bench"}


def _modules() -> dict[str, Path]:
    """Every project module by its installed dotted name."""
    found: dict[str, Path] = {}
    for folder, name in PACKAGES.items():
        base = ROOT / folder
        if not base.is_dir():
            continue
        for path in base.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(base).with_suffix("")
            parts = [name, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module name imported anywhere in a file (top level or inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _project_edges() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from package import name` counts when name is a module)."""
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges[module] = {name for name in _imports(path) if name in MODULES and name != module}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_project_has_no_import_circle() -> None:
    edges = _project_edges()
    # A package __init__ that re-exports its children is an index, not a dependency: drop package -> child edges.
    for module in edges:
        edges[module] = {w for w in edges[module] if not w.startswith(module + ".")}
    assert _cycles(edges) == []


def test_no_project_module_imports_a_generic_top_level_name() -> None:
    offenders = sorted(f"{module} imports {name}" for module, path in MODULES.items()
                       for name in _imports(path) if name.split(".")[0] in GENERIC_NAMES)
    assert offenders == []


def test_the_domain_modules_of_the_shard_know_no_wire_types() -> None:
    domain = ["ps_server.shard", "ps_server.consistency", "ps_server.store", "ps_server.membership",
              "ps_server.barrier", "ps_server.optimizers", "ps_server.events"]
    offenders = sorted(f"{module} imports {name}" for module in domain for name in _imports(MODULES[module])
                       if name.startswith(("ps_proto", "grpc")))
    assert offenders == []
