"""Forward and backward of one step's microbatches: in turn on one rank, or as a pipeline schedule's actions.

Both return this rank's share of the summed cross-entropy and say how to sum it over the mesh (`sum_losses`),
and both record what the first microbatch's forward saved for backward (for `--memory-report`):

    MicrobatchesInTurn   no pipeline: each microbatch's forward and backward with the data-parallel engine as
                         the model's hooks, so the gradient buckets reduce while the last backward runs
    PipelinePasses       --pp: `pipeline_parallel.PipelineExecutor` runs the schedule without the engine's hooks
                         (it interleaves microbatches and splits backward); then the tied embedding's gradient
                         is summed over the first and last stage (pp's only gradient sum)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import data
from ..pipeline_parallel import PipelineExecutor, sum_tied_gradient
from .metering import sum_over
from .parallelize import Parallel, activation_shape
from .settings import TrainSettings

Pieces = list[tuple[np.ndarray, np.ndarray]]


def forward_backward_passes(parallel: Parallel, settings: TrainSettings, tracer: Any) -> Any:
    """`PipelinePasses` with a pipeline schedule, else `MicrobatchesInTurn`."""
    if parallel.schedule is None:
        return MicrobatchesInTurn(parallel)
    executor = PipelineExecutor(parallel.model, parallel.schedule, parallel.mesh.pp,
                                activation_shape(settings, parallel.mesh, parallel.model.config),
                                parallel.model.compute_dtype)
    return PipelinePasses(parallel, executor, tracer)


class MicrobatchesInTurn:
    """Forward and backward of each microbatch in turn, the data-parallel engine hooked in to overlap the
    gradient reduction with the last microbatch's backward."""

    hooked = True  # the engine's hooks run during backward (the traffic formulas count its overlap)

    def __init__(self, parallel: Parallel) -> None:
        self.model, self.engine, self.mesh = parallel.model, parallel.engine, parallel.mesh
        self.activation_bytes = 0  # what the first microbatch's forward saved for backward, all units
        self.block_activation_bytes = 0  # of that, one transformer block's

    def forward_backward(self, pieces: Pieces, normalizer: int, on_forward: Callable[[Any], None], step: int) -> float:
        loss = 0.0
        for i, (x, y) in enumerate(pieces):
            with self.engine.microbatch(last=i == len(pieces) - 1):
                microbatch_loss, saved = self.model.forward(x, y, normalizer=normalizer, hooks=self.engine)
                loss += microbatch_loss - saved.aux_loss  # the cross-entropy; the aux loss is logged apart
                on_forward(saved)
                if i == 0:
                    self.activation_bytes = saved.nbytes()
                    self.block_activation_bytes = saved.per_unit[1].nbytes() if self.model.blocks else 0
                self.model.backward(saved, hooks=self.engine)
        return loss

    def forward_only(self, x: np.ndarray, y: np.ndarray, normalizer: int) -> float:
        """Validation: the rows' cross-entropy, nothing kept for backward."""
        out, saved = self.model.forward(x, y, normalizer=normalizer, hooks=self.engine)
        return out - saved.aux_loss

    def sum_losses(self, local: float) -> float:
        """The global batch's loss: summed over DP and CP ranks (each holds other tokens)."""
        return sum_over(self.mesh.dp_cp, local)


class PipelinePasses(MicrobatchesInTurn):
    """The pipeline schedule's actions on this rank's stages (`PipelineExecutor`), without the engine's hooks."""

    hooked = False

    def __init__(self, parallel: Parallel, executor: PipelineExecutor, tracer: Any) -> None:
        super().__init__(parallel)
        self.executor, self.schedule, self.tracer = executor, executor.schedule, tracer

    def forward_backward(self, pieces: Pieces, normalizer: int, on_forward: Callable[[Any], None], step: int) -> float:
        with self.engine.unhooked():
            loss = self.executor.step(pieces, normalizer, on_forward)
        self.tracer.pipeline_actions(self.executor.timeline, self.schedule.stage_ranks, step)
        self.activation_bytes = self.executor.peak_saved_bytes
        self.block_activation_bytes = self.executor.block_saved_bytes
        sum_tied_gradient(self.model, self.mesh.pp, self.schedule.stage_ranks[0], self.schedule.stage_ranks[-1])
        return loss

    def forward_only(self, x: np.ndarray, y: np.ndarray, normalizer: int) -> float:
        with self.engine.unhooked(backward=False):
            return self.executor.forward_only(data.microbatches(x, y, self.schedule.microbatches), normalizer)

    def sum_losses(self, local: float) -> float:
        """Summed over DP and CP ranks, then over pipeline ranks (only the last stage's holds it)."""
        return sum_over(self.mesh.pp, super().sum_losses(local))
