"""ps-ctl export against real shard processes and their checkpoint folders: the values the shards hold come out in
the user's graph, read at one step, with the reader token; and every bad input gets one line, exit 2, and never a
half file in place of a good one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from ps_models.builders import build_mlp
from ps_tools import ctl, export
from ps_tools import certs
from ps_common.tls import read_token
from worker_client.client import PSClient, RetryPolicy

LR = 0.5
STEPS = 3


def write_mlp(path: Path, *, input_dim: int = 8, hidden: tuple[int, ...] = (6,)) -> Path:
    onnx.save(build_mlp(input_dim=input_dim, hidden=hidden, num_classes=3), path)
    return path


def initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


@pytest.fixture
def trained(start_cluster, tmp_path: Path):
    """Two sync shards (checkpointing every step into their folders) that trained the MLP STEPS steps: (cluster,
    model path, the values they hold)."""
    model = write_mlp(tmp_path / "mlp.onnx")
    folders = [tmp_path / "ckpt" / f"shard{i}" for i in range(2)]
    cluster = start_cluster(2, mode="sync", flags=["--optimizer", "sgd", "--lr", str(LR), "--replicas-to-aggregate",
                                                   "1", "--total-replicas", "1", "--checkpoint-every-steps", "1",
                                                   "--partition-min-bytes", "64"],
                            shard_flags={i: ["--checkpoint-dir", str(f)] for i, f in enumerate(folders)})
    values = initializers(model)
    with PSClient(cluster.addresses, worker_id="w0", rpc_timeout=30, wait_timeout=30,
                  retry=RetryPolicy(attempts=3, initial_backoff=0.05)) as client:
        client.wait_ready(30)
        client.initialize(values)
        client.register(heartbeat=False)
        for step in range(STEPS):
            client.pull(min_steps=step)   # a sync push names the step it read
            assert client.push({n: np.full_like(v, 0.1 * (step + 1)) for n, v in values.items()}).accepted
        held = {n: np.array(v) for n, v in client.pull(min_steps=STEPS).items()}
    return cluster, model, held


def run_export(capsys, *args: str) -> tuple[int, str, str]:
    code = ctl.main(["export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_export_from_the_live_shards_writes_the_users_graph_with_their_values(trained, tmp_path, capsys) -> None:
    cluster, model, held = trained
    out = tmp_path / "out" / "trained.onnx"
    out.parent.mkdir()
    code, stdout, err = run_export(capsys, "--model", str(model), "--out", str(out), "--servers", cluster.address_option)
    assert code == 0, err
    line = json.loads(stdout)
    assert line["step"] == STEPS and line["shard_steps"] == [STEPS, STEPS] and line["mode"] == "sync"
    got = initializers(out)
    assert sorted(got) == sorted(held)
    for name, value in held.items():
        np.testing.assert_array_equal(got[name], value)
    exported = onnx.load(out)
    original = onnx.load(model)
    assert [n.op_type for n in exported.graph.node] == [n.op_type for n in original.graph.node]
    metadata = {p.key: p.value for p in exported.metadata_props}
    assert metadata["onnx_ps.step"] == str(STEPS) and metadata["model"] == "mlp"   # the user's own metadata stays
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    logits = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    hidden = np.maximum(x @ held["fc1.weight"] + held["fc1.bias"], 0)
    np.testing.assert_allclose(logits, hidden @ held["fc2.weight"] + held["fc2.bias"], rtol=1e-5, atol=1e-6)

    # the same values from the checkpoint folders once the shards are gone, as one folder or one per shard
    cluster.stop()
    for folders in ([str(tmp_path / "ckpt")], [str(tmp_path / "ckpt" / "shard0"), str(tmp_path / "ckpt" / "shard1")]):
        again = tmp_path / "again.onnx"
        code, stdout, err = run_export(capsys, "--model", str(model), "--out", str(again),
                                       *[a for f in folders for a in ("--checkpoint-dir", f)])
        assert code == 0, err
        assert json.loads(stdout)["step"] == STEPS
        for name, value in initializers(again).items():
            np.testing.assert_array_equal(value, held[name])

    # an older step, still kept (--checkpoint-keep 3), from its checkpoints
    code, stdout, err = run_export(capsys, "--model", str(model), "--out", str(tmp_path / "old.onnx"),
                                   "--checkpoint-dir", str(tmp_path / "ckpt"), "--step", str(STEPS - 1))
    assert code == 0, err
    assert json.loads(stdout)["step"] == STEPS - 1
    assert not np.array_equal(initializers(tmp_path / "old.onnx")["fc1.bias"], held["fc1.bias"])

    # external data on request: one data file beside the model, which onnxruntime loads
    big = tmp_path / "external.onnx"
    code, _, err = run_export(capsys, "--model", str(model), "--out", str(big), "--checkpoint-dir",
                              str(tmp_path / "ckpt"), "--external-data")
    assert code == 0, err
    data = list(tmp_path.glob("external.onnx.*.data"))
    assert len(data) == 1 and data[0].stat().st_size > 0
    assert ort.InferenceSession(str(big)).run(None, {"x": x})[0].shape == (5, 3)


def test_every_bad_input_gets_one_line_exit_2_and_leaves_the_good_file(trained, tmp_path, capsys) -> None:
    cluster, model, _ = trained
    out = tmp_path / "good.onnx"
    out.write_bytes(b"a good file from before")
    other = write_mlp(tmp_path / "other.onnx", input_dim=9)
    ckpt = tmp_path / "ckpt"
    cases = {
        "does not match the shards": ["--model", str(other), "--servers", cluster.address_option],
        "step 1 is gone": ["--model", str(model), "--servers", cluster.address_option, "--step", "1"],
        "cannot read the model file": ["--model", str(tmp_path / "missing.onnx"), "--servers", cluster.address_option],
        "shard(s) [1] missing": ["--model", str(model), "--checkpoint-dir", str(ckpt / "shard0")],
        "step 99 is gone": ["--model", str(model), "--checkpoint-dir", str(ckpt), "--step", "99"],
        "holds no checkpoint": ["--model", str(model), "--checkpoint-dir", str(tmp_path)],
        "does not exist": ["--model", str(model), "--checkpoint-dir", str(tmp_path / "nowhere")],
    }
    for expected, args in cases.items():
        code, stdout, err = run_export(capsys, "--out", str(out), *args)
        assert code == 2 and stdout == "", (expected, code, stdout, err)
        assert expected in err and err.startswith("ps-ctl export: ") and err.count("\n") == 1, (expected, err)
        assert out.read_bytes() == b"a good file from before", expected
    code, _, err = run_export(capsys, "--model", str(model), "--out", str(tmp_path), "--checkpoint-dir", str(ckpt))
    assert code == 2 and "is a folder" in err
    assert not list(tmp_path.glob(".good.onnx.*")), "a temporary file was left behind"


def test_the_reader_token_suffices_to_export(start_cluster, tmp_path, capsys, monkeypatch) -> None:
    for name in ("PS_AUTH_TOKEN", "PS_ADMIN_TOKEN", "PS_READER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert certs.main(["-o", str(tmp_path / "certs"), "--reader"]) == 0
    tokens = {role: tmp_path / "certs" / f"{role}.token" for role in ("worker", "reader")}
    cluster = start_cluster(1, mode="async", flags=["--auth-token-file", str(tokens["worker"]),
                                                    "--reader-token-file", str(tokens["reader"])])
    model = write_mlp(tmp_path / "mlp.onnx")
    with PSClient(cluster.addresses, call_metadata=[("authorization", f"Bearer {read_token(tokens['worker'])}")],
                  rpc_timeout=30) as client:
        client.wait_ready(30)
        client.initialize(initializers(model))
    out = tmp_path / "trained.onnx"
    code, _, err = run_export(capsys, "--model", str(model), "--out", str(out), "--servers", cluster.address_option)
    assert code == 2 and "UNAUTHENTICATED" in err   # no token: refused, and said so in one line
    code, stdout, err = run_export(capsys, "--model", str(model), "--out", str(out), "--servers", cluster.address_option,
                                   "--reader-token-file", str(tokens["reader"]))
    assert code == 0, err
    assert json.loads(stdout)["mode"] == "async"


def test_trained_state_checks_that_parts_cover_each_tensor_once() -> None:
    from ps_common.shard_map import ParamSpec

    specs = {"w": ParamSpec("w", "float32", (4, 2))}
    with pytest.raises(export.ExportError, match=r"rows \[2, 3\) are missing"):
        export._whole(specs, {"w": [(0, np.zeros((2, 2), np.float32)), (3, np.zeros((1, 2), np.float32))]}, {}, "x")
    with pytest.raises(export.ExportError, match="no shard holds tensor 'w'"):
        export._whole(specs, {}, {}, "x")
