"""The peers benchmark's helpers, without torch and without processes: flags, systems, ratios, data files, JSON lines.

`ps_bench.train_bench` compares ours with PyTorch RPC (variants and transports) and DDP;
what it runs and how it compares is decided by `ps_bench.peers` and its argument parsing,
checked here. The runs themselves are benchmarks (tests/integration/test_benchmarks.py
runs a tiny one of ours).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ps_bench import harness, peers, tf_ps, train_bench
from ps_bench.peers import DDP, OURS, TF, TORCH, System
from ps_bench.train_worker import epochs_for
from ps_models.datasets import load_dataset


def test_without_flags_the_benchmark_is_the_mlp_table_and_peers_presets_the_comparison() -> None:
    classic = train_bench.parse_args([])
    assert classic.model_list == ["mlp"] and classic.shards == 1 and classic.workers_list == [1, 2]
    assert classic.batch == 64 and classic.path_list == ["shm"] and classic.mode_list == ["sync", "ssp", "async"]
    assert classic.variant_list == ["two-call/tcp", "fused/tcp", "fused/shm"]
    preset = train_bench.parse_args(["--peers"])
    assert preset.model_list == ["mlp", "fm", "transformer", "resnet18"]
    assert (preset.shards, preset.workers_list, preset.batch) == (2, [2], 32)
    assert preset.mode_list == ["async", "sync"] and preset.path_list == ["shm", "channel", "grpc"]
    mine = train_bench.parse_args(["--peers", "--models", "fm", "--batch", "8", "--paths", "grpc,shm"])
    assert mine.model_list == ["fm"] and mine.batch == 8 and mine.shards == 2 and mine.path_list == ["grpc", "shm"]
    assert train_bench.parse_args(["--paths", "all"]).path_list == ["shm", "channel", "grpc"]


@pytest.mark.parametrize("argv", [["--models", "vgg"], ["--paths", "rdma"], ["--torch-variants", "fused/ib"],
                                  ["--modes", "bsp"], ["--steps", "0"], ["--shards", "0"],
                                  ["--netns", "--paths", "shm"], ["--tf-steps-per-function", "0"]])
def test_bad_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train_bench.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_systems_of_a_case() -> None:
    ours_only = peers.systems_for("sync", ["shm", "grpc"], peers.TORCH_VARIANTS, ddp=True, with_torch=False,
                                  netns=False)
    assert [s.label for s in ours_only] == ["onnx-ps[shm]", "onnx-ps[grpc]"]
    sync = peers.systems_for("sync", ["shm", "grpc"], peers.TORCH_VARIANTS, ddp=True, with_torch=True, netns=False)
    assert [s.label for s in sync] == ["onnx-ps[shm]", "onnx-ps[grpc]", "torch-rpc[two-call/tcp]",
                                       "torch-rpc[fused/tcp]", "torch-rpc[fused/shm]", "torch-ddp[gloo]"]
    asynchronous = peers.systems_for("async", ["shm"], peers.TORCH_VARIANTS, ddp=True, with_torch=True, netns=False)
    assert DDP not in {s.kind for s in asynchronous}   # DDP is synchronous training
    # across namespaces: no shared memory on either side
    netns = peers.systems_for("sync", ["shm", "grpc"], peers.ALL_TORCH_VARIANTS, ddp=True, with_torch=True,
                              netns=True)
    assert [s.label for s in netns] == ["onnx-ps[grpc]", "torch-rpc[two-call/tcp]", "torch-rpc[fused/tcp]",
                                        "torch-ddp[gloo]"]


def test_tensorflow_runs_in_async_mode_only_and_meets_every_path() -> None:
    asynchronous = peers.systems_for("async", ["shm", "channel"], ["fused/tcp"], ddp=True, with_torch=True,
                                     netns=False, with_tf=True)
    assert [s.label for s in asynchronous] == ["onnx-ps[shm]", "onnx-ps[channel]", "torch-rpc[fused/tcp]",
                                               "tf-ps[grpc]"]
    # TensorFlow 2's parameter servers have no synchronous mode; without the flag it is not run at all
    for mode in ("sync", "ssp"):
        assert TF not in {s.kind for s in peers.systems_for(mode, ["shm"], ["fused/tcp"], ddp=True, with_torch=True,
                                                            netns=False, with_tf=True)}
    assert TF not in {s.kind for s in peers.systems_for("async", ["shm"], ["fused/tcp"], ddp=True, with_torch=True,
                                                        netns=False)}
    # its tasks talk gRPC: it crosses namespaces, and both scopes meet it
    netns = peers.systems_for("async", ["shm", "grpc"], ["fused/shm"], ddp=True, with_torch=True, netns=True,
                              with_tf=True)
    assert [s.label for s in netns] == ["onnx-ps[grpc]", "tf-ps[grpc]"]
    tf, shm, grpc = System(TF), System(OURS, path="shm"), System(OURS, path="grpc")
    assert tf.scope == "wire" and tf.fields() == {"strategy": "ParameterServerStrategy"}
    found = {(c.ours.path, c.peer.label): c.value for c in peers.comparisons({shm: [30.0], grpc: [10.0], tf: [20.0]})}
    assert found == {("shm", "tf-ps[grpc]"): 1.5, ("grpc", "tf-ps[grpc]"): 0.5}


@pytest.mark.parametrize("workers,warmup,steps,per_function,expected", [
    (2, 3, 20, 10, (2, 4)),      # a warm-up function for each worker, at least
    (2, 50, 500, 10, (10, 100)),
    (1, 0, 7, 10, (1, 1)),       # timed steps rounded up to a whole function
    (2, 2, 10, 3, (2, 7)),
])
def test_tensorflow_functions_cover_every_workers_steps(workers: int, warmup: int, steps: int, per_function: int,
                                                       expected: tuple[int, int]) -> None:
    assert tf_ps.function_counts(workers, warmup, steps, per_function) == expected


@pytest.mark.parametrize("bad", [(0, 1, 1, 1), (1, -1, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)])
def test_tensorflow_function_counts_refuse_nonsense(bad: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="got " + ", ".join(str(v) for v in (bad[0], bad[2], bad[1], bad[3]))):
        tf_ps.function_counts(*bad)


def test_the_tensorflow_cluster_names_the_coordinator_its_chief() -> None:
    assert tf_ps.cluster_spec(["h:1", "h:2"], ["w:3"], "w:4") == {"ps": ["h:1", "h:2"], "worker": ["w:3"],
                                                                 "chief": ["w:4"]}


def test_without_tensorflow_its_peer_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "tensorflow", None)   # import tensorflow raises ImportError
    with pytest.raises(SystemExit, match=r"ps_bench.tf_ps needs tensorflow \(tensorflow-cpu\)"):
        tf_ps.main(["server", "--job", "ps", "--index", "0", "--cluster", '{"ps": ["127.0.0.1:1"]}'])
    # nor does train_bench run it, and it says why
    monkeypatch.setattr(train_bench.harness, "tensorflow_available", lambda: False)
    assert not train_bench.with_tensorflow(train_bench.parse_args(["--peers"]), with_torch=True)
    assert "tensorflow is not importable in this environment" in capsys.readouterr().err
    monkeypatch.setattr(train_bench.harness, "tensorflow_available", lambda: True)
    assert train_bench.with_tensorflow(train_bench.parse_args(["--peers"]), with_torch=True)
    assert not train_bench.with_tensorflow(train_bench.parse_args(["--peers", "--no-tf"]), with_torch=True)
    assert not train_bench.with_tensorflow(train_bench.parse_args(["--peers"]), with_torch=False)   # --no-torch
    assert capsys.readouterr().err == ""


def test_a_path_meets_the_fastest_peer_of_its_scope() -> None:
    shm, grpc = System(OURS, path="shm"), System(OURS, path="grpc")
    two_tcp = System(TORCH, variant="two-call", transport="tcp")
    fused_tcp = System(TORCH, variant="fused", transport="tcp")
    fused_shm, ddp = System(TORCH, variant="fused", transport="shm"), System(DDP)
    runs = {shm: [100.0, 120.0, 110.0], grpc: [50.0, 60.0, 55.0], two_tcp: [40.0, 40.0, 40.0],
            fused_tcp: [50.0, 50.0, 50.0], fused_shm: [80.0, 100.0, 90.0], ddp: [200.0, 200.0, 200.0]}
    assert peers.best_peer(runs, "one-host") == fused_shm
    assert peers.best_peer(runs, "wire") == fused_tcp   # shared memory is no peer of the wire
    found = {(c.ours.path, c.peer.label): c for c in peers.comparisons(runs)}
    assert set(found) == {("shm", "torch-rpc[fused/shm]"), ("shm", "torch-ddp[gloo]"),
                          ("grpc", "torch-rpc[fused/tcp]"), ("grpc", "torch-ddp[gloo]")}
    # the ratio is the median of the repeats' own ratios (each pair measured side by side)
    assert found[("shm", "torch-rpc[fused/shm]")].ratios == pytest.approx([1.25, 1.2, 110 / 90])
    assert found[("shm", "torch-rpc[fused/shm]")].value == pytest.approx(110 / 90)
    assert found[("grpc", "torch-rpc[fused/tcp]")].value == pytest.approx(1.1)
    # a peer that failed every run is no comparison
    assert peers.best_peer({shm: [1.0], fused_tcp: []}, "one-host") is None


def test_systems_alternate_their_order_and_a_failing_one_is_left_out() -> None:
    a, b, c = System(OURS, path="shm"), System(TORCH, variant="fused", transport="tcp"), System(DDP)
    calls: list[str] = []

    def run(label: str, fail: bool = False):
        def go() -> float:
            calls.append(label)
            if fail:
                raise RuntimeError("no")
            return 1.0
        return go

    errors: list[str] = []
    runs = peers.alternate(3, {a: run("a"), b: run("b"), c: run("c", fail=True)},
                           on_error=lambda system, exc: errors.append(system.label))
    assert calls == ["a", "b", "c", "b", "a", "a", "b"]
    assert runs == {a: [1.0] * 3, b: [1.0] * 3, c: []} and errors == ["torch-ddp[gloo]"]


def test_bench_case_prints_a_line_per_system_and_ratio_lines_with_the_load(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rates = {"onnx-ps[shm]": [30.0, 32.0], "onnx-ps[grpc]": [12.0, 10.0], "torch-rpc[two-call/tcp]": [10.0, 10.0],
             "torch-rpc[fused/tcp]": [20.0, 20.0], "torch-rpc[fused/shm]": [15.0, 15.0],
             "torch-ddp[gloo]": [16.0, 16.0]}
    monkeypatch.setattr(train_bench, "runner", lambda case, system: lambda: rates[system.label].pop(0))
    args = train_bench.parse_args(["--peers", "--repeats", "2"])
    case = train_bench.Case(peers.MODELS["fm"], tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path, ["factors.weight"],
                            0.68, 2, 2, "sync", 32, 1, 5, 1)
    systems = peers.systems_for("sync", ["shm", "grpc"], peers.TORCH_VARIANTS, ddp=True, with_torch=True, netns=False)
    train_bench.bench_case(args, case, systems)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for line in lines:
        assert {"system", "metric", "size_mb", "value", "unit", "model", "workers", "shards", "mode", "batch",
                "network", "machine"} <= set(line)
        assert {"cpus", "loadavg"} <= set(line["machine"])
    by_label = {(r["system"], r.get("path") or r.get("variant", "") + "/" + r.get("transport", "")): r
                for r in lines if r["metric"] == "steps_per_s"}
    assert by_label[("onnx-ps", "shm")]["value"] == 31.0 and by_label[("onnx-ps", "shm")]["samples_per_s"] == 992.0
    assert by_label[("torch-rpc", "fused/shm")]["runs"] == [15.0, 15.0]
    ratios = {(r["system"], r["path"]): r for r in lines if r["metric"] == "steps_per_s_ratio"}
    assert set(ratios) == {("onnx-ps/torch-rpc", "shm"), ("onnx-ps/torch-ddp", "shm"), ("onnx-ps/torch-rpc", "grpc"),
                           ("onnx-ps/torch-ddp", "grpc")}
    assert ratios[("onnx-ps/torch-rpc", "shm")]["against"] == "torch-rpc[fused/tcp]"   # faster than fused/shm here
    assert ratios[("onnx-ps/torch-rpc", "shm")]["value"] == pytest.approx(1.55)
    assert ratios[("onnx-ps/torch-rpc", "grpc")]["scope"] == "wire"
    assert ratios[("onnx-ps/torch-ddp", "grpc")]["value"] == pytest.approx(0.6875)


def test_each_run_records_the_cpu_the_hypervisor_took_and_a_large_share_is_flagged(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # /proc/stat's "cpu" line before and after each run: 250 of 1,000 ticks stolen in the first, 10 of 1,100 in
    # the second (the guest fields after steal are inside user and nice, so not counted twice)
    readings = iter([[100, 0, 50, 800, 0, 0, 0, 50, 7, 7], [200, 0, 100, 1400, 0, 0, 0, 300, 9, 9],
                     [200, 0, 100, 1400, 0, 0, 0, 300, 9, 9], [300, 0, 150, 2340, 0, 0, 0, 310, 9, 9]])
    monkeypatch.setattr(harness, "cpu_ticks", lambda: next(readings))
    monkeypatch.setattr(train_bench, "run_ours", lambda case, path: [{"steps_per_s": 10.0}, {"steps_per_s": 5.0}])
    args = train_bench.parse_args(["--repeats", "2"])
    case = train_bench.Case(peers.MODELS["mlp"], tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path, [], 0.8, 1, 2,
                            "async", 32, 1, 5, 1)
    runs = train_bench.bench_case(args, case, [System(OURS, path="shm")])
    assert runs == {System(OURS, path="shm"): [15.0, 15.0]}
    captured = capsys.readouterr()
    (line,) = [json.loads(line) for line in captured.out.splitlines()]
    assert line["steal_per_run"] == [0.25, pytest.approx(10 / 1100, abs=1e-4)]
    first, second = [text for text in captured.err.splitlines() if "repeat" in text]
    assert first.endswith("onnx-ps[shm] 480.0 samples/s (25% of the CPU stolen)")
    assert second.endswith("onnx-ps[shm] 480.0 samples/s")   # 0.9%: under harness.STEAL_FLAG, not flagged


def test_the_stolen_share_of_the_cpu_from_proc_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 1 5 80 2 0 1 3 0 0\ncpu0 5 0 2 40 1 0 0 2 0 0\nintr 1 2 3\n")
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path,
                                                                         *a, **k))
    assert harness.cpu_ticks() == [10, 1, 5, 80, 2, 0, 1, 3, 0, 0]   # every CPU's line, not cpu0's
    assert harness.steal_share([10, 1, 5, 80, 2, 0, 1, 3], [20, 1, 5, 160, 2, 0, 1, 13]) == pytest.approx(0.1)
    assert harness.steal_share(None, [1] * 8) is None and harness.steal_share([1] * 8, None) is None
    assert harness.steal_share([1] * 7, [2] * 7) is None   # no steal field
    assert harness.steal_share([1] * 8, [1] * 8) is None   # no tick passed
    assert harness.stolen_note(0.2) == " (20% of the CPU stolen)"
    assert harness.stolen_note(harness.STEAL_FLAG) == "" and harness.stolen_note(None) == ""
    stat.write_text("intr 1 2 3\n")   # no "cpu" line
    assert harness.cpu_ticks() is None
    stat.write_text("cpu  10 x\n")
    assert harness.cpu_ticks() is None
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert harness.cpu_ticks() is None


def test_the_steady_heap_keeps_large_freed_blocks_in_the_heap(tmp_path: Path) -> None:
    """In a process of its own (the settings stay for the process's life), set by steady_heap or by the environment
    every benchmark child gets: a 16 MiB block comes from the heap, where glibc's default maps it on its own."""
    import subprocess
    script = tmp_path / "heap.py"
    script.write_text(
        "import ctypes, sys\n"
        "from ps_bench import harness\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "libc.sbrk.restype = ctypes.c_void_p\n"
        "took = harness.steady_heap() if sys.argv[1] == 'steady' else None\n"
        "top = libc.sbrk(0)\n"
        "block = libc.malloc(16 << 20)\n"
        "print(took, block < libc.sbrk(0) and block >= top - (1 << 30))\n")
    plain = {k: v for k, v in harness.child_env().items() if k not in harness.STEADY_HEAP_ENV}
    # steady_heap in the process; glibc's default; a child started with the benchmarks' environment
    for mode, env, expected in (("steady", plain, "True True"), ("default", plain, "None False"),
                                ("default", harness.child_env(), "None True")):
        done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60,
                              env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == expected.split(), (mode, done.stdout)


def test_the_steady_heap_is_a_no_op_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    monkeypatch.setattr(ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(f"{name}: not found")))
    assert harness.steady_heap() is False


def test_a_push_pull_line_carries_the_stolen_share_of_each_run_where_it_was_measured(
        capsys: pytest.CaptureFixture[str]) -> None:
    from ps_bench import pushpull_bench

    pushpull_bench.emit_median("onnx-ps", [1.0, 3.0, 2.0], [0.123456, None, 0.0], size_mb=16.0, unit="GB/s",
                               data_path="channel")
    pushpull_bench.emit_median("raw-tcp", [1.0], [None], size_mb=16.0, unit="GB/s")
    measured, unmeasured = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert measured["value"] == 2.0 and measured["steal_per_run"] == [0.1235, None, 0.0]
    assert "steal_per_run" not in unmeasured   # no reading (no /proc/stat): no field, rather than a made-up 0


def test_tensorflow_lines_say_its_strategy_and_steps_per_call(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rates = {"onnx-ps[channel]": [30.0], "tf-ps[grpc]": [12.0]}
    monkeypatch.setattr(train_bench, "runner", lambda case, system: lambda: rates[system.label].pop(0))
    args = train_bench.parse_args(["--peers", "--repeats", "1", "--tf-steps-per-function", "25"])
    case = train_bench.Case(peers.MODELS["mlp"], tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path, [], 0.81, 2, 2,
                            "async", 32, 1, 5, 1, tf_steps_per_function=args.tf_steps_per_function)
    systems = peers.systems_for("async", ["channel"], [], ddp=True, with_torch=True, netns=False, with_tf=True)
    train_bench.bench_case(args, case, systems)
    lines = {line["system"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert lines["tf-ps"]["strategy"] == "ParameterServerStrategy" and lines["tf-ps"]["steps_per_function"] == 25
    assert lines["tf-ps"]["samples_per_s"] == 384.0
    assert lines["onnx-ps/tf-ps"]["value"] == 2.5 and lines["onnx-ps/tf-ps"]["against"] == "tf-ps[grpc]"


@pytest.mark.parametrize("model", ["mlp", "fm"])
@pytest.mark.parametrize("workers,total", [(1, 7), (2, 60), (2, 550)])
def test_the_data_file_makes_exactly_the_steps_asked_for(tmp_path: Path, model: str, workers: int, total: int) -> None:
    case = peers.MODELS[model]
    path = peers.write_data(case, tmp_path / "d.npz", workers=workers, batch=32, total=total)
    dataset = load_dataset(str(path))
    assert dataset.num_train == peers.rows_for(workers, 32, total)
    assert total % epochs_for(dataset, workers=workers, batch=32, total=total) == 0
    assert dataset.input_name == ("x" if model == "mlp" else "ids") and dataset.num_classes == case.classes
    if model == "fm":   # the first rows of synthetic:clicks, as they are
        clicks = load_dataset("synthetic:clicks")
        assert np.array_equal(dataset.x_train, clicks.x_train[:dataset.num_train])


def test_a_data_file_that_does_not_make_whole_epochs_is_refused(tmp_path: Path) -> None:
    path = peers.write_data(peers.MODELS["mlp"], tmp_path / "d.npz", workers=2, batch=32, total=10)
    with pytest.raises(ValueError, match="cannot make 7 iterations"):
        epochs_for(load_dataset(str(path)), workers=2, batch=32, total=7)


def test_shards_get_their_index_and_count_and_the_mode_its_flags() -> None:
    flags = train_bench.shard_flags("sync", 2, index=1, shards=2)
    assert flags[flags.index("--shard-index") + 1] == "1" and flags[flags.index("--shards") + 1] == "2"
    assert flags[flags.index("--replicas-to-aggregate") + 1] == "2"
    assert "--staleness" in train_bench.shard_flags("ssp", 1)


def test_each_data_path_sets_the_client_as_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    from ps_bench import train_worker
    assert train_worker.client_settings("shm") == {}   # ps-worker's defaults
    # a profile times the one-host default's frames too (the data channel stays on): shared memory however small
    assert train_worker.client_settings("shm", profile=True) == {"shared_memory_min_bytes": 0}
    monkeypatch.setattr(train_worker, "data_channel_supported", lambda: True)
    assert train_worker.client_settings("channel") == {"shared_memory": False, "data_channel": True}
    assert train_worker.client_settings("grpc") == {"shared_memory": False, "data_channel": False}
    monkeypatch.setattr(train_worker, "data_channel_supported", lambda: False)
    assert train_worker.client_settings("grpc") == {"shared_memory": False}
    with pytest.raises(ValueError, match="no data channel"):
        train_worker.client_settings("channel")


@pytest.mark.parametrize("module, missing, says", [
    ("ps_bench.keras_sweep", "tensorflow", "ps_bench.keras_sweep compares against TensorFlow, which is not installed"),
    ("ps_bench.grad_sweep", "torch", "ps_bench.grad_sweep compares against torch, which is not installed"),
])
def test_a_sweep_without_its_framework_says_what_to_install(monkeypatch, module, missing, says):
    import importlib

    monkeypatch.setitem(sys.modules, missing, None)   # an import of it raises ImportError
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(SystemExit, match=says):
        importlib.import_module(module)


def test_the_machine_record_names_the_cpu_and_its_widest_vector_extension(tmp_path: Path, monkeypatch) -> None:
    from ps_bench import harness

    record = harness.machine()
    assert {"cpus", "cpu", "vector", "loadavg", "python", "time"} <= set(record)
    assert record["vector"] in ("", *harness.VECTOR_FLAGS)
    real_open = open
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse4_2 avx avx2 fma\n\n"
                    "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu sse4_2 avx avx2 fma\n")
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path,
                                                                         *a, **k))
    assert harness.cpu() == {"cpu": "Some CPU", "vector": "avx2"}
    info.write_text("model name\t: Other\nflags\t\t: fpu avx512f avx2\n")
    assert harness.cpu() == {"cpu": "Other", "vector": "avx512f"}
    info.write_text("Features\t: fp asimd\n")   # an Arm CPU: no x86 vector flags, no model name line
    assert harness.cpu() == {"cpu": "", "vector": ""}
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert harness.cpu() == {"cpu": "", "vector": ""}


def test_a_timed_name_counts_its_outermost_calls_once_per_thread() -> None:
    timings = harness.Timings()
    inner = timings.timed("encode", lambda n: n * 2)
    outer = timings.timed("encode", lambda n: inner(n) + 1)   # an encoder wrapped beside the one it calls
    other = timings.timed("decode", lambda n: inner(n))
    assert outer(3) == 7 and other(1) == 2 and inner(5) == 10
    assert len(timings.calls["encode"]) == 3    # outer's (inner not again), other's inner, the lone inner
    assert len(timings.calls["decode"]) == 1
    done = threading.Barrier(2, timeout=10)

    def both_open_at_once() -> int:
        done.wait()   # each thread's outer call is open while the other's is
        return inner(1)

    def nested_on_two_threads() -> None:
        timings.timed("encode", both_open_at_once)()

    threads = [threading.Thread(target=nested_on_two_threads) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(timings.calls["encode"]) == 5    # one each: a name open on one thread is not open on the other
