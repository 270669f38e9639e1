"""The Dockerfiles pass hadolint and follow the image conventions (multi-stage, non-root, health check)."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest

from tests.containers.engine import REPO_ROOT

DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_has_no_hadolint_warnings(tool, name: str) -> None:
    proc = subprocess.run([tool("hadolint"), "--failure-threshold", "warning", name], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"hadolint {name}:\n{proc.stdout}{proc.stderr}"


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = (REPO_ROOT / name).read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_as_non_root_with_a_grpc_health_check(name: str) -> None:
    steps = instructions(name)
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) >= 3, f"{name}: expected dependency, build and runtime stages, got FROM {froms}"
    last_stage = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM"):]
    users = [args for word, args in last_stage if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"{name}: runtime stage USER is {users}"
    health = [args for word, args in last_stage if word == "HEALTHCHECK"]
    assert health and "ps-health" in health[-1], f"{name}: runtime HEALTHCHECK is {health}"
    assert any(word == "ENTRYPOINT" and "ps-entrypoint" in args for word, args in last_stage)


def test_cpu_image_is_built_from_the_standard_python_slim_base() -> None:
    args = dict(a.split("=", 1) for w, a in instructions("Dockerfile") if w == "ARG" and "=" in a)
    assert args.get("PYTHON_IMAGE") == "python:3.11-slim"


def test_dependencies_are_installed_before_the_sources_are_copied() -> None:
    steps = instructions("Dockerfile")
    copy_all = next(i for i, (w, a) in enumerate(steps) if w == "COPY" and a.split()[:2] == [".", "."])
    install = next(i for i, (w, a) in enumerate(steps) if w == "RUN" and "-r requirements.txt" in a)
    assert install < copy_all


def test_build_context_is_an_allow_list() -> None:
    lines = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "the .dockerignore should exclude everything, then allow what the image needs"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    # Every folder the wheel is built from, read from pyproject.toml, so a new package cannot be left out of the
    # image's build context (ps_serve once was: the image's `pip wheel .` failed on its missing folder).
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs = setuptools.get("package-dir", {})
    folders = {package_dirs.get(package.split(".")[0], package.split(".")[0]).split("/")[0]
               for package in setuptools["packages"]}
    for needed in sorted(folders) + ["pyproject.toml", "deploy/containers/entrypoint.sh",
                                     "deploy/containers/requirements.py"]:
        assert needed in allowed, f".dockerignore does not allow {needed}, which the image's wheel is built from"
    assert not {".git", ".venv", "tests"} & allowed


def test_entrypoint_is_posix_shell_and_dispatches_each_role() -> None:
    script = (REPO_ROOT / "deploy" / "containers" / "entrypoint.sh").read_text()
    assert script.startswith("#!/bin/sh\n")
    for role, command in (("server", "ps-server"), ("worker", "ps-worker"), ("health", "ps-health")):
        assert re.search(rf"^\s*{role} \| {command}\)", script, re.M), f"entrypoint has no {role} branch"
    proc = subprocess.run(["sh", "-n", str(REPO_ROOT / "deploy" / "containers" / "entrypoint.sh")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_requirements_swap_onnxruntime_for_the_gpu_package() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("requirements", REPO_ROOT / "deploy/containers/requirements.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    cpu = module.requirements(str(REPO_ROOT / "pyproject.toml"))
    gpu = module.requirements(str(REPO_ROOT / "pyproject.toml"), "onnxruntime-gpu")
    assert any(r.startswith("onnxruntime") and not r.startswith("onnxruntime-gpu") for r in cpu)
    assert not any(re.match(r"onnxruntime(?!-gpu)", r) for r in gpu)
    assert any(r.startswith("onnxruntime-gpu") for r in gpu)
    assert len(cpu) == len(gpu)
