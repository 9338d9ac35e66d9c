"""The planner (`mpiparallel plan`): predicted memory, time and communication of every layout, ranked.

Modules: `core` (the model of a layout and the search; pure Python, no MPI), `calibrate` (measures α, β, γ and
the compute rates of this machine under MPI), `page` (the self-contained interactive map, `plan --html`).
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
    load_machine,
    min_microbatches,
    min_model_parallel,
    plan,
    precision_with,
)

__all__ = ["AXES", "DEFAULT_PEAK_FLOPS", "PRECISIONS", "Choices", "Cluster", "Layout", "Model", "Plan", "Precision",
           "candidate_layouts", "data_parallel_degree", "evaluate", "load_machine", "min_microbatches",
           "min_model_parallel", "plan", "precision_with"]
