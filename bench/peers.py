"""What `ps_bench.train_bench` compares, without torch: the models, the systems, the data files, the ratios.

The systems of one case (a model, a worker count, a mode, a network):

- ours, one per data path (`PATHS`): ``shm`` (the defaults on one host: bytes through a
  shared-memory segment with each shard, the call's header over the data channel), ``channel`` (the data channel, a TCP
  connection of its own per shard: the default between hosts, where this version has it),
  ``grpc`` (every byte through gRPC: ``PSClient(shared_memory=False, data_channel=False)``);
- PyTorch RPC (`ps_bench.torch_rpc`), one per variant and transport (`TORCH_VARIANTS`):
  ``two-call/tcp`` and ``fused/tcp`` (TensorPipe's TCP transport only, as between hosts),
  ``fused/shm`` (TensorPipe's defaults, shared memory on one host); ``two-call/shm`` on request;
- DDP (`ps_bench.ddp`, gloo): sync mode only;
- TensorFlow's ParameterServerStrategy (`ps_bench.tf_ps`, where tensorflow is importable): async
  mode only, the only mode TensorFlow 2's parameter servers have; its tasks talk gRPC.

A path's scope says which peers it meets: "one-host" paths (shm) meet every PyTorch RPC
variant, "wire" paths (channel, grpc) only those over TCP -- each against the fastest of them
(`best_peer`); every path meets DDP in sync mode and TensorFlow in async mode. Across network
namespaces (``--netns``) only wire paths and TCP variants run: shared memory does not cross hosts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: Our data paths, and the scope of each (what a peer must use to be compared with it).
PATHS = {"shm": "one-host", "channel": "wire", "grpc": "wire"}
#: PyTorch RPC's variant/transport pairs run by default; "two-call/shm" may be asked for too.
TORCH_VARIANTS = ("two-call/tcp", "fused/tcp", "fused/shm")
ALL_TORCH_VARIANTS = ("two-call/tcp", "fused/tcp", "two-call/shm", "fused/shm")

OURS, TORCH, DDP, TF = "onnx-ps", "torch-rpc", "torch-ddp", "tf-ps"


@dataclass(frozen=True)
class ModelCase:
    """One model of the benchmark: how to get it, what trains by rows, and how long a step may take."""

    name: str
    description: str
    #: (warm-up, timed) steps per worker by default
    steps: tuple[int, int]
    #: the most seconds one step of one worker may take before a run counts as hung (loaded machine, 1 thread)
    step_allowance: float
    #: our engine's sparse settings: tables named, or None for the worker's defaults (large tables by rows)
    sparse_tables: tuple[str, ...] | None = None
    #: the model's file comes from ps_bench.torch_models.export, which needs torch
    needs_torch: bool = False
    classes: int = 10


MODELS: dict[str, ModelCase] = {
    # The MLP's runs were 50 + 500 steps, a window of about 3 s, until 2026-12-01: there DDP's sync rate ran above
    # its rate over 3,000 steps (docs/benchmarks.md, that day) and ours a few percent under its own after 1,000
    # steps of warm-up; a training run is long, so a window of about 10 s.
    "mlp": ModelCase("mlp", "MLP 784-256-10 (0.2 M parameters), synthetic features", (100, 1500), 0.05),
    # The FM keeps 50 + 500: at 100 + 1,500 its DDP peer died in both runs tried (a rank killed by SIGSEGV, or its
    # partner's gloo read reset, in the backward pass's sparse all-reduce of the embeddings' gradients; torch 2.13,
    # gloo on CPU).
    "fm": ModelCase("fm", "the recommendation example: models/recsys/fm.onnx on synthetic:clicks, both tables "
                          "trained by rows", (50, 500), 0.1, sparse_tables=("factors.weight", "linear.weight"),
                    classes=2),
    "transformer": ModelCase("transformer", "transformer classifier, 4 layers, d_model 384 (10.2 M parameters), "
                                            "its token embedding trained by rows", (3, 20), 6.0, needs_torch=True,
                             classes=4),
    "resnet18": ModelCase("resnet18", "ResNet-18 for 32x32 images (11.2 M parameters), training-mode BatchNorm",
                          (3, 20), 6.0, needs_torch=True),
}


@dataclass(frozen=True)
class System:
    """One system of a case: ours on a data path, a PyTorch RPC variant over a transport, or DDP."""

    kind: str                 # OURS, TORCH, DDP or TF
    path: str = ""            # ours: a key of PATHS
    variant: str = ""         # torch: two-call or fused
    transport: str = ""       # torch: tcp or shm

    @property
    def label(self) -> str:
        if self.kind == OURS:
            return f"{OURS}[{self.path}]"
        if self.kind == TORCH:
            return f"{TORCH}[{self.variant}/{self.transport}]"
        if self.kind == TF:
            return f"{TF}[grpc]"
        return f"{DDP}[gloo]"

    @property
    def scope(self) -> str:
        """Ours: the path's scope; a peer: "one-host" if it needs one host (shared memory), else "wire"."""
        if self.kind == OURS:
            return PATHS[self.path]
        return "one-host" if self.transport == "shm" else "wire"

    def fields(self) -> dict[str, str]:
        """The keys this system adds to its JSON lines."""
        if self.kind == OURS:
            return {"path": self.path}
        if self.kind == TORCH:
            return {"variant": self.variant, "transport": self.transport}
        if self.kind == TF:
            return {"strategy": "ParameterServerStrategy"}
        return {"backend": "gloo"}


def parse_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated list, each item in `allowed` (ValueError naming the bad one); "all" is every one."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items == ["all"]:
        return list(allowed)
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"{what}: {', '.join(bad) or 'nothing'} is not one of {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def systems_for(mode: str, paths: Sequence[str], torch_variants: Sequence[str], *, ddp: bool, with_torch: bool,
                netns: bool, with_tf: bool = False) -> list[System]:
    """The systems of one case, ours first. Across namespaces: wire paths and TCP variants only. TensorFlow's
    ParameterServerStrategy (`with_tf`) in async mode only."""
    out = [System(OURS, path=p) for p in paths if not (netns and PATHS[p] == "one-host")]
    if with_torch:
        for pair in torch_variants:
            variant, transport = pair.split("/")
            if not (netns and transport == "shm"):
                out.append(System(TORCH, variant=variant, transport=transport))
        if ddp and mode == "sync":
            out.append(System(DDP))
    if with_tf and mode == "async":
        out.append(System(TF))
    return out


def alternate(repeats: int, runners: Mapping[System, Callable[[], float]],
              report: Callable[[int, dict[System, list[float]]], None] | None = None,
              on_error: Callable[[System, Exception], None] | None = None) -> dict[System, list[float]]:
    """Runs every system `repeats` times, in the given order on even repeats and the reverse on odd ones, so
    none always meets a warmer or busier machine. A system whose run raises RuntimeError is reported
    (`on_error`) and not run again; its list keeps what it measured."""
    runs: dict[System, list[float]] = {s: [] for s in runners}
    failed: set[System] = set()
    order = list(runners)
    for repeat in range(repeats):
        for system in (order if repeat % 2 == 0 else order[::-1]):
            if system in failed:
                continue
            try:
                runs[system].append(runners[system]())
            except RuntimeError as exc:
                failed.add(system)
                if on_error is not None:
                    on_error(system, exc)
        if report is not None:
            report(repeat, runs)
    return runs


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def best_peer(runs: Mapping[System, list[float]], scope: str, kind: str = TORCH) -> System | None:
    """The fastest peer of `kind` (highest median) that a path of `scope` is compared with: for "wire",
    peers over TCP only; for "one-host", every one. None when none ran."""
    peers = [s for s, v in runs.items() if s.kind == kind and v and (scope == "one-host" or s.scope == "wire")]
    return max(peers, key=lambda s: median(runs[s]), default=None)


def paired_ratios(ours: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """ours / theirs of each repeat both measured (the repeats alternate, so a pair shares the machine's state)."""
    return [a / b for a, b in zip(ours, theirs) if b > 0]


@dataclass
class Comparison:
    """One ratio line: ours on a path against a peer (the fastest of its kind for the path's scope)."""

    ours: System
    peer: System
    ratios: list[float] = field(default_factory=list)

    @property
    def value(self) -> float:
        return median(self.ratios)


def comparisons(runs: Mapping[System, list[float]]) -> list[Comparison]:
    """For every path of ours that ran: against the best PyTorch RPC variant of its scope, against DDP and
    against TensorFlow."""
    out = []
    for ours in (s for s, v in runs.items() if s.kind == OURS and v):
        for kind in (TORCH, DDP, TF):
            peer = best_peer(runs, ours.scope, kind)
            if peer is not None:
                out.append(Comparison(ours, peer, paired_ratios(runs[ours], runs[peer])))
    return out


# ---------------------------------------------------------------------------------- data files

def rows_for(workers: int, batch: int, total: int) -> int:
    """Training rows giving each worker a share of whole batches that whole epochs turn into exactly `total` steps."""
    from ps_bench import mlp
    return workers * batch * mlp.batches_per_epoch(total)


def write_npz(path: Path, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, *,
              input_name: str, classes: int) -> Path:
    """A dataset file in the project's .npz format (docs/data-format.md)."""
    np.savez(path, x_train=x_train, y_train=y_train.astype(np.int64), x_test=x_test, y_test=y_test.astype(np.int64),
             input_name=np.array(input_name), num_classes=np.array(classes))
    return path


def write_data(case: ModelCase, path: Path, *, workers: int, batch: int, total: int, seed: int = 0) -> Path:
    """The case's training data for `workers` workers running exactly `total` steps of `batch`: the same file
    for every system. mlp: standard-normal features, uniform labels; fm: the first rows of synthetic:clicks;
    resnet18 and transformer: `ps_bench.torch_models.example_batch` (needs torch)."""
    rows = rows_for(workers, batch, total)
    if case.name == "mlp":
        from ps_bench import mlp
        data = mlp.synthetic_dataset(workers=workers, steps_per_worker=total, batch=batch, seed=seed)
        return write_npz(path, data.x_train, data.y_train, data.x_test, data.y_test, input_name="x",
                         classes=mlp.CLASSES)
    if case.name == "fm":
        from ps_models.datasets import load_dataset
        data = load_dataset("synthetic:clicks", seed=seed)
        if data.num_train < rows:
            raise ValueError(f"synthetic:clicks has {data.num_train} training rows, {rows} needed")
        return write_npz(path, data.x_train[:rows], data.y_train[:rows], data.x_test[:batch], data.y_test[:batch],
                         input_name=data.input_name, classes=case.classes)
    from ps_bench import torch_models
    inputs, labels = torch_models.example_batch(case.name, rows + batch, seed)
    (name, x), = inputs.items()
    return write_npz(path, x[:rows], labels[:rows], x[rows:], labels[rows:], input_name=name, classes=case.classes)


def model_file(case: ModelCase, folder: Path) -> Path:
    """The case's ONNX file: the MLP written, fm.onnx as shipped, the others exported from torch."""
    if case.name == "mlp":
        from ps_bench import mlp
        return mlp.write_mlp(folder / "mlp.onnx")
    if case.name == "fm":
        import ps_models.recsys
        return Path(ps_models.recsys.__file__).resolve().parent / "fm.onnx"
    from ps_bench import torch_models
    return torch_models.export(case.name, folder)
