"""Compose file and Kubernetes manifests: valid, consistent with each other, holding job files the commands accept."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests.containers.conftest import unavailable
from tests.containers.engine import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.29.0"
GRPC_PORT = 50051


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    try:
        import yaml
    except ImportError:
        unavailable("PyYAML is not installed (kubernetes-validate in the test extras brings it)")
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def k8s_documents() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in load_yaml_documents(path)]


def server_config(path: Path, *flags: str, env: dict[str, str] | None = None):
    """What ps-server makes of this job file and flags (raises the command's own error for a bad setting)."""
    from ps_common import jobconfig
    from ps_server import cli

    args = cli.build_parser().parse_args(["--config", str(path), *flags])
    return cli.server_config(jobconfig.load_config(args, scope="server", env=env or {}))


def worker_job(path: Path, *flags: str, env: dict[str, str] | None = None):
    """What ps-worker makes of this job file and flags."""
    from ps_common import jobconfig
    from worker_client import cli

    args = cli.build_parser().parse_args(["--config", str(path), *flags])
    return jobconfig.load_config(args, scope="worker", env=env or {})


def write_temp(text: str) -> Path:
    f = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    with f:
        f.write(text)
    return Path(f.name)


# ------------------------------------------------------------------------- compose

def test_compose_file_is_valid_against_the_compose_spec(tool) -> None:
    proc = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                           str(DEPLOY / "compose.yaml")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_runs_two_shards_and_two_workers_with_checkpoints_and_metrics() -> None:
    compose = load_yaml_documents(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    shards = sorted(name for name, s in services.items() if s["command"][0] == "server")
    workers = sorted(name for name, s in services.items() if s["command"][0] == "worker")
    assert shards == ["shard-0", "shard-1"] and workers == ["worker-0", "worker-1"]
    for i, name in enumerate(shards):
        command = services[name]["command"]
        assert command[command.index("--shard-index") + 1] == str(i)
        assert any(str(v).startswith("checkpoints:") for v in services[name]["volumes"])
        assert any(str(p).endswith(":9464") for p in services[name]["ports"])
    for i, name in enumerate(workers):
        command = services[name]["command"]
        assert command[command.index("--worker-index") + 1] == str(i)
        assert services[name]["healthcheck"] == {"disable": True}
    assert "checkpoints" in compose["volumes"]


def test_compose_job_file_is_accepted_by_the_shards_and_workers() -> None:
    job_file = DEPLOY / "job.toml"
    for i in range(2):
        config = server_config(job_file, "--shard-index", str(i), "--host", "0.0.0.0", "--port", str(GRPC_PORT))
        assert (config.num_shards, config.mode, config.metrics_port) == (2, "sync", 9464)
        assert config.replicas_to_aggregate == 2 and config.total_replicas == 2
    job = worker_job(job_file, "--worker-index", "1")
    assert job.worker.servers == [f"shard-{i}:{GRPC_PORT}" for i in range(2)]
    assert (job.worker.model, job.worker.data, job.job.workers) == ("mlp", "digits", 2)


# ------------------------------------------------------------------------- Kubernetes

def test_kubernetes_manifests_are_valid_for_1_29_strict(tool) -> None:
    files = [str(p) for p in sorted(K8S.glob("*.yaml"))]
    assert len(files) >= 4
    proc = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, *files],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "WARN" not in out and "ERROR" not in out, out


def test_shards_are_a_statefulset_behind_a_headless_service_with_grpc_probes() -> None:
    docs = k8s_documents()
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "onnx-ps-shard")
    sts = by_kind(docs, "StatefulSet")
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    container = sts["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == GRPC_PORT, probe
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert "checkpoints" in claims
    checkpoint_dir = container["args"][container["args"].index("--checkpoint-dir") + 1]
    assert mounts["checkpoints"] == checkpoint_dir
    assert container["args"][container["args"].index("--shard-index") + 1] == "$(PS_SHARD_INDEX)"
    env = {e["name"]: e for e in container["env"]}
    assert env["PS_SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_workers_are_an_indexed_job_sized_like_the_job_file() -> None:
    docs = k8s_documents()
    job = by_kind(docs, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--worker-index") + 1] == "$(PS_WORKER_INDEX)"
    env = {e["name"]: e for e in container["env"]}
    assert env["PS_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    sts = by_kind(docs, "StatefulSet")
    configmap = by_kind(docs, "ConfigMap")
    job_file = write_temp(configmap["data"]["job.toml"])
    try:
        shard = server_config(job_file, "--shard-index", "1", "--host", "0.0.0.0", "--port", str(GRPC_PORT))
        worker = worker_job(job_file, "--worker-index", "1")
    finally:
        job_file.unlink()
    assert sts["spec"]["replicas"] == shard.num_shards
    assert spec["completions"] == spec["parallelism"] == worker.job.workers
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert worker.worker.servers == [f"{name}-{i}.{service}:{GRPC_PORT}" for i in range(shard.num_shards)]


def test_tls_secret_is_a_documented_placeholder_mounted_optionally() -> None:
    docs = k8s_documents()
    secret = by_kind(docs, "Secret")
    assert set(secret["stringData"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert all("PLACEHOLDER" in value for value in secret["stringData"].values())
    for kind in ("StatefulSet", "Job"):
        volumes = {v["name"]: v for v in by_kind(docs, kind)["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"] == {**volumes["tls"]["secret"], "secretName": "onnx-ps-tls",
                                            "optional": True}


# ------------------------------------------------------------------------- TFJob (a CRD)

#: The parts of the kubeflow.org/v1 TFJob CRD (training-operator) this example uses; the
#: CRD's own schema is not available offline, so its pod templates are validated as
#: PodTemplates against the Kubernetes schemas instead (test below).
TFJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "TFJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["tfReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "enableDynamicWorker": {"type": "boolean"},
                "successPolicy": {"type": "string"},
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "cleanPodPolicy": {"enum": ["None", "Running", "All"]},
                        "schedulingPolicy": {"type": "object"},
                        "suspend": {"type": "boolean"},
                        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                    },
                },
                "tfReplicaSpecs": {
                    "type": "object",
                    "propertyNames": {"enum": ["Chief", "Master", "PS", "Worker", "Evaluator"]},
                    "additionalProperties": {
                        "type": "object",
                        "required": ["template"],
                        "additionalProperties": False,
                        "properties": {
                            "replicas": {"type": "integer", "minimum": 0},
                            "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
                            "template": {"type": "object", "required": ["spec"]},
                        },
                    },
                },
            },
        },
    },
}


def tfjob_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = load_yaml_documents(K8S / "tfjob" / "tfjob.yaml")
    return by_kind(docs, "TFJob"), by_kind(docs, "ConfigMap")


def test_tfjob_matches_the_tfjob_crd_fields() -> None:
    try:
        import jsonschema
    except ImportError:
        unavailable("jsonschema is not installed (check-jsonschema in the test extras brings it)")
    tfjob, _ = tfjob_documents()
    jsonschema.validate(tfjob, TFJOB_SCHEMA)
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"PS", "Worker"}
    for role, spec in specs.items():
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "tensorflow", f"{role}: the operator only wires the 'tensorflow' container"
        assert any(p["name"] == "tfjob-port" and p["containerPort"] == GRPC_PORT for p in container["ports"])
        assert container["args"][0] == {"PS": "server", "Worker": "worker"}[role]


def test_tfjob_pod_templates_and_configmap_are_valid_kubernetes_objects(tool, tmp_path: Path) -> None:
    import yaml

    tfjob, configmap = tfjob_documents()
    objects = [configmap]
    for role, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        template = json.loads(json.dumps(spec["template"]))
        template.setdefault("metadata", {})["labels"] = {"replica-type": role.lower()}
        template["spec"]["restartPolicy"] = spec["restartPolicy"]   # the operator copies it into the pod
        objects.append({"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{tfjob['metadata']['name']}-{role.lower()}"}, "template": template})
    path = tmp_path / "tfjob-parts.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    proc = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(path)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WARN" not in out and "ERROR" not in out, out


def test_tfjob_job_file_leaves_the_cluster_to_tf_config() -> None:
    tfjob, configmap = tfjob_documents()
    specs = tfjob["spec"]["tfReplicaSpecs"]
    name = tfjob["metadata"]["name"]
    cluster = {kind.lower(): [f"{name}-{kind.lower()}-{i}.default.svc:{GRPC_PORT}" for i in range(spec["replicas"])]
               for kind, spec in specs.items()}
    job_file = write_temp(configmap["data"]["job.toml"])
    try:
        for i in range(specs["PS"]["replicas"]):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "ps", "index": i}})
            shard = server_config(job_file, env={"TF_CONFIG": tf_config})
            assert (shard.shard_index, shard.num_shards, shard.host, shard.port) == \
                (i, specs["PS"]["replicas"], "0.0.0.0", GRPC_PORT)
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})
        worker = worker_job(job_file, env={"TF_CONFIG": tf_config})
    finally:
        job_file.unlink()
    assert worker.worker.index == 1 and worker.job.workers == specs["Worker"]["replicas"]
    assert worker.worker.servers == cluster["ps"]


# ------------------------------------------------------------------------- replicated shards on Kubernetes

REPLICATED = K8S / "replicated"


def test_replicated_shard_manifests_are_valid_for_1_29_strict(tool) -> None:
    files = [str(p) for p in sorted(REPLICATED.glob("*.yaml"))]
    assert len(files) == 2
    proc = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, *files],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WARN" not in out and "ERROR" not in out, out


def test_each_replicated_pod_is_its_ordinals_replica_of_its_shard_and_the_job_file_agrees(tmp_path: Path) -> None:
    """The StatefulSet's start script, run by sh for every ordinal with ps-entrypoint replaced by a recorder: each
    pod gets its shard, replica, its shard's replicas and every voter, and ps-server accepts those flags with
    the ConfigMap's job file; the workers' servers list the same replicas per shard."""
    docs = [d for path in sorted(REPLICATED.glob("*.yaml")) for d in load_yaml_documents(path)]
    sts = by_kind(docs, "StatefulSet")
    job_toml = by_kind(docs, "ConfigMap")["data"]["job.toml"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    shards, replicas = int(env["PS_SHARDS"]), int(env["PS_SHARD_REPLICAS"])
    assert sts["spec"]["replicas"] == shards * replicas
    (tmp_path / "ps-entrypoint").write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    (tmp_path / "ps-entrypoint").chmod(0o755)
    job_file = tmp_path / "job.toml"
    job_file.write_text(job_toml)
    groups = []
    for ordinal in range(shards * replicas):
        proc = subprocess.run(["/bin/sh", "-c", container["args"][0]], capture_output=True, text=True, timeout=30,
                              env={"PATH": f"{tmp_path}:/usr/bin:/bin", "PS_POD_INDEX": str(ordinal),
                                   "PS_SHARDS": str(shards), "PS_SHARD_REPLICAS": str(replicas)})
        assert proc.returncode == 0, proc.stderr
        argv = proc.stdout.splitlines()
        assert argv[0] == "server"
        flags = argv[1:]
        flags[flags.index("--config") + 1] = str(job_file)
        config = server_config(job_file, *flags[2:])
        assert (config.shard_index, config.replica_index) == (ordinal // replicas, ordinal % replicas)
        assert config.replicas[config.replica_index] == f"onnx-ps-shard-{ordinal}.onnx-ps-shard:{GRPC_PORT}"
        assert list(config.voters) == [f"onnx-ps-shard-{i}.onnx-ps-shard:{GRPC_PORT}" for i in range(shards * replicas)]
        assert config.num_shards == shards
        groups.append("|".join(config.replicas))
    job = worker_job(job_file, "--worker-index", "0")
    assert job.worker.servers == list(dict.fromkeys(groups))
