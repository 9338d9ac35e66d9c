"""Training over the mesh (`mpiparallel train`) and sampling (`mpiparallel generate`), in named parts.

Read one training step in this order (from `mpiparallel train` in `commands/cli.py`):

    loop.py          `run`: data and model shape, `parallelize`, then the loop (step, validation, log, checkpoint)
    parallelize.py   mesh → schedule → model → engines → optimizer: where each axis enters, every mesh check
    step.py          `Trainer.step`: batch pieces, forward-backward, finish gradients, model-parallel sums,
                     overflow, clip, update — on one screen; under it the two forms of forward-backward (the
                     microbatches in turn with the DP engine's hooks, or a pipeline schedule)
    ../data_parallel.py, ../pipeline_parallel.py   the engines the step drives

The other parts: `settings` (every option and its default: the command line reads them from there), `inputs`
(data, model shape, tokenizer), `state` (gather, save, resume), `metering` (time, bytes per axis, trace,
memory, MFU's peak), `reports` (the progress line and JSON log), `progress` (where each rank is, told to the
parent's stall watchdog), `experts` (router tallies and expert-bias
balancing), `scaling` (float16's loss scaling), `generate` (sampling).

Importing this package is cheap (the settings only, for the command line's option defaults); the parts that
start MPI load when `run`, `Trainer` or `generate` are first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .settings import DataSettings, MeshSettings, ModelSettings, OptimizerSettings, OutputSettings, TrainSettings

_LAZY = {"run": "loop", "Trainer": "step", "generate": "generate", "sample_text": "generate",
         "Reporter": "reports", "describe_model": "reports"}

__all__ = ["DataSettings", "MeshSettings", "ModelSettings", "OptimizerSettings", "OutputSettings", "TrainSettings",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
