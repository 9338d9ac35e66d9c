"""`python -m mpiparallel`: the same command line as the `mpiparallel` script.

`-n N` relaunches through this entry point (`mpiexec -n N <python> -m mpiparallel ...`), so the ranks run the
interpreter and the package that the user started, whatever script directory is or is not on PATH.
"""

from .commands.cli import main

if __name__ == "__main__":
    main(prog_name="mpiparallel")
