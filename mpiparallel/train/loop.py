"""`mpiparallel train`'s run, top to bottom: read the data and the model's shape, parallelize, then the loop —
a step, a validation loss now and then, the log line, a checkpoint now and then — and at the end the bytes per
axis beside their formulas, the trace, the saved model and a sample."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np

from collectives import backend
from collectives.faults import PeerFailure
from models.transformer import Transformer

from .. import traffic
from ..checkpoints import sharded
from ..errors import ConfigError, on_every_rank
from ..mesh import Mesh
from ..trace import Tracer
from . import inputs, state
from .generate import sample_text
from .metering import NO_TRACER, memory_report, peak_flops, traffic_by_axis
from .parallelize import build_mesh, microbatch_rows, parallelize
from .preemption import Preemption
from .progress import ProgressReports
from .recovery import InPlace, MeshRule, describe, recovery_for, restart_event
from .reports import CONTINUE_LOG, Reporter
from .settings import TrainSettings
from .step import Trainer


def run(settings: TrainSettings, survivors_rule: MeshRule | None = None) -> int:
    """Train as `settings` says; return the exit status. `survivors_rule` (--elastic's, from the command line) turns
    in-place recovery on where the MPI has ULFM (`recovery`; a process that recovered ends without MPI_Finalize,
    on its way out: `recovery.leave_if_recovered`)."""
    return _train(settings, survivors_rule)


def _train(settings: TrainSettings, survivors_rule: MeshRule | None) -> int:
    from mpi4py import MPI

    progress = ProgressReports.to_parent(MPI.COMM_WORLD.Get_rank())
    progress.setup()
    mesh = build_mesh(settings, MPI.COMM_WORLD)
    recovery = recovery_for(settings, mesh.world, survivors_rule)
    xp = _array_library(settings, mesh)
    _announce_mesh(settings, mesh)
    dataset, validation = inputs.open_data(settings, mesh.world)
    settings = inputs.settle_documents(inputs.settle_vocab(settings, dataset), dataset)
    config = inputs.model_config(settings)
    tokenizer = on_every_rank(mesh.world, lambda: inputs.tokenizer(settings, dataset, config))  # errors early
    train_batches, validation_batches = inputs.batches(settings, config, dataset, validation)
    identity = inputs.data_identity(settings, dataset)
    tracer = Tracer.for_mesh(mesh, {"mesh": asdict(mesh.shape), "schedule": settings.mesh.schedule}) \
        if settings.output.trace else NO_TRACER
    job = Job(config, xp, tracer, progress, train_batches, validation_batches, identity, recovery)
    resume = state.Resume(settings, mesh, identity)
    here = job.on_mesh(settings, mesh, resume)
    if resume.story():
        here.reporter.say(resume.story())
    if recovery is not None:
        here.reporter.say("elastic: a lost rank is recovered in place (MPI fault tolerance, ULFM, is on): the "
                          "survivors agree on every step, shrink the world and go on")
    failures = InPlace.failures if recovery is not None else ()  # without recovery, a failure ends the job
    step, record = resume.first_step, {}
    while step < settings.data.steps:
        try:
            record = job.step(here, step)
            stop = job.after_step(here, step, record)
        except failures as failure:
            here = job.recover(here, failure)
            if here is None:  # a spare when the run ended
                progress.done()
                return 0
            step, record = recovery.applied, {}
            continue
        if stop:
            return job.stop(here, stop, step + 1)
        step += 1
    progress.done()
    here.preemption.close()
    job.release_spares()
    here.reporter.finish()
    _report_traffic(here.reporter, here.trainer, record)
    if settings.output.trace:
        tracer.write(settings.output.trace)
        here.reporter.say(f"wrote the trace to {settings.output.trace}")
    _finish(here.settings, here.trainer, here.reporter, tokenizer)
    return 0


@dataclass
class OnMesh:
    """What the run is on one mesh: its settings (the mesh options of a recovery's), the mesh, the trainer, the
    reporter (rank 0's writes), the preemption agreement."""

    settings: TrainSettings
    mesh: Mesh
    trainer: Trainer
    reporter: Reporter
    preemption: Preemption


@dataclass
class Job:
    """What stays when the mesh changes (in-place recovery): the model's shape, the array library, the tracer,
    the progress reports, the data, and the recovery protocol (None without it)."""

    config: Any
    xp: Any
    tracer: Any
    progress: Any
    train_batches: Any
    validation_batches: Any
    identity: dict[str, Any]
    recovery: InPlace | None
    reported: int = 0  # the last step whose record was logged

    def on_mesh(self, settings: TrainSettings, mesh: Mesh, source: Any, reporter: Reporter | None = None) -> OnMesh:
        """This rank's part of the run on `mesh`, its state from `source` (--resume, a recovery's refill)."""
        parallel = parallelize(settings, mesh, self.config, self.xp, source.load_model)
        trainer = Trainer(parallel, settings, self.tracer, self.progress)
        source.load_optimizer(trainer)
        trainer.committed = trainer.scalars()
        if self.recovery is not None:
            trainer.commit = self.recovery.commit
        peak = peak_flops(settings.model.device, mesh, self.config.n_embd, microbatch_rows(settings, mesh) *
                          settings.data.seq_len, settings.model.compute_dtype or settings.model.dtype)
        if reporter is not None and reporter.is_root and mesh.world.rank == 0:  # rank 0 stayed: its log goes on
            reporter.peak_flops = peak
        else:
            reporter = Reporter(settings, self.config, mesh.world.rank == 0, peak_flops=peak,
                                first_step=source.first_step)
            self._say_how_it_runs(reporter, settings, mesh)
        return OnMesh(settings, mesh, trainer, reporter, Preemption(mesh.world))

    def _say_how_it_runs(self, reporter: Reporter, settings: TrainSettings, mesh: Mesh) -> None:
        if settings.model.device == "gpu":
            reporter.say(f"on GPU (CuPy); GPU buffers reach MPI by {backend.transfer_path()}")
        if mesh.world.check_arguments:
            reporter.say("every collective checks first that all its ranks call it alike (--check-collectives, "
                         "MPIPARALLEL_CHECK=1): one small all-gather per call")

    def step(self, here: OnMesh, step: int) -> dict[str, Any]:
        record = here.trainer.step(self.train_batches, step)
        if _due(step, here.settings.data.eval_every, here.settings.data.steps):
            self.progress.at(step + 1, "validation")
            record["val_loss"] = here.trainer.evaluate(self.validation_batches)
        return record

    def after_step(self, here: OnMesh, step: int, record: dict[str, Any]) -> int:
        """Log the step, save a checkpoint when due; the preempting signal every rank stops for (0: none)."""
        settings = here.settings
        self.progress.at(step + 1, "end")
        here.reporter.step(record)
        self.reported = step + 1
        if settings.output.memory_report and step == here.reporter.first_step:
            here.reporter.say_from_every_rank(memory_report(here.trainer), here.mesh.world)
        stop = here.preemption.agreed()
        if settings.output.checkpoint_dir and (stop or _checkpoint_due(step, settings)):
            self.save(here, step + 1)
        return stop

    def save(self, here: OnMesh, steps_done: int) -> None:
        self.progress.at(steps_done, "checkpoint")
        here.reporter.say(state.save_and_describe(here.trainer, steps_done, self.train_batches, self.identity))

    def stop(self, here: OnMesh, number: int, steps_done: int) -> int:
        """End the run after a preempting signal: the line that says how to resume, the signal's status."""
        self.progress.done()
        here.preemption.close()
        self.release_spares()
        here.reporter.say(_how_to_resume(here.settings, number, steps_done))
        here.reporter.finish()
        return Preemption.exit_status(number)

    def release_spares(self) -> None:
        """The run is over: the spares of a recovery may end too."""
        if self.recovery is not None:
            self.recovery.release_spares()

    def recover(self, here: OnMesh | None, failure: BaseException) -> OnMesh | None:
        """A failed peer: this rank's part of the recovery (`recovery.InPlace.recover`), then, on the new mesh, the
        line and event that say what happened, and the checkpoint a failure cut short saved again. None on a
        spare whose wait ended with the run."""
        recovery = self.recovery
        assert recovery is not None
        cut_short = here.trainer.applied_record if here is not None else {}
        while True:
            if here is None:  # a spare: it holds nothing
                held, scalars, optimizer, reporter = [], None, None, None
            else:
                trainer = here.trainer
                held, scalars, optimizer, reporter = (state.held_pieces(trainer), trainer.committed,
                                                      trainer.optimizer, here.reporter)
            built, outcome = recovery.recover(failure, held, scalars, state.expected_tensors(self.config, optimizer),
                                              partial(self._rebuild, reporter))
            here = None  # the old mesh's arrays go with it
            if built is not None:
                return self._went_on(built, outcome, cut_short)
            if recovery.wait_as_spare():
                return None
            failure = PeerFailure("woken as a spare", 0)

    def _rebuild(self, reporter: Reporter | None, settings: TrainSettings, world: Any, source: Any) -> OnMesh:
        """This rank's part of the run on the survivors' mesh (the reporter kept where rank 0 stays rank 0)."""
        mesh = build_mesh(settings, world)
        source.bind(mesh, self.identity)
        os.environ[CONTINUE_LOG] = "1"  # a new rank 0 appends to the log the lost one began
        return self.on_mesh(settings, mesh, source, reporter)

    def _went_on(self, here: OnMesh, outcome: Any, cut_short: dict[str, Any]) -> OnMesh:
        applied = outcome.step
        if cut_short.get("step") == applied > self.reported:  # applied, then lost before its record was logged
            here.reporter.step(cut_short | {"time_s": 0.0, "comm_bytes": {}, "cut_short": True})
            self.reported = applied
        here.reporter.say(describe(outcome))
        here.reporter.event(restart_event(outcome))
        settings = here.settings
        if settings.output.checkpoint_dir and applied > 0 and _checkpoint_due(applied - 1, settings) and \
                not (sharded.step_folder(settings.output.checkpoint_dir, applied) / sharded.MANIFEST).is_file():
            self.save(here, applied)  # the failure cut its save short
        return here


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
