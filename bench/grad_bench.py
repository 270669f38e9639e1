"""One gradient step of GradientEngine against torch autograd, on the same batch and threads.

Three kinds of model: the small torch fixtures of the engine's tests (``mlp``, ``cnn``,
``embedding_bag``, ``transformer``: tests/fixtures/torch), the models users train from
`ps_bench.torch_models` (``resnet18``: ResNet-18 for 32x32 images with training-mode BatchNorm;
``transformer_cls``: its ``transformer``, a 4-layer text classifier with Dropout), exported with the
documented recipe into ``--export-dir``; and the small models of other architectures in
`ps_bench.zoo_models` (``vgg``, ``mobilenet``, ``lstm``, ``gru``, ``conv1d``, ``prenorm``, ``vit``,
``unet``, ``wide_mlp``, ``effnet``, ``bilstm``, ``pixelshuffle``), exported the same way. A step is
forward, cross-entropy (mse for ``embedding_bag``, ``unet`` and ``pixelshuffle``) and backward, the
gradients handed out as numpy arrays; torch runs the module in training mode (BatchNorm on batch
statistics, Dropout on), the engine draws its Dropout masks itself as a worker's step does. Both sides
start from the same weights. ``--device cuda`` runs both on the GPU (the engine through onnxruntime-gpu),
each taking the parameters from host arrays and handing the gradients back as host arrays, as a worker does.
The process keeps the heap memory it frees (`harness.steady_heap`): torch's CPU tensors come from malloc, and
glibc's default maps and unmaps large blocks, so torch's step could run a half slower in one process than another.

JSON lines (ps_bench.harness.emit): per model ``grad_step_ms_NAME`` of each system (the median
step) and ``grad_step_speedup_NAME`` of ``torch/onnx-ps``: torch's time over the engine's, above 1
when the engine is faster, with the batch, the threads and the load average when the model was done;
and, for a model without Dropout (whose masks differ between the sides), ``grad_check_max_error_NAME``:
the largest difference between the engine's gradients and torch's, in millionths of the largest
gradient (a warning on stderr above 100). Above 100 both sides are measured against torch's gradients in
float64 (a CPU copy of the module, the same weights and batch), ``grad_check_float64_error_NAME`` of each in
millionths of the largest float64 gradient, since either can be the one off: a float32 sum over a BatchNorm's
quarter million elements a channel misses by up to 1e-2 in torch's CPU kernels. The warning says the timing
compares different computations only where the engine is the farther of the two (and above 100).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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

from ps_bench import harness, torch_models, zoo_models
from worker_client import GradientEngine
from worker_client.engine import thread_choice

#: Timed steps per block of one system's steps (see bench_model).
BLOCK = 5
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torch"
#: fixture name -> (torch class in make_torch_fixtures.py, graph input name)
FIXTURE_MODELS: dict[str, tuple[str, str]] = {
    "mlp": ("MLP", "x"),
    "cnn": ("CNN", "image"),
    "embedding_bag": ("EmbeddingBag", "ids"),
    "transformer": ("TransformerBlock", "ids"),
}
#: this benchmark's name -> the ps_bench.torch_models name
USER_MODELS: dict[str, str] = {"resnet18": "resnet18", "transformer_cls": "transformer"}
MODELS = [*FIXTURE_MODELS, *USER_MODELS, *zoo_models.MODELS]
#: what runs when --models is not given
DEFAULT_MODELS = ["mlp", "resnet18", "transformer_cls"]
#: timed steps per system and untimed warm-up steps when not given: a user model's step takes a
#: good part of a second on one thread, a fixture's a millisecond or less
DEFAULT_STEPS = {"fixture": (300, 20), "user": (30, 3), "zoo": (40, 3)}


@dataclass
class Case:
    """One model on both sides: the ONNX file, the torch module holding the same weights, the
    engine's inputs (with "labels"), torch's input and labels, and the loss."""

    onnx_path: Path
    module: torch.nn.Module
    inputs: dict[str, np.ndarray]
    torch_input: torch.Tensor
    torch_labels: torch.Tensor
    loss: str


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


def fixture_case(name: str, batch: int) -> Case:
    """A test fixture: its .onnx, its torch class loaded with the file's initializers, its batch tiled."""
    class_name, input_name = FIXTURE_MODELS[name]
    data = np.load(FIXTURES / f"{name}.npz")
    inputs = {input_name: _tile(data[f"input:{input_name}"], batch),
              "labels": _tile(data["labels"], batch)}
    module = getattr(_fixture_module(), class_name)()
    initializers = {t.name: numpy_helper.to_array(t)
                    for t in onnx.load(FIXTURES / f"{name}.onnx").graph.initializer}
    module.load_state_dict({k: torch.from_numpy(initializers[k].copy())
                            for k in module.state_dict()})
    return Case(FIXTURES / f"{name}.onnx", module.train(), inputs,
                torch.from_numpy(inputs[input_name]), torch.from_numpy(inputs["labels"]),
                str(data["loss_kind"]))


def user_case(name: str, batch: int, export_dir: Path) -> Case:
    """A ps_bench.torch_models model: exported once into `export_dir`, built with the same weights."""
    model = USER_MODELS[name]
    path = torch_models.export(model, export_dir)
    data, labels = torch_models.example_batch(model, batch, seed=1)
    return Case(path, torch_models.build(model), {**data, "labels": labels},
                torch_models.torch_inputs(model, data), torch.from_numpy(labels), "cross_entropy")


def zoo_case(name: str, batch: int, export_dir: Path) -> Case:
    """A ps_bench.zoo_models model: exported once into `export_dir`, built with the same weights."""
    path, module, example, labels, loss = zoo_models.case(name, batch, export_dir)
    return Case(path, module, {"x": example.numpy(), "labels": labels.numpy()}, example, labels, loss)


def bench_model(name: str, case: Case, *, batch: int, threads: int, steps: int, warmup: int,
                cache_dir: Path | None, device: str = "cpu") -> list[dict[str, object]]:
    """Interleaved engine / torch gradient steps on one model; emits and returns the JSON records.

    On a CUDA `device` both sides do what a worker's step does there: take the parameters from host
    arrays (the engine binds them as CPU inputs; torch copies them into its module on the device),
    read the batch from the host, and hand the gradients back as host arrays."""
    engine = GradientEngine(case.onnx_path, batch_size=batch, loss=case.loss, device=device,
                            intra_op_threads=threads, inter_op_threads=1, cache_dir=cache_dir)
    # what a worker holds: the parameters and the state, fed back every step
    parameters = {**engine.parameters(), **engine.state()}
    inputs = case.inputs
    on_cuda = device != "cpu"
    module = case.module.to(device)
    host_parameters = {k: p.detach().cpu().clone() for k, p in module.named_parameters()} if on_cuda else {}
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
        F.cross_entropy if case.loss == "cross_entropy" else F.mse_loss)

    def engine_step() -> None:
        engine.step(parameters, inputs)

    def torch_step() -> None:
        if on_cuda:   # a worker's fresh parameters, from the host
            with torch.no_grad():
                for key, parameter in module.named_parameters():
                    parameter.copy_(host_parameters[key])
        for parameter in module.parameters():
            parameter.grad = None
        loss_fn(module(case.torch_input.to(device)), case.torch_labels.to(device)).backward()
        # hand the gradients out as numpy arrays, as the engine does (on CUDA: copied to the host, synchronizing)
        {k: p.grad.cpu().numpy() for k, p in module.named_parameters()}  # noqa: B018

    # a graph with a loop first tries one thread too (worker_client/engine/thread_choice.py): settled before
    # any torch step, whose idle OpenMP threads keep spinning on the cores for a while after it
    for _ in range(2 * (thread_choice.TRIAL_STEPS + 1)):
        if not engine.trying_threads:
            break
        engine_step()
    agreement = _agreement(engine, parameters, inputs, torch_step, module) if not engine.mask_names else None
    for _ in range(warmup):
        engine_step()
        torch_step()
    # Interleaved in blocks: a block of one system's steps, then one of the other's, the
    # order flipping every round. The first step of each block is not timed -- the other
    # system's idle worker threads may still be spinning on the same cores then. The ratio
    # is the median over rounds of the two blocks' median ratio: a pair of blocks runs
    # within seconds, so load from other processes that comes and goes cancels out.
    block_steps = min(BLOCK, steps)
    timings: dict[str, list[float]] = {"onnx-ps": [], "torch": []}
    ratios: list[float] = []
    order = [("onnx-ps", engine_step), ("torch", torch_step)]
    for round_ in range(-(-steps // block_steps)):
        block: dict[str, list[float]] = {"onnx-ps": [], "torch": []}
        for system, step in (order if round_ % 2 == 0 else order[::-1]):
            step()
            for _ in range(block_steps):
                start = time.perf_counter()
                step()
                block[system].append(time.perf_counter() - start)
            timings[system] += block[system]
        ratios.append(statistics.median(block["torch"]) / statistics.median(block["onnx-ps"]))

    size_mb = round(sum(v.nbytes for v in engine.parameters().values()) / 1e6, 4)
    context = {"batch": batch, "threads": threads, "device": device, "steps": len(timings["torch"]),
               "loadavg": harness.machine()["loadavg"]}
    records = [harness.emit(system, f"grad_step_ms_{name}", size_mb, _median_ms(samples), "ms",
                            **context, **({"engine_threads": engine.step_threads} if system == "onnx-ps" else {}))
               for system, samples in timings.items()]
    records.append(harness.emit("torch/onnx-ps", f"grad_step_speedup_{name}", size_mb,
                                statistics.median(ratios), "x", **context))
    if agreement is None:
        harness.log(f"grad_bench: {name}: its Dropouts draw different masks on the two sides; gradients not compared")
    else:
        error, compared, gradients, torch_gradients = agreement
        records.append(harness.emit("onnx-ps", f"grad_check_max_error_{name}", size_mb, error * 1e6,
                                    "ppm of the largest gradient", parameters_compared=compared, **context))
        if not compared:   # the module's parameter names are not the file's: an export of another definition
            harness.log(f"grad_bench: {name}: no parameter of the torch module has its name and shape in "
                        f"{case.onnx_path}; the file may be a stale export of another definition -- delete it "
                        f"and run again")
        elif error > AGREEMENT:
            # which side is off: both against torch in float64 (a float32 sum over a BatchNorm's quarter million
            # elements a channel can miss by 1e-2 on either side)
            engine_error, torch_error = _float64_errors(gradients, torch_gradients, module, case, loss_fn)
            for system, value in (("onnx-ps", engine_error), ("torch", torch_error)):
                records.append(harness.emit(system, f"grad_check_float64_error_{name}", size_mb, value * 1e6,
                                            "ppm of the largest float64 gradient", **context))
            harness.log(f"grad_bench: {name}: the engine's gradients differ from torch's by {error:.2e} of the "
                        f"largest gradient (more than {AGREEMENT:g}); against torch in float64 the engine's are off "
                        f"by {engine_error:.2e}, torch's float32 ones by {torch_error:.2e}"
                        + ("" if engine_error <= max(torch_error, AGREEMENT) else
                           ": the timing compares different computations"))
    return records


#: The largest difference between the two sides' gradients, relative to the largest gradient, that passes.
AGREEMENT = 1e-4


def _agreement(engine: GradientEngine, parameters: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
               torch_step: Callable[[], None], module: torch.nn.Module
               ) -> tuple[float, int, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the largest |engine - torch| over every parameter both sides name alike, over the largest |torch|
    gradient; how many parameters were compared; the engine's gradients and torch's of those), from one step of
    each on the same weights and batch."""
    gradients = engine.step(parameters, inputs).gradients
    # in full float32 as the engine computes (torch's cuDNN convs take TF32 by default; its timed steps still do)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch_step()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    theirs = {name: p.grad.cpu().numpy() for name, p in module.named_parameters()
              if name in gradients and p.grad is not None and gradients[name].shape == tuple(p.grad.shape)}
    if not theirs:
        return float("nan"), 0, gradients, theirs
    return _largest_error({k: gradients[k] for k in theirs}, theirs), len(theirs), gradients, theirs


def _largest_error(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    """The largest |got - expected| over the parameters of `expected`, over its largest |gradient|."""
    scale = max(float(np.abs(value).max()) for value in expected.values()) or 1.0
    return max(float(np.abs(got[name] - value).max()) for name, value in expected.items()) / scale


def _float64_errors(gradients: dict[str, np.ndarray], torch_gradients: dict[str, np.ndarray],
                    module: torch.nn.Module, case: Case,
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[float, float]:
    """(the engine's, torch's float32) largest difference from torch's gradients in float64 -- a copy of `module`
    on the CPU, the same weights, batch and training mode --, over the parameters both sides gave, each over the
    largest float64 gradient."""
    reference = copy.deepcopy(module).cpu().double()
    reference.zero_grad(set_to_none=True)
    labels = case.torch_labels.cpu()
    loss_fn(reference(case.torch_input.cpu().double()), labels.double() if labels.is_floating_point() else labels
            ).backward()
    exact = {name: p.grad.numpy() for name, p in reference.named_parameters() if name in torch_gradients}
    return (_largest_error({k: gradients[k].astype(np.float64) for k in exact}, exact),
            _largest_error({k: torch_gradients[k].astype(np.float64) for k in exact}, exact))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps_bench.grad_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=DEFAULT_MODELS,
                        help=f"models to run [{' '.join(DEFAULT_MODELS)}]")
    parser.add_argument("--batch", type=int, default=32,
                        help="batch size (a fixture's batch is tiled to it) [32]")
    parser.add_argument("--threads", type=int, default=1,
                        help="onnxruntime intra-op threads = torch.set_num_threads [1]")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per system [300 for a fixture, 30 for resnet18 and "
                             "transformer_cls, 40 for the others]")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first [20 for a fixture, 3 for the others]")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="gradient-model cache [$ONNX_PS_CACHE or ~/.cache/onnx-ps]")
    parser.add_argument("--export-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "onnx-ps-bench-models",
                        help="where the models past the fixtures are exported once [%(default)s]")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N: the engine's device (onnxruntime-gpu) and torch's [cpu]")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    steady = harness.steady_heap()   # torch at its best: its activations not page-faulted afresh every step
    harness.log(f"grad_bench: batch {args.batch}, {args.threads} thread(s), device {args.device}, "
                f"heap {'kept (mallopt)' if steady else 'as the C library has it'}, {harness.machine()}")
    for name in args.models:
        kind = "fixture" if name in FIXTURE_MODELS else "user" if name in USER_MODELS else "zoo"
        steps, warmup = DEFAULT_STEPS[kind]
        case = (fixture_case(name, args.batch) if kind == "fixture"
                else user_case(name, args.batch, args.export_dir) if kind == "user"
                else zoo_case(name, args.batch, args.export_dir))
        bench_model(name, case, batch=args.batch, threads=args.threads,
                    steps=args.steps if args.steps is not None else steps,
                    warmup=args.warmup if args.warmup is not None else warmup,
                    cache_dir=args.cache_dir, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
