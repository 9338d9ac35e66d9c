"""mpiparallel: distributed LLM training written by hand over MPI.

This package is the top floor (see DESIGN.md): the `mpiparallel` command line today, and the mesh, data
parallelism, pipeline schedules and trainer as they arrive. It builds on `collectives` and never the other way
round. Importing it imports neither mpi4py nor NumPy, so `mpiparallel --help` answers at once; MPI starts only
when a command that needs ranks runs.
"""

__version__ = "0.1.0"
