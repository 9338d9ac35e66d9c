"""The planner: memory, time and communication of every layout of a GPT on a cluster, ranked. Pure Python, no MPI.

A layout is dp·tp·pp·cp (= the GPUs), ep (dividing dp), ZeRO stage, microbatches, pipeline schedule,
recomputation and sequence parallelism. For each the planner predicts, per pipeline rank and per stage:

- memory: parameters, gradients and optimizer state of the units the rank holds (embedding, blocks, head; TP
  shards, the vocabulary padded to a multiple of tp, the last stage's copy of the tied embedding, E/ep experts),
  divided by dp where ZeRO shards them; plus the activations in flight: the schedule simulator's list of
  actions walked in order, each stage holding its microbatches between F and W (or B), each microbatch costing
  what its units save (`models.layers.block_activation_elements` per block, the head's logits);
- compute: the matrix products (6·N·tokens FLOPs over all ranks, plus attention; `--recompute full` adds one
  more forward of the blocks, `selective` the attention scores) at the matmul rate, and the elementwise passes
  (LayerNorm, GELU, softmax, AdamW) at the elementwise rate;
- communication per axis from the α-β-γ formulas the collectives use (`collectives.cost_model`, the cheapest
  algorithm as algo="auto" picks): tp 4 all-reduces of b·s·h per block and microbatch (reduce-scatter +
  all-gather with SP), cp the ring passing K/V, ep four all-to-alls of K·tokens·h per MoE block, pp one
  message of b·s·h per microbatch and stage boundary each way, dp the gradient all-reduce (ZeRO: reduce-scatter
  + all-gather; ZeRO-3 all-gathers the parameters in forward and backward too);
- the bubble: the schedule simulated with F = I = W = 1 (the step then lasts makespan/3 × the slowest chunk's
  F + B); exposed communication: tp, cp and ep block the compute; pp exposes its pipeline fill and drain; dp
  overlaps with backward (all but the last bucket) without a pipeline and is exposed after one.

Step time = pipeline (or microbatches one after another) + exposed dp + the optimizer. Layouts that do not
fit in the GPU memory are dropped; the rest are ranked by step time.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any

from collectives.cost_model import CostModel, choose, predict
from models.layers import QUERY_BLOCK, block_activation_elements, query_blocks

from ..schedules import SCHEDULES, bubble_formula, build_schedule, simulate, stage_units
from ..schedules.actions import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from ..schedules.build import V_SHAPED, check_arguments
from ..schedules.simulator import peak_activations

AXES = ("dp", "tp", "pp", "cp", "ep")
RECOMPUTE = ("none", "selective", "full")
GB = 10**9
SIMULATED_ACTIONS = 1024
"""Largest pp·microbatches·chunks the layout search simulates when m ≥ 2p (a simulation of 4096 takes a
second); beyond, the bubble is the schedule's formula, exact at unit costs for m ≥ 2p (every schedule here)."""


# -- what is planned ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    """A GPT-2 shape (train's model); `parameters` overrides the count (`--params` without a shape)."""

    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    vocab_size: int
    n_positions: int = 1024
    experts: int = 0
    top_k: int = 2
    parameters: int | None = None

    @classmethod
    def from_parameter_count(cls, parameters: float, seq_len: int = 2048, vocab_size: int = 50257) -> Model:
        """A shape with about `parameters` weights (12·L·h² in the blocks, h ≈ 128·L as GPT-3 and Llama roughly
        have, rounded to a multiple of 1024), 128 channels per head; the count itself stays `parameters`."""
        layers = max(1, round((parameters / (12 * 128**2)) ** (1 / 3)))
        width = max(1024, round(math.sqrt(parameters / (12 * layers)) / 1024) * 1024)  # heads: a multiple of 8
        return cls(layers, width, width // 128, seq_len, vocab_size, max(1024, seq_len), parameters=int(parameters))

    def total_parameters(self) -> int:
        if self.parameters is not None:
            return self.parameters
        return sum(unit_parameters(self, tp=1, ep=1)) - tied_parameters(self, tp=1)  # the tied copy counts once

    def active_parameters(self) -> int:
        """Weights a token passes through: top_k of the experts (6·N·tokens counts these)."""
        if not self.experts:
            return self.total_parameters()
        expert = 8 * self.n_embd**2 + 5 * self.n_embd
        return self.total_parameters() - self.n_layer * (self.experts - self.top_k) * expert


@dataclass(frozen=True)
class Cluster:
    """GPUs (or ranks) and what they can do; rates are per rank."""

    gpus: int = 8
    gpu_memory: float = 80 * GB
    gpus_per_node: int = 8
    intra: CostModel = CostModel(alpha=5e-6, beta=1 / 450e9, gamma=1 / 1.5e12)
    inter: CostModel = CostModel(alpha=10e-6, beta=1 / 50e9, gamma=1 / 1.5e12)
    matmul_flops: float = 989e12 * 0.5
    elementwise_bytes: float = 3.35e12 * 0.5


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of weights, gradients and optimizer state, and per activation element."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def per_parameter(self) -> float:
        return self.weights + self.gradients + self.optimizer


PRECISIONS = {
    # bf16 weights and gradients; AdamW keeps an fp32 master copy and two fp32 moments: 2 + 2 + 12 = 16 bytes
    "mixed": Precision(2, 2, 12, 2),
    "float32": Precision(4, 4, 8, 4),  # train --dtype float32 --optimizer adamw: weights, grads, 2 moments
    "float64": Precision(8, 8, 16, 8),
}


def precision_with(name: str, optimizer: str = "adamw", bytes_per_param: float | None = None,
                   weights_only: bool = False) -> Precision:
    """A preset; SGD keeps no state; `weights_only` keeps only the weights; `bytes_per_param` rescales the
    model states to that many bytes per parameter (the weights alone with `weights_only`)."""
    base = PRECISIONS[name]
    if optimizer == "sgd":
        base = replace(base, optimizer=0)
    if weights_only:
        base = replace(base, gradients=0, optimizer=0)
    if bytes_per_param is not None:
        scale = bytes_per_param / base.per_parameter
        base = replace(base, weights=base.weights * scale, gradients=base.gradients * scale,
                       optimizer=base.optimizer * scale)
    return base


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sp: bool = False

    @property
    def chunks(self) -> int:
        """Stages per pipeline rank: 2 for interleaved (v = 2) and the V-shaped schedules."""
        return 2 if self.pp > 1 and (self.schedule == "interleaved" or self.schedule in V_SHAPED) else 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}{'+sp' if self.sp else ''}", f"pp{self.pp}", f"cp{self.cp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        schedule = f" {self.schedule}" if self.pp > 1 else ""
        return f"{' '.join(parts)} z{self.zero} m{self.microbatches}{schedule} rc-{self.recompute}"


@dataclass(frozen=True)
class Choices:
    """Fixed choices (None: searched) and the run's global batch."""

    batch_size: int = 8
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    sp: bool | None = None


# -- parameters per unit ------------------------------------------------------------------------------------

def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def unit_parameters(model: Model, tp: int, ep: int) -> list[int]:
    """Parameters one rank holds of each unit (embedding, blocks…, head), for one TP and EP rank. The head holds
    the tied embedding's vocabulary shard (only counted once when one rank holds both)."""
    h = model.n_embd
    embedding = padded_vocab(model.vocab_size, tp) // tp * h + model.n_positions * h
    attention = (3 * h * h + 3 * h) // tp + (h * h) // tp + h
    mlp_one = (4 * h * h + 4 * h) // tp + (4 * h * h) // tp + h
    if model.experts:  # experts replicated over the TP group, E/ep of them here, a router [h, E]
        mlp = model.experts // ep * (8 * h * h + 5 * h) + h * model.experts
    else:
        mlp = mlp_one
    block = 4 * h + attention + mlp
    head = 2 * h + padded_vocab(model.vocab_size, tp) // tp * h
    return [embedding] + [block] * model.n_layer + [head]


def tied_parameters(model: Model, tp: int) -> int:
    """The token embedding's vocabulary shard, held by both the embedding and the head unit."""
    return padded_vocab(model.vocab_size, tp) // tp * model.n_embd


def scaled_unit_parameters(model: Model, layout: Layout) -> tuple[list[float], float]:
    """Per unit, this rank's parameters, and the tied shard; with `--params` and no shape, scaled so that the
    whole model adds up to N."""
    units, tied = unit_parameters(model, layout.tp, layout.ep), tied_parameters(model, layout.tp)
    scale = 1.0
    if model.parameters is not None:
        scale = model.parameters / replace(model, parameters=None).total_parameters()
    return [u * scale for u in units], tied * scale


def held_parameters(units: list[int], per_unit: list[float], tied: float) -> float:
    """Parameters of the units one rank holds; the tied embedding once when it holds both ends."""
    count = sum(per_unit[u] for u in units)
    return count - tied if 0 in units and len(per_unit) - 1 in units else count


# -- activations and work per unit and microbatch -----------------------------------------------------------

@dataclass(frozen=True)
class UnitCost:
    """One unit, one microbatch, one rank: elements saved, matmul FLOPs and elementwise elements, forward and
    backward; and the communication it blocks on (collective name, bytes, axis) per direction."""

    saved: float
    flops_forward: float
    flops_backward: float
    elementwise_forward: float
    elementwise_backward: float
    collectives_forward: tuple[tuple[str, float, str], ...] = ()
    collectives_backward: tuple[tuple[str, float, str], ...] = ()


def _causal_pairs(seq: int) -> int:
    """(query, key) products the blocked causal attention computes: Σ over query blocks of rows·keys seen."""
    return sum((stop - start) * stop for start, stop in query_blocks(seq, QUERY_BLOCK))


def unit_costs(model: Model, layout: Layout, rows: int, precision: Precision) -> list[UnitCost]:
    """Embedding, one block, head: what one microbatch of `rows` sequences costs on one rank."""
    h, tp, item = model.n_embd, layout.tp, precision.activations
    seq = model.seq_len // layout.cp
    tokens = rows * seq
    s = tokens * h
    vocab = padded_vocab(model.vocab_size, tp) // tp
    seq_shard = tp if layout.sp else 1
    tp_collectives: tuple[tuple[str, float, str], ...] = ()
    if tp > 1:
        pair = (("reduce_scatter", s * item, "tp"), ("all_gather", s * item, "tp")) if layout.sp else \
            (("all_reduce", s * item, "tp"),)
        tp_collectives = pair * 2
    embedding = UnitCost(saved=tokens * 8 / item, flops_forward=0, flops_backward=0,
                         elementwise_forward=2 * s / seq_shard, elementwise_backward=2 * s,
                         collectives_forward=tp_collectives[:len(tp_collectives) // 2],
                         collectives_backward=())
    # the vocab-parallel cross-entropy: the row maxima, then the sums and target logits in one message
    head_collectives = (("all_reduce", tokens * item, "tp"), ("all_reduce", 2 * tokens * item, "tp")) if tp > 1 else ()
    head = UnitCost(saved=2 * s + tokens * vocab + tokens, flops_forward=2 * tokens * h * vocab,
                    flops_backward=4 * tokens * h * vocab, elementwise_forward=6 * s / seq_shard + 6 * tokens * vocab,
                    elementwise_backward=10 * s / seq_shard,
                    collectives_forward=head_collectives,
                    collectives_backward=tp_collectives[:len(tp_collectives) // 2])
    return [embedding, block_cost(model, layout, rows, precision, tp_collectives), head]


def block_cost(model: Model, layout: Layout, rows: int, precision: Precision,
               tp_collectives: tuple[tuple[str, float, str], ...]) -> UnitCost:
    h, tp, item = model.n_embd, layout.tp, precision.activations
    seq = model.seq_len // layout.cp
    tokens = rows * seq
    s = tokens * h
    seq_shard = tp if layout.sp else 1
    probabilities = rows * (model.n_head // tp) * _causal_pairs(seq) * (layout.cp if layout.cp > 1 else 1)
    attention_flops = 4 * rows * _causal_pairs(seq) * h / tp * layout.cp
    if model.experts:
        mlp_flops = 16 * tokens * h * h * model.top_k
        mlp_elements = 4 * s * model.top_k
    else:
        mlp_flops = 16 * tokens * h * h / tp
        mlp_elements = 4 * s / tp
    flops_forward = 8 * tokens * h * h / tp + mlp_flops + attention_flops
    # LayerNorms and residual adds (sharded with SP), biases, the attention's head reshapes, GELU, softmax
    elementwise_forward = 12 * s / seq_shard + 8 * s / tp + 7 * mlp_elements + 5 * probabilities
    saved = float(block_activation_elements(rows, seq, h, model.n_head, tp, layout.sp, layout.recompute))
    if model.experts:  # each token's K expert MLPs keep their hidden units instead of the dense MLP's
        saved += 8 * s * (model.top_k - 1 / tp)
    if layout.cp > 1 and layout.recompute != "full":  # K/V of the other chunks seen by ring attention
        saved += 2 * s / tp * (layout.cp - 1)
    recompute_flops = {"none": 0.0, "selective": attention_flops / 2, "full": flops_forward}[layout.recompute]
    recompute_elements = {"none": 0.0, "selective": 5 * probabilities, "full": elementwise_forward}[layout.recompute]
    collectives = list(tp_collectives)
    if layout.cp > 1:  # ring attention: K and V of one chunk pair per step, cp − 1 steps; backward the same twice
        collectives.append(("ring_pass", (layout.cp - 1) * 2 * s / tp * item, "cp"))
    if model.experts and layout.ep > 1:  # dispatch and combine: K copies of every token
        collectives += [("all_to_all", model.top_k * s * item, "ep")] * 2
    forward = tuple(collectives)
    backward = tuple(c if c[0] != "ring_pass" else (c[0], 2 * c[1], c[2]) for c in collectives)
    return UnitCost(saved=saved, flops_forward=flops_forward, flops_backward=2 * flops_forward + recompute_flops,
                    elementwise_forward=elementwise_forward,
                    elementwise_backward=2 * elementwise_forward + recompute_elements,
                    collectives_forward=forward, collectives_backward=backward)


# -- time of a collective on an axis ------------------------------------------------------------------------

def axis_stride(layout: Layout, axis: str) -> int:
    """Rank distance between neighbours of `axis` (innermost first: tp, cp, dp, pp; ep inside dp)."""
    return {"tp": 1, "cp": layout.tp, "dp": layout.tp * layout.cp, "ep": layout.tp * layout.cp,
            "pp": layout.tp * layout.cp * layout.dp}[axis]


def axis_size(layout: Layout, axis: str) -> int:
    return getattr(layout, axis)


def axis_link(layout: Layout, axis: str, cluster: Cluster) -> CostModel:
    """NVLink-like inside a node; once the group spans nodes, the two-tier model (inside and across) that the
    collectives' cost model prices flat and hierarchical algorithms with."""
    return group_link(axis_stride(layout, axis), axis_size(layout, axis), cluster)


def group_link(stride: int, ranks: int, cluster: Cluster) -> CostModel:
    if stride * ranks <= cluster.gpus_per_node:
        return cluster.intra
    return replace(cluster.intra, alpha_inter=cluster.inter.alpha, beta_inter=cluster.inter.beta)


def group_nodes(stride: int, ranks: int, cluster: Cluster) -> int:
    """Nodes a group of `ranks` ranks `stride` apart spans (nodes of gpus_per_node consecutive ranks)."""
    per_node = max(1, min(ranks, cluster.gpus_per_node // stride))
    return math.ceil(ranks / per_node)


def axis_nodes(layout: Layout, axis: str, cluster: Cluster) -> int:
    return group_nodes(axis_stride(layout, axis), axis_size(layout, axis), cluster)


def collective_seconds(name: str, nbytes: float, ranks: int, link: CostModel, nodes: int = 1) -> float:
    """The cheapest algorithm's predicted time, as algo="auto" would choose it (`collectives.cost_model`, with
    hierarchical algorithms where the group spans `nodes` > 1); a ring pass of K/V is ranks − 1 point-to-point
    messages of nbytes/(ranks − 1)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if name in ("ring_pass", "send"):
        steps = ranks - 1 if name == "ring_pass" else 1
        crossing = link.across() if nodes > 1 else link
        return steps * (crossing.alpha + nbytes / steps * crossing.beta)
    algo = choose(link, name, int(nbytes), ranks, nodes)
    return predict(link, name, algo, int(nbytes), ranks, nodes)


def collective_bytes_sent(name: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends (bandwidth-optimal algorithms)."""
    if ranks <= 1:
        return 0.0
    fraction = (ranks - 1) / ranks
    return {"all_reduce": 2 * fraction, "reduce_scatter": fraction, "all_gather": fraction,
            "all_to_all": fraction, "ring_pass": 1.0, "send": 1.0}[name] * nbytes


# -- the pipeline: bubble and peak activations from the simulator -----------------------------------------

@dataclass(frozen=True)
class PipelineShape:
    bubble: float
    makespan_units: float
    peak_per_stage: tuple[int, ...]
    rank_stage_counts: tuple[tuple[tuple[int, ...], ...], ...]
    """Per rank: every distinct state (microbatches held on each of its stages), to weigh by bytes per stage."""
    stage_ranks: tuple[int, ...]
    simulated: bool


@lru_cache(maxsize=4096)
def pipeline_shape(schedule: str, pp: int, microbatches: int) -> PipelineShape:
    """Bubble and activations held of `schedule` with F = I = W = 1 (cached). The activations come from the
    action lists alone (list order is time order on a rank); the bubble from the simulator, or for schedules of
    more than SIMULATED_ACTIONS compute actions from the schedule's formula."""
    chunks = 2 if schedule in V_SHAPED or schedule == "interleaved" else 1
    built = build_schedule(schedule, pp, microbatches, chunks if schedule == "interleaved" else 1)
    simulated = pp * microbatches * chunks <= SIMULATED_ACTIONS or microbatches < 2 * pp
    if simulated:
        makespan = simulate(built).makespan
        bubble = 1 - 3 * microbatches * chunks / makespan
    else:
        bubble = bubble_formula(schedule, pp, microbatches, chunks if schedule == "interleaved" else 1)
        makespan = 3 * microbatches * chunks / (1 - bubble)
    states = tuple(_held_states(built, rank) for rank in range(pp))
    return PipelineShape(bubble, makespan, peak_activations(built)[0], states, built.stage_ranks, simulated)


def _held_states(built: Any, rank: int) -> tuple[tuple[int, ...], ...]:
    """Every distinct count of microbatches held on each of `rank`'s stages (in `stages_of` order), after each
    of its actions: list order is time order on a rank."""
    stages = built.stages_of(rank)
    held = dict.fromkeys(stages, 0)
    states = {tuple(held.values())}
    for action in built.actions[rank]:
        change = {FORWARD: 1, BACKWARD_WEIGHT: -1, FULL_BACKWARD: -1}.get(action.kind, 0)
        if change:
            held[action.stage] += change
            states.add(tuple(held.values()))
    return tuple(sorted(states))


def min_microbatches(schedule: str, pp: int, max_bubble: float) -> int:
    """The fewest microbatches whose simulated bubble (F = I = W = 1) is below `max_bubble`, exactly: the
    makespan is an integer, so the comparison is made in fractions. The schedule's formula (cheap) gives the
    starting count, the simulator the answer. Interleaved (v = 2) needs multiples of pp."""
    target = Fraction(max_bubble).limit_denominator(10**9)
    step = pp if schedule == "interleaved" else 1
    first = pp if schedule == "zb" else step
    virtual = 2 if schedule == "interleaved" else 1

    def below(m: int) -> bool:
        return _exact_bubble(schedule, pp, m) < target

    high = first
    while bubble_formula(schedule, pp, high, virtual) >= max_bubble:
        high *= 2
    low = max(first, high // 2)
    while high - low > step:  # bisect the formula: its bubble falls as m grows
        middle = max(low + step, (low + high) // 2 // step * step)
        low, high = (low, middle) if bubble_formula(schedule, pp, middle, virtual) < max_bubble else (middle, high)
    count = high if bubble_formula(schedule, pp, low, virtual) >= max_bubble else low
    while not below(count):  # the formula is only a lower bound for a few microbatches (ZB-V below 2p − 1)
        count += step
    while count - step >= first and below(count - step):
        count -= step
    return count


@lru_cache(maxsize=1024)
def _exact_bubble(schedule: str, pp: int, microbatches: int) -> Fraction:
    chunks = 2 if schedule in V_SHAPED or schedule == "interleaved" else 1
    simulation = simulate(build_schedule(schedule, pp, microbatches, chunks if schedule == "interleaved" else 1))
    return 1 - Fraction(3 * microbatches * chunks) / Fraction(simulation.makespan)


# -- one layout -----------------------------------------------------------------------------------------------

BUCKET_BYTES = 25 * 2**20
"""train's default --bucket-mb: the data-parallel engine reduces gradients in buckets of this size."""


@dataclass
class Plan:
    """One layout's prediction. Memory in bytes, times in seconds, per rank and step."""

    layout: Layout
    memory_per_rank: list[dict[str, float]]
    """Per pipeline rank: parameters, gradients, optimizer_state, activations and total."""
    memory_per_stage: list[dict[str, Any]]
    compute_s: float
    comm_s: dict[str, float]
    comm_bytes: dict[str, float]
    exposed_comm_s: float
    bubble: float
    step_s: float
    fits: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def max_memory(self) -> float:
        return max(rank["total"] for rank in self.memory_per_rank)

    def rank_memory(self, world_rank: int) -> dict[str, float]:
        """World rank `world_rank`'s memory: its pipeline rank's (rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i)."""
        layout = self.layout
        return self.memory_per_rank[world_rank // (layout.dp * layout.cp * layout.tp)]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.layout), "label": self.layout.label(), "step_s": self.step_s,
                "compute_s": self.compute_s, "bubble": self.bubble, "comm_s": self.comm_s,
                "comm_bytes": self.comm_bytes, "exposed_comm_s": self.exposed_comm_s, "fits": self.fits,
                "max_memory_bytes": self.max_memory, "memory_per_rank": self.memory_per_rank,
                "memory_per_stage": self.memory_per_stage, "notes": self.notes}


@dataclass(frozen=True)
class _Setting:
    """Everything `evaluate` derives once per layout."""

    model: Model
    cluster: Cluster
    precision: Precision
    layout: Layout
    costs: list[UnitCost]
    stages: list[range]
    stage_ranks: tuple[int, ...]
    shape: PipelineShape | None
    rows: int
    """Sequences per microbatch on one rank."""

    def cost_of(self, unit: int) -> UnitCost:
        return self.costs[0 if unit == 0 else 2 if unit == self.model.n_layer + 1 else 1]

    def kind_counts(self, units: list[int] | range) -> tuple[int, int, int]:
        """How many embeddings, blocks and heads are among `units` (every block costs the same)."""
        ends = (0 in units, self.model.n_layer + 1 in units)
        return int(ends[0]), len(units) - sum(ends), int(ends[1])

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, owner in enumerate(self.stage_ranks) if owner == rank]

    def units_of(self, rank: int) -> list[int]:
        return sorted(u for s in self.stages_of(rank) for u in self.stages[s])


def evaluate(model: Model, cluster: Cluster, precision: Precision, layout: Layout, batch_size: int,
             weights_only: bool = False) -> Plan:
    """Memory, time and communication of one layout (a valid one: see `candidate_layouts`)."""
    rows = batch_size // (layout.dp * layout.microbatches)
    shape = pipeline_shape(layout.schedule, layout.pp, layout.microbatches) if layout.pp > 1 else None
    setting = _Setting(model, cluster, precision, layout, unit_costs(model, layout, rows, precision),
                       stage_units(model.n_layer, layout.pp * layout.chunks), shape.stage_ranks if shape else (0,),
                       shape, rows)
    per_unit, tied = scaled_unit_parameters(model, layout)
    stage_saved = [0.0 if weights_only else sum(setting.cost_of(u).saved for u in units) * precision.activations
                   for units in setting.stages]
    peaks = shape.peak_per_stage if shape else (1,)
    memory_per_stage = [{"stage": s, "pp_rank": setting.stage_ranks[s], "units": [units.start, units.stop],
                         "parameters": sum(per_unit[u] for u in units),
                         "activations_per_microbatch": stage_saved[s], "peak_microbatches": peaks[s],
                         "activations": peaks[s] * stage_saved[s]} for s, units in enumerate(setting.stages)]
    memory_per_rank = [_rank_memory(setting, rank, per_unit, tied, stage_saved) for rank in range(layout.pp)]
    plan = _timed_plan(setting, per_unit, tied, memory_per_rank, memory_per_stage)
    plan.fits = plan.max_memory <= cluster.gpu_memory
    if model.experts or layout.cp > 1:
        plan.notes.append("activations and ep/cp traffic approximate (no exact formula for experts or ring attention)")
    if shape and not shape.simulated:
        plan.notes.append(f"bubble from the schedule's formula (more than {SIMULATED_ACTIONS} actions to simulate)")
    return plan


def _rank_memory(setting: _Setting, rank: int, per_unit: list[float], tied: float,
                 stage_saved: list[float]) -> dict[str, float]:
    layout, precision = setting.layout, setting.precision
    count = held_parameters(setting.units_of(rank), per_unit, tied)
    weights = count * precision.weights / (layout.dp if layout.zero == 3 else 1)
    gradients = count * precision.gradients / (layout.dp if layout.zero >= 2 else 1)
    optimizer = count * precision.optimizer / (layout.dp if layout.zero >= 1 else 1)
    if setting.shape is None:
        activations = stage_saved[0]  # microbatches one after another: one in flight
    else:
        stages = setting.stages_of(rank)
        activations = max(sum(n * stage_saved[s] for s, n in zip(stages, state, strict=True))
                          for state in setting.shape.rank_stage_counts[rank])
    return {"pp_rank": rank, "parameters": weights, "gradients": gradients, "optimizer_state": optimizer,
            "activations": activations, "total": weights + gradients + optimizer + activations}


def _compute_seconds(setting: _Setting, cost: UnitCost, backward: bool) -> float:
    cluster = setting.cluster
    flops = cost.flops_backward if backward else cost.flops_forward
    elements = cost.elementwise_backward if backward else cost.elementwise_forward
    return flops / cluster.matmul_flops + elements * setting.precision.activations / cluster.elementwise_bytes


def _blocking(setting: _Setting, cost: UnitCost) -> tuple[dict[str, float], dict[str, float]]:
    """Per axis, seconds and bytes sent of the collectives one microbatch of a unit waits for."""
    layout = setting.layout
    seconds, bytes_sent = dict.fromkeys(AXES, 0.0), dict.fromkeys(AXES, 0.0)
    for name, nbytes, axis in cost.collectives_forward + cost.collectives_backward:
        ranks = axis_size(layout, axis)
        seconds[axis] += collective_seconds(name, nbytes, ranks, axis_link(layout, axis, setting.cluster),
                                            axis_nodes(layout, axis, setting.cluster))
        bytes_sent[axis] += collective_bytes_sent(name, nbytes, ranks)
    return seconds, bytes_sent


def _timed_plan(setting: _Setting, per_unit: list[float], tied: float, memory_per_rank: list[dict[str, float]],
                memory_per_stage: list[dict[str, Any]]) -> Plan:
    layout, m = setting.layout, setting.layout.microbatches
    compute_of = [_compute_seconds(setting, c, False) + _compute_seconds(setting, c, True) for c in setting.costs]
    blocking_of = [_blocking(setting, c) for c in setting.costs]

    def weighted(units: list[int] | range, values: list[float]) -> float:
        return sum(n * v for n, v in zip(setting.kind_counts(units), values, strict=True))

    waits_of = [sum(seconds.values()) for seconds, _ in blocking_of]
    chunk_seconds = [weighted(units, compute_of) + weighted(units, waits_of) for units in setting.stages]
    per_rank = []  # (compute, comm seconds per axis, bytes per axis) of each pipeline rank's step
    for rank in range(layout.pp):
        units = setting.units_of(rank)
        seconds = {axis: m * weighted(units, [b[0][axis] for b in blocking_of]) for axis in AXES}
        sent = {axis: m * weighted(units, [b[1][axis] for b in blocking_of]) for axis in AXES}
        per_rank.append((m * weighted(units, compute_of), seconds, sent))
    busiest = max(range(layout.pp), key=lambda rank: per_rank[rank][0] + sum(per_rank[rank][1].values()))
    compute, comm_s, comm_bytes = per_rank[busiest]
    exposed = sum(comm_s.values())
    if setting.shape is None:
        pipeline, bubble = m * chunk_seconds[0], 0.0
    else:
        message = _stage_message_bytes(setting)
        boundary = collective_seconds("send", message, 2, axis_link(layout, "pp", setting.cluster),
                                      axis_nodes(layout, "pp", setting.cluster))
        sends = 2 * m * layout.chunks
        comm_s["pp"], comm_bytes["pp"] = sends * boundary, sends * message
        fill_and_drain = 2 * (layout.pp * layout.chunks - 1) * boundary  # each boundary once each way, waited for
        pipeline = setting.shape.makespan_units / 3 * max(chunk_seconds) + fill_and_drain
        bubble = setting.shape.bubble
        exposed += fill_and_drain
    count = held_parameters(setting.units_of(busiest), per_unit, tied)
    dp_seconds, dp_bytes, last_bucket = _data_parallel(setting, count)
    comm_s["dp"], comm_bytes["dp"] = dp_seconds, dp_bytes
    if setting.shape is None and layout.dp * layout.cp > 1:  # overlapped with the last microbatch's backward
        backward = weighted(setting.stages[0], [_compute_seconds(setting, c, True) for c in setting.costs])
        dp_exposed = max(last_bucket, dp_seconds - backward)
    else:  # a pipeline reduces the gradients after its schedule
        dp_exposed = dp_seconds
    exposed += dp_exposed
    step = pipeline + dp_exposed + _optimizer_seconds(setting, count)
    return Plan(layout, memory_per_rank, memory_per_stage, compute, comm_s, comm_bytes, exposed, bubble, step)


def _stage_message_bytes(setting: _Setting) -> float:
    """One microbatch's activation handed from stage to stage (train's activation_shape)."""
    layout, model = setting.layout, setting.model
    positions = model.seq_len // layout.cp // (layout.tp if layout.sp else 1)
    return setting.rows * positions * model.n_embd * setting.precision.activations


def _data_parallel(setting: _Setting, count: float) -> tuple[float, float, float]:
    """Seconds, bytes sent and the last bucket's seconds of the gradient reduction over dp×cp (the ranks that
    hold the same parameters): all-reduce per bucket; ZeRO-1/2 reduce-scatter + all-gather of the updated
    parameters; ZeRO-3 also all-gathers every parameter for forward and again for backward."""
    layout, precision = setting.layout, setting.precision
    ranks = layout.dp * layout.cp
    if ranks == 1 or precision.gradients == 0:
        return 0.0, 0.0, 0.0
    link, nodes = group_link(layout.tp, ranks, setting.cluster), group_nodes(layout.tp, ranks, setting.cluster)
    grad_bytes = count * precision.gradients
    buckets = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
    bucket = grad_bytes / buckets
    gathers = 3 if layout.zero == 3 else 1
    calls = [("all_reduce", 1)] if layout.zero == 0 else [("reduce_scatter", 1), ("all_gather", gathers)]
    seconds = sent = last_bucket = 0.0
    for name, per_bucket in calls:  # every bucket the same size: one prediction each
        one = collective_seconds(name, bucket, ranks, link, nodes)
        seconds += buckets * per_bucket * one
        sent += buckets * per_bucket * collective_bytes_sent(name, bucket, ranks)
        last_bucket = one if last_bucket == 0 else last_bucket
    return seconds, sent, last_bucket


def _optimizer_seconds(setting: _Setting, count: float) -> float:
    """AdamW's elementwise passes over this rank's parameters (about 12: moments, square root, division, decay);
    SGD's 2; plus zeroing the gradients."""
    layout, precision = setting.layout, setting.precision
    passes = 12 if precision.optimizer else 2
    local = count / (layout.dp if layout.zero >= 1 else 1)
    return (passes + 1) * local * precision.weights / setting.cluster.elementwise_bytes


# -- the search -------------------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: Model, cluster: Cluster, choices: Choices) -> Iterator[Layout]:
    """Every layout train would accept for this model on `cluster.gpus` ranks, with the fixed choices kept:
    tp inside a node dividing the heads, pp·chunks ≤ layers, 2·cp dividing the sequence, ep dividing dp and the
    experts, microbatches ≥ pp dividing the batch rows of a DP rank, ZeRO ≤ 1 with a pipeline."""
    def pick(name: str, values: list) -> list:
        fixed = getattr(choices, name)
        return [fixed] if fixed is not None else values

    for tp, pp, cp in itertools.product(pick("tp", divisors(cluster.gpus)), pick("pp", divisors(cluster.gpus)),
                                        pick("cp", divisors(cluster.gpus))):
        if cluster.gpus % (tp * pp * cp) or model.n_head % tp or model.seq_len % (2 * cp if cp > 1 else 1):
            continue
        if choices.tp is None and tp > cluster.gpus_per_node or pp > model.n_layer:
            continue
        dp = cluster.gpus // (tp * pp * cp)
        if choices.dp is not None and choices.dp != dp or choices.batch_size % dp:
            continue
        yield from _inner_choices(model, choices, dp, tp, pp, cp, pick)


def _inner_choices(model: Model, choices: Choices, dp: int, tp: int, pp: int, cp: int, pick: Any) -> Iterator[Layout]:
    eps = pick("ep", [e for e in divisors(dp) if model.experts and model.experts % e == 0] or [1])
    zeros = pick("zero", [0, 1] if pp > 1 else [0, 1, 2, 3])
    schedules = pick("schedule", list(SCHEDULES)) if pp > 1 else ["1f1b"]
    sps = pick("sp", [False, True]) if tp > 1 else [False]
    microbatch_counts = pick("microbatches", _microbatch_candidates(choices.batch_size // dp, pp))
    for ep, zero, schedule, m, recompute, sp in itertools.product(eps, zeros, schedules, microbatch_counts,
                                                                   pick("recompute", list(RECOMPUTE)), sps):
        if (choices.batch_size // dp) % m or ep > 1 and dp % ep:
            continue
        layout = Layout(dp, tp, pp, cp, ep, zero, m, schedule, recompute, sp)
        if pp > 1 and not _valid_schedule(layout, model.n_layer):
            continue
        yield layout


def _microbatch_candidates(rows: int, pp: int) -> list[int]:
    """Divisors of the rows from pp up: the first three (more microbatches shrink the bubble and the activations
    but cost a message and a kernel launch each) and the largest."""
    counts = [d for d in divisors(rows) if d >= pp]
    return sorted(set(counts[:3] + counts[-1:]))


def _valid_schedule(layout: Layout, n_layer: int) -> bool:
    try:
        check_arguments(layout.schedule, layout.pp, layout.microbatches, 2 if layout.schedule == "interleaved" else 1)
    except ValueError:
        return False
    return layout.pp * layout.chunks <= n_layer


def plan(model: Model, cluster: Cluster, precision: Precision, choices: Choices,
         weights_only: bool = False) -> tuple[list[Plan], int]:
    """The layouts that fit, fastest first, and how many were considered."""
    considered, fitting = 0, []
    for layout in candidate_layouts(model, cluster, choices):
        considered += 1
        result = evaluate(model, cluster, precision, layout, choices.batch_size, weights_only)
        if result.fits:
            fitting.append(result)
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


# -- a machine measured by `plan --calibrate` --------------------------------------------------------------------

def load_machine(path: Path, ranks_per_node: int, gpu_memory: float) -> Cluster:
    """A cluster of `ranks_per_node` ranks on one machine from `plan --calibrate`'s file. Its rates were measured
    per rank with every core busy (one rank per core); fewer ranks than cores give each rank more BLAS threads
    (matmul rate × cores / ranks), more ranks share the cores (both rates × cores / ranks); both are scaled by the
    compute efficiency measured on a real serial training step."""
    measured = json.loads(Path(path).read_text())
    cores = measured["cores"]
    share = cores / ranks_per_node
    efficiency = measured.get("compute_efficiency", 1.0)  # the share of the raw rates a real step reaches
    link = CostModel(measured["alpha"], measured["beta"], measured["gamma"])
    across = CostModel(measured.get("alpha_inter") or link.alpha, measured.get("beta_inter") or link.beta, link.gamma)
    return Cluster(gpus=ranks_per_node, gpu_memory=gpu_memory, gpus_per_node=ranks_per_node, intra=link,
                   inter=across, matmul_flops=measured["matmul_flops"] * share * efficiency,
                   elementwise_bytes=measured["elementwise_bytes"] * min(1.0, share) * efficiency)
