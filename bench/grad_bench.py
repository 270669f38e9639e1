"""Median gradient-step time of GradientEngine against torch autograd on the torch fixtures."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
from onnx import numpy_helper

try:
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # torch is a benchmark-only dependency
    raise SystemExit("ps_bench.grad_bench compares against torch, which is not installed here; "
                     "run it in an environment of its own that has torch and the project: "
                     "`python -m venv .venv-bench && .venv-bench/bin/pip install -e . torch && "
                     ".venv-bench/bin/python -m ps_bench.grad_bench`") from exc

from worker_client import GradientEngine

#: Timed steps per block of one system's steps (see bench_model).
BLOCK = 5
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torch"
#: fixture name -> (torch class in make_torch_fixtures.py, graph input name)
MODELS: dict[str, tuple[str, str]] = {
    "mlp": ("MLP", "x"),
    "cnn": ("CNN", "image"),
    "embedding_bag": ("EmbeddingBag", "ids"),
    "transformer": ("TransformerBlock", "ids"),
}


def _fixture_module() -> ModuleType:
    """The fixture script, loaded by path (tests/fixtures is not a package)."""
    spec = importlib.util.spec_from_file_location("make_torch_fixtures",
                                                  FIXTURES / "make_torch_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tile(array: np.ndarray, batch: int) -> np.ndarray:
    """The fixture batch repeated (or cut) along axis 0 to `batch` rows."""
    repeats = -(-batch // array.shape[0])
    return np.concatenate([array] * repeats)[:batch]


def _median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e3


def bench_model(name: str, *, batch: int, threads: int, steps: int, warmup: int,
                cache_dir: Path | None) -> list[dict[str, object]]:
    """Interleaved engine / torch gradient steps on one fixture; returns the JSON records."""
    fixtures = _fixture_module()
    class_name, input_name = MODELS[name]
    data = np.load(FIXTURES / f"{name}.npz")
    kind = str(data["loss_kind"])
    inputs = {input_name: _tile(data[f"input:{input_name}"], batch),
              "labels": _tile(data["labels"], batch)}

    engine = GradientEngine(FIXTURES / f"{name}.onnx", batch_size=batch, loss=kind,
                            intra_op_threads=threads, inter_op_threads=1,
                            cache_dir=cache_dir)
    parameters = engine.parameters()

    module = getattr(fixtures, class_name)()
    initializers = {t.name: numpy_helper.to_array(t)
                    for t in onnx.load(FIXTURES / f"{name}.onnx").graph.initializer}
    module.load_state_dict({k: torch.from_numpy(initializers[k].copy())
                            for k in module.state_dict()})
    module.train()
    torch_inputs = torch.from_numpy(inputs[input_name])
    torch_labels = torch.from_numpy(inputs["labels"])
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
        F.cross_entropy if kind == "cross_entropy" else F.mse_loss)

    def engine_step() -> None:
        engine.gradients(parameters, inputs)

    def torch_step() -> None:
        for parameter in module.parameters():
            parameter.grad = None
        loss_fn(module(torch_inputs), torch_labels).backward()
        # hand the gradients out as numpy arrays, as the engine does
        {k: p.grad.numpy() for k, p in module.named_parameters()}  # noqa: B018

    for _ in range(warmup):
        engine_step()
        torch_step()
    # Interleaved in blocks: a block of one system's steps, then one of the other's, the
    # order flipping every round. The first step of each block is not timed -- the other
    # system's idle worker threads may still be spinning on the same cores then. The ratio
    # is the median over rounds of the two blocks' median ratio: a pair of blocks runs
    # within milliseconds, so load from other processes that comes and goes cancels out.
    timings: dict[str, list[float]] = {"onnx-ps": [], "torch": []}
    ratios: list[float] = []
    order = [("onnx-ps", engine_step), ("torch", torch_step)]
    for round_ in range(-(-steps // BLOCK)):
        block: dict[str, list[float]] = {"onnx-ps": [], "torch": []}
        for system, step in (order if round_ % 2 == 0 else order[::-1]):
            step()
            for _ in range(BLOCK):
                start = time.perf_counter()
                step()
                block[system].append(time.perf_counter() - start)
            timings[system] += block[system]
        ratios.append(statistics.median(block["onnx-ps"]) / statistics.median(block["torch"]))

    size_mb = round(sum(v.nbytes for v in parameters.values()) / 1e6, 4)
    records: list[dict[str, object]] = [
        {"system": system, "metric": f"grad_step_ms_{name}", "size_mb": size_mb,
         "value": round(_median_ms(samples), 4), "unit": "ms"}
        for system, samples in timings.items()]
    records.append({"system": "onnx-ps/torch", "metric": f"grad_step_ratio_{name}",
                    "size_mb": size_mb, "value": round(statistics.median(ratios), 3),
                    "unit": "x"})
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps_bench.grad_bench", description=__doc__)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--batch", type=int, default=64,
                        help="batch size (the fixture batch, tiled) [64]")
    parser.add_argument("--threads", type=int, default=2,
                        help="onnxruntime intra-op threads = torch.set_num_threads [2]")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per system [300]")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first [20]")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="gradient-model cache [$ONNX_PS_CACHE or ~/.cache/onnx-ps]")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    for name in args.models:
        for record in bench_model(name, batch=args.batch, threads=args.threads,
                                  steps=args.steps, warmup=args.warmup,
                                  cache_dir=args.cache_dir):
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
