from ps_proto.v1 import parameter_server_pb2 as _parameter_server_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaseRequest(_message.Message):
    __slots__ = ("shard", "epoch", "replica", "isr", "incarnation")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    shard: int
    epoch: int
    replica: str
    isr: _containers.RepeatedScalarFieldContainer[str]
    incarnation: str
    def __init__(self, shard: _Optional[int] = ..., epoch: _Optional[int] = ..., replica: _Optional[str] = ..., isr: _Optional[_Iterable[str]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class IsrRequest(_message.Message):
    __slots__ = ("shard", "epoch", "holder", "isr")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    shard: int
    epoch: int
    holder: str
    isr: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shard: _Optional[int] = ..., epoch: _Optional[int] = ..., holder: _Optional[str] = ..., isr: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaseGrant(_message.Message):
    __slots__ = ("granted", "epoch", "holder", "isr", "why", "voter")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    VOTER_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    epoch: int
    holder: str
    isr: _containers.RepeatedScalarFieldContainer[str]
    why: str
    voter: str
    def __init__(self, granted: _Optional[bool] = ..., epoch: _Optional[int] = ..., holder: _Optional[str] = ..., isr: _Optional[_Iterable[str]] = ..., why: _Optional[str] = ..., voter: _Optional[str] = ...) -> None: ...

class FollowAck(_message.Message):
    __slots__ = ("shard", "replica", "confirmed")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    shard: int
    replica: str
    confirmed: int
    def __init__(self, shard: _Optional[int] = ..., replica: _Optional[str] = ..., confirmed: _Optional[int] = ...) -> None: ...

class ReplicaOp(_message.Message):
    __slots__ = ("kind", "worker_id", "clock", "live_count", "push", "chunks", "specs", "accepted", "step_after", "clock_after")
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEP_AFTER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_AFTER_FIELD_NUMBER: _ClassVar[int]
    kind: str
    worker_id: str
    clock: int
    live_count: int
    push: _parameter_server_pb2.PushHeader
    chunks: _containers.RepeatedCompositeFieldContainer[_parameter_server_pb2.TensorChunk]
    specs: _containers.RepeatedCompositeFieldContainer[_parameter_server_pb2.ParameterSpec]
    accepted: bool
    step_after: int
    clock_after: int
    def __init__(self, kind: _Optional[str] = ..., worker_id: _Optional[str] = ..., clock: _Optional[int] = ..., live_count: _Optional[int] = ..., push: _Optional[_Union[_parameter_server_pb2.PushHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[_parameter_server_pb2.TensorChunk, _Mapping]]] = ..., specs: _Optional[_Iterable[_Union[_parameter_server_pb2.ParameterSpec, _Mapping]]] = ..., accepted: _Optional[bool] = ..., step_after: _Optional[int] = ..., clock_after: _Optional[int] = ...) -> None: ...

class SnapshotPart(_message.Message):
    __slots__ = ("metadata", "tensors", "last")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    metadata: _containers.ScalarMap[str, str]
    tensors: _containers.RepeatedCompositeFieldContainer[_parameter_server_pb2.TensorChunk]
    last: bool
    def __init__(self, metadata: _Optional[_Mapping[str, str]] = ..., tensors: _Optional[_Iterable[_Union[_parameter_server_pb2.TensorChunk, _Mapping]]] = ..., last: _Optional[bool] = ...) -> None: ...

class FollowItem(_message.Message):
    __slots__ = ("epoch", "seq", "op", "snapshot", "more", "isr")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq: int
    op: ReplicaOp
    snapshot: SnapshotPart
    more: bool
    isr: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[int] = ..., seq: _Optional[int] = ..., op: _Optional[_Union[ReplicaOp, _Mapping]] = ..., snapshot: _Optional[_Union[SnapshotPart, _Mapping]] = ..., more: _Optional[bool] = ..., isr: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FollowerState(_message.Message):
    __slots__ = ("replica", "confirmed", "in_sync")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    replica: str
    confirmed: int
    in_sync: bool
    def __init__(self, replica: _Optional[str] = ..., confirmed: _Optional[int] = ..., in_sync: _Optional[bool] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("shard", "replica", "role", "epoch", "seq", "step", "primary", "isr", "followers", "failovers", "pid", "address", "applied_gradients", "dropped")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    shard: int
    replica: int
    role: str
    epoch: int
    seq: int
    step: int
    primary: str
    isr: _containers.RepeatedScalarFieldContainer[str]
    followers: _containers.RepeatedCompositeFieldContainer[FollowerState]
    failovers: int
    pid: int
    address: str
    applied_gradients: int
    dropped: int
    def __init__(self, shard: _Optional[int] = ..., replica: _Optional[int] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., step: _Optional[int] = ..., primary: _Optional[str] = ..., isr: _Optional[_Iterable[str]] = ..., followers: _Optional[_Iterable[_Union[FollowerState, _Mapping]]] = ..., failovers: _Optional[int] = ..., pid: _Optional[int] = ..., address: _Optional[str] = ..., applied_gradients: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...
