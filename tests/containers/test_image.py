"""The CPU image built from this checkout: unprivileged, one image for every role, healthy shards, clean stops."""

from __future__ import annotations

import json

import pytest

from tests.containers.engine import Engine, Session

pytestmark = pytest.mark.timeout(1800)   # the first test also builds the image (minutes on a fresh machine)

#: A guard against an accidental heavy layer (a copied venv twice, a pip cache, the build context).
MAX_IMAGE_BYTES = 700 * 1024 * 1024


def test_image_runs_as_an_unprivileged_user(engine: Engine, image: str) -> None:
    result = engine.podman("run", "--rm", "--no-healthcheck", "--entrypoint", "id", image)
    assert result.stdout.startswith("uid=10001"), result.stdout
    assert "(root)" not in result.stdout


@pytest.mark.parametrize("role, program", [("server", "ps-server"), ("worker", "ps-worker"), ("health", "ps-health")])
def test_image_entrypoint_runs_each_role(engine: Engine, image: str, role: str, program: str) -> None:
    result = engine.podman("run", "--rm", "--no-healthcheck", image, role, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: {program}"), result.stdout[:200]


def test_image_is_a_slim_runtime(engine: Engine, image: str) -> None:
    size = int(engine.podman("image", "inspect", "--format", "{{.Size}}", image).stdout)
    print(f"\nimage {image}: {size / 1e6:.0f} MB")
    assert size < MAX_IMAGE_BYTES
    listing = engine.podman("run", "--rm", "--no-healthcheck", "--entrypoint", "sh", image, "-c",
                            "ls /opt/onnx-ps/bin; ls /src /wheels /tmp/wheels 2>&1; true").stdout
    assert "ps-server" in listing and "ps-worker" in listing
    assert "\npip\n" not in f"\n{listing}\n", "the runtime environment should not carry pip"
    assert "No such file" in listing   # no build context, no wheels left behind


def test_default_server_refuses_plaintext_on_all_interfaces(containers: Session, image: str) -> None:
    shard = containers.run("plain", image, ["server"], options=["--no-healthcheck"])
    assert containers.wait_exit(shard, timeout=60) == 2
    assert "refusing to serve plaintext" in containers.logs(shard)


def test_shard_container_turns_healthy_and_stops_cleanly_on_sigterm(containers: Session, image: str) -> None:
    shard = containers.run("shard", image, ["server", "--insecure"])
    # The image's own HEALTHCHECK (ps-health against 127.0.0.1:50051), run by the engine.
    containers.wait_healthy(shard, timeout=60, probe=("ps-health", "--quiet"))
    health = containers.engine.podman("healthcheck", "run", shard, check=False)
    assert health.returncode == 0, health.stdout + health.stderr
    logs = containers.logs(shard)
    assert "PS_SERVER_READY" in logs and '"address": "0.0.0.0:50051"' in logs
    assert containers.stop(shard, grace=20) == 0, containers.logs(shard)[-2000:]


def test_image_serves_a_model_with_ps_serve(engine: Engine, image: str) -> None:
    """ps-serve is in the image (its package and aiohttp): it serves a model built in the container over KServe v2."""
    script = (
        "set -e; python -m ps_models.build --model mlp --out /tmp/mlp.onnx >/dev/null; "
        "ps-serve --model /tmp/mlp.onnx --port 8000 >/tmp/ready 2>/tmp/log & serve=$!; "
        "python - <<'PY'\n"
        "import json, time, urllib.request\n"
        "deadline = time.monotonic() + 60\n"
        "while True:\n"
        "    try:\n"
        "        print(urllib.request.urlopen('http://127.0.0.1:8000/v2/models/mlp', timeout=5).read().decode())\n"
        "        break\n"
        "    except OSError:\n"
        "        if time.monotonic() > deadline:\n"
        "            raise SystemExit('ps-serve did not answer within 60 s: ' + open('/tmp/log').read())\n"
        "        time.sleep(0.5)\n"
        "PY\n"
        "kill $serve; wait $serve || true; cat /tmp/ready")
    result = engine.podman("run", "--rm", "--no-healthcheck", "--entrypoint", "sh", image, "-c", script, timeout=180)
    metadata = json.loads(result.stdout.splitlines()[0])
    assert metadata["name"] == "mlp" and [i["name"] for i in metadata["inputs"]] == ["x"], result.stdout
    assert "PS_SERVE_READY" in result.stdout, result.stdout + result.stderr
