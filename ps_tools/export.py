"""The trained model comes out: the user's own ONNX graph with the values the shards trained.

Two sources, one result (`TrainedState`): the live shards of a job, read at one step with
ReadState (`read_servers`), or the shards' checkpoint folders with no shard running
(`read_checkpoints`). `write_model` puts the state into the model the user gave the job
and writes it atomically:

- every trained initializer and BatchNormalization running statistic is replaced; the
  graph keeps the inputs, outputs and opset the user gave it (no loss, no gradient nodes, no
  rewritten sparse inputs); a graph exported in training mode gets its inference form (the
  one the job's evaluation ran);
- a dynamic (hashed) table becomes the rows the shards hold, sorted by key, plus one zero
  row, and each Gather reading it reads through an `ai.onnx.ml` LabelEncoder that maps a key
  to its row (an unseen key to the zero row): onnxruntime serves it as it is
  (docs/serving.md, "Dynamic tables in an exported model");
- the step, the time and the job ride in the model's metadata (`onnx_ps.*`);
- a model above `EXTERNAL_DATA_BYTES` keeps its tensors in one external data file beside it.

Every problem is an ExportError with one line naming the thing and the values; nothing is
written in place of a good file unless the new one is whole (temporary file, rename).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ps_common import codec
from ps_common.errors import (CheckpointMismatchError, CorruptCheckpointError, ExportError, ModelLoadError,
                              ServerError, WaitTimeoutError)
from ps_common.shard_map import ParamSpec

log = logging.getLogger(__name__)

__all__ = ["EXTERNAL_DATA_BYTES", "ExportError", "TrainedState", "apply_state", "build_model", "checkpoint_folders",
           "export", "read_checkpoints", "read_servers", "write_model"]

#: A model whose tensors hold more bytes than this is written with external data (protobuf's limit is 2 GiB).
EXTERNAL_DATA_BYTES = 1 << 30
#: The metadata keys an exported model carries.
STEP_KEY = "onnx_ps.step"
SHARD_STEPS_KEY = "onnx_ps.shard_steps"
EXPORTED_AT_KEY = "onnx_ps.exported_at"
JOB_KEY = "onnx_ps.job"
DYNAMIC_EXPORT_KEY = "onnx_ps.exported_dynamic_tables"
#: The key that declares dynamic tables for training (worker_client/engine/sparse.py); an exported
#: table is keyed through its LabelEncoder, so the declaration does not carry over.
DYNAMIC_TABLES_KEY = "onnx_ps.dynamic_tables"
#: The ai.onnx.ml opset whose LabelEncoder maps int64 keys to int64 values.
ML_DOMAIN, ML_OPSET = "ai.onnx.ml", 2
#: How long a sync job's shards may take to be read at one step before the export gives up (seconds).
CONSISTENT_READ_SECONDS = 60.0
#: a sync job's shards at unequal steps that none leaves in this long have no common step to wait for
SETTLE_SECONDS = 2.0


@dataclass
class TrainedState:
    """A job's trained values, whole: dense tensors (sparse tables included) and dynamic tables' rows.

    `steps` holds each shard's step (all equal for a sync job); `dynamic` maps a table to its
    (keys sorted, rows).
    """

    specs: dict[str, ParamSpec]
    dense: dict[str, np.ndarray]
    dynamic: dict[str, tuple[np.ndarray, np.ndarray]]
    steps: list[int]
    mode: str
    source: str

    @property
    def step(self) -> int:
        """The step the values belong to: every shard's in a sync job; the lowest shard's otherwise."""
        return min(self.steps)

    @classmethod
    def merged(cls, states: Sequence["TrainedState"]) -> "TrainedState":
        """One state of several shard groups' (a pipeline job: one group per stage, each its own tensors)."""
        if len(states) == 1:
            return states[0]
        first = states[0]
        out = cls({}, {}, {}, [], first.mode, "; ".join(s.source for s in states))
        for state in states:
            taken = set(out.specs) & set(state.specs)
            if taken:
                raise ExportError(f"tensor(s) {sorted(taken)[:5]} are held by two shard groups ({state.source})")
            out.specs.update(state.specs)
            out.dense.update(state.dense)
            out.dynamic.update(state.dynamic)
            out.steps.extend(state.steps)
        return out


# ---------------------------------------------------------------------- from parts to whole tensors


def _whole(specs: Mapping[str, ParamSpec], parts: Mapping[str, list[tuple[int, np.ndarray]]],
           dynamic: Mapping[str, list[tuple[np.ndarray, np.ndarray]]], where: str
           ) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Whole tensors from every shard's parts (row ranges), checked to cover each tensor exactly once; dynamic
    tables' rows from every shard, sorted by key."""
    dense: dict[str, np.ndarray] = {}
    for name, spec in specs.items():
        if spec.dynamic is not None:
            continue
        got = sorted(parts.get(name, []), key=lambda p: p[0])
        if not got:
            raise ExportError(f"{where}: no shard holds tensor {name!r} ({spec.dtype}{list(spec.shape)})")
        if len(got) == 1 and got[0][0] == 0 and tuple(got[0][1].shape) == tuple(spec.shape):
            dense[name] = np.asarray(got[0][1])
            continue
        row = 0
        for start, value in got:
            if start != row:
                raise ExportError(f"{where}: tensor {name!r} rows [{min(start, row)}, {max(start, row)}) are "
                                  f"{'missing' if start > row else 'held twice'} (shape {list(spec.shape)})")
            row += len(value)
        if row != spec.shape[0]:
            raise ExportError(f"{where}: tensor {name!r} has rows up to {row} of {spec.shape[0]}")
        dense[name] = np.concatenate([v for _, v in got])
    tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, spec in specs.items():
        if spec.dynamic is None:
            continue
        got = dynamic.get(name, [])
        ids = np.concatenate([i for i, _ in got]) if got else np.zeros(0, np.int64)
        rows = (np.concatenate([r for _, r in got]) if got else
                np.zeros((0, *spec.shape), np.dtype(spec.dtype)))
        order = np.argsort(ids, kind="stable")
        ids, rows = ids[order], rows[order]
        if len(ids) > 1 and (ids[1:] == ids[:-1]).any():
            raise ExportError(f"{where}: dynamic table {name!r}: key {int(ids[1:][ids[1:] == ids[:-1]][0])} is "
                              "held by two shards")
        tables[name] = (ids, rows)
    return dense, tables


# ---------------------------------------------------------------------- source 1: the live shards


def read_servers(addresses: Sequence[str], *, channel_credentials=None, call_metadata: Sequence = (),
                 server_name: str | None = None, step: int | None = None,
                 timeout: float = CONSISTENT_READ_SECONDS) -> TrainedState:
    """The job's trained state read from its live shards with ReadState (the reader role suffices).

    A sync job is read at one step on every shard (read again until the shards agree, at most
    `timeout` s); an async or SSP job has no common step, and each shard's is recorded.
    `step`: wait for it, and refuse when the shards have moved past it. `channel_credentials` (TLS) and
    `call_metadata` (a token) as PSClient takes them; `server_name`: the name the shards' certificate holds.
    """
    from worker_client.client import PSClient, RetryPolicy, ShardState  # noqa: F401 (ShardState: annotation)

    client = PSClient(list(addresses), worker_id=f"export-{os.getpid()}", channel_credentials=channel_credentials,
                      call_metadata=call_metadata, shared_memory=False, rpc_timeout=max(30.0, timeout),
                      wait_timeout=timeout, retry=RetryPolicy(attempts=4, initial_backoff=0.2, max_backoff=2.0),
                      channel_options=[("grpc.ssl_target_name_override", server_name)] if server_name else ())
    try:
        try:
            client.wait_ready(timeout)
            info = client.cluster_info(0)
            shard_map = client.fetch_shard_map()
        except (TimeoutError, ServerError, ValueError) as exc:
            raise ExportError(f"cannot read the job at {','.join(addresses)}: {exc}") from None
        mode = codec.mode_from_wire(info.mode).value
        deadline = time.monotonic() + timeout
        target = step or 0
        settled = 0   # sync: reads in a row that found the shards at unequal steps, none of them moving

        def read(i: int, min_step: int, wait: float | None) -> "ShardState":
            try:
                return client.read_state(i, -1, min_step=min_step, timeout=wait)
            except WaitTimeoutError:   # behind and not moving: read it where it stands
                return client.read_state(i, -1, timeout=wait)

        previous: list[int] | None = None
        while True:
            wait = None if target == (step or 0) else min(SETTLE_SECONDS, max(0.0, deadline - time.monotonic()))
            try:
                reads = list(client._pool.map(lambda i: read(i, target, wait), range(client.num_shards)))
            except ServerError as exc:
                raise ExportError(f"cannot read the trained state of {','.join(addresses)}: {exc}") from None
            steps = [r.step for r in reads]
            if step is not None and any(s != step for s in steps):
                raise ExportError(f"step {step} is gone: the shards are at steps {steps} (live shards hold only "
                                  "their current step; export a past step from its checkpoint folders)")
            if mode != "sync" or len(set(steps)) == 1:
                break
            # A sync job's shards can stop a step or two apart (with backup workers the last pushes of a step
            # may reach one shard and not the other): once no shard moves for SETTLE_SECONDS, there is no
            # common step to wait for, and each shard's is recorded, as in async.
            settled = settled + 1 if steps == previous else 0
            if settled >= 1:
                log.warning("the sync job's shards stay at unequal steps %s (no worker brings them level): each "
                            "shard's values are read at its own step", steps)
                break
            if time.monotonic() > deadline:
                raise ExportError(f"could not read the sync job's shards at one step in {timeout:g} s: they "
                                  f"answered steps {steps}; read again when training pauses or ends")
            previous, target = steps, max(steps)
        parts: dict[str, list[tuple[int, np.ndarray]]] = {}
        dynamic: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for read in reads:
            for (name, row_start), value in read.parts.items():
                parts.setdefault(name, []).append((row_start, value))
            for name, (ids, rows) in read.rows.items():
                dynamic.setdefault(name, []).append((ids, rows))
        where = f"the shards at {','.join(addresses)}"
        dense, tables = _whole(shard_map.specs, parts, dynamic, where)
        return TrainedState(dict(shard_map.specs), dense, tables, steps, mode, f"servers {','.join(addresses)}")
    finally:
        client.close()


# ---------------------------------------------------------------------- source 2: checkpoint folders

_SHARD_FOLDER = re.compile(r"^shard(\d+)$")


def checkpoint_folders(folders: Sequence[str | os.PathLike]) -> list[Path]:
    """The shard folders to read: those given, or the `shard<i>` folders inside one given folder that holds
    no checkpoint itself (ps-launch's --checkpoint-dir layout)."""
    from ps_server.checkpoints.directory import iter_checkpoints

    paths = [Path(f) for f in folders]
    if len(paths) == 1 and paths[0].is_dir() and not iter_checkpoints(paths[0]):
        inner = sorted((int(m.group(1)), p) for p in paths[0].iterdir()
                       if p.is_dir() and (m := _SHARD_FOLDER.match(p.name)))
        if inner:
            return [p for _, p in inner]
    return paths


def read_checkpoints(folders: Sequence[str | os.PathLike], *, step: int | None = None) -> TrainedState:
    """The trained state in the shards' checkpoint folders (one per shard), with no shard running.

    Reads the newest step every folder holds (a sync job's shards checkpoint the same steps),
    or each folder's newest for an async or SSP job, or `step` when given. ExportError for a
    folder with no checkpoint, a missing or repeated shard, a step that is gone, a corrupt file.
    """
    from ps_server.checkpoints.directory import CheckpointDirectory

    paths = checkpoint_folders(folders)
    if not paths:
        raise ExportError("no checkpoint folder given")
    listed: list[tuple[Path, dict[int, Path]]] = []
    for path in paths:
        if not path.is_dir():
            raise ExportError(f"checkpoint folder {path} does not exist or is not a folder")
        found = dict(CheckpointDirectory(path).checkpoints())
        if not found:
            raise ExportError(f"checkpoint folder {path} holds no checkpoint (ckpt-<step>.safetensors)")
        listed.append((path, found))

    def read(path: Path, file: Path):
        try:
            return CheckpointDirectory(path).read(file)
        except (CorruptCheckpointError, CheckpointMismatchError) as exc:
            raise ExportError(f"checkpoint {file} cannot be read: {exc}") from None
        except OSError as exc:
            raise ExportError(f"checkpoint {file} cannot be read: {exc.strerror or exc}") from None

    newest = [read(path, found[max(found)]) for path, found in listed]
    mode = newest[0].mode
    if step is not None:
        gone = [f"{path} has steps {sorted(found)}" for path, found in listed if step not in found]
        if gone:
            raise ExportError(f"step {step} is gone: {'; '.join(gone)}")
        states = [read(path, found[step]) for path, found in listed]
    elif mode == "sync":
        common = set.intersection(*(set(found) for _, found in listed))
        if not common:
            raise ExportError("the shards' folders hold no step in common: " + "; ".join(
                f"{path} has steps {sorted(found)}" for path, found in listed))
        pick = max(common)
        states = [s if s.step == pick else read(path, found[pick])
                  for s, (path, found) in zip(newest, listed)]
    else:
        states = newest
    num_shards = states[0].num_shards
    indexes = [s.shard_index for s in states]
    if sorted(indexes) != list(range(num_shards)):
        missing = sorted(set(range(num_shards)) - set(indexes))
        repeated = sorted({i for i in indexes if indexes.count(i) > 1})
        raise ExportError(f"a partial set of checkpoint folders: the job had {num_shards} shard(s); the folders "
                          f"{[str(p) for p in paths]} hold shard(s) {indexes}"
                          + (f", shard(s) {missing} missing" if missing else "")
                          + (f", shard(s) {repeated} twice" if repeated else ""))
    for s, path in zip(states, paths):
        if s.num_shards != num_shards or [p.name for p in s.parameters] != [p.name for p in states[0].parameters]:
            raise ExportError(f"checkpoint folder {path} belongs to another job: {s.num_shards} shards and "
                              f"{len(s.parameters)} tensors, against {num_shards} and {len(states[0].parameters)}")
    specs = {p.name: p for p in states[0].parameters}
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    dynamic: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for s in states:
        for part in s.parts:
            parts.setdefault(part.name, []).append((part.row_start, part.value))
        for table in s.dynamic:
            dynamic.setdefault(table.name, []).append((table.ids, table.values))
    ordered = sorted(zip(indexes, states, paths), key=lambda t: t[0])
    dense, tables = _whole(specs, parts, dynamic, f"checkpoint folders {[str(p) for p in paths]}")
    return TrainedState(specs, dense, tables, [s.step for _, s, _ in ordered], mode,
                        "checkpoints " + ",".join(str(p) for _, _, p in ordered))


# ---------------------------------------------------------------------- into the user's graph


def _np_dtype(tensor: TensorProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))


def _check_matches(model: onnx.ModelProto, state: TrainedState, where: str) -> dict[str, TensorProto]:
    """The model's initializers by name, after checking that every tensor of the shards is one of them with the
    same dtype and shape (a dynamic table: the same row shape)."""
    initializers = {t.name: t for t in model.graph.initializer}
    missing = [n for n in state.specs if n not in initializers]
    if missing:
        raise ExportError(f"{where} does not match the shards: tensor(s) {missing[:5]} of the shards "
                          f"are not initializers of the model ({len(missing)} of {len(state.specs)}); give the "
                          "model the job trained")
    for name, spec in state.specs.items():
        tensor = initializers[name]
        dims, dtype = tuple(tensor.dims), _np_dtype(tensor)
        want = tuple(spec.shape)
        if spec.dynamic is not None:
            if dims[1:] != want or dtype != np.dtype(spec.dtype):
                raise ExportError(f"{where} does not match the shards: dynamic table {name!r} has rows "
                                  f"of {spec.dtype}{list(want)} on the shards, the model's table is "
                                  f"{dtype.name}{list(dims)}")
        elif dims != want or dtype != np.dtype(spec.dtype):
            raise ExportError(f"{where} does not match the shards: tensor {name!r} is "
                              f"{spec.dtype}{list(want)} on the shards and {dtype.name}{list(dims)} in the model")
    return initializers


def _lookup_of(graph: onnx.GraphProto, node: onnx.NodeProto, table: str) -> onnx.NodeProto | None:
    """The LabelEncoder an earlier export put before this Gather of `table` (ps-serve --follow re-keys it)."""
    for candidate in graph.node:
        if (candidate.op_type == "LabelEncoder" and candidate.domain == ML_DOMAIN and node.input[1] in candidate.output
                and candidate.name.startswith(f"{table}.key")):
            return candidate
    return None


def _set_keys(encoder: onnx.NodeProto, keys: np.ndarray) -> None:
    """A LabelEncoder's attributes for `keys` (sorted): key i -> row i, any other key -> row len(keys)."""
    del encoder.attribute[:]
    encoder.attribute.extend([helper.make_attribute("keys_int64s", keys.tolist()),
                              helper.make_attribute("values_int64s", list(range(len(keys)))),
                              helper.make_attribute("default_int64", len(keys))])


def _key_through_label_encoder(model: onnx.ModelProto, table: str, keys: np.ndarray) -> int:
    """Makes every Gather of `table` read the row of its key: Cast(indices, int64) -> LabelEncoder(key -> row,
    default: the last row), or re-keys the LabelEncoder an earlier export put there. Returns how many Gathers;
    ExportError when the table has another use."""
    graph = model.graph
    users = [n for n in graph.node if table in n.input]
    others = [n for n in users if n.op_type != "Gather" or n.input[0] != table or
              any(a.name == "axis" and a.i != 0 for a in n.attribute)]
    if others:
        raise ExportError(f"dynamic table {table!r} is read by {others[0].op_type} node {others[0].name!r}, not only "
                          "by Gather on axis 0: it cannot be keyed")
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | \
        {t.name for t in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    count = 0
    for node in graph.node:
        if node in users:
            count += 1
            existing = _lookup_of(graph, node, table)
            if existing is not None:
                _set_keys(existing, keys)
            else:
                base = f"{table}.key{count}"
                while base + ".int64" in taken or base + ".row" in taken:
                    base += "_"
                as_int64, row = base + ".int64", base + ".row"
                taken.update((as_int64, row))
                nodes.append(helper.make_node("Cast", [node.input[1]], [as_int64], name=base + ".cast",
                                              to=TensorProto.INT64))
                encoder = helper.make_node("LabelEncoder", [as_int64], [row], name=base + ".lookup", domain=ML_DOMAIN)
                _set_keys(encoder, keys)
                nodes.append(encoder)
                node.input[1] = row
        nodes.append(node)
    graph.ClearField("node")
    graph.node.extend(nodes)
    return count


def _set_metadata(model: onnx.ModelProto, values: Mapping[str, str], drop: Sequence[str] = ()) -> None:
    kept = [(p.key, p.value) for p in model.metadata_props if p.key not in values and p.key not in drop]
    del model.metadata_props[:]
    for key, value in [*kept, *values.items()]:
        model.metadata_props.add(key=key, value=value)


def build_model(model_path: str | os.PathLike, state: TrainedState, *, job: str = "") -> onnx.ModelProto:
    """The user's model at `model_path` with the trained state in it (module docstring); ExportError when the
    model does not match the shards or cannot be read."""
    from worker_client.engine.load import read_model

    model_path = Path(model_path)
    try:
        model = read_model(model_path)
    except ModelLoadError as exc:
        raise ExportError(str(exc)) from None
    apply_state(model, state, where=f"model {model_path}", job=job)
    return model


def apply_state(model: onnx.ModelProto, state: TrainedState, *, where: str, job: str = "") -> onnx.ModelProto:
    """Puts the trained state into `model` in place (module docstring) and returns it: dense values replace their
    initializers; dynamic tables become their rows plus a zero row, keyed by LabelEncoders (re-keyed when an earlier
    export made them); the inference form when the graph trains; the onnx_ps.* metadata."""
    from worker_client.engine.load import clamp_ir_version
    from worker_client.engine.training_mode import has_training_forms, inference_form

    initializers = _check_matches(model, state, where)
    for name, value in state.dense.items():
        tensor = initializers[name]
        tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value).astype(_np_dtype(tensor), copy=False),
                                                name))
    exported_tables = {}
    for name, (keys, rows) in state.dynamic.items():
        tensor = initializers[name]
        spec = state.specs[name]
        table = np.concatenate([rows.astype(_np_dtype(tensor), copy=False),
                                np.zeros((1, *spec.shape), _np_dtype(tensor))])
        tensor.CopyFrom(numpy_helper.from_array(table, name))
        gathers = _key_through_label_encoder(model, name, keys)
        exported_tables[name] = {"rows": int(len(keys)), "unseen_key_row": int(len(keys)), "gathers": gathers}
    if exported_tables:
        ml = next((o for o in model.opset_import if o.domain == ML_DOMAIN), None)
        if ml is None:
            model.opset_import.add(domain=ML_DOMAIN, version=ML_OPSET)
        elif ml.version < ML_OPSET:
            ml.version = ML_OPSET
    if has_training_forms(model):   # the form the job's evaluation ran: running statistics, no Dropout
        model.CopyFrom(inference_form(model))
    # what the job ran: the engine lowers an IR version newer than onnxruntime loads (a file declaring 99 trained,
    # then failed onnx's checker at export, and ps-serve refused it)
    clamp_ir_version(model)
    metadata = {STEP_KEY: str(state.step), SHARD_STEPS_KEY: json.dumps(state.steps),
                EXPORTED_AT_KEY: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                JOB_KEY: job or json.dumps({"mode": state.mode, "shards": len(state.steps), "source": state.source})}
    if exported_tables:
        metadata[DYNAMIC_EXPORT_KEY] = json.dumps(exported_tables, sort_keys=True)
    _set_metadata(model, metadata, drop=[DYNAMIC_TABLES_KEY])
    return model


def _tensor_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) or (t.ByteSize()) for t in model.graph.initializer)


def write_model(model: onnx.ModelProto, out: str | os.PathLike, *, external_data: bool | None = None) -> Path:
    """Writes `model` to `out` atomically (a temporary file in the same folder, checked, then renamed), its tensors
    in one external data file `<out>.<token>.data` beside it when `external_data` (None: when they hold more than
    EXTERNAL_DATA_BYTES); an older export's data file at `out` is removed once the new model is in place."""
    out = Path(out)
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ExportError(f"cannot write {out}: folder {folder} does not exist")
    if out.is_dir():
        raise ExportError(f"cannot write {out}: it is a folder; give a file name such as {out / 'model.onnx'}")
    asked = external_data is True
    if external_data is None:
        external_data = _tensor_bytes(model) > EXTERNAL_DATA_BYTES
    token = secrets.token_hex(4)
    tmp = folder / f".{out.name}.{token}.tmp"
    data_name = f"{out.name}.{token}.data"
    try:
        if external_data:
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=0 if asked else 1024)
        else:
            onnx.save_model(model, tmp)
        onnx.checker.check_model(str(tmp))
        os.replace(tmp, out)
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:
        tmp.unlink(missing_ok=True)
        (folder / data_name).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
        raise ExportError(f"the exported model does not pass onnx's checker, nothing written to {out}: {exc}") from None
    for stale in folder.glob(f"{out.name}.*.data"):
        if stale.name != data_name:
            stale.unlink(missing_ok=True)
    return out


def export(model_path: str | os.PathLike, state: TrainedState, out: str | os.PathLike, *, job: str = "",
           external_data: bool | None = None) -> Path:
    """build_model + write_model: the user's model with the trained state, written atomically to `out`."""
    model = build_model(model_path, state, job=job)
    path = write_model(model, out, external_data=external_data)
    log.info("exported %s at step %d (%s) to %s", model_path, state.step, state.source, path)
    return path
