"""ps-serve's gRPC messages (protos/inference/grpc_service.proto): the specification's field numbers and types, so
tritonclient.grpc reads and writes them unchanged, and generated code that matches the .proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ps_serve.grpc_service import RPCS, SERVICE
from ps_serve.proto import grpc_service_pb2 as ours

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
generate = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(generate)


def _fields(descriptor) -> dict:
    """Every field of a message and of its nested messages: path -> (number, type, repeated, message type name)."""
    found = {}
    for field in descriptor.fields:
        kind = field.message_type.name if field.message_type is not None else None
        repeated = field.label == field.LABEL_REPEATED if hasattr(field, "label") else field.is_repeated
        found[field.name] = (field.number, field.type, repeated, kind)
    for nested in descriptor.nested_types:
        for name, value in _fields(nested).items():
            found[f"{nested.name}.{name}"] = value
    return found


def test_every_message_has_the_field_numbers_and_types_of_tritonclients_copy_of_the_specification() -> None:
    theirs = pytest.importorskip("tritonclient.grpc.service_pb2")
    names = [message.name for message in ours.DESCRIPTOR.message_types_by_name.values()]
    assert len(names) == 14
    for name in names:
        mine = _fields(ours.DESCRIPTOR.message_types_by_name[name])
        spec = _fields(theirs.DESCRIPTOR.message_types_by_name[name])
        assert mine == spec, name


def test_the_service_is_registered_under_the_specifications_name_with_its_six_rpcs() -> None:
    theirs = pytest.importorskip("tritonclient.grpc.service_pb2")
    service = theirs.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert SERVICE == service.full_name
    for rpc, (request, response, _, _) in RPCS.items():
        method = service.methods_by_name[rpc]
        assert request.DESCRIPTOR.name == method.input_type.name
        assert response.DESCRIPTOR.name == method.output_type.name


def test_our_messages_and_tritonclients_live_together_in_one_process() -> None:
    theirs = pytest.importorskip("tritonclient.grpc.service_pb2")
    request = theirs.ModelInferRequest(model_name="m", id="7", raw_input_contents=[b"\x01\x02"])
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    request.parameters["binary_data_output"].bool_param = True
    decoded = ours.ModelInferRequest.FromString(request.SerializeToString())
    assert decoded.model_name == "m" and decoded.id == "7" and decoded.raw_input_contents == [b"\x01\x02"]
    assert list(decoded.inputs[0].shape) == [1, 2] and decoded.parameters["binary_data_output"].bool_param


def test_the_generated_modules_are_up_to_date_with_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) generates the code")
    fresh = generate.generate_inference(tmp_path)
    assert sorted(p.name for p in fresh) == ["grpc_service_pb2.py", "grpc_service_pb2.pyi"]
    for path in fresh:
        committed = ROOT / generate.INFERENCE_PACKAGE_DIR / path.name
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make proto` and commit"
