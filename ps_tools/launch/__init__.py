"""The `ps-launch` command: a whole job -- N shards and M workers as separate local processes -- with one progress bar.

Before it starts anything it checks the job: the settings, the model file, the data, the two
against each other (worker_client.training.preflight), the metrics ports and the TensorBoard writer.
A job that cannot run ends there, with one line and exit status 2, and no process started.
It then starts the shards, learns their addresses from their READY lines, starts the
workers, shows what they log and their progress, and ends with ONE JSON line on stdout --
the job's summary (`test_accuracy`, `steps`, `seconds`, `samples_per_second`, ...).
Everything else goes to stderr, so ``ps-launch ... | tail -1`` is the summary.
``--metrics-port BASE`` serves shard i's metrics on BASE + i (printed), ``--tensorboard DIR``
writes the job's scalars, ``--record DIR`` writes run.json and plot.png.

One module per concern:

* `cli` -- the arguments, `main`, the exit status (0 done, 1 failed while running, 2 refused
  before anything started, 128 + N on signal N);
* `supervise` -- `Launcher`: the checks before anything starts, starting and stopping the
  children (ps_common.process), the event loop, timeouts and signals;
* `children` -- what the launcher knows of each child process, and the shards' and workers'
  command lines;
* `display` -- what the user sees on stderr: the bar, progress lines, log lines, JSON lines;
* `reports` -- the job's progress and summary from what the workers reported;
* `pipeline_evaluation` -- a pipeline job's evaluations of the whole model;
* `record` -- run.json, plot.png and the job's TensorBoard scalars.

docs/tools.md says what it shows, what each phase blocks on, and its exit codes.
"""

from ps_tools.launch.cli import build_parser, main
from ps_tools.launch.display import LEVELS, PLAIN, Display, Progress, display_level
from ps_tools.launch.record import plot_figure, plot_run, short_name, write_record
from ps_tools.launch.supervise import Launcher

__all__ = ["LEVELS", "PLAIN", "Display", "Launcher", "Progress", "build_parser", "display_level", "main",
           "plot_figure", "plot_run", "short_name", "write_record"]
