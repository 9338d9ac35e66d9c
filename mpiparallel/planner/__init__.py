"""The planner (`mpiparallel plan`): predicted memory, time and communication of every layout, ranked.

Modules: `core` (the model of a layout and the search; pure Python, no MPI), `gpus` (GPU presets with their
sources, the GEMM model, the two FLOP counts), `published` (the published runs of `published_runs.csv`
predicted), `calibrate` (measures α, β, γ and the compute rates of this machine under MPI), `page` (the
self-contained interactive map, `plan --html`).
"""

from .core import (
    AXES,
    DEFAULT_PEAK_FLOPS,
    PRECISIONS,
    Choices,
    Cluster,
    Layout,
    Model,
    Plan,
    Precision,
    candidate_layouts,
    data_parallel_degree,
    evaluate,
    flops_per_token,
    load_machine,
    min_microbatches,
    min_model_parallel,
    plan,
    precision_with,
    training_mfu,
)
from .gpus import GPUS, peak_flops, preset_for_device

__all__ = ["AXES", "DEFAULT_PEAK_FLOPS", "GPUS", "PRECISIONS", "Choices", "Cluster", "Layout", "Model", "Plan",
           "Precision", "candidate_layouts", "data_parallel_degree", "evaluate", "flops_per_token", "load_machine",
           "min_microbatches", "min_model_parallel", "peak_flops", "plan", "precision_with", "preset_for_device",
           "training_mfu"]
