"""`mpiparallel train`'s run, top to bottom: read the data and the model's shape, parallelize, then the loop —
a step, a validation loss now and then, the log line, a checkpoint now and then — and at the end the bytes per
axis beside their formulas, the trace, the saved model and a sample."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from collectives import backend
from models.transformer import Transformer

from .. import traffic
from ..errors import ConfigError, on_every_rank
from ..mesh import Mesh
from ..trace import Tracer
from . import inputs, state
from .generate import sample_text
from .metering import NO_TRACER, memory_report, peak_flops, traffic_by_axis
from .parallelize import build_mesh, microbatch_rows, parallelize
from .preemption import Preemption
from .progress import ProgressReports
from .reports import Reporter
from .settings import TrainSettings
from .step import Trainer


def run(settings: TrainSettings) -> int:
    """Train as `settings` says; return the exit status."""
    from mpi4py import MPI

    progress = ProgressReports.to_parent(MPI.COMM_WORLD.Get_rank())
    progress.setup()
    mesh = build_mesh(settings, MPI.COMM_WORLD)
    xp = _array_library(settings, mesh)
    _announce_mesh(settings, mesh)
    dataset, validation = inputs.open_data(settings, mesh.world)
    settings = inputs.settle_vocab(settings, dataset)
    config = inputs.model_config(settings)
    tokenizer = on_every_rank(mesh.world, lambda: inputs.tokenizer(settings, dataset, config))  # errors early
    train_batches, validation_batches = inputs.batches(settings, config, dataset, validation)
    identity = inputs.data_identity(settings, dataset)
    resume = state.Resume(settings, mesh, identity)
    parallel = parallelize(settings, mesh, config, xp, resume.load_model)
    tracer = Tracer.for_mesh(mesh, {"mesh": asdict(mesh.shape), "schedule": settings.mesh.schedule}) \
        if settings.output.trace else NO_TRACER
    trainer = Trainer(parallel, settings, tracer, progress)
    resume.load_optimizer(trainer)
    peak = peak_flops(settings.model.device, mesh, config.n_embd, microbatch_rows(settings, mesh) *
                      settings.data.seq_len, settings.model.compute_dtype or settings.model.dtype)
    reporter = Reporter(settings, config, mesh.world.rank == 0, peak_flops=peak, first_step=resume.first_step)
    if settings.model.device == "gpu":
        reporter.say(f"on GPU (CuPy); GPU buffers reach MPI by {backend.transfer_path()}")
    if mesh.world.check_arguments:
        reporter.say("every collective checks first that all its ranks call it alike (--check-collectives, "
                     "MPIPARALLEL_CHECK=1): one small all-gather per call")
    if resume.story():
        reporter.say(resume.story())
    preemption = Preemption(mesh.world)
    record: dict[str, Any] = {}
    for step in range(resume.first_step, settings.data.steps):
        record = trainer.step(train_batches, step)
        if _due(step, settings.data.eval_every, settings.data.steps):
            progress.at(step + 1, "validation")
            record["val_loss"] = trainer.evaluate(validation_batches)
        progress.at(step + 1, "end")
        reporter.step(record)
        if settings.output.memory_report and step == resume.first_step:
            reporter.say_from_every_rank(memory_report(trainer), mesh.world)
        stop = preemption.agreed()
        if settings.output.checkpoint_dir and (stop or _checkpoint_due(step, settings)):
            progress.at(step + 1, "checkpoint")
            reporter.say(state.save_and_describe(trainer, step + 1, train_batches, identity))
        if stop:
            progress.done()
            preemption.close()
            reporter.say(_how_to_resume(settings, stop, step + 1))
            reporter.finish()
            return Preemption.exit_status(stop)
    progress.done()
    preemption.close()
    reporter.finish()
    _report_traffic(reporter, trainer, record)
    if settings.output.trace:
        tracer.write(settings.output.trace)
        reporter.say(f"wrote the trace to {settings.output.trace}")
    _finish(settings, trainer, reporter, tokenizer)
    return 0


def _report_traffic(reporter: Reporter, trainer: Trainer, record: dict[str, Any]) -> None:
    """The last step's bytes per axis, on every rank, beside the formulas' (and across nodes, on several)."""
    world = trainer.mesh.world
    if world.size == 1 or not record:
        return
    reporter.say("bytes each rank sent in the last step, per mesh axis, beside the formula that predicts them "
                 "(mpiparallel/traffic.py):")
    reporter.say_from_every_rank(traffic.format_line(world.rank, traffic_by_axis(trainer, record["comm_bytes"])),
                                 world)
    if "inter_node_bytes" in record:
        reporter.say("of them, the bytes sent to another node, beside the formula's:")
        rows = traffic_by_axis(trainer, record["inter_node_bytes"], across_nodes=True)
        reporter.say_from_every_rank(traffic.format_line(world.rank, rows, "across nodes"), world)


def _finish(settings: TrainSettings, trainer: Trainer, reporter: Reporter, tokenizer: Any) -> None:
    """--save the model (with its tokenizer) and print a --sample-tokens sample."""
    output, world, config = settings.output, trainer.mesh.world, trainer.model.config
    full = state.full_model_tensors(trainer) if output.save or output.sample_tokens else {}
    if output.save:
        state.save_model(settings, config, full, tokenizer, world)
        reporter.say(f"saved the model to {output.save}")
    if not output.sample_tokens or world.rank != 0:
        return
    if tokenizer is None:
        reporter.say(f"no sample: the vocabulary has {config.vocab_size} tokens and neither the data nor the "
                     f"model folder has a tokenizer.json to decode them")
        return
    serial = Transformer(config, dtype=np.dtype(settings.model.dtype))
    serial.load_state_dict(full)
    reporter.say(sample_text(serial, prompt="The " if tokenizer.kind == "byte" else "The",
                             new_tokens=output.sample_tokens, seed=settings.model.seed, window=settings.data.seq_len,
                             tokenizer=tokenizer))


def _announce_mesh(settings: TrainSettings, mesh: Mesh) -> None:
    if mesh.world.rank == 0 and settings.output.show_mesh:
        print(mesh.describe(), flush=True)
    if mesh.world.rank == 0 and mesh.topology_warning():
        print(mesh.topology_warning(), flush=True)


def _array_library(settings: TrainSettings, mesh: Mesh) -> Any:
    """NumPy, or CuPy with this rank bound to a GPU of its machine (--device gpu)."""
    if settings.model.device == "cpu":
        return np
    reason = backend.gpu_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"--device gpu: {reason}")
    backend.bind_device(mesh.world.comm)
    return backend.gpu_array_module()


def _checkpoint_due(step: int, settings: TrainSettings) -> bool:
    """--checkpoint-every N: after every N-th step and the last; --checkpoint-dir alone: after the last."""
    every, steps = settings.output.checkpoint_every, settings.data.steps
    return _due(step, every, steps) or step + 1 == steps


def _how_to_resume(settings: TrainSettings, number: int, steps_done: int) -> str:
    stopped = f"stopped by {Preemption.name(number)} after step {steps_done}/{settings.data.steps}"
    if not settings.output.checkpoint_dir:
        return f"{stopped}; nothing saved (no --checkpoint-dir): a new run starts from step 0"
    return (f"{stopped}; to continue, run the same command with --resume (it reads "
            f"{settings.output.checkpoint_dir})")


def _due(step: int, every: int, steps: int) -> bool:
    """Whether a periodic action runs after 0-based `step`: every `every` steps, and after the last one."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)
