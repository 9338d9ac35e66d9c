"""The planner (`mpiparallel plan`): predicted memory, time and communication of every layout, ranked.

Modules: `core` (the arithmetic of a layout, stated once, and its names gathered; pure Python, no MPI), one module
per concern below it (`layout`, `software`, `hardware`, `shapes`, `communication`, `kernel_costs`, `deepseek_block`,
`costs`, `pipeline`, `setting`, `memory`, `results`, `step_time`, `search`: `core`'s docstring says which models what),
`deepseek` (DeepSeek-V3's counts and dispatch), `gpus` (GPU presets with their sources, the GEMM model, the two
FLOP counts), `published` (the published runs of `published_runs.csv` predicted), `calibrate` (measures α, β, γ
and the compute rates of this machine under MPI), `page` (the self-contained interactive map, `plan --html`).
"""

from .gpus import GPUS, peak_flops, preset_for_device
from .hardware import DEFAULT_PEAK_FLOPS, Cluster, load_machine
from .layout import AXES, PRECISIONS, Choices, Layout, Precision, precision_with
from .pipeline import min_microbatches
from .results import Plan
from .search import candidate_layouts, data_parallel_degree, evaluate, min_model_parallel, plan
from .shapes import Model, flops_per_token, training_mfu

__all__ = ["AXES", "DEFAULT_PEAK_FLOPS", "GPUS", "PRECISIONS", "Choices", "Cluster", "Layout", "Model", "Plan",
           "Precision", "candidate_layouts", "data_parallel_degree", "evaluate", "flops_per_token", "load_machine",
           "min_microbatches", "min_model_parallel", "peak_flops", "plan", "precision_with", "preset_for_device",
           "training_mfu"]
