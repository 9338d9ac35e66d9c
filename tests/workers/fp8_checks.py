"""The FP8 training matrix's runs (tests/test_fp8_training.py): each mesh trains as the composition matrix's do
(`workers.composition_checks`), and rank 0 compares it with the serial FP8 run step by step — the first step's
loss and gradients (before any update: what the tiles alone change) apart from the later steps' losses (after
AdamW, whose m/√v turns a small difference in a near-zero gradient into a whole step of lr)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from .composition_checks import _losses, _train
from .errors import relative_error, worst


def matches_serial_per_step(models: dict[str, dict[str, Any]], runs: list[tuple[str, dict[str, Any]]],
                            references: str) -> list[dict]:
    """Train each run (a model's name and mesh options); on rank 0 return per run its step count, every step's
    loss error, and the worst relative error over the parameters of the first step's gradients, against the
    serial run in `references`/<model name> (`workers.composition_checks.serial_references`)."""
    world = MPI.COMM_WORLD
    results = []
    for model, options in runs:
        directory = Path(world.bcast(tempfile.mkdtemp(prefix="fp8-") if world.rank == 0 else None))
        gradients = _train({**models[model], **options}, directory)
        world.barrier()
        if world.rank == 0:
            reference = Path(references) / model
            serial_gradients = np.load(reference / "gradients.npz")
            losses, serial_losses = _losses(directory), _losses(reference)
            results.append({
                "model": model, "options": options, "steps": len(gradients),
                "loss_errors": [relative_error(a, b) for a, b in zip(losses, serial_losses, strict=True)],
                "first_step_gradient_error": worst(relative_error(grad, serial_gradients[f"0/{name}"])
                                                   for name, grad in gradients[0].items())})
    return results
