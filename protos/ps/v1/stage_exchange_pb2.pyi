from ps_proto.v1 import parameter_server_pb2 as _parameter_server_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_KIND_UNSPECIFIED: _ClassVar[StageKind]
    ACTIVATIONS: _ClassVar[StageKind]
    COTANGENTS: _ClassVar[StageKind]
    COMMIT: _ClassVar[StageKind]
    END: _ClassVar[StageKind]
STAGE_KIND_UNSPECIFIED: StageKind
ACTIVATIONS: StageKind
COTANGENTS: StageKind
COMMIT: StageKind
END: StageKind

class StageHeader(_message.Message):
    __slots__ = ("replica", "from_stage", "to_stage", "kind", "step", "micro_batch", "micro_batches")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    replica: int
    from_stage: int
    to_stage: int
    kind: StageKind
    step: int
    micro_batch: int
    micro_batches: int
    def __init__(self, replica: _Optional[int] = ..., from_stage: _Optional[int] = ..., to_stage: _Optional[int] = ..., kind: _Optional[_Union[StageKind, str]] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., micro_batches: _Optional[int] = ...) -> None: ...

class StageMessage(_message.Message):
    __slots__ = ("header", "chunks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    header: StageHeader
    chunks: _containers.RepeatedCompositeFieldContainer[_parameter_server_pb2.TensorChunk]
    def __init__(self, header: _Optional[_Union[StageHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[_parameter_server_pb2.TensorChunk, _Mapping]]] = ...) -> None: ...

class StageAck(_message.Message):
    __slots__ = ("duplicate", "stale", "discarded_through")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    stale: bool
    discarded_through: int
    def __init__(self, duplicate: _Optional[bool] = ..., stale: _Optional[bool] = ..., discarded_through: _Optional[int] = ...) -> None: ...
