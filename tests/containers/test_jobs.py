"""Real training jobs in containers: 2 shards and 2 workers, each in its own container, reach >= 0.95 test accuracy.

Three ways the project ships: deploy/compose.yaml under podman-compose; the Kubernetes
manifests' pods (their args, env, job file and security settings) run as podman containers
on a network where the StatefulSet's DNS names resolve; and the TFJob's replicas, each
given the TF_CONFIG the Kubeflow operator would write. No Kubernetes API server is
reachable here, so Kubernetes itself is not in the loop: the pods are.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.containers.engine import REPO_ROOT, Engine, Session
from tests.containers.test_manifests import by_kind, k8s_documents, tfjob_documents

pytestmark = pytest.mark.timeout(1800)

MIN_ACCURACY = 0.95
#: Longest wait for a whole training job (300 sync steps of the MLP take ~20 s on 2 cores).
JOB_TIMEOUT = 600.0
SHARD_READY_TIMEOUT = 120.0
GRPC_PORT = 50051
DONE_LINE = re.compile(r"worker 0 done at step (\d+):.*test accuracy ([0-9.]+)")


def final_accuracy(log: str) -> float:
    """Worker 0's final test accuracy from its text report (`worker 0 done at step N: ...; test accuracy A`)."""
    match = DONE_LINE.search(log)
    assert match, f"worker 0 reported no final accuracy; log tail:\n{log[-3000:]}"
    return float(match.group(2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def substitute(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def pod_options(containers: Session, pod_spec: dict[str, Any], container: dict[str, Any], *, network: str,
                alias: str, job_file: Path, volumes: dict[str, str]) -> list[str]:
    """podman run options that give a container what its pod spec says: user, read-only root, mounts, network name.

    A volume claim is the podman volume `volumes` names for it; an emptyDir is a tmpfs at
    /tmp and a fresh podman volume elsewhere (podman gives a tmpfs over an image directory
    that directory's owner and mode, where Kubernetes makes an emptyDir world-writable).
    """
    security = pod_spec.get("securityContext", {})
    options = ["--network", network, "--network-alias", alias,
               "--user", f"{security.get('runAsUser', 10001)}:{security.get('runAsGroup', 10001)}"]
    if container.get("securityContext", {}).get("readOnlyRootFilesystem"):
        options.append("--read-only")
    if container.get("securityContext", {}).get("capabilities", {}).get("drop") == ["ALL"]:
        options += ["--cap-drop", "ALL"]
    pod_volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        source = pod_volumes.get(mount["name"], {})
        if "configMap" in source:
            options += ["-v", f"{job_file}:{mount['mountPath']}:ro"]
        elif "emptyDir" in source and mount["mountPath"] == "/tmp":
            options += ["--tmpfs", "/tmp:rw,mode=1777"]
        elif "emptyDir" in source:
            volume = containers.volume(f"{alias}-{mount['name']}")
            options += ["-v", f"{volume}:{mount['mountPath']}"]
        elif mount["name"] in volumes:   # a volume claim: a podman volume
            options += ["-v", f"{volumes[mount['name']]}:{mount['mountPath']}"]
        # the optional TLS Secret is left out, as Kubernetes does when it does not exist
    return options


def run_workers_to_the_end(containers: Session, workers: list[str]) -> list[str]:
    """Waits for every worker container to exit 0; returns their logs."""
    logs = []
    for worker in workers:
        code = containers.wait_exit(worker, timeout=JOB_TIMEOUT)
        log = containers.logs(worker)
        assert code == 0, f"worker container {worker} exited {code}:\n{log[-3000:]}"
        logs.append(log)
    return logs


# ------------------------------------------------------------------------- compose

def test_compose_job_trains_the_mlp_to_95_percent(engine: Engine, image: str, containers: Session, tool) -> None:
    compose = tool("podman-compose")
    project = f"onnx-ps-test-{containers.run_id}"
    metrics = [free_port(), free_port()]
    env = {"ONNX_PS_IMAGE": image, "PS_METRICS_PORT_0": str(metrics[0]), "PS_METRICS_PORT_1": str(metrics[1])}
    base = [compose, "-p", project, "-f", str(REPO_ROOT / "deploy" / "compose.yaml")]
    try:
        started = time.monotonic()
        up = engine.command([*base, "up", "-d"], env=env, check=False, timeout=300)
        containers.adopt_labelled("io.podman.compose.project", project)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
        ids = {name: engine.podman("ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
                                   "--filter", f"label=io.podman.compose.service={name}", "--format", "{{.ID}}"
                                   ).stdout.split()[0]
               for name in ("shard-0", "shard-1", "worker-0", "worker-1")}
        for shard in ("shard-0", "shard-1"):
            containers.wait_healthy(ids[shard], timeout=SHARD_READY_TIMEOUT)
        logs = run_workers_to_the_end(containers, [ids["worker-0"], ids["worker-1"]])
        seconds = time.monotonic() - started
        accuracy = final_accuracy(logs[0])
        print(f"\ncompose job: test accuracy {accuracy:.4f} in {seconds:.0f} s (up to the workers' exit)")
        assert accuracy >= MIN_ACCURACY
        # The published metrics port and the checkpoint volume of each shard.
        for i, port in enumerate(metrics):
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert f'shard="{i}"' in body and "ps_pushes_total" in body
            listing = engine.podman("exec", ids[f"shard-{i}"], "ls", f"/var/lib/onnx-ps/checkpoints/shard-{i}").stdout
            assert re.search(r"ckpt-\d+\.safetensors", listing), listing
        health = engine.podman("healthcheck", "run", ids["shard-0"], check=False)
        assert health.returncode == 0, health.stderr
    finally:
        down = engine.command([*base, "down", "-v", "-t", "10"], env=env, check=False, timeout=300)
        containers.adopt_labelled("io.podman.compose.project", project)   # whatever `down` left: removed by id
        assert down.returncode == 0, down.stderr[-2000:]


# ------------------------------------------------------------------------- Kubernetes pods

def test_kubernetes_pods_train_the_mlp_to_95_percent(containers: Session, image: str, tmp_path: Path) -> None:
    docs = k8s_documents()
    sts, job, configmap = by_kind(docs, "StatefulSet"), by_kind(docs, "Job"), by_kind(docs, "ConfigMap")
    job_file = tmp_path / "job.toml"
    job_file.write_text(configmap["data"]["job.toml"])
    job_file.chmod(0o644)
    network = containers.network()
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    shards = []
    for i in range(sts["spec"]["replicas"]):
        claim = containers.volume(f"checkpoints-{name}-{i}")
        options = pod_options(containers, pod, container, network=network, alias=f"{name}-{i}.{service}",
                              job_file=job_file, volumes={"checkpoints": claim})
        args = substitute(container["args"], {"PS_SHARD_INDEX": str(i)})
        shards.append(containers.run(f"{name}-{i}", image, args, options=options))
    for shard in shards:   # the readiness probe: grpc.health.v1 on the container port
        containers.wait_healthy(shard, timeout=SHARD_READY_TIMEOUT, probe=("ps-health", f"127.0.0.1:{GRPC_PORT}"))
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    workers = []
    started = time.monotonic()
    for i in range(job["spec"]["completions"]):
        options = pod_options(containers, pod, container, network=network,
                              alias=f"{job['metadata']['name']}-{i}", job_file=job_file, volumes={})
        args = substitute(container["args"], {"PS_WORKER_INDEX": str(i)})
        workers.append(containers.run(f"{job['metadata']['name']}-{i}", image, args,
                                      options=[*options, "--no-healthcheck"]))
    logs = run_workers_to_the_end(containers, workers)
    accuracy = final_accuracy(logs[0])
    print(f"\nKubernetes pods: test accuracy {accuracy:.4f} in {time.monotonic() - started:.0f} s")
    assert accuracy >= MIN_ACCURACY
    # A shard pod that restarts comes back from the checkpoint on its volume.
    assert containers.stop(shards[1], grace=20) == 0
    containers.engine.podman("start", shards[1])
    containers.wait_healthy(shards[1], timeout=SHARD_READY_TIMEOUT, probe=("ps-health", f"127.0.0.1:{GRPC_PORT}"))
    assert re.search(r"shard 1 restored from \S+: step 300\b", containers.logs(shards[1])), \
        containers.logs(shards[1])[-3000:]


# ------------------------------------------------------------------------- TFJob replicas

def test_tfjob_replicas_train_the_mlp_from_tf_config(containers: Session, image: str, tmp_path: Path) -> None:
    tfjob, configmap = tfjob_documents()
    job_file = tmp_path / "job.toml"
    job_file.write_text(configmap["data"]["job.toml"])
    job_file.chmod(0o644)
    network = containers.network()
    name = tfjob["metadata"]["name"]
    specs = tfjob["spec"]["tfReplicaSpecs"]

    def port(spec: dict[str, Any]) -> int:
        ports = spec["template"]["spec"]["containers"][0]["ports"]
        return next(p["containerPort"] for p in ports if p["name"] == "tfjob-port")

    # What the training operator writes: every replica's service name and tfjob-port.
    cluster = {kind.lower(): [f"{name}-{kind.lower()}-{i}:{port(spec)}" for i in range(spec["replicas"])]
               for kind, spec in specs.items()}
    started: dict[str, list[str]] = {}
    for kind in ("PS", "Worker"):
        spec = specs[kind]
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        for i in range(spec["replicas"]):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": kind.lower(), "index": i}})
            options = pod_options(containers, pod, container, network=network,
                                  alias=f"{name}-{kind.lower()}-{i}", job_file=job_file, volumes={})
            if kind == "Worker":
                options.append("--no-healthcheck")
            started.setdefault(kind, []).append(
                containers.run(f"{kind.lower()}-{i}", image, container["args"], options=options,
                               env={"TF_CONFIG": tf_config}))
        if kind == "PS":
            for shard in started["PS"]:
                containers.wait_healthy(shard, timeout=SHARD_READY_TIMEOUT,
                                        probe=("ps-health", f"127.0.0.1:{port(spec)}"))
    logs = run_workers_to_the_end(containers, started["Worker"])
    accuracy = final_accuracy(logs[0])
    print(f"\nTFJob replicas (TF_CONFIG): test accuracy {accuracy:.4f}")
    assert accuracy >= MIN_ACCURACY
    # The cluster came from TF_CONFIG: worker 0 saw every ps replica as a shard, every worker replica as a worker.
    assert f"on {specs['PS']['replicas']} shard(s), {specs['Worker']['replicas']} worker(s)" in logs[0], logs[0][:2000]

