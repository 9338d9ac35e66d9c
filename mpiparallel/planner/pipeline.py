"""The pipeline: its bubble and the activations it holds, from the schedule simulator; the fewest microbatches for a
bubble target; and its time.

Each schedule is built and simulated with F = I = W = 1 (cached by schedule, pp, m, v). Activations: each rank's
action list walked in order (list order is time order on a rank), each stage holding its microbatches between F
and W (or B); a rank's peak is its largest state weighted by the bytes of each stage. Bubble = 1 − 3·m·chunks /
makespan, simulated, or beyond SIMULATED_ACTIONS compute actions with m ≥ 2p the schedule's formula (exact at unit
costs). `min_microbatches` compares the simulated bubble in fractions (the makespan is an integer).

Time: the steady state lasts m × the busiest rank's chunks (F + B: every microbatch passes each of its stages), the
fill and drain — makespan/3 − m·chunks idle chunks — the average chunk; equal chunks give makespan/3 × one chunk.
A stage boundary carries b·(s/cp)·h (÷ tp under SP) per microbatch each way (Megatron's scatter/gather: 1/tp of it
per TP rank, then an all-gather over NVLink); the tied embedding's gradient goes once per step between the end
stages' ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

from ..schedules import bubble_formula, build_schedule, simulate
from ..schedules.actions import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from ..schedules.build import V_SHAPED
from ..schedules.simulator import peak_activations
from .communication import axis_link, axis_nodes, collective_seconds
from .hardware import Cluster
from .layout import Layout
from .shapes import Model

SIMULATED_ACTIONS = 1024
"""Largest pp·microbatches·chunks the layout search simulates when m ≥ 2p (a simulation of 4096 takes a
second); beyond, the bubble is the schedule's formula, exact at unit costs for m ≥ 2p (every schedule here)."""


@dataclass(frozen=True)
class PipelineShape:
    """A schedule run with F = I = W = 1: its bubble and makespan, the microbatches each stage and rank holds, and
    the rank of each stage."""

    bubble: float
    makespan_units: float
    peak_per_stage: tuple[int, ...]
    rank_stage_counts: tuple[tuple[tuple[int, ...], ...], ...]
    """Per rank: every distinct state (microbatches held on each of its stages), to weigh by bytes per stage."""
    rank_peak_states: tuple[tuple[tuple[int, ...], ...], ...]
    """Per rank: the states that no other state of the rank covers on every stage — the only candidates for its
    largest activations when every stage's bytes are ≥ 0 (`_uncovered`)."""
    stage_ranks: tuple[int, ...]
    simulated: bool
    """The bubble simulated, not the schedule's formula (SIMULATED_ACTIONS)."""

    def stages_of(self, rank: int) -> list[int]:
        """The stages pipeline rank `rank` runs, in stage order."""
        return [s for s, owner in enumerate(self.stage_ranks) if owner == rank]


@lru_cache(maxsize=4096)
def pipeline_shape(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2) -> PipelineShape:
    """Bubble and activations held of `schedule` with F = I = W = 1 (cached; `virtual_stages`: interleaved's v).
    The activations come from the action lists alone (list order is time order on a rank); the bubble from the
    simulator, or for schedules of more than SIMULATED_ACTIONS compute actions from the schedule's formula. The
    action lists are not kept: cached, they would cost every garbage collection a walk over them."""
    chunks = 2 if schedule in V_SHAPED else virtual_stages if schedule == "interleaved" else 1
    built = build_schedule(schedule, pp, microbatches, chunks if schedule == "interleaved" else 1)
    simulated = pp * microbatches * chunks <= SIMULATED_ACTIONS or microbatches < 2 * pp
    if simulated:
        makespan = simulate(built).makespan
        bubble = 1 - 3 * microbatches * chunks / makespan
    else:
        bubble = bubble_formula(schedule, pp, microbatches, chunks if schedule == "interleaved" else 1)
        makespan = 3 * microbatches * chunks / (1 - bubble)
    states = tuple(_held_states(built, rank) for rank in range(pp))
    uncovered = tuple(_uncovered(held) for held in states)
    return PipelineShape(bubble, makespan, peak_activations(built)[0], states, uncovered, built.stage_ranks, simulated)


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


def _uncovered(states: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The states (distinct, sorted) that no other state holds at least as many microbatches as on every stage, for
    one or two stages per rank: a sweep in decreasing order, where a state is covered when one before it holds as
    many on the last stage. With more stages per rank (interleaved, v > 2) all of them: comparing every pair costs
    more than it saves."""
    if len(states[0]) > 2:
        return states
    kept, most_on_last = [], -1
    for state in reversed(states):
        if state[-1] > most_on_last:
            kept.append(state)
            most_on_last = state[-1]
    return tuple(reversed(kept))


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


def pipeline_seconds(shape: PipelineShape, layout: Layout, chunk_seconds: list[float]) -> float:
    """The schedule's time: its steady state as long as the busiest rank's chunks (m times their F + B: every
    microbatch passes each of that rank's stages), its fill and drain — the simulated bubble, in chunk times —
    as long as the average chunk (they pass every stage once). Equal chunks give makespan/3 × one chunk."""
    busiest = max(sum(chunk_seconds[s] for s in shape.stages_of(rank)) for rank in range(layout.pp))
    idle_chunks = shape.makespan_units / 3 - layout.microbatches * layout.chunks
    return layout.microbatches * busiest + idle_chunks * sum(chunk_seconds) / len(chunk_seconds)


def stage_boundary(model: Model, layout: Layout, cluster: Cluster, rows: int, item: float) -> tuple[float, float]:
    """Bytes one rank sends across a stage boundary per microbatch and direction, and the seconds it waits: the
    activation; with Megatron's scatter/gather (tp > 1, no SP) each TP rank sends 1/tp of it and the receivers
    all-gather it over the node's links."""
    message = stage_message_bytes(model, layout, rows, item)
    scatter_gather = cluster.software.pipeline_scatter_gather and layout.tp > 1 and not layout.sp
    sent = message / layout.tp if scatter_gather else message
    seconds = collective_seconds("send", sent, 2, axis_link(layout, "pp", cluster), axis_nodes(layout, "pp", cluster))
    if scatter_gather:
        seconds += collective_seconds("all_gather", message, layout.tp, axis_link(layout, "tp", cluster))
    return sent, seconds


def stage_message_bytes(model: Model, layout: Layout, rows: int, item: float) -> float:
    """One microbatch's activation handed from stage to stage (train's activation_shape), `item` bytes per
    element."""
    positions = model.seq_len // layout.cp // (layout.tp if layout.sp else 1)
    return rows * positions * model.n_embd * item


def tied_gradient_bytes(stage_ranks: tuple[int, ...], rank: int, tied: float, gradient_bytes: float) -> float:
    """The tied embedding's gradient, sent once per step between the first and the last stage's ranks when
    they differ (GPT-2 and tied llama; `mpiparallel.traffic.pipeline_bytes`): `tied` parameters of
    `gradient_bytes` each."""
    ends = (stage_ranks[0], stage_ranks[-1])
    if not tied or ends[0] == ends[1] or rank not in ends:
        return 0.0
    return tied * gradient_bytes
