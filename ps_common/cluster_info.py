"""Reading a shard's ClusterInfo message: what that one shard holds.

Shared by the shard's own metrics (ps_server.metrics) and the operator's `ps-ctl status`
(ps_tools.ctl), so the server never imports the operator tools to describe itself.
"""

from __future__ import annotations

import math

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common import codec


def owned_parts_and_bytes(info: pb.ClusterInfo) -> tuple[int, int]:
    """(parts, bytes of parameter values) the shard that sent `info` holds, from its shard map."""
    specs = {p.name: p for p in info.parameters}
    parts = nbytes = 0
    for part in info.parts:
        if part.shard != info.shard_index:
            continue
        parts += 1
        spec = specs.get(part.name)
        if spec is not None:
            row = math.prod(spec.shape[1:]) * codec.dtype_from_wire(spec.dtype, name=spec.name).itemsize
            nbytes += (part.row_end - part.row_start) * row
    return parts, nbytes
