"""A small podman driver for the container tests: every wait bounded, every object labelled and removed by id.

``Engine`` wraps the ``podman`` command with the settings ``deploy/containers/setup-engine.sh``
wrote (``CONTAINERS_CONF``, ``CONTAINERS_STORAGE_CONF``). ``Engine.session(run_id)`` gives a
``Session`` that names what it creates ``onnx-ps-test-<run_id>-...``, labels it
``onnx-ps-test=<run_id>``, and on ``close()`` removes exactly the containers, networks and
volumes it created (by id), so parallel runs and the user's own containers are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "deploy" / "containers"
#: The label on everything a test session creates; its value is the run id.
LABEL = "onnx-ps-test"
#: Longest single podman command (run -d, exec, rm, ...), in seconds.
COMMAND_TIMEOUT = 120.0


class EngineUnavailable(RuntimeError):
    """No usable container engine on this machine; the message says why."""


class EngineError(RuntimeError):
    """A podman command failed or timed out; the message holds the command and its output."""


def in_ci() -> bool:
    """True under CI (CI=true/1/yes), where a missing engine is a failure, not a skip."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def cache_dir() -> Path:
    """Where setup-engine.sh keeps its settings and the base image (the same rule as common.sh)."""
    if os.environ.get("PS_CONTAINER_CACHE"):
        return Path(os.environ["PS_CONTAINER_CACHE"])
    if os.geteuid() == 0:
        return Path("/var/cache/onnx-ps")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onnx-ps"


def read_env_file(path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of a shell env file (export lines and comments skipped)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("export "):
            continue
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip().strip('"')
    return out


@dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class Engine:
    """The podman command with this machine's engine settings."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)

    @classmethod
    def setup(cls, *, timeout: float = 1200.0) -> "Engine":
        """Installs/configures the engine and the base image when needed (root), then checks `podman info`.

        Raises EngineUnavailable with the reason when there is no engine and it cannot be set up.
        """
        env_file = cache_dir() / "engine.env"
        have_podman = shutil.which("podman") is not None
        if os.geteuid() == 0:
            try:
                proc = subprocess.run([str(SCRIPTS / "setup-engine.sh")], capture_output=True, text=True,
                                      timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                raise EngineUnavailable(f"setup-engine.sh did not finish within {timeout:.0f} s") from exc
            if proc.returncode != 0:
                raise EngineUnavailable(f"setup-engine.sh failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        elif not have_podman:
            raise EngineUnavailable("no container engine: podman is not installed and this user is not root, "
                                    "so deploy/containers/setup-engine.sh cannot install it")
        env = dict(os.environ)
        if env_file.is_file():
            env.update(read_env_file(env_file))
        engine = cls(env)
        info = engine.podman("info", "--format", "json", check=False, timeout=60)
        if info.returncode != 0:
            raise EngineUnavailable(f"`podman info` fails here: {info.stderr.strip()[-1000:]}")
        return engine

    def podman(self, *args: str, check: bool = True, timeout: float = COMMAND_TIMEOUT,
               input: str | None = None) -> Result:
        """Runs `podman ARGS` (at most `timeout` s); EngineError on failure when `check`."""
        return self.command(["podman", *args], check=check, timeout=timeout, input=input)

    def command(self, argv: Sequence[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT,
                input: str | None = None, env: Mapping[str, str] | None = None,
                cwd: Path | None = None) -> Result:
        """Runs any command with the engine's environment (plus `env`), bounded by `timeout` seconds."""
        full_env = {**self.env, **(env or {})}
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input,
                                  env=full_env, cwd=cwd)
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"{' '.join(argv)} did not finish within {timeout:.0f} s") from exc
        result = Result(list(argv), proc.returncode, proc.stdout, proc.stderr)
        if check and proc.returncode != 0:
            raise EngineError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return result

    def session(self, run_id: str) -> "Session":
        return Session(self, run_id)


@dataclass
class Session:
    """The containers, networks and volumes of one test run, removed by id on close()."""

    engine: Engine
    run_id: str
    containers: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)

    def name(self, role: str) -> str:
        return f"onnx-ps-test-{self.run_id}-{role}"

    def network(self, role: str = "net") -> str:
        name = self.name(role)
        self.engine.podman("network", "create", "--label", f"{LABEL}={self.run_id}", name)
        self.networks.append(name)
        return name

    def volume(self, role: str) -> str:
        name = self.name(role)
        self.engine.podman("volume", "create", "--label", f"{LABEL}={self.run_id}", name)
        self.volumes.append(name)
        return name

    def run(self, role: str, image: str, args: Sequence[str] = (), *, options: Sequence[str] = (),
            env: Mapping[str, str] | None = None) -> str:
        """Starts a detached container named after `role`; returns its id."""
        argv = ["run", "-d", "--name", self.name(role), "--label", f"{LABEL}={self.run_id}"]
        for key, value in (env or {}).items():
            argv += ["--env", f"{key}={value}"]
        argv += [*options, image, *args]
        cid = self.engine.podman(*argv).stdout.strip().splitlines()[-1]
        self.containers.append(cid)
        return cid

    def adopt_labelled(self, label: str, value: str) -> None:
        """Records (for removal) the containers another tool created with label=value, e.g. podman-compose's."""
        out = self.engine.podman("ps", "-a", "--filter", f"label={label}={value}", "--format", "{{.ID}}").stdout
        for cid in out.split():
            if cid not in self.containers:
                self.containers.append(cid)

    def wait_exit(self, container: str, timeout: float) -> int:
        """The container's exit code once it has stopped; EngineError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.inspect(container)["State"]
            if state["Status"] in ("exited", "stopped"):
                return int(state["ExitCode"])
            if time.monotonic() >= deadline:
                raise EngineError(f"container {container} still {state['Status']} after {timeout:.0f} s; log tail:\n"
                                  f"{self.logs(container)[-3000:]}")
            time.sleep(1.0)

    def wait_healthy(self, container: str, timeout: float, *, probe: Sequence[str] = ("ps-health", "--quiet")) -> None:
        """Runs `probe` in the container until it exits 0 (the shard is SERVING); EngineError after `timeout` s."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.engine.podman("exec", container, *probe, check=False, timeout=30)
            if last.returncode == 0:
                return
            if self.inspect(container)["State"]["Status"] != "running":
                break
            time.sleep(1.0)
        raise EngineError(f"container {container} not healthy within {timeout:.0f} s "
                          f"(probe: {last.stderr.strip() if last else 'not run'}); log tail:\n"
                          f"{self.logs(container)[-3000:]}")

    def inspect(self, container: str) -> dict:
        return json.loads(self.engine.podman("inspect", "--type", "container", container).stdout)[0]

    def logs(self, container: str) -> str:
        result = self.engine.podman("logs", container, check=False)
        return result.stdout + result.stderr

    def stop(self, container: str, *, grace: int = 20) -> int:
        """SIGTERM, SIGKILL after `grace` seconds; returns the exit code."""
        self.engine.podman("stop", "-t", str(grace), container, timeout=grace + 60)
        return int(self.inspect(container)["State"]["ExitCode"])

    def close(self) -> list[str]:
        """Removes what this session created (by id / name); returns the errors, if any."""
        errors = []
        for cid in reversed(self.containers):
            result = self.engine.podman("rm", "-f", "-t", "5", cid, check=False, timeout=90)
            if result.returncode != 0 and "no such container" not in result.stderr.lower():
                errors.append(f"rm {cid}: {result.stderr.strip()}")
        for kind, names in (("network", self.networks), ("volume", self.volumes)):
            for name in reversed(names):
                result = self.engine.podman(kind, "rm", "-f", name, check=False, timeout=60)
                if result.returncode != 0 and "no such" not in result.stderr.lower():
                    errors.append(f"{kind} rm {name}: {result.stderr.strip()}")
        self.containers.clear()
        self.networks.clear()
        self.volumes.clear()
        return errors
