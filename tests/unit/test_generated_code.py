"""The checked-in generated code equals what protos/generate.py makes from the .proto files."""

import importlib.util
from pathlib import Path

import pytest

# protos/generate.py is a script of the repository, not an installed module: load it by path.
_SPEC = importlib.util.spec_from_file_location("generate", Path(__file__).resolve().parents[2] / "protos" / "generate.py")
generate = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(generate)


def test_generated_modules_are_up_to_date_with_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) generates the code")
    fresh = generate.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = generate.ROOT / generate.PROTO_DIR / path.name
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make proto` and commit"


def test_every_rpc_and_field_of_the_contract_has_a_comment() -> None:
    from google.protobuf import descriptor_pb2

    from ps_proto.v1 import parameter_server_pb2 as pb

    text = (generate.ROOT / generate.PROTO_DIR / "parameter_server.proto").read_text().splitlines()
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    for method in service.methods:
        line = next(i for i, l in enumerate(text) if l.strip().startswith(f"rpc {method.name}("))
        assert text[line - 1].strip().startswith("//"), f"rpc {method.name} has no comment above it"
    assert descriptor_pb2  # the descriptor module is importable alongside the generated code
