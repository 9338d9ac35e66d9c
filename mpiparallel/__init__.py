"""mpiparallel: distributed LLM training written by hand over MPI.

This package is the top floor — `collectives` (communication) ← `models` (layers) ← `mpiparallel` (training):
the training runtime (mesh, data parallelism and ZeRO, optimizer, data, checkpoints, trainer) and, in
`mpiparallel.commands`, the `mpiparallel` command line. Nothing below imports it. Importing it imports
neither mpi4py nor NumPy, so `mpiparallel --help` answers at once; MPI starts only when a command that needs
ranks runs.
"""

__version__ = "0.1.0"
