"""`mpiparallel plot LOG.jsonl`: a training run's JSON log (`train --log-json`) drawn with matplotlib — the loss
(and validation loss), tokens per second, and the bytes each mesh axis sent per step. No MPI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError


def read_log(path: Path) -> list[dict[str, Any]]:
    """The step records of a JSON log, in order (other events, such as restarts, left out)."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{path} line {number} is not JSON: is it a `train --log-json` log?") from None
        if "loss" in record and "step" in record:
            records.append(record)
    if not records:
        raise ConfigError(f"{path} holds no training steps (`train --log-json` writes one line per step)")
    return records


def draw(records: list[dict[str, Any]]) -> Any:
    """A figure of three panels over the steps (counted from 1): loss, tokens/s, bytes sent per mesh axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [record["step"] for record in records]
    figure, (loss, speed, traffic) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss.plot(steps, [record["loss"] for record in records], label="train")
    validated = [(step, record["val_loss"]) for step, record in zip(steps, records, strict=True)
                 if "val_loss" in record]
    if validated:
        loss.plot(*zip(*validated, strict=True), "o-", label="validation")
    loss.set_ylabel("loss")
    loss.legend()
    speed.plot(steps, [record["tokens"] / record["time_s"] for record in records])
    speed.set_ylabel("tokens/s")
    axes = sorted({axis for record in records for axis in record.get("comm_bytes", {})})
    for axis in axes:
        traffic.plot(steps, [record.get("comm_bytes", {}).get(axis, 0) / 1e6 for record in records], label=axis)
    traffic.set_ylabel("MB sent per step (this rank)")
    traffic.set_xlabel("step")
    if axes:
        traffic.legend()
    figure.tight_layout()
    return figure


@click.command()
@click.argument("log", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The image to write (its suffix picks the format). [default: LOG with .png]")
def plot(log: Path, out: Path | None) -> None:
    """Draw a training log: loss (and validation loss), tokens/s and the bytes sent per mesh axis, per step.

    LOG is a file written by `train --log-json` (rank 0's records). Needs matplotlib.

    \b
    Examples:
      mpiparallel train -n 2 --zero 1 --steps 30 --log-json run.jsonl && mpiparallel plot run.jsonl -o run.png
    """
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError("drawing needs matplotlib: pip install matplotlib")
    out = out or log.with_suffix(".png")
    draw(read_log(log)).savefig(out, dpi=100)
    click.echo(f"wrote {out}")
