"""Pipeline stages: an ONNX model's graph cut into K consecutive subgraphs, each a model of its own.

The nodes of an ONNX graph are in topological order, so a cut is a position c in that order:
nodes 0..c go before it, the rest after. What crosses a cut (its boundary) is every tensor
made before it -- by a node, or fed as a model input -- that a node after it reads; at the
last stage's end the boundary is the loss's output (the model's first output, or the one
`output:NAME` names). Initializers are not activations: a constant read on both sides is
copied into both stages, but a trainable parameter read on both sides would train twice, so
no cut may split the readers of one (`CutError` names it).

Stage k's model (`stage_model`) holds nodes (cut k-1, cut k], the initializers they read, the
boundary before it that they read as inputs, and the boundary after it that they make as
outputs. A boundary tensor that a stage neither makes nor needs but a later stage reads is
carried through it by the runtime (`Stage.carried`), not by the graph. The batch axis of
every boundary tensor stays symbolic ("batch"), so a stage runs at any micro-batch size.

`plan_stages` chooses the cuts: given as tensor or node names (cut right after the node that
makes the tensor, or after the named node), or automatically, balancing each stage's cost --
half its share of the parameters, half its share of the estimated multiply-adds per example
-- and preferring cuts that few tensors cross. A `StagePlan` is JSON (`to_json`/`from_json`),
so a launcher can cut once and every stage worker load just its own stage's model file.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
from onnx import helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine.selection import FLOAT_TYPES
from worker_client.engine.trainables import trainable_parameters

__all__ = ["BATCH_SYMBOL", "CutError", "Stage", "StagePlan", "plan_stages", "stage_model",
           "write_stages"]

#: The batch axis' name in every stage model's boundary inputs and outputs.
BATCH_SYMBOL = "batch"
#: How much a cut's score worsens per tensor beyond one that crosses it (in shares of the
#: model's cost): a cut that one activation crosses beats one two cross unless it balances
#: the stages by this much more.
CROSSING_PENALTY = 0.03


class CutError(UnsupportedModelError):
    """The model cannot be cut as asked (too few layers, a cut that splits a parameter's
    readers, an unknown cut name)."""


@dataclass(frozen=True)
class Stage:
    """One stage: its nodes (a range of the graph's node order) and what crosses its ends."""

    index: int
    first: int                 # index of its first node
    last: int                  # index of its last node (inclusive)
    receives: list[str]        # the boundary before it (stage 0: the model's data inputs)
    sends: list[str]           # the boundary after it (the last stage: the loss's output)
    inputs: list[str]          # what of `receives` its nodes read (its model's data inputs)
    outputs: list[str]         # what of `sends` its nodes make (its model's outputs)
    carried: list[str]         # in both `receives` and `sends`: handed on by the runtime
    parameters: list[str]      # the trainable parameters its nodes read
    differentiable: list[str]  # its float inputs from an earlier stage: their gradients go back


@dataclass
class StagePlan:
    """The stages of one model, in order, and the model's data inputs and loss output."""

    stages: list[Stage]
    model_inputs: list[str]
    loss_output: str
    costs: list[float] = field(default_factory=list)   # each stage's share of the cost

    @property
    def count(self) -> int:
        return len(self.stages)

    def to_json(self) -> str:
        return json.dumps({"stages": [asdict(s) for s in self.stages],
                           "model_inputs": self.model_inputs, "loss_output": self.loss_output,
                           "costs": self.costs}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> StagePlan:
        data = json.loads(text)
        stages = [Stage(**s) for s in data["stages"]]
        return cls(stages, list(data["model_inputs"]), data["loss_output"],
                   list(data.get("costs", [])))


def _reads(node: onnx.NodeProto) -> list[str]:
    """Every name a node reads: its inputs, and the outer names its subgraphs (If, Loop, Scan) read."""
    names = [n for n in node.input if n]
    for attribute in node.attribute:
        graphs = list(attribute.g and [attribute.g] or []) + list(attribute.graphs)
        for graph in graphs:
            made = {o for n in graph.node for o in n.output} | {v.name for v in graph.input} \
                | {t.name for t in graph.initializer}
            for inner in graph.node:
                names += [n for n in _reads(inner) if n not in made]
    return names


def _static_elements(value: onnx.ValueInfoProto | None) -> int:
    """Elements per example of an inferred value (symbolic axes count 1); 1 when unknown."""
    if value is None or not value.type.tensor_type.HasField("shape"):
        return 1
    return math.prod(d.dim_value if d.HasField("dim_value") else 1
                     for d in value.type.tensor_type.shape.dim) or 1


def _symbolic_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose data inputs have axis 0 named BATCH_SYMBOL, shapes inferred (best effort)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    initializers = {t.name for t in out.graph.initializer}
    for value in out.graph.input:
        if value.name in initializers or not value.type.tensor_type.HasField("shape"):
            continue
        dims = value.type.tensor_type.shape.dim
        if len(dims):
            dims[0].Clear()
            dims[0].dim_param = BATCH_SYMBOL
    for value in out.graph.output:
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and len(dims):
            dims[0].Clear()
            dims[0].dim_param = BATCH_SYMBOL
    out.graph.ClearField("value_info")
    try:
        return onnx.shape_inference.infer_shapes(out, data_prop=True)
    except Exception:   # noqa: BLE001 -- onnx raises several kinds; the shapes are only a help here
        return out


def _inferred_values(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every input's and inferred value's type, with the batch symbolic (`_symbolic_batch`)."""
    inferred = _symbolic_batch(model).graph
    return {v.name: v for v in list(inferred.input) + list(inferred.value_info) + list(inferred.output)}


def _covered(positions: int, spans: Sequence[tuple[int, int]]) -> list[int]:
    """For each cut position 0..positions-1, how many of the inclusive ranges `spans` hold it."""
    steps = [0] * (positions + 1)
    for low, high in spans:
        if low <= high:
            steps[max(low, 0)] += 1
            steps[min(high, positions - 1) + 1] -= 1
    counts, running = [], 0
    for delta in steps[:positions]:
        running += delta
        counts.append(running)
    return counts


def _batch_first(value: onnx.ValueInfoProto) -> bool:
    """Whether an inferred value's axis 0 can be the batch: symbolic (the batch's symbol, or
    another an op such as a Reshape to -1 gave it), never a fixed length."""
    shape = value.type.tensor_type.shape
    return value.type.tensor_type.HasField("shape") and len(shape.dim) > 0 \
        and not shape.dim[0].HasField("dim_value")


def _loss_output(model: onnx.ModelProto, loss: str | None) -> str:
    if loss is not None and loss.startswith("output:"):
        return loss[len("output:"):]
    return model.graph.output[0].name


def plan_stages(model: onnx.ModelProto, count: int, *, cuts: Sequence[str] = (),
                loss: str | None = "cross_entropy", include: Sequence[str] = (),
                exclude: Sequence[str] = (), source: str = "the model") -> StagePlan:
    """The `count` stages of `model`, cut after the nodes that `cuts` name or, without
    `cuts`, where the stages' costs balance best (module docstring)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"the stage count must be a positive integer, got {count!r}")
    if cuts and len(cuts) != count - 1:
        raise CutError(f"{count} stages need {count - 1} cuts, got {len(cuts)}: {list(cuts)}")
    graph = model.graph
    nodes = list(graph.node)
    initializers = {t.name: t for t in graph.initializer}
    model_inputs = [v.name for v in graph.input if v.name not in initializers]
    loss_output = _loss_output(model, loss)
    parameters = set(trainable_parameters(model, include=include, exclude=exclude, source=source))
    reads = [_reads(n) for n in nodes]
    made_at = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    if loss_output not in made_at:
        raise CutError(f"{source}: the loss reads {loss_output!r}, which no node makes")
    last_read: dict[str, int] = {}
    first_read: dict[str, int] = {}
    for i, names in enumerate(reads):
        for name in names:
            last_read[name] = i
            first_read.setdefault(name, i)

    # cost per node: parameter elements and estimated multiply-adds per example
    values = _inferred_values(model)
    param_cost = [0.0] * len(nodes)
    flop_cost = [0.0] * len(nodes)
    for i, node in enumerate(nodes):
        out = values.get(node.output[0]) if node.output else None
        elements = _static_elements(out)
        flop_cost[i] = float(elements)
        for name in set(reads[i]) & parameters:
            if first_read[name] == i:
                dims = list(initializers[name].dims)
                param_cost[i] += math.prod(dims)
                flop_cost[i] += elements * _reduction(node, name, dims)
    total_p = sum(param_cost) or 1.0
    total_f = sum(flop_cost) or 1.0
    cost = [0.5 * p / total_p + 0.5 * f / total_f for p, f in zip(param_cost, flop_cost)]

    def boundary(c: int) -> list[str]:
        """What crosses a cut after node c (model inputs first, then in the order made)."""
        out = [n for n in model_inputs if last_read.get(n, -1) > c]
        out += [o for i in range(c + 1) for o in nodes[i].output
                if o and (last_read.get(o, -1) > c or o == loss_output)]
        return out

    def splits(c: int) -> str | None:
        """The parameter whose readers a cut after node c would split, if any."""
        for name in parameters:
            if name in first_read and first_read[name] <= c < last_read[name]:
                return name
        return None

    # what may cross a cut: tensors whose axis 0 is the batch (each micro-batch's own rows), as
    # inferred with a symbolic batch; a stage fixes axis 0 of its inputs to its micro-batch size
    batch_major = {name for name, value in values.items() if _batch_first(value)}
    # per cut position, counted once for all of them (what `boundary` and `splits` find at one):
    # the tensors that cross it, those of them that are not batch-major, the parameters it splits
    final = len(nodes) - 1
    spans = [(0, last_read.get(n, -1) - 1, n) for n in model_inputs]
    spans += [(i, final if o == loss_output else last_read.get(o, -1) - 1, o)
              for i, node in enumerate(nodes) for o in node.output if o]
    crossing = _covered(len(nodes), [(low, high) for low, high, _ in spans])
    not_batch_major = _covered(len(nodes), [(low, high) for low, high, name in spans if name not in batch_major])
    splitting = _covered(len(nodes), [(first_read[n], last_read[n] - 1) for n in parameters if n in first_read])
    holders = [i for i in range(len(nodes)) if param_cost[i] > 0]
    if cuts:
        positions = [_cut_position(nodes, made_at, name, source) for name in cuts]
        if positions != sorted(positions) or len(set(positions)) != len(positions):
            raise CutError(f"{source}: the cuts {list(cuts)} are not in the graph's order "
                           f"(node positions {positions})")
        for name, c in zip(cuts, positions):
            split = splits(c)
            if split is not None:
                raise CutError(f"{source}: a cut at {name!r} splits the readers of parameter "
                               f"{split!r}; cut before its first reader or after its last")
            odd = [n for n in boundary(c) if n not in batch_major]
            if odd:
                raise CutError(f"{source}: the cut at {name!r} would hand {odd} to the next stage, but their "
                               f"axis 0 is not the batch (or their shape is unknown): a stage takes only "
                               f"batch-major tensors; cut where only activations cross")
            if c >= made_at[loss_output]:
                raise CutError(f"{source}: the cut at {name!r} leaves no node that computes "
                               f"the loss's input {loss_output!r} after it")
    else:
        if len(holders) < count:
            raise CutError(f"{source}: {count} stages need at least {count} layers with "
                           f"parameters, but the model has {len(holders)}")
        usable = [not splitting[c] and not not_batch_major[c] for c in range(len(nodes))]
        positions = _balanced(cost, count, crossing, usable, holders, made_at[loss_output])
    ends = positions + [len(nodes) - 1]
    stages = []
    starts = [0] + [c + 1 for c in positions]
    receives = model_inputs
    float_names = {name for name, value in values.items() if value.type.tensor_type.elem_type in FLOAT_TYPES}
    for k, (first, last) in enumerate(zip(starts, ends)):
        sends = boundary(last) if k < count - 1 else [loss_output]
        local_reads = {n for i in range(first, last + 1) for n in reads[i]}
        local_made = {o for i in range(first, last + 1) for o in nodes[i].output if o}
        inputs = [n for n in receives if n in local_reads]
        outputs = [n for n in sends if n in local_made]
        carried = [n for n in sends if n in receives]
        owned = sorted(n for n in parameters if n in local_reads)
        float_inputs = [n for n in inputs if k > 0 and n in float_names]
        stages.append(Stage(k, first, last, list(receives), sends, inputs, outputs, carried,
                            owned, float_inputs))
        receives = sends
    shares = [sum(cost[s.first:s.last + 1]) for s in stages]
    return StagePlan(stages, model_inputs, loss_output, shares)


def _reduction(node: onnx.NodeProto, weight: str, dims: list[int]) -> int:
    """Multiply-adds per output element that a weight of these dims costs its node (0 for a
    bias or a scale: the output's own elements already count those)."""
    if len(dims) < 2 or weight not in node.input[1:]:
        return 0
    if node.op_type in ("Conv", "ConvTranspose"):
        return math.prod(dims[1:])
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return dims[1] if trans_b else dims[0]
    if node.op_type == "MatMul":
        return dims[-2]
    return 0


def _cut_position(nodes: list[onnx.NodeProto], made_at: dict[str, int], name: str,
                  source: str) -> int:
    if name in made_at:
        return made_at[name]
    for i, node in enumerate(nodes):
        if node.name == name:
            return i
    raise CutError(f"{source}: cut {name!r} is neither a tensor a node makes nor a node's name")


def _balanced(cost: list[float], count: int, crossing: list[int], usable: list[bool], holders: list[int],
              loss_node: int) -> list[int]:
    """K-1 cut positions, each as close as it can be to j/K of the cumulative cost, that are
    `usable` (split no parameter, cross only batch-major tensors) and leave every stage at
    least one layer with parameters (`holders`, in order); `crossing`: tensors crossing each."""
    prefix = list(itertools.accumulate(cost))
    positions: list[int] = []
    for j in range(1, count):
        target = j / count
        previous = positions[-1] if positions else -1
        held_before = bisect.bisect_right(holders, previous)
        best: tuple[float, int] | None = None
        for c in range(previous + 1, loss_node):
            held = bisect.bisect_right(holders, c)
            if held == held_before or len(holders) - held < count - j or not usable[c]:
                continue
            score = abs(prefix[c] - target) + CROSSING_PENALTY * max(0, crossing[c] - 1)
            if best is None or score < best[0]:
                best = (score, c)
        if best is None:
            raise CutError(f"no cut for stage {j} of {count}: every position splits a "
                           f"parameter's readers, crosses a tensor that is not batch-major (or "
                           f"of unknown shape), or leaves a stage without a layer; name the cuts "
                           f"(--cuts) or use fewer stages")
        positions.append(best[1])
    return positions


def stage_model(model: onnx.ModelProto, plan: StagePlan, index: int, *,
                known: dict[str, onnx.ValueInfoProto] | None = None) -> onnx.ModelProto:
    """Stage `index` of `model` as a model of its own (module docstring). `known`: the model's
    inferred values (`_inferred_values`), when the caller has them already."""
    stage = plan.stages[index]
    known = _inferred_values(model) if known is None else known
    graph = model.graph
    nodes = list(graph.node)[stage.first:stage.last + 1]
    reads = {n for node in nodes for n in _reads(node)}
    initializers = [t for t in graph.initializer if t.name in reads]

    def value(name: str) -> onnx.ValueInfoProto:
        if name not in known:   # a model input or an inferred value; a cut plan_stages made has every one
            raise CutError(f"the type of {name!r}, which crosses into or out of stage {index}, "
                           f"cannot be inferred; give the model static shapes or cut elsewhere")
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(known[name])
        return copy

    sub = helper.make_graph(nodes, f"{graph.name or 'model'}-stage{index}",
                            [value(n) for n in stage.inputs], [value(n) for n in stage.outputs],
                            initializer=initializers)
    out = helper.make_model(sub, opset_imports=list(model.opset_import),
                            producer_name=model.producer_name,
                            producer_version=model.producer_version)
    out.ir_version = model.ir_version
    for prop in model.metadata_props:   # what the model says of itself (its kind, its exporter)
        out.metadata_props.add(key=prop.key, value=prop.value)
    out.metadata_props.add(key="onnx_ps.stage", value=json.dumps(
        {"index": index, "stages": plan.count, "source_graph": graph.name}))
    return out


def write_stages(model: onnx.ModelProto, plan: StagePlan, directory: str | Path) -> list[Path]:
    """Each stage's model as `stage{k}.onnx` and the plan as `stages.json` in `directory`."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    known = _inferred_values(model)   # inferred once for every stage
    for k in range(plan.count):
        path = folder / f"stage{k}.onnx"
        onnx.save(stage_model(model, plan, k, known=known), str(path))
        paths.append(path)
    (folder / "stages.json").write_text(plan.to_json())
    return paths
