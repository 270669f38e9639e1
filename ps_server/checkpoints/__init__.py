"""Shard checkpoints: the whole state of one shard in one safetensors file, written atomically, restored on start.

Four modules, one concern each: `state` (the snapshot dataclasses and their checks against
the configuration), `fileformat` (state <-> safetensors tensors and metadata), `directory`
(atomic write, claim, prune, quarantine of corrupt files) and `writer` (when to write: the
Checkpointer thread). The shard's components each give and take their own part of a
snapshot (store, membership, policy); `ps_server.shard.Shard.snapshot/restore` gathers them.

What a checkpoint holds, per shard (one file `ckpt-<step:012d>.safetensors`, in a
directory of its own per shard; `SHARD.json` there names the shard index and count that
own it, and another shard pointed at that directory refuses to start):

- tensors: every owned part's value `param/<name>@<row_start>`, every optimizer slot
  (including the int64 "step" counter) `slot/<name>@<row_start>/<slot>`, and in sync
  mode the step's accumulator `acc/<name>@<row_start>`. Keys are identifiers only: the
  state JSON below maps each part to its keys, so tensor names may hold any character.
- metadata (the safetensors header's `__metadata__`): `format`, `format_version`,
  `state` (JSON: shard index, num shards, mode and consistency settings,
  partition_min_bytes, the full parameter list so the shard map can be rebuilt, the
  optimizer's name and hyperparameters, the global step, dropped and applied counts, every
  worker's clock, liveness and its window of recent push outcomes, and in sync mode the
  step's contributors) and `checksum`, a CRC-32 over the state JSON and every tensor's
  key, dtype, shape and bytes.

Writing: the state is copied under the shard's lock (one consistent cut: no push is half
in it), then written outside the lock to a hidden temporary file in the same directory,
fsynced, renamed to its final name and the directory fsynced. A crash at any point leaves
either the complete file or no file under the final name (a leftover temporary file is
removed at the next start). The newest `keep` checkpoints are kept.

Restoring: the newest checkpoint that reads back whole (header parses, every tensor is
there, checksum matches) wins; one that does not is skipped with a warning naming the
file and the reason, renamed to `<name>.corrupt` (kept, never deleted), and the previous
one is tried. A checkpoint of another shard index, shard count, mode, partition size or
optimizer, or of a newer format version, is refused with CheckpointMismatchError; the
server does not start. Changed hyperparameters or sync/ssp/async bounds are taken from
the new configuration, with a warning.

Why a push is still applied at most once across a restart. A shard that restarts from
a checkpoint taken at time T is exactly the shard as it was at T: the parameters and
every worker's clock are from the same cut. For any worker, the pushes it made before T
are in both the parameters and its clock (so a retry of one of them, clock < the
restored clock, is acknowledged as a duplicate with its remembered outcome and not
applied again); the pushes it made after T are in neither (so their retries, and the
worker's next pushes, clock >= the restored clock, are applied to the restored
parameters once). What the shard did after T is lost, as with any checkpoint; it is
never counted twice.

Sync mode: the in-flight partial step is checkpointed, not discarded. Discarding it is
not safe: a worker whose gradient sat in the lost accumulator has its clock advanced in
the checkpoint (the clock moves in the same critical section as the accumulation), so
its retry would be answered "duplicate" and never re-added, and the step would wait for a
gradient that no one will send again (until every wait timed out). Rolling those clocks
back instead would not help a worker that already got its "accepted" answer: it only
pulls for step t+1 and does not push again. Keeping the accumulator and the
contributors makes the cut consistent: contributors' retries are duplicates, everyone
else's push for step t is added, and the step completes with the same mean it would
have had without the crash. The price is one more copy of the shard's size in the file
while a step is partly in.

After a restore the shard's step may be lower than the step a worker last saw (the
steps after T were lost). A worker must pull again (min_step 0, or the shard's step)
before it pushes: a push whose read_step is ahead of the shard's step is dropped
(DROP_STEP_AHEAD), and a pull waiting for a lost step, or for an SSP bound over clocks the
shard lost, would wait until its timeout. The training loop waits in slices of a few
seconds and, between them, asks every shard for its step and its clock for the worker
(worker_client.client.PSClient.lost_progress), then pulls a shard that went back as it is.

Leases are monotonic times and do not survive a process: a worker that was live at T
gets a fresh lease on restore (so a sync step or an SSP bound does not move on without
it at once; a dead one expires after one lease), a worker that had left stays gone.
Barriers are not checkpointed: a barrier's waiters see UNAVAILABLE and call again.

Admin.ResetParameters (Shard.reset) drops the parameters; the Checkpointer then writes
the reset state at once and deletes every older checkpoint, since their higher steps
would otherwise win at the next start and bring the dropped parameters back.

Costs: the copy under the lock takes about a memcpy of the shard (and of the sync
accumulator), and the process holds that second copy while the file is written.
"""

from ps_server.checkpoints.directory import CheckpointDirectory, checkpoint_name, checkpoint_step, iter_checkpoints
from ps_server.checkpoints.fileformat import FORMAT, FORMAT_VERSION, decode, encode
from ps_server.checkpoints.state import (OutcomeSnapshot, PartSnapshot, ShardState, WorkerSnapshot,
                                         check_compatible)
from ps_server.checkpoints.writer import Checkpointer

__all__ = ["FORMAT", "FORMAT_VERSION", "CheckpointDirectory", "Checkpointer", "OutcomeSnapshot", "PartSnapshot",
           "ShardState", "WorkerSnapshot", "check_compatible", "checkpoint_name", "checkpoint_step", "decode", "encode",
           "iter_checkpoints"]
