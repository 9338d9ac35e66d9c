"""The layout search: every layout train would accept for a model on a cluster (`plan`'s fixed choices kept), each
evaluated, the ones that fit ranked by step time; and the seeds' closed-form answers.

Candidates: dp·tp·pp·cp = the GPUs; tp inside a node, dividing the heads and the MLP width, and the KV heads or a
multiple of them; pp·chunks ≤ layers; 2·cp dividing the sequence (Ulysses: cp dividing a TP rank's heads, and its
KV heads dividing cp or cp them); ep dividing dp and the experts (the two-hop dispatch only for node-limited
routing); ZeRO ≤ 1 with a pipeline; microbatches ≥ pp dividing the rows of a DP rank (the first three such and the
largest). `min_model_parallel` = ⌈N · bytes per parameter / GPU memory⌉; `data_parallel_degree` = GPUs / (tp·pp·cp).

The search prices each candidate's memory first and times only the layouts that fit (the others are never shown);
a layout whose model states, averaged over its pipeline ranks, already exceed a GPU's memory is dropped before its
schedule is built (`memory.least_largest_states`, a lower bound of its largest rank's memory). Unit costs, the
collectives' and kernels' times and the schedules are cached across layouts: the answers are `evaluate`'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any, NamedTuple

from mpiparallel.axes.context_parallel.attention import VARIANTS as CP_ATTENTIONS
from mpiparallel.axes.tensor_parallel import check_tensor_parallel_shape

from ..schedules import SCHEDULES, stage_units
from ..schedules.build import check_arguments
from . import deepseek
from .costs import unit_costs, unit_kinds
from .hardware import Cluster
from .layout import RECOMPUTE, Choices, Layout, Precision
from .memory import least_largest_states, rank_memory, stage_activation_bytes, stage_memory
from .pipeline import SIMULATED_ACTIONS, pipeline_shape
from .results import Plan, report_throughput
from .setting import Setting
from .shapes import Model, local_kv_heads, scaled_unit_parameters
from .step_time import timed_plan


def evaluate(model: Model, cluster: Cluster, precision: Precision, layout: Layout, batch_size: int,
             weights_only: bool = False) -> Plan:
    """Memory, time and communication of one layout (a valid one: see `candidate_layouts`)."""
    return _timed(_held_memory(model, cluster, precision, layout, batch_size, weights_only), batch_size)


class _Memory(NamedTuple):
    """One layout's setting and memory, before its time."""

    setting: Setting
    per_unit: list[float]
    tied: float
    stage_saved: list[float]
    per_rank: list[dict[str, float]]

    @property
    def fits(self) -> bool:
        return max(rank["total"] for rank in self.per_rank) <= self.setting.cluster.gpu_memory


def _held_memory(model: Model, cluster: Cluster, precision: Precision, layout: Layout, batch_size: int,
                 weights_only: bool) -> _Memory:
    setting, per_unit, tied = _setting(model, cluster, precision, layout, batch_size)
    stage_saved = stage_activation_bytes(setting, weights_only)
    per_rank = [rank_memory(setting, rank, per_unit, tied, stage_saved) for rank in range(layout.pp)]
    return _Memory(setting, per_unit, tied, stage_saved, per_rank)


def _surely_too_big(model: Model, cluster: Cluster, precision: Precision, layout: Layout, batch_size: int) -> bool:
    """Whether the model states alone, averaged over the pipeline ranks, exceed the GPU memory (by more than any
    rounding): then so does the largest rank's memory, as long as no unit saves a negative amount — the layout is
    dropped before its schedule is built."""
    rows = batch_size // (layout.dp * layout.microbatches)
    if any(cost.saved < 0 for cost in unit_costs(model, layout, rows, precision, cluster.software)):
        return False
    return least_largest_states(model, layout, precision) > cluster.gpu_memory * (1 + 1e-9)


def _timed(memory: _Memory, batch_size: int) -> Plan:
    setting, layout, model = memory.setting, memory.setting.layout, memory.setting.model
    plan = timed_plan(setting, memory.per_unit, memory.tied, memory.per_rank,
                      stage_memory(setting, memory.per_unit, memory.stage_saved))
    plan.fits = memory.fits
    report_throughput(plan, model, setting.cluster, setting.precision, batch_size)
    if layout.cp > 1 or model.experts and (layout.tp > 1 or layout.ep > 1):
        plan.notes.append("activations and ep traffic approximate (balanced routing; CP attention's buffers "
                          "not measured)")
    if setting.shape and not setting.shape.simulated:
        plan.notes.append(f"bubble from the schedule's formula (more than {SIMULATED_ACTIONS} actions to simulate)")
    return plan


def _setting(model: Model, cluster: Cluster, precision: Precision, layout: Layout,
             batch_size: int) -> tuple[Setting, list[float], float]:
    """The layout's `Setting`, the parameters one rank holds of each unit and the tied embedding's shard."""
    rows = batch_size // (layout.dp * layout.microbatches)
    shape = pipeline_shape(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages) \
        if layout.pp > 1 else None
    costs = unit_costs(model, layout, rows, precision, cluster.software)
    per_unit, tied, experts = scaled_unit_parameters(model, layout)
    setting = Setting(model, cluster, precision, layout, costs, stage_units(model.n_layer, layout.pp * layout.chunks),
                      shape.stage_ranks if shape else (0,), shape, rows, unit_kinds(model), tuple(experts))
    return setting, per_unit, tied


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: Model, cluster: Cluster, choices: Choices) -> Iterator[Layout]:
    """Every layout train would accept for this model on `cluster.gpus` ranks, with the fixed choices kept:
    tp inside a node dividing the heads and the MLP width, and dividing the KV heads or a multiple of them
    (`mpiparallel.axes.tensor_parallel.check_tensor_parallel_shape`), pp·chunks ≤ layers, 2·cp dividing the sequence
    (Ulysses: cp dividing the heads of a TP rank, and dividing their KV heads or a multiple of them), ep
    dividing dp and the experts, microbatches ≥ pp dividing the batch rows of a DP rank, ZeRO ≤ 1 with a
    pipeline."""
    def pick(name: str, values: list) -> list:
        fixed = getattr(choices, name)
        return [fixed] if fixed is not None else values

    for tp, pp, cp in itertools.product(pick("tp", divisors(cluster.gpus)), pick("pp", divisors(cluster.gpus)),
                                        pick("cp", divisors(cluster.gpus))):
        if cluster.gpus % (tp * pp * cp) or not _splits(model, tp) or model.seq_len % (2 * cp if cp > 1 else 1):
            continue
        if choices.tp is None and tp > cluster.gpus_per_node or pp > model.n_layer:
            continue
        dp = cluster.gpus // (tp * pp * cp)
        if choices.dp is not None and choices.dp != dp or choices.batch_size % dp:
            continue
        yield from _inner_choices(model, choices, dp, tp, pp, cp, pick, cluster.gpus_per_node)


def _splits(model: Model, tp: int) -> bool:
    """Whether tensor parallelism over tp ranks can split this model (heads, MLP width, KV heads)."""
    try:
        check_tensor_parallel_shape(model.config, tp)
    except ValueError:
        return False
    return True


def _cp_attentions(model: Model, tp: int, cp: int, fixed: str | None) -> list[str]:
    """The CP attentions this cp can run: ring and all-gather always, Ulysses when cp divides this TP rank's
    heads and its KV heads divide cp or cp them."""
    if cp == 1:
        return [fixed or "ring"]
    heads, kv_heads = model.n_head // tp, local_kv_heads(model, tp)
    ulysses = heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0)
    return [a for a in ([fixed] if fixed else CP_ATTENTIONS) if a != "ulysses" or ulysses]


def _dispatches(model: Model, tp: int, cp: int, ep: int, per_node: int, fixed: str | None) -> list[str]:
    """The EP dispatches this ep can run: flat always, hierarchical when the routing is node-limited over the
    nodes the EP group spans (`deepseek.node_limited`)."""
    nodes = math.ceil(ep / max(1, min(ep, per_node // (tp * cp))))
    hierarchical = model.is_deepseek and deepseek.node_limited(model.config, nodes)
    return [d for d in ([fixed] if fixed else deepseek.DISPATCHES) if d == "flat" or hierarchical]


def _inner_choices(model: Model, choices: Choices, dp: int, tp: int, pp: int, cp: int, pick: Any,
                   per_node: int = 8) -> Iterator[Layout]:
    eps = pick("ep", [e for e in divisors(dp) if model.experts and model.experts % e == 0] or [1])
    zeros = pick("zero", [0, 1] if pp > 1 else [0, 1, 2, 3])
    schedules = pick("schedule", list(SCHEDULES)) if pp > 1 else ["1f1b"]
    sps = pick("sp", [False, True]) if tp > 1 else [False]
    microbatch_counts = pick("microbatches", _microbatch_candidates(choices.batch_size // dp, pp))
    attentions = _cp_attentions(model, tp, cp, choices.cp_attention)
    for ep, zero, schedule, m, recompute, sp, attention in itertools.product(
            eps, zeros, schedules, microbatch_counts, pick("recompute", list(RECOMPUTE)), sps, attentions):
        if (choices.batch_size // dp) % m or ep > 1 and dp % ep:
            continue
        for virtual, dispatch, dp_shard in itertools.product(
                pick("virtual_stages", [2]) if schedule == "interleaved" else [2],
                _dispatches(model, tp, cp, ep, per_node, choices.ep_dispatch),
                _shard_groups(dp, tp, cp, ep, zero, per_node, choices.dp_shard)):
            layout = Layout(dp, tp, pp, cp, ep, zero, m, schedule, recompute, sp, attention, virtual, dispatch,
                            dp_shard)
            if pp == 1 or _valid_schedule(layout, model.n_layer):
                yield layout


def _shard_groups(dp: int, tp: int, cp: int, ep: int, zero: int, per_node: int, fixed: int | None) -> list[int]:
    """The ZeRO shard groups to try: all of dp (0), and with ZeRO a node's DP ranks (hybrid sharding: only the
    replicas' all-reduce of one shard crosses nodes), when a node holds several but not all of them and whole EP
    groups. A fixed --dp-shard as train takes it: dividing dp, with ZeRO, a multiple of ep (0 where it is all of
    dp)."""
    if fixed is not None:  # train's rules: it divides dp, shards only ZeRO's states, holds whole EP groups
        if fixed in (0, dp):  # 0: all of dp, whatever dp is (elastic's planner without --dp-shard)
            return [0]
        return [fixed] if dp % fixed == 0 and zero >= 1 and fixed % ep == 0 else []
    node = per_node // (tp * cp)
    hybrid = zero >= 1 and 2 <= node < dp and dp % node == 0 and node % ep == 0  # a group of 1 would shard nothing
    return [0, node] if hybrid else [0]


def _microbatch_candidates(rows: int, pp: int) -> list[int]:
    """Divisors of the rows from pp up: the first three (more microbatches shrink the bubble and the activations
    but cost a message and a kernel launch each) and the largest."""
    counts = [d for d in divisors(rows) if d >= pp]
    return sorted(set(counts[:3] + counts[-1:]))


def _valid_schedule(layout: Layout, n_layer: int) -> bool:
    try:
        check_arguments(layout.schedule, layout.pp, layout.microbatches,
                        layout.virtual_stages if layout.schedule == "interleaved" else 1)
    except ValueError:
        return False
    return layout.pp * layout.chunks <= n_layer


def plan(model: Model, cluster: Cluster, precision: Precision, choices: Choices,
         weights_only: bool = False) -> tuple[list[Plan], int]:
    """The layouts that fit, fastest first, and how many were considered."""
    considered, fitting = 0, []
    for layout in candidate_layouts(model, cluster, choices):
        considered += 1
        if _surely_too_big(model, cluster, precision, layout, choices.batch_size):
            continue
        memory = _held_memory(model, cluster, precision, layout, choices.batch_size, weights_only)
        if memory.fits:  # only these are timed: the time of a layout that does not fit is never shown
            fitting.append(_timed(memory, choices.batch_size))
    fitting.sort(key=lambda p: (p.step_s, p.max_memory))
    return fitting, considered


def min_model_parallel(model: Model, precision: Precision, gpu_memory: float) -> int:
    """The fewest GPUs that must share the model states (all of them, or the weights only): ⌈N·bytes / memory⌉,
    in integers so that an exact fit is not rounded up."""
    need = Fraction(model.total_parameters()) * Fraction(precision.per_parameter).limit_denominator(10**6)
    return max(1, math.ceil(need / Fraction(gpu_memory).limit_denominator(10**6)))


def data_parallel_degree(gpus: int, choices: Choices) -> int | None:
    """The DP degree the fixed model-parallel degrees leave (the others at 1): gpus / (tp·pp·cp)."""
    model_parallel = (choices.tp or 1) * (choices.pp or 1) * (choices.cp or 1)
    if choices.dp is not None:
        return choices.dp
    return gpus // model_parallel if gpus % model_parallel == 0 else None
