"""Training checkpoints on every rank (see mpi_harness): a run saves on one mesh, copies of its middle checkpoint
resume on other meshes, and rank 0 compares each continuation with the uninterrupted run; and a run that dies
while writing a checkpoint. Files go under a directory the test owns, so it can inspect them afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiparallel import train
from mpiparallel.checkpoints import hugging_face, sharded

from .errors import relative_error, worst


def _train(options: dict[str, Any], folder: Path, **outputs: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    settings = train.TrainSettings.from_options(**options, log_json=str(folder / "log.jsonl"),
                                                save=str(folder / "model"), **outputs)
    train.run(settings)
    MPI.COMM_WORLD.barrier()


def _log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


def resume_on_other_meshes(common: dict[str, Any], saved_mesh: dict[str, Any], resumed_meshes: list[dict[str, Any]],
                           directory: str, every: int) -> list[dict]:
    """Train `common` on `saved_mesh` with a checkpoint every `every` steps (into DIR/saved/), then resume a copy
    of the first checkpoint on each of `resumed_meshes` (DIR/resumed-i/). On rank 0, per resumed mesh: the steps
    it ran, the worst relative errors of its losses and final tensors (expert biases included) against the
    uninterrupted run, and whether they are equal bit for bit."""
    world, root = MPI.COMM_WORLD, Path(directory)
    _train(common | saved_mesh, root / "saved", checkpoint_dir=str(root / "saved" / "checkpoints"),
           checkpoint_every=every)
    straight_log, straight = _log(root / "saved"), hugging_face.load_pretrained(root / "saved" / "model")[1]
    results = []
    for i, mesh in enumerate(resumed_meshes):
        folder = root / f"resumed-{i}"
        if world.rank == 0:
            shutil.copytree(sharded.step_folder(root / "saved" / "checkpoints", every),
                            sharded.step_folder(folder / "checkpoints", every))
        world.barrier()
        _train(common | mesh, folder, checkpoint_dir=str(folder / "checkpoints"), resume=True)
        if world.rank == 0:
            log, tensors = _log(folder), hugging_face.load_pretrained(folder / "model")[1]
            want = straight_log[every:]
            results.append({
                "mesh": mesh, "steps": [record["step"] for record in log],
                "loss_error": worst(relative_error(a["loss"], b["loss"]) for a, b in zip(log, want, strict=True)),
                "weight_error": worst(relative_error(tensors[name], value) for name, value in straight.items()),
                "bitwise": [r["loss"] for r in log] == [r["loss"] for r in want]
                and all(np.array_equal(tensors[name], value) for name, value in straight.items()),
                "tensors": sorted(tensors) == sorted(straight)})
    return results


def crash_while_saving(options: dict[str, Any], directory: str, crash_step: int) -> None:
    """Train with checkpoints into DIR/checkpoints; rank 0 dies by SIGKILL when step `crash_step`'s shard files are
    written and its manifest is about to be (the job never returns)."""
    publish = sharded.publish_manifest

    def die_at_crash_step(folder: Path, manifest: dict) -> None:
        if manifest["step"] == crash_step:
            os.kill(os.getpid(), signal.SIGKILL)
        publish(folder, manifest)

    sharded.publish_manifest = die_at_crash_step
    _train(options, Path(directory), checkpoint_dir=str(Path(directory) / "checkpoints"))
