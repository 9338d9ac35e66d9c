"""Parallel training runs on every rank (see mpi_harness): each configuration trains through
`mpiparallel.train.run` and rank 0 compares its losses and saved weights with a serial run's (files made by the
test). Several configurations per launch, since starting ranks is the slow part."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from mpi4py import MPI

from mpiparallel import train
from mpiparallel.checkpoints import hugging_face

from .byte_data import on_bytes
from .errors import relative_error, worst


def matches_serial(common: dict[str, Any], configs: list[dict[str, Any]], reference: str) -> list[dict]:
    """Train each configuration; on rank 0 return, per configuration, the worst relative errors of the logged
    losses and of the saved weights against the serial run in directory `reference` (log.jsonl, model/); the
    other ranks return an empty list."""
    world = MPI.COMM_WORLD
    serial_losses = [json.loads(line)["loss"] for line in (Path(reference) / "log.jsonl").read_text().splitlines()]
    serial_weights = hugging_face.load_pretrained(Path(reference) / "model")[1]
    results = []
    for options in configs:
        directory = Path(world.bcast(tempfile.mkdtemp(prefix="training-check-") if world.rank == 0 else None))
        settings = train.TrainSettings.from_options(**on_bytes({**common, **options}),
                                                    log_json=str(directory / "log.jsonl"),
                                                    save=str(directory / "model"))
        train.run(settings)
        world.barrier()
        if world.rank == 0:
            losses = [json.loads(line)["loss"] for line in (directory / "log.jsonl").read_text().splitlines()]
            weights = hugging_face.load_pretrained(directory / "model")[1]
            records = [json.loads(line) for line in (directory / "log.jsonl").read_text().splitlines()]
            results.append({"options": options, "steps": len(losses), "logs": records,
                            "pp_bytes_sent": [record["comm_bytes"]["pp"] for record in records],
                            "loss_error": worst(relative_error(a, b)
                                                 for a, b in zip(losses, serial_losses, strict=True)),
                            "weight_error": worst(relative_error(weights[n], w) for n, w in serial_weights.items())})
    return results


def serial_reference(common: dict[str, Any], directory: str) -> bool:
    """The serial run the pipeline runs are compared with (one rank): its log and saved model in `directory`."""
    train.run(train.TrainSettings.from_options(**on_bytes(common), log_json=str(Path(directory) / "log.jsonl"),
                                               save=str(Path(directory) / "model")))
    return True
