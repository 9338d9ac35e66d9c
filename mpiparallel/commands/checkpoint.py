"""`mpiparallel checkpoint info DIR [--verify]`: what a training checkpoint holds and how its tensors are
sharded, and whether its files are whole; `mpiparallel checkpoint export DIR --out HF_DIR`: the model as a
Hugging Face folder. No MPI ranks."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def checkpoint() -> None:
    """Inspect the training checkpoints that `train --checkpoint-dir` writes."""


@checkpoint.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True, help="Read every shard file: its bytes and SHA-256 against the manifest's, "
                                             "and every tensor entry in it. Exit status 3 if any differs.")
def info(directory: Path, verify: bool) -> None:
    """Print a checkpoint's step, the mesh it was saved from, and every tensor with its dtype, global shape and
    shards (offsets and sizes), with the total bytes. The shard files' sizes are checked against the manifest;
    --verify also reads every byte (SHA-256) and every tensor entry.

    DIRECTORY is a step folder (DIR/step-00000100) or a checkpoint directory, whose newest complete checkpoint
    is shown.

    \b
    Example:
      mpiparallel checkpoint info checkpoints/
      mpiparallel checkpoint info checkpoints/step-00000001 --verify
    """
    from ..checkpoints import sharded, upkeep
    from ..errors import ExitCode

    saved = sharded.TrainingCheckpoint(sharded.find_checkpoint(directory))
    click.echo(sharded.describe(saved))
    problems, notes = upkeep.verify(saved) if verify else (upkeep.size_problems(saved), [])
    for note in notes:
        click.echo(f"note: {note}")
    if problems:
        click.echo(f"Error: checkpoint {saved.folder} is damaged:\n  " + "\n  ".join(problems), err=True)
        raise SystemExit(ExitCode.CORRUPT_CHECKPOINT)
    if verify:
        click.echo(f"verified: every shard file and tensor entry of {saved.folder} matches the manifest")


@checkpoint.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The Hugging Face folder to write (config.json, model.safetensors).")
def export(directory: Path, out: Path) -> None:
    """Write a training checkpoint's model (its master weights, gathered from the shards of whatever mesh saved
    it) and the tokenizer the run trained with as a Hugging Face folder, as `train --save` does; `generate --init`
    and transformers read it.

    DIRECTORY is a step folder or a checkpoint directory (its newest complete checkpoint).

    \b
    Example:
      mpiparallel checkpoint export checkpoints/ --out model/
    """
    from ..checkpoints import sharded, upkeep
    from ..checkpoints.hugging_face import save_pretrained

    saved = sharded.TrainingCheckpoint(sharded.find_checkpoint(directory))
    config, tensors = upkeep.whole_model(saved)
    tokenizer, source = upkeep.run_tokenizer(saved)
    save_pretrained(out, config, tensors)
    if tokenizer is not None:
        tokenizer.save(out)  # beside the model, where generate --init and AutoTokenizer look for it
    click.echo(f"exported step {saved.step} of {saved.folder} to {out}; tokenizer: {source}")
