"""The `mpiparallel` command line and its subcommands.

`cli` parses the arguments (click) and hands each command to its module: `bench` and `verify` here, `train`
and `generate` to the training runtime one floor up (`mpiparallel.train`). `launch` starts the ranks (`-n N`
relaunches under mpiexec) and gives every error one ending. `schedule` (no ranks: it simulates pipeline
schedules), `plan`, `checkpoint`, `data` and `plot` (a training log drawn with matplotlib) define their click
commands in their own modules.
Importing this package starts neither MPI nor NumPy, so `mpiparallel --help` answers at once.
"""
