"""One training step over the mesh — `Trainer.step`, which reads on one screen:

    batch pieces            this rank's rows of the step's batch (dp; cp: its zigzag chunks), cut in microbatches
    routing counts          --moe-aux-scope global: a forward-only pass counts every router's choices over the
                            whole step (`experts`), so each token set's aux loss is its share of the step's
    forward-backward        every microbatch in turn with the data-parallel engine hooked in (its buckets reduce
                            while backward runs), or the pipeline schedule's actions (pp: `PipelinePasses`)
    finish gradients        the engine's reductions over dp (×cp; experts over expert_dp): all-reduce, or ZeRO's
                            reduce-scatter
    model-parallel sums     the gradients still partial over tp (LayerNorms under --sp)
    overflow                float16: any inf/NaN on any rank skips the step on every rank (`scaling`)
    clip                    the global gradient norm over every rank, each piece counted once
    commit                  under in-place recovery, one fault-tolerant agreement that every rank got here (a
                            step cut short by a lost rank is then applied nowhere and redone: `recovery`)
    update                  the optimizer on what the engines hand it, then the engines' after-update gathers

Forward-backward has two forms with one interface (`Passes`), below the step: `MicrobatchesInTurn` (no pipeline: each
microbatch's forward and backward with the data-parallel engine as the model's hooks, so the gradient buckets
reduce while the last backward runs) and `PipelinePasses` (--pp: `pipeline_parallel.PipelineExecutor` runs the
schedule without the engine's hooks, then the tied embedding's gradient is summed over the first and last stage,
pp's only gradient sum). Both return this rank's share of the summed cross-entropy and say how to sum it over the
mesh (`sum_losses`).

Around the step, each in its own part: the expert tallies (`experts`), the clock and byte ledgers (`metering`),
the log (`reports`). A part that is off is an object that does nothing (no loss scaling, no tracer, a dense
model's tallies), so the step has no branches for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from models.documents import ONE_DOCUMENT, Documents
from models.parameter import counts_once, reduce_partial_gradients
from models.precision import has_overflow
from mpiparallel.axes.context_parallel.attention import zigzag_shard

from .. import data, optim
from ..axes.pipeline_parallel import PipelineExecutor, sum_tied_gradient
from ..checkpoints.sharded import MOMENT_KEYS
from ..errors import on_every_rank
from .experts import expert_tallies
from .metering import NO_TRACER, StepMeter, sum_over
from .parallelize import Parallel, activation_shape, microbatch_count, microbatch_rows
from .progress import NO_PROGRESS_REPORTS
from .scaling import forced_overflows, loss_scaler
from .settings import TrainSettings


class Trainer:
    """One optimizer step over this rank's part of the run (`parallelize.Parallel`), and the validation loss."""

    def __init__(self, parallel: Parallel, settings: TrainSettings, tracer: Any = NO_TRACER,
                 progress: Any = NO_PROGRESS_REPORTS) -> None:
        self.mesh, self.model, self.engine = parallel.mesh, parallel.model, parallel.engine
        self.optimizer, self.schedule, self.settings = parallel.optimizer, parallel.schedule, settings
        self.microbatches = microbatch_count(settings, self.mesh)
        self.microbatch_rows = microbatch_rows(settings, self.mesh)
        self.global_tokens = settings.data.batch_size * settings.data.seq_len
        self.documents = documents_rule(settings)
        self.passes = forward_backward_passes(parallel, settings, tracer, progress)
        self.progress = progress
        self.scaler = loss_scaler(settings.model)
        self.experts = expert_tallies(self.model, self.mesh, settings.mesh.sp, self.passes.sum_losses)
        self.meter = StepMeter(self.mesh, self.model, tracer)
        self.forced_overflows = forced_overflows(self.mesh.world.rank)
        self.commit: Callable[[int], None] = lambda step: None  # in-place recovery's agreement (`recovery`)
        self.committed = self.scalars()  # as of the last step applied (a step redone starts from them)
        self.applied_record: dict[str, Any] = {}  # that step's record before its gathers (what a loss there leaves)

    def step(self, batches: data.TokenBatches | np.ndarray, step: int) -> dict:
        """One optimizer step on the step's batch (`step` indexes the data and the schedule from 0); returns its
        log record, whose "step" counts from 1 as the console and the checkpoints do (record k: the k-th step, after
        which checkpoint step-k is saved) and whose loss is the batch's before the update."""
        clock, scale = self.meter.start(), self.scaler.scale
        self.progress.at(step + 1, "data")
        x, y, documents = self.rows_here(batches, step)
        pieces = data.microbatches(x, y, self.microbatches, documents)
        self.progress.at(step + 1, "routing")
        clock = self.meter.apart(clock, "routing_bytes",
                                 lambda: self.experts.count_routing(self.passes, pieces, self.global_tokens))
        self.engine.zero_grad()
        tally = self.experts.new_step()
        with self.model.scaled_objective(scale):  # float16: S·objective, gradients unscaled in the clip
            loss = self.passes.forward_backward(pieces, self.global_tokens, tally.add, step)
        self.progress.at(step + 1, "gradients")
        self.engine.finish_gradients()
        reduce_partial_gradients(self.engine.optimizer_parameters(), {"tp": self.mesh.tp})
        updates = step - self.scaler.skipped  # skipped steps hold the learning-rate schedule
        self.progress.at(step + 1, "optimizer")
        skipped = self.scaler.skip_step(lambda: self._overflowed(step))
        grad_norm = None if skipped else self._clip_gradients(1.0 / scale)
        lr = self._learning_rate(updates)
        record = {"step": step + 1, "loss": self.passes.sum_losses(loss) / scale, "lr": lr,
                  "tokens": self.global_tokens}
        record |= self.scaler.record(scale, skipped) | tally.finish()
        self.commit(step)  # in-place recovery: every rank agrees the step is whole before any applies it
        if not skipped:
            self.optimizer.step(lr)
            tally.apply()
        self.committed, self.applied_record = self.scalars(), record | {"grad_norm": grad_norm}
        self.progress.at(step + 1, "gather")
        if not skipped:
            self.engine.after_update()
        return record | self.meter.finish(clock, step) | {"grad_norm": grad_norm}

    def scalars(self) -> dict[str, Any]:
        """The state besides the arrays, the same on every rank: the optimizer's step count, the loss scaler's."""
        optimizer = {key: value for key, value in self.optimizer.state_dict().items() if key not in MOMENT_KEYS}
        return {"optimizer": optimizer, "loss_scaler": self.scaler.state_dict()}

    def rows_here(self, batches: data.TokenBatches | np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray, Any]:
        """This rank's share of the step's batch, read alone: its DP rank's rows, and of those its CP rank's two
        zigzag chunks of every sequence, with the documents of those rows' whole windows (`models.documents`:
        found before CP cuts them, since a document may open in another rank's chunk). Memory-mapped tokens are
        checked against the vocabulary as they are read; a bad id on any rank stops every rank with one message
        (`on_every_rank`). A bare token array is read in order."""
        mesh, settings = self.mesh, self.settings.data
        if not isinstance(batches, data.TokenBatches):
            batches = data.in_memory(batches, settings.batch_size, settings.seq_len)

        def read() -> tuple[np.ndarray, np.ndarray]:
            return batches.rows_for_rank(step, mesh.dp.rank, mesh.dp.size)

        x, y = on_every_rank(mesh.world, read) if batches.checked_when_read else read()
        documents = self.documents(x)
        if mesh.cp.size == 1:
            return x, y, documents
        return zigzag_shard(x, mesh.cp.rank, mesh.cp.size), zigzag_shard(y, mesh.cp.rank, mesh.cp.size), documents

    def _overflowed(self, step: int) -> bool:
        """Whether any rank's gradients hold an inf or NaN — agreed over the whole world (a sum of votes), so that
        every rank skips the same steps and no pipeline or collective waits for a rank that went on."""
        grads = [piece.grad for piece in self.engine.optimizer_parameters()]
        local = has_overflow(grads) or step in self.forced_overflows
        return sum_over(self.mesh.world, float(local)) > 0

    def _clip_gradients(self, unscale: float = 1.0) -> float:
        """Global gradient-norm clipping over the whole mesh; returns the norm before clipping. `unscale` first
        divides a loss-scaled gradient by its scale.

        One all-reduce over every rank of Σ g² over the pieces this rank counts: by their placement, a piece
        sharded over an axis (tp shards, ZeRO segments) counts on every rank of it, a replica only once."""
        if unscale != 1.0:
            for piece in self.engine.optimizer_parameters():
                piece.grad *= unscale
        def counts(piece: Any) -> bool:  # experts and hybrid sharding also name the two axes they split dp into
            return counts_once(piece.placement, self.mesh.coordinates_for(piece.placement))

        return optim.clip_grad_norm(self.engine.optimizer_parameters(), self.settings.optimizer.grad_clip,
                                    lambda local: sum_over(self.mesh.world, local), counts=counts)

    def _learning_rate(self, updates: int) -> float:
        schedule = self.settings.optimizer
        return optim.learning_rate(updates, schedule.lr, schedule.lr_schedule, schedule.warmup_steps,
                                   self.settings.data.steps)

    def evaluate(self, batches: data.TokenBatches | np.ndarray) -> float:
        """Mean loss over the first `eval_batches` held-out batches (in order), each DP rank taking its rows (no
        update)."""
        losses = []
        for i in range(self.settings.data.eval_batches):
            loss = self.passes.forward_only(*self.rows_here(batches, i), self.global_tokens)
            losses.append(self.passes.sum_losses(loss))
            self.engine.release_all()
        return float(np.mean(losses))


# -- forward-backward of one step's microbatches -------------------------------------------------------------

Pieces = list[data.Microbatch]


def documents_rule(settings: TrainSettings) -> Callable[[np.ndarray], Any]:
    """What the step's rows (B, T) of input tokens are made of: one document per window (--attention causal), or
    the documents each end-of-text token (--eot-id) opens (--attention document)."""
    if settings.model.attention == "causal":
        return lambda tokens: ONE_DOCUMENT
    eot_id = settings.data.eot_id
    return lambda tokens: Documents.of_tokens(tokens, eot_id)


def forward_backward_passes(parallel: Parallel, settings: TrainSettings, tracer: Any,
                            progress: Any = NO_PROGRESS_REPORTS) -> Passes:
    """`PipelinePasses` with a pipeline schedule, else `MicrobatchesInTurn`; both tell `progress` where they are
    (`train.progress`)."""
    if parallel.schedule is None:
        return MicrobatchesInTurn(parallel, progress)
    executor = PipelineExecutor(parallel.model, parallel.schedule, parallel.mesh.pp,
                                activation_shape(settings, parallel.mesh, parallel.model.config),
                                parallel.model.compute_dtype)
    return PipelinePasses(parallel, executor, tracer, progress)


class Passes:
    """How a step runs its forward and backward passes over the microbatches: `forward_backward` (the step's
    loss on this rank), `forward_only` (validation) and `sum_losses` (a local loss to the global batch's), and
    what the passes saved for backward (`activation_bytes`, `block_activation_bytes`). Two ways below: the
    microbatches in turn, or a pipeline schedule's actions."""

    hooked: bool  # whether the data-parallel engine's hooks run during backward (the traffic formulas count it)

    def __init__(self, parallel: Parallel, progress: Any = NO_PROGRESS_REPORTS) -> None:
        self.model, self.engine, self.mesh, self.progress = parallel.model, parallel.engine, parallel.mesh, progress
        self.activation_bytes = 0  # what the first microbatch's forward saved for backward, all units
        self.block_activation_bytes = 0  # of that, one transformer block's
        self.block_documents: Any = ONE_DOCUMENT  # the documents of the microbatch it was measured on

    def sum_losses(self, local: float) -> float:
        """The global batch's loss: summed over DP and CP ranks (each holds other tokens)."""
        return sum_over(self.mesh.dp_cp, local)


class MicrobatchesInTurn(Passes):
    """Forward and backward of each microbatch in turn, the data-parallel engine hooked in to overlap the
    gradient reduction with the last microbatch's backward."""

    hooked = True

    def forward_backward(self, pieces: Pieces, normalizer: int, on_forward: Callable[[Any], None], step: int) -> float:
        loss = 0.0
        for i, (x, y, documents) in enumerate(pieces):
            with self.engine.microbatch(last=i == len(pieces) - 1):
                self.progress.at(step + 1, "forward", i)
                microbatch_loss, saved = self.model.forward(x, y, normalizer=normalizer, hooks=self.engine,
                                                            documents=documents)
                loss += microbatch_loss - saved.aux_loss  # the cross-entropy; the aux loss is logged apart
                on_forward(saved)
                if i == 0:
                    self.activation_bytes = saved.nbytes()
                    self.block_activation_bytes = saved.per_unit[1].nbytes() if self.model.blocks else 0
                    self.block_documents = documents
                self.progress.at(step + 1, "backward", i)
                self.model.backward(saved, hooks=self.engine)
        return loss

    def forward_only(self, x: np.ndarray, y: np.ndarray, documents: Any, normalizer: int) -> float:
        """Validation: the rows' cross-entropy, nothing kept for backward."""
        out, saved = self.model.forward(x, y, normalizer=normalizer, hooks=self.engine, documents=documents)
        return out - saved.aux_loss

    def forward_only_each(self, pieces: Pieces, normalizer: int, on_forward: Callable[[Any], None]) -> None:
        """Every microbatch's forward, nothing kept for backward, `on_forward` seeing each (the global aux loss's
        counting pass)."""
        for x, y, documents in pieces:
            on_forward(self.model.forward(x, y, normalizer=normalizer, hooks=self.engine, documents=documents)[1])
        self.engine.release_all()


class PipelinePasses(Passes):
    """The pipeline schedule's actions on this rank's stages (`PipelineExecutor`), without the engine's hooks."""

    hooked = False

    def __init__(self, parallel: Parallel, executor: PipelineExecutor, tracer: Any,
                 progress: Any = NO_PROGRESS_REPORTS) -> None:
        super().__init__(parallel, progress)
        self.executor, self.schedule, self.tracer = executor, executor.schedule, tracer

    def forward_backward(self, pieces: Pieces, normalizer: int, on_forward: Callable[[Any], None], step: int) -> float:
        with self.engine.unhooked():
            loss = self.executor.step(pieces, normalizer, on_forward,
                                      lambda action: self.progress.at(step + 1, "pipeline", action))
        self.tracer.pipeline_actions(self.executor.timeline, self.schedule.stage_ranks, step)
        self.activation_bytes = self.executor.peak_saved_bytes
        self.block_activation_bytes = self.executor.block_saved_bytes
        self.block_documents = self.executor.block_saved_documents
        sum_tied_gradient(self.model, self.mesh.pp, self.schedule.stage_ranks[0], self.schedule.stage_ranks[-1])
        return loss

    def forward_only(self, x: np.ndarray, y: np.ndarray, documents: Any, normalizer: int) -> float:
        with self.engine.unhooked(backward=False):
            return self.executor.forward_only(data.microbatches(x, y, self.schedule.microbatches, documents),
                                              normalizer)

    def forward_only_each(self, pieces: Pieces, normalizer: int, on_forward: Callable[[Any], None]) -> None:
        with self.engine.unhooked(backward=False):
            self.executor.forward_only(pieces, normalizer, on_forward)
        self.engine.release_all()

    def sum_losses(self, local: float) -> float:
        """Summed over DP and CP ranks, then over pipeline ranks (only the last stage's holds it)."""
        return sum_over(self.mesh.pp, super().sum_losses(local))
