"""`mpiparallel debug hang DIR`: what a hung job's ranks were doing, from their flight-recorder dumps
(`mpiparallel.jobs.hang`). No MPI ranks."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def debug() -> None:
    """Look into a job that went wrong."""


@debug.command()
@click.argument("directory", type=click.Path(path_type=Path))
def hang(directory: Path) -> None:
    """Read the flight-recorder dumps (flight-rank-K.json) in DIRECTORY and say, per communicator, which rank is
    behind and where it is, which call each waiting rank is in (the step of its algorithm and the peer it waits
    on), which ranks made mismatched calls, and which ranks left no dump (stopped or dead).

    Ranks write their dumps on SIGUSR2 (any launcher: `pkill -USR2 -f 'mpiparallel train'`), on an error, and
    when the stall watchdog ends a job; `train --flight-dir` says where (default: the working directory).

    On a hung job: `pkill -USR2 -f 'mpiparallel train'`, then `mpiparallel debug hang .` in its working
    directory. A finished run's last calls, which agree:

    \b
    Example:
      mpiparallel train -n 2 --steps 5 --flight-dir flight && mpiparallel debug hang flight
    """
    from ..jobs.hang import analyse

    for line in analyse(directory):
        click.echo(line)
