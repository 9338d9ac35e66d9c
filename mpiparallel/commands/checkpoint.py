"""`mpiparallel checkpoint info DIR`: what a training checkpoint holds and how its tensors are sharded. No MPI
ranks: it reads manifest.json only."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def checkpoint() -> None:
    """Inspect the training checkpoints that `train --checkpoint-dir` writes."""


@checkpoint.command()
@click.argument("directory", type=click.Path(path_type=Path))
def info(directory: Path) -> None:
    """Print a checkpoint's step, the mesh it was saved from, and every tensor with its dtype, global shape and
    shards (offsets and sizes), with the total bytes.

    DIRECTORY is a step folder (DIR/step-00000100) or a checkpoint directory, whose newest complete checkpoint
    is shown.

    \b
    Example:
      mpiparallel checkpoint info checkpoints/
    """
    from .. import training_checkpoint

    saved = training_checkpoint.TrainingCheckpoint(training_checkpoint.find_checkpoint(directory))
    click.echo(training_checkpoint.describe(saved))
