"""The composition matrix's runs (see tests/runtime/test_composition.py): each configuration trains through
`mpiparallel.train.run`, and after every step every rank gathers the whole model's reduced gradients — ZeRO
shards all-gathered over dp (×cp), TP shards over tp, pipeline stages and EP ranks' experts merged — so rank 0
can compare them, with the losses and the saved weights, against a serial run's. Several configurations per
launch, since starting ranks is the slow part.

The gradients are the clipped ones the update used (still in place after the step), recorded by running
the loop with a `Trainer` that records them after each step (swapped in for the duration of one run).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiparallel.checkpoints import hugging_face
from mpiparallel.train import loop as train
from mpiparallel.train.state import gather_over_model_axes

from .arrays import host, parallel_array_module
from .byte_data import on_bytes
from .errors import relative_error, worst


class RecordingTrainer(train.Trainer):
    """The training loop's `Trainer`, keeping the serial-model gradients of every step (on every rank)."""

    recorded: list[dict[str, np.ndarray]] = []

    def step(self, tokens: np.ndarray, step: int) -> dict:
        record = super().step(tokens, step)
        RecordingTrainer.recorded.append(self.whole_gradients())
        return record

    def whole_gradients(self) -> dict[str, np.ndarray]:
        """The serial model's gradient of every parameter, gathered over every axis that splits it."""
        engines = getattr(self.engine, "engines", [self.engine])
        held = {name: grad for engine in engines for name, grad in engine.full_gradients().items()}
        return {name: host(grad) for name, grad in gather_over_model_axes(self.model, self.mesh, held).items()}


@contextmanager
def recording_gradients() -> Iterator[list[dict[str, np.ndarray]]]:
    """`train.run` builds a `RecordingTrainer` while this is open; yields the list its steps append to."""
    original, RecordingTrainer.recorded = train.Trainer, []
    train.Trainer = RecordingTrainer
    try:
        yield RecordingTrainer.recorded
    finally:
        train.Trainer = original


def _train(options: dict[str, Any], directory: Path) -> list[dict[str, np.ndarray]]:
    settings = train.TrainSettings.from_options(**on_bytes(options), log_json=str(directory / "log.jsonl"),
                                                save=str(directory / "model"))
    with recording_gradients() as gradients:
        train.run(settings)
    return gradients


def serial_references(models: dict[str, dict[str, Any]], directory: str) -> bool:
    """Every model's serial run (one rank): its log, saved model and per-step gradients (gradients.npz) in
    `directory`/<model name>."""
    for name, options in models.items():
        here = Path(directory) / name
        here.mkdir(parents=True, exist_ok=True)
        gradients = _train(options, here)
        np.savez(here / "gradients.npz", **{f"{step}/{parameter}": grad for step, grads in enumerate(gradients)
                                            for parameter, grad in grads.items()})
    return True


def _losses(directory: Path) -> list[float]:
    """Every step's training loss, then the validation losses (the steps that evaluated)."""
    records = [json.loads(line) for line in (directory / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records] + [r["val_loss"] for r in records if "val_loss" in r]


def matches_serial(models: dict[str, dict[str, Any]], runs: list[tuple[str, dict[str, Any]]],
                   references: str) -> list[dict]:
    """Train each run (a model's name and the mesh options on top of it); on rank 0 return, per run, its step
    count and the worst relative errors of its losses (training and validation), gradients (every parameter,
    every step) and saved weights against the model's serial run in `references`/<model name>; the other ranks
    return an empty list."""
    world = MPI.COMM_WORLD
    if any(options.get("device") == "gpu" for _, options in runs):
        parallel_array_module()  # MPIPARALLEL_TEST_ARRAYS=fake: the CuPy double stands in for the GPU
    results = []
    for model, options in runs:
        directory = Path(world.bcast(tempfile.mkdtemp(prefix="composition-") if world.rank == 0 else None))
        gradients = _train({**models[model], **options}, directory)
        world.barrier()
        if world.rank == 0:
            results.append({"model": model, "options": options,
                            **_compare(directory, gradients, Path(references) / model)})
    return results


def _compare(directory: Path, gradients: list[dict[str, np.ndarray]], reference: Path) -> dict:
    """Worst relative errors of a run in `directory` (with its recorded `gradients`) against the serial run in
    `reference`: training and validation losses, gradients, weights. Every serial loss and gradient must have its
    parallel twin (a missing one raises)."""
    serial_weights = hugging_face.load_pretrained(reference / "model")[1]
    serial_gradients = np.load(reference / "gradients.npz")
    weights = hugging_face.load_pretrained(directory / "model")[1]
    losses, serial_losses = _losses(directory), _losses(reference)
    return {"steps": len((directory / "log.jsonl").read_text().splitlines()), "losses": len(losses),
            "loss_error": worst(relative_error(a, b) for a, b in zip(losses, serial_losses, strict=True)),
            "gradient_error": worst(relative_error(gradients[int(step)][name], serial_gradients[key])
                                    for key in serial_gradients.files for step, name in [key.split("/", 1)]),
            "gradients_compared": len(serial_gradients.files),
            "weight_error": worst(relative_error(weights[name], w) for name, w in serial_weights.items())}


def unhooked_gradients_match_hooked(zeros: list[int], microbatch_count: int = 2) -> dict[int, float]:
    """For each ZeRO stage, one engine per way of running a step, both with `overlap` on: the hooks, microbatch
    by microbatch; and the model without hooks inside `engine.unhooked()` (as a pipeline schedule runs it), split
    backward included. Returns, by stage, the worst relative difference of their reduced gradients."""
    return {zero: _unhooked_against_hooked(zero, microbatch_count) for zero in zeros}


def _unhooked_against_hooked(zero: int, microbatch_count: int) -> float:
    from collectives import Communicator
    from models.transformer import GPTConfig, Transformer
    from mpiparallel import data
    from mpiparallel.axes.data_parallel import data_parallel

    config = GPTConfig(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    comm = Communicator(MPI.COMM_WORLD)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, 8 * 16 + 1)
    inputs, targets = tokens[:-1].reshape(8, 16), tokens[1:].reshape(8, 16)
    pieces = data.microbatches(*data.rows_for_rank(inputs, targets, comm.rank, comm.size), microbatch_count)
    gradients = []
    for hooked in (True, False):
        model = Transformer(config, seed=0, dtype=np.dtype("float64"))
        engine = data_parallel(model, comm, zero=zero, bucket_mb=0.004, overlap=True)
        engine.zero_grad()
        if hooked:
            for i, (x, y, _) in enumerate(pieces):
                with engine.microbatch(last=i == len(pieces) - 1):
                    model.backward(model.forward(x, y, normalizer=inputs.size, hooks=engine)[1], hooks=engine)
        else:
            with engine.unhooked():
                for x, y, _ in pieces:
                    saved = model.forward(x, y, normalizer=inputs.size)[1]
                    model.backward_input(saved)
                    model.backward_weights(saved)
        engine.finish_gradients()
        gradients.append(engine.full_gradients())
    return worst(relative_error(gradients[1][name], grad) for name, grad in gradients[0].items())
