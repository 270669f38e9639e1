"""Export a factorization machine from PyTorch to ONNX, with torch autograd's gradients on one batch.

Run from the repository root with an environment that has torch (it is not a project
dependency; nothing in the package imports this script):

    python models/recsys/export_fm.py            (torch 2.13 made the committed fm.onnx / fm.npz)
    python models/recsys/export_fm.py --fields 26 --vocab 100000 --dim 32 --out /tmp/fm_big.onnx

The model (Rendle 2010) reads ``ids``: (batch, fields) int64 global ids, field f's ids in
``[f * vocab, (f + 1) * vocab)`` as ``synthetic:clicks`` draws them (ps_models.datasets), so
both tables are read by one plain ``Gather`` on axis 0 of a graph input -- what the engine's
sparse stage needs (an offset added inside the graph, or ``nn.EmbeddingBag``, would not be):

* ``factors.weight`` (fields * vocab, dim): the latent vectors v;
* ``linear.weight`` (fields * vocab, 1): the first-order weights w;
* ``bias`` (1,): the global bias.

``z = bias + sum_f w[id_f] + 0.5 * sum_k ((sum_f v[id_f, k])^2 - sum_f v[id_f, k]^2)``, the
pairwise term ``sum_{f<g} <v[id_f], v[id_g]>`` in O(fields * dim). The output ``logits``
(batch, 2) is ``[-z/2, z/2]``: its softmax is ``[1 - sigmoid(z), sigmoid(z)]``, so the
engine's ``cross_entropy`` is the logistic loss of z and ps-launch reports ``test_auc``.

It exports with the legacy exporter (``dynamo=False``) in training mode without constant
folding at opset 18, with a dynamic batch axis, checks that every torch parameter is the
initializer of the same name and value, and writes beside the .onnx a .npz: ``input:ids``
and ``labels`` (a batch of 16 with repeated ids), ``loss`` and ``grad:<parameter>``, torch
autograd in float64 on the float32 parameters (tests/unit/test_recsys_fm.py compares
the engine with them, densely and sparsely). The export is deterministic (``--seed``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

HERE = Path(__file__).resolve().parent
OPSET = 18
#: The reference batch's size.
REFERENCE_BATCH = 16


class FactorizationMachine(nn.Module):
    """A second-order factorization machine over one table of global ids (see the module docstring)."""

    def __init__(self, rows: int, dim: int, *, init_std: float) -> None:
        super().__init__()
        self.factors = nn.Embedding(rows, dim)
        self.linear = nn.Embedding(rows, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        with torch.no_grad():
            self.factors.weight.normal_(0.0, init_std)
            self.linear.weight.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        v = self.factors(ids)                                            # (B, F, D)
        summed = v.sum(dim=1)                                            # (B, D)
        pairwise = 0.5 * (summed * summed - (v * v).sum(dim=1)).sum(dim=1, keepdim=True)   # (B, 1)
        z = self.bias + self.linear(ids).sum(dim=1) + pairwise           # (B, 1)
        return torch.cat([-0.5 * z, 0.5 * z], dim=1)                     # (B, 2)


def export(module: nn.Module, example: torch.Tensor) -> onnx.ModelProto:
    """The training-mode, unfolded legacy export with a dynamic batch axis."""
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)     # the legacy-exporter notice
        path = Path(folder) / "model.onnx"
        torch.onnx.export(module, (example,), path, dynamo=False, opset_version=OPSET,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["ids"], output_names=["logits"],
                          dynamic_axes={"ids": {0: "batch"}, "logits": {0: "batch"}})
        return onnx.load(path)


def check_names(module: nn.Module, model: onnx.ModelProto) -> None:
    """Every torch parameter is exactly one float initializer of the same name and value."""
    parameters = dict(module.named_parameters())
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                    if t.data_type == onnx.TensorProto.FLOAT}
    if set(parameters) != set(initializers):
        raise SystemExit(f"torch parameters {sorted(parameters)} do not map one-to-one onto the float "
                         f"initializers {sorted(initializers)}")
    for key, parameter in parameters.items():
        if not np.array_equal(parameter.detach().numpy(), initializers[key]):
            raise SystemExit(f"initializer {key!r} differs from the torch parameter")


def reference(module: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, dict[str, np.ndarray]]:
    """Cross-entropy of the logits and its gradients by torch autograd, in float64."""
    exact = {k: v.detach().to(torch.float64).requires_grad_(True) for k, v in module.named_parameters()}
    with torch.enable_grad():
        output = torch.func.functional_call(module.to(torch.float64), exact, (ids,))
        loss = F.cross_entropy(output, labels)
        grads = torch.autograd.grad(loss, list(exact.values()))
    module.to(torch.float32)
    return float(loss.detach()), {k: g.numpy() for k, g in zip(exact, grads)}


def reference_batch(fields: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """REFERENCE_BATCH rows of global ids (a few popular ids per field, so ids repeat across rows) and labels."""
    rng = np.random.default_rng(seed)
    local = rng.integers(0, min(vocab, 4), size=(REFERENCE_BATCH, fields))
    local[::3] = rng.integers(0, vocab, size=local[::3].shape)
    ids = local + np.arange(fields) * vocab
    labels = rng.integers(0, 2, size=REFERENCE_BATCH)
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fields", type=int, default=10, help="categorical fields per example")
    p.add_argument("--vocab", type=int, default=1000, help="ids per field (the tables have fields * vocab rows)")
    p.add_argument("--dim", type=int, default=16, help="latent factors per id")
    p.add_argument("--init-std", type=float, default=0.05, help="standard deviation of the initial factors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "fm.onnx", help="the .onnx to write (the .npz goes beside it)")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    module = FactorizationMachine(args.fields * args.vocab, args.dim, init_std=args.init_std).eval()
    ids, labels = reference_batch(args.fields, args.vocab, args.seed)
    model = export(module, ids)
    check_names(module, model)
    loss, grads = reference(module, ids, labels)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, args.out)
    npz = args.out.with_suffix(".npz")
    arrays = {"input:ids": ids.numpy(), "labels": labels.numpy(), "loss": np.array(loss, np.float64),
              **{f"grad:{k}": v for k, v in grads.items()}}
    np.savez_compressed(npz, allow_pickle=False, **arrays)
    for path in (args.out, npz):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
