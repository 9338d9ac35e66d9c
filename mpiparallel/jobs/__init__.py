"""The job machinery: how ranks are started, watched and ended — everything a training run needs from outside
the math, kept apart so that a reader of the teaching core (collectives, models, the parallel axes, train/) never
has to open it. Nothing in the core imports this package; the command line (`mpiparallel.commands`) drives it.

- `launch`: self-launch under mpiexec (`-n N`), the parent that supervises the ranks (naming a lost rank or
  host), and one exit path with one message for every error.
- `stall`: the stall watchdog (`--stall-timeout`), fed by the ranks' progress reports (`train.progress`).
- `elastic`: `train --elastic`, relaunching the survivors from the newest checkpoint on a mesh that fits.
- `hosts`: hostfiles, the launch line across hosts, and what was lost when a host dies or drops off the network.
- `namespace_cluster`: hosts made of network namespaces on one machine (`mpiparallel cluster`), to test all this.
- `slurm_cluster`: a Slurm of the namespace hosts' own (`cluster up --scheduler slurm`).
- `slurm_launch`: `-n N` inside a Slurm allocation: srun starts the ranks; a lost node; `--elastic` on the nodes left.

Rank-side counterparts live with the loop they serve: `train.progress` (what a rank reports) and
`train.preemption` (SIGTERM/SIGUSR1 ending a run at a step boundary).
"""
