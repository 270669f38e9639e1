"""A shard process with its push and pull path timed per call: ``python -P -m ps_bench.profiled_shard FLAGS``.

It takes the flags of ``ps-server`` and runs `ps_server.cli.main` unchanged, after
wrapping (in this process only) the functions a push and a pull go through
(docs/architecture.md, "The path of a push" and "... of a pull"):

| name            | what is timed                                                                    |
| --------------- | -------------------------------------------------------------------------------- |
| server.push     | the Push handler, from its start to its response (admission, decode, domain)     |
| server.receive  | waiting for the request stream's messages (the handler starts with the call)     |
| server.decode   | `service._header_and_chunks` + `service._assemble`: walking and assembling the   |
|                 | request's chunks (server.receive is inside it)                                   |
| server.push_pull| the PushPull handler, or a data channel frame's (`push_pull_on_channel`: from   |
|                 | its header and bytes received to its answer made; the frame's sending is wire)   |
| server.domain   | `Shard.push` / `Shard.push_pull`: checks, the lock, the policy, the update, read |
| server.apply    | `ParameterStore.apply`: the optimizer's update                                            |
| server.pull     | the Pull handler up to the list of messages (waiting, the lock, encoding)        |
| server.wait     | `Shard._wait`: a pull held for min_step or the SSP bound                         |
| server.encode   | `codec.encode_pull_messages` / `service.push_pull_response`: the answer's bytes  |
| server.serialize| the Pull response serializer (small chunks' messages; cached ones pass as bytes) |

Each call is kept as (start on the monotonic clock, seconds); at exit the calls are
written as JSON to the file named by $PS_BENCH_PROFILE_OUT. The monotonic clock is the
machine's, so a worker's timed window selects the calls inside it. cProfile would not do:
it sees only the main thread, and gRPC runs the handlers on its pool's threads (the data
channel its frames on a thread per connection).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections.abc import Iterator

from ps_bench import harness
from ps_server import cli, service
from ps_common import codec
from ps_server.shard import Shard
from ps_server.store import ParameterStore

OUT_ENV = "PS_BENCH_PROFILE_OUT"

#: The wrapped functions' calls, by name (harness.Timings).
timings = harness.Timings()
timed = timings.timed


def received(requests: Iterator) -> Iterator:
    """The request stream, the time spent waiting for each of its messages kept as one call of server.receive."""
    return harness.timed_iteration(requests, timings.calls.setdefault("server.receive", []))


def install() -> None:
    """Wraps the functions in the table of the module docstring."""
    servicer = service.ParameterServerServicer
    servicer.Push = timed("server.push", servicer.Push)
    servicer._pull = timed("server.pull", servicer._pull)
    stream = servicer._stream
    servicer._stream = lambda self, requests, context, rpc: received(stream(self, requests, context, rpc))
    service._header_and_chunks = timed("server.decode", service._header_and_chunks)
    service._assemble = timed("server.decode", service._assemble)
    Shard.push = timed("server.domain", Shard.push)
    Shard._wait = timed("server.wait", Shard._wait)
    ParameterStore.apply = timed("server.apply", ParameterStore.apply)
    codec.encode_pull_messages = timed("server.encode", codec.encode_pull_messages)
    # The training loop's round trip: PushPull (its values copied under the shard's lock, into the
    # worker's shared memory or for push_pull_response to encode).
    servicer.PushPull = timed("server.push_pull", servicer.PushPull)
    servicer.push_pull_on_channel = timed("server.push_pull", servicer.push_pull_on_channel)
    Shard.push_pull = timed("server.domain", Shard.push_pull)
    service.push_pull_response = timed("server.encode", service.push_pull_response)
    pass_bytes = service._pass_bytes
    service._pass_bytes = lambda serialize: timed("server.serialize", pass_bytes(serialize))


def _write() -> None:
    path = os.environ.get(OUT_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(timings.calls, f)


def main() -> int:
    install()
    atexit.register(_write)
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
