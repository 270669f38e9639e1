from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]

class ConsistencyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[ConsistencyMode]
    MODE_SYNC: _ClassVar[ConsistencyMode]
    MODE_SSP: _ClassVar[ConsistencyMode]
    MODE_ASYNC: _ClassVar[ConsistencyMode]

class PushOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_OUTCOME_UNSPECIFIED: _ClassVar[PushOutcome]
    PUSH_ACCEPTED: _ClassVar[PushOutcome]
    PUSH_DROPPED: _ClassVar[PushOutcome]

class DropReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DROP_REASON_UNSPECIFIED: _ClassVar[DropReason]
    DROP_STALE: _ClassVar[DropReason]
    DROP_ALREADY_CONTRIBUTED: _ClassVar[DropReason]
    DROP_STEP_AHEAD: _ClassVar[DropReason]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_FLOAT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT8: DType
DTYPE_BFLOAT16: DType
MODE_UNSPECIFIED: ConsistencyMode
MODE_SYNC: ConsistencyMode
MODE_SSP: ConsistencyMode
MODE_ASYNC: ConsistencyMode
PUSH_OUTCOME_UNSPECIFIED: PushOutcome
PUSH_ACCEPTED: PushOutcome
PUSH_DROPPED: PushOutcome
DROP_REASON_UNSPECIFIED: DropReason
DROP_STALE: DropReason
DROP_ALREADY_CONTRIBUTED: DropReason
DROP_STEP_AHEAD: DropReason

class ParameterSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "state", "dynamic")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    state: bool
    dynamic: DynamicTable
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., state: _Optional[bool] = ..., dynamic: _Optional[_Union[DynamicTable, _Mapping]] = ...) -> None: ...

class DynamicTable(_message.Message):
    __slots__ = ("initializer", "evict_after_steps", "seed")
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    EVICT_AFTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    initializer: str
    evict_after_steps: int
    seed: int
    def __init__(self, initializer: _Optional[str] = ..., evict_after_steps: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "row_start", "byte_offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    row_start: int
    byte_offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., row_start: _Optional[int] = ..., byte_offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("header", "chunks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    header: InitHeader
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, header: _Optional[_Union[InitHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class InitHeader(_message.Message):
    __slots__ = ("parameters", "worker_id")
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    worker_id: str
    def __init__(self, parameters: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class InitResponse(_message.Message):
    __slots__ = ("already_initialized", "step", "num_parts")
    ALREADY_INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    already_initialized: bool
    step: int
    num_parts: int
    def __init__(self, already_initialized: _Optional[bool] = ..., step: _Optional[int] = ..., num_parts: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunks", "row_gradients")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ROW_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    row_gradients: _containers.RepeatedCompositeFieldContainer[RowGradient]
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., row_gradients: _Optional[_Iterable[_Union[RowGradient, _Mapping]]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "clock", "read_step", "row_gradients")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    READ_STEP_FIELD_NUMBER: _ClassVar[int]
    ROW_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    clock: int
    read_step: int
    row_gradients: _containers.RepeatedCompositeFieldContainer[RowGradient]
    def __init__(self, worker_id: _Optional[str] = ..., clock: _Optional[int] = ..., read_step: _Optional[int] = ..., row_gradients: _Optional[_Iterable[_Union[RowGradient, _Mapping]]] = ...) -> None: ...

class RowGradient(_message.Message):
    __slots__ = ("name", "ids", "dtype", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    data: bytes
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("outcome", "drop_reason", "message", "step", "clock", "duplicate", "aggregated")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DROP_REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    outcome: PushOutcome
    drop_reason: DropReason
    message: str
    step: int
    clock: int
    duplicate: bool
    aggregated: int
    def __init__(self, outcome: _Optional[_Union[PushOutcome, str]] = ..., drop_reason: _Optional[_Union[DropReason, str]] = ..., message: _Optional[str] = ..., step: _Optional[int] = ..., clock: _Optional[int] = ..., duplicate: _Optional[bool] = ..., aggregated: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("names", "min_step", "worker_id", "clock", "wait_timeout_ms", "wire_dtype")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    min_step: int
    worker_id: str
    clock: int
    wait_timeout_ms: int
    wire_dtype: DType
    def __init__(self, names: _Optional[_Iterable[str]] = ..., min_step: _Optional[int] = ..., worker_id: _Optional[str] = ..., clock: _Optional[int] = ..., wait_timeout_ms: _Optional[int] = ..., wire_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("step", "chunks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, step: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class RowIds(_message.Message):
    __slots__ = ("name", "ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("tables", "min_step", "worker_id", "clock", "wait_timeout_ms")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[RowIds]
    min_step: int
    worker_id: str
    clock: int
    wait_timeout_ms: int
    def __init__(self, tables: _Optional[_Iterable[_Union[RowIds, _Mapping]]] = ..., min_step: _Optional[int] = ..., worker_id: _Optional[str] = ..., clock: _Optional[int] = ..., wait_timeout_ms: _Optional[int] = ...) -> None: ...

class RowValues(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadStateRequest(_message.Message):
    __slots__ = ("since_step", "whole", "min_step", "wait_timeout_ms")
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    since_step: int
    whole: _containers.RepeatedScalarFieldContainer[str]
    min_step: int
    wait_timeout_ms: int
    def __init__(self, since_step: _Optional[int] = ..., whole: _Optional[_Iterable[str]] = ..., min_step: _Optional[int] = ..., wait_timeout_ms: _Optional[int] = ...) -> None: ...

class ReadStateResponse(_message.Message):
    __slots__ = ("step", "chunks", "rows", "state_id", "dynamic_tables")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_TABLES_FIELD_NUMBER: _ClassVar[int]
    step: int
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    rows: _containers.RepeatedCompositeFieldContainer[RowValues]
    state_id: str
    dynamic_tables: _containers.RepeatedCompositeFieldContainer[DynamicTableInfo]
    def __init__(self, step: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., rows: _Optional[_Iterable[_Union[RowValues, _Mapping]]] = ..., state_id: _Optional[str] = ..., dynamic_tables: _Optional[_Iterable[_Union[DynamicTableInfo, _Mapping]]] = ...) -> None: ...

class PullRowsResponse(_message.Message):
    __slots__ = ("step", "tables")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    step: int
    tables: _containers.RepeatedCompositeFieldContainer[RowValues]
    def __init__(self, step: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[RowValues, _Mapping]]] = ...) -> None: ...

class PullAfterPush(_message.Message):
    __slots__ = ("names", "wait_for_step", "ssp", "wait_timeout_ms", "shared_memory", "wire_dtype", "rows")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_STEP_FIELD_NUMBER: _ClassVar[int]
    SSP_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    wait_for_step: bool
    ssp: bool
    wait_timeout_ms: int
    shared_memory: bool
    wire_dtype: DType
    rows: _containers.RepeatedCompositeFieldContainer[RowIds]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., wait_for_step: _Optional[bool] = ..., ssp: _Optional[bool] = ..., wait_timeout_ms: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., rows: _Optional[_Iterable[_Union[RowIds, _Mapping]]] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("header", "chunks", "pull", "gradients_in_shared_memory")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_IN_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    pull: PullAfterPush
    gradients_in_shared_memory: bool
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., pull: _Optional[_Union[PullAfterPush, _Mapping]] = ..., gradients_in_shared_memory: _Optional[bool] = ...) -> None: ...

class PushPullResponse(_message.Message):
    __slots__ = ("step", "chunks", "push", "ready", "rows")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    step: int
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    push: PushResponse
    ready: bool
    rows: _containers.RepeatedCompositeFieldContainer[RowValues]
    def __init__(self, step: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., push: _Optional[_Union[PushResponse, _Mapping]] = ..., ready: _Optional[bool] = ..., rows: _Optional[_Iterable[_Union[RowValues, _Mapping]]] = ...) -> None: ...

class SharedMemoryRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class SharedMemoryResponse(_message.Message):
    __slots__ = ("name", "size", "values_offset", "door", "ticket")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DOOR_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    values_offset: int
    door: str
    ticket: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., values_offset: _Optional[int] = ..., door: _Optional[str] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class DataChannelRequest(_message.Message):
    __slots__ = ("worker_id", "wire_dtype", "names")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    wire_dtype: DType
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class DataChannelResponse(_message.Message):
    __slots__ = ("port", "ticket", "size", "values_offset", "tls", "idle_ms")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    size: int
    values_offset: int
    tls: bool
    idle_ms: int
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., size: _Optional[int] = ..., values_offset: _Optional[int] = ..., tls: _Optional[bool] = ..., idle_ms: _Optional[int] = ...) -> None: ...

class DataChannelStatus(_message.Message):
    __slots__ = ("code", "reason", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("name", "participant_id", "participants", "timeout_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    participant_id: str
    participants: int
    timeout_ms: int
    def __init__(self, name: _Optional[str] = ..., participant_id: _Optional[str] = ..., participants: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ("generation", "arrived")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    arrived: int
    def __init__(self, generation: _Optional[int] = ..., arrived: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("clock", "step", "lease_ms")
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    clock: int
    step: int
    lease_ms: int
    def __init__(self, clock: _Optional[int] = ..., step: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ms", "step")
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    step: int
    def __init__(self, lease_ms: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "clock", "live", "lease_remaining_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    clock: int
    live: bool
    lease_remaining_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., clock: _Optional[int] = ..., live: _Optional[bool] = ..., lease_remaining_ms: _Optional[int] = ...) -> None: ...

class PartAssignment(_message.Message):
    __slots__ = ("name", "row_start", "row_end", "shard")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    row_start: int
    row_end: int
    shard: int
    def __init__(self, name: _Optional[str] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("shard_index", "num_shards", "mode", "replicas_to_aggregate", "total_replicas", "staleness", "max_staleness", "step", "initialized", "parameters", "parts", "workers", "optimizer", "partition_min_bytes", "chunk_bytes", "effective_replicas", "dropped_stale", "dynamic_tables", "row_gradients_continue")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PARTITION_MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_TABLES_FIELD_NUMBER: _ClassVar[int]
    ROW_GRADIENTS_CONTINUE_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    mode: ConsistencyMode
    replicas_to_aggregate: int
    total_replicas: int
    staleness: int
    max_staleness: int
    step: int
    initialized: bool
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    parts: _containers.RepeatedCompositeFieldContainer[PartAssignment]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    optimizer: str
    partition_min_bytes: int
    chunk_bytes: int
    effective_replicas: int
    dropped_stale: int
    dynamic_tables: _containers.RepeatedCompositeFieldContainer[DynamicTableInfo]
    row_gradients_continue: bool
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., mode: _Optional[_Union[ConsistencyMode, str]] = ..., replicas_to_aggregate: _Optional[int] = ..., total_replicas: _Optional[int] = ..., staleness: _Optional[int] = ..., max_staleness: _Optional[int] = ..., step: _Optional[int] = ..., initialized: _Optional[bool] = ..., parameters: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., parts: _Optional[_Iterable[_Union[PartAssignment, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., optimizer: _Optional[str] = ..., partition_min_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., effective_replicas: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., dynamic_tables: _Optional[_Iterable[_Union[DynamicTableInfo, _Mapping]]] = ..., row_gradients_continue: _Optional[bool] = ...) -> None: ...

class DynamicTableInfo(_message.Message):
    __slots__ = ("name", "rows", "created", "evicted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    created: int
    evicted: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., created: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetParametersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetParametersResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...
