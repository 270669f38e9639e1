"""The installed distribution's import names, and which package may import which."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Folder names a user's own project commonly has; none may be an import name of ours.
USER_FOLDER_NAMES = {"models", "protos", "bench", "tests", "tools"}


def top_level_names() -> set[str]:
    text = importlib.metadata.distribution("onnx-ps").read_text("top_level.txt")
    if text is None:
        pytest.fail("the installed onnx-ps distribution has no top_level.txt; rebuild it with `make venv`")
    return set(text.split())


def test_the_distribution_installs_only_the_projects_own_import_names() -> None:
    names = top_level_names()
    assert not names & USER_FOLDER_NAMES, f"top-level names a user's folder would collide with: {names & USER_FOLDER_NAMES}"
    assert names == {"ps_proto", "ps_models", "ps_bench", "ps_common", "ps_server", "ps_tools", "worker_client",
                     "ps_serve"}


def imported_modules(package: Path) -> dict[str, set[str]]:
    """For each .py file under package: the top-level names of the modules it imports (anywhere in the file)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO_ROOT))] = names
    return found


@pytest.mark.parametrize(("package", "forbidden"), [
    ("ps_server", {"worker_client", "ps_tools", "ps_serve"}),
    ("ps_common", {"ps_server", "worker_client", "ps_tools", "ps_serve"}),
    ("worker_client", {"ps_server", "ps_tools", "ps_serve"}),
    # the inference server reads a job as a reader (worker_client's PSClient, ps_tools.export), never a shard's code
    ("ps_serve", {"ps_server"}),
    ("ps_tools", {"ps_serve"}),
])
def test_a_package_imports_nothing_from_the_layers_above_it(package: str, forbidden: set[str]) -> None:
    offenders = {path: sorted(names & forbidden) for path, names in imported_modules(REPO_ROOT / package).items()
                 if names & forbidden}
    assert not offenders, f"{package} must not import {sorted(forbidden)}: {offenders}"


#: The folders that install as packages, and the import name each installs as (pyproject's package-dir).
PACKAGE_ROOTS = {"protos/ps": "ps_proto", "models": "ps_models", "bench": "ps_bench", "ps_common": "ps_common",
                 "ps_server": "ps_server", "worker_client": "worker_client", "ps_tools": "ps_tools",
                 "ps_serve": "ps_serve"}


def test_every_package_folder_is_listed_in_pyproject_so_the_wheel_carries_it() -> None:
    import tomllib

    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for folder, name in PACKAGE_ROOTS.items():
        for init in (REPO_ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO_ROOT / folder).parts
            on_disk.add(".".join((name, *relative)))
    assert on_disk - listed == set(), "packages missing from pyproject.toml [tool.setuptools] packages"
    assert listed - on_disk == set(), "pyproject.toml lists packages that have no folder"
