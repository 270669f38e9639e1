"""The benchmarks run end to end in a tiny configuration, without torch, and print the JSON lines they promise.

Benchmarks are not tests: these only check that `python -m ps_bench.train_bench` and
`python -m ps_bench.pushpull_bench` start their processes, measure, clean up, and print
parseable lines with the keys docs/benchmarks.md names. `--no-torch` keeps them on our side
whether or not torch happens to be installed (the suite never needs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ps_bench import netns

REQUIRED = {"system", "metric", "size_mb", "value", "unit"}
#: Longest run of one tiny benchmark, in seconds (the test's own limit is above it).
RUN_TIMEOUT = 60


def run_bench(module: str, *args: str, cwd: Path) -> tuple[list[dict], str]:
    """The JSON lines a benchmark printed on stdout (every stdout line must be one), and its stderr."""
    done = subprocess.run([sys.executable, "-P", "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{module} exited with {done.returncode}:\n{done.stderr[-3000:]}"
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    for record in records:
        assert REQUIRED <= set(record), record
        assert isinstance(record["value"], (int, float)), record
    return records, done.stderr


@pytest.mark.timeout(90)
def test_the_training_benchmark_prints_steps_per_second_and_a_profile(tmp_path: Path) -> None:
    records, stderr = run_bench("ps_bench.train_bench", "--no-torch", "--workers", "1", "--modes", "sync",
                                "--warmup", "2", "--steps", "5", "--repeats", "1", "--profile",
                                "--profile-modes", "async", cwd=tmp_path)
    assert "onnx-ps only" in stderr
    rates = [r for r in records if r["metric"] == "steps_per_s"]
    assert len(rates) == 1
    assert rates[0]["system"] == "onnx-ps" and rates[0]["workers"] == 1 and rates[0]["mode"] == "sync"
    assert rates[0]["unit"] == "steps/s" and rates[0]["value"] > 0
    assert rates[0]["size_mb"] == pytest.approx((784 * 256 + 256 + 256 * 10 + 10) * 4 / 1e6, abs=1e-3)
    # the share of the machine's CPU the hypervisor took during the run (0 on a machine of its own)
    assert len(rates[0]["steal_per_run"]) == 1 and 0.0 <= rates[0]["steal_per_run"][0] <= 1.0
    parts = {r["part"]: r["value"] for r in records if r["metric"] == "profile_ms"}
    for part in ("step", "compute", "push_pull", "server.push_pull", "wire.push_pull", "client.encode",
                 "client.decode", "server.decode", "server.apply", "server.wait", "loop"):
        assert part in parts, sorted(parts)
    # the training loop's step is one PushPull round trip, whose handler applies the gradient
    assert parts["compute"] > 0 and parts["push_pull"] > 0 and parts["server.push_pull"] > 0
    assert parts["server.apply"] > 0
    assert parts["step"] >= parts["compute"]


@pytest.mark.timeout(90)
def test_the_push_pull_benchmark_prints_gigabytes_per_second(tmp_path: Path) -> None:
    records, stderr = run_bench("ps_bench.pushpull_bench", "--no-torch", "--sizes-mb", "1", "--rounds", "2",
                                "--repeats", "2", cwd=tmp_path)
    assert "onnx-ps only" in stderr
    assert [(r["system"], r["metric"], r["size_mb"], r["unit"]) for r in records] == [
        ("onnx-ps", "pushpull_gbps", 1.0, "GB/s")]
    assert records[0]["value"] > 0 and len(records[0]["runs"]) == 2


@pytest.mark.timeout(120)
@pytest.mark.skipif(netns.unavailable() is not None, reason=f"--netns: {netns.unavailable()}")
def test_the_push_pull_benchmark_measures_across_the_namespace_network_and_leaves_nothing(tmp_path: Path) -> None:
    before = set(netns.parse_netns_list(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                       timeout=30).stdout))
    records, stderr = run_bench("ps_bench.pushpull_bench", "--netns", "--no-torch", "--sizes-mb", "1", "--rounds",
                                "2", "--repeats", "1", "--data-path", "channel", "--raw-tcp", cwd=tmp_path)
    assert "2 host namespaces" in stderr
    assert {(r["system"], r["metric"]) for r in records} == {
        ("onnx-ps", "pushpull_gbps"), ("raw-tcp", "pushpull_gbps"), ("onnx-ps/raw-tcp", "pushpull_ratio")}
    assert all(r["network"] == "netns veth tbf 10gbit" and r["value"] > 0 for r in records), records
    after = set(netns.parse_netns_list(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                      timeout=30).stdout))
    assert not {n for n in after - before if n.startswith(netns.NS_PREFIX)}, after - before


def test_the_push_pull_benchmark_keeps_shared_memory_off_the_namespace_network(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "ps_bench.pushpull_bench", "--netns", "--data-path",
                           "push-pull"], cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert "--netns runs the wire paths only" in done.stderr and done.stdout == ""


@pytest.mark.parametrize("variants, says", [("fused/udp", "fused/udp is not one of"), ("", "nothing is not one of")])
def test_the_push_pull_benchmark_names_a_torch_variant_it_does_not_know(tmp_path: Path, variants: str,
                                                                      says: str) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "ps_bench.pushpull_bench", "--torch-variants", variants],
                          cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert f"--torch-variants: {says}" in done.stderr and done.stdout == ""


@pytest.mark.parametrize("module", ["ps_bench.grad_bench", "ps_bench.kernel_bench"])
def test_a_benchmark_against_torch_says_how_to_get_torch_where_it_is_missing(tmp_path: Path, module: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed here: the message for its absence cannot show")
    done = subprocess.run([sys.executable, "-P", "-m", module], cwd=tmp_path, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 1 and done.stdout == "", done.stderr[-2000:]
    assert f"{module} compares against torch, which is not installed here" in done.stderr
