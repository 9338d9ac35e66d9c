"""Memory per pipeline rank and per stage: the model states of the units a rank holds and the activations it holds.

    model states  weights + gradients + optimizer state, each (dense + experts) × its bytes per parameter, divided
                  from ZeRO stage 3, 2, 1 respectively by dp (dense parameters) or dp/ep (routed experts)
    activations   max over the rank's states (microbatches held on each of its stages, `pipeline`) of
                  Σ held × the stage's bytes; a stage's bytes: its units' saved elements × bytes per element

Without a pipeline one microbatch is in flight. The parameters held are `shapes`': TP shards, the vocabulary padded
to a multiple of tp, the last stage's copy of the tied embedding, E/ep experts. Every unit is held by one pipeline
rank, so the model states' mean over the ranks bounds the largest rank's memory from below (the search's first
filter, `least_largest_states`).
"""

from __future__ import annotations

from typing import Any

from .layout import Layout, Precision
from .setting import Setting
from .shapes import Model, held_parameters, scaled_unit_parameters


def model_state_bytes(layout: Layout, precision: Precision, dense: float,
                      experts: float) -> tuple[float, float, float]:
    """Bytes of the weights, gradients and optimizer state of `dense` parameters and `experts` routed experts'
    parameters, each sharded from its ZeRO stage up (3, 2, 1) over dp (a shard group of dp_shard ranks with
    hybrid sharding), or dp/ep for the experts."""

    def sharded(per_parameter: float, stage: int) -> float:
        if layout.zero < stage:
            return (dense + experts) * per_parameter
        return per_parameter * (dense / layout.shard_ranks + experts / (layout.shard_ranks // layout.ep))

    return sharded(precision.weights, 3), sharded(precision.gradients, 2), sharded(precision.optimizer, 1)


def least_largest_states(model: Model, layout: Layout, precision: Precision) -> float:
    """A lower bound of the largest pipeline rank's model states without placing the units: their mean over the pp
    ranks (every unit is held by one rank; the tied shard counted once)."""
    per_unit, tied, experts = scaled_unit_parameters(model, layout)
    routed = sum(experts)
    return sum(model_state_bytes(layout, precision, sum(per_unit) - tied - routed, routed)) / layout.pp


def stage_activation_bytes(setting: Setting, weights_only: bool = False) -> list[float]:
    """Per stage, the bytes one microbatch leaves saved on it: its units' saved elements × bytes per element."""
    if weights_only:
        return [0.0 for _ in setting.stages]
    saved, kinds = [cost.saved for cost in setting.costs], setting.kinds
    return [sum(saved[kinds[u]] for u in units) * setting.precision.activations for units in setting.stages]


def stage_memory(setting: Setting, per_unit: list[float], stage_saved: list[float]) -> list[dict[str, Any]]:
    """Per stage: its pipeline rank, units, parameters, and activations per microbatch and at its peak."""
    peaks = setting.shape.peak_per_stage if setting.shape else (1,)
    return [{"stage": s, "pp_rank": setting.stage_ranks[s], "units": [units.start, units.stop],
             "parameters": sum(per_unit[u] for u in units), "activations_per_microbatch": stage_saved[s],
             "peak_microbatches": peaks[s], "activations": peaks[s] * stage_saved[s]}
            for s, units in enumerate(setting.stages)]


def rank_memory(setting: Setting, rank: int, per_unit: list[float], tied: float,
                stage_saved: list[float]) -> dict[str, float]:
    """Pipeline rank `rank`'s bytes: parameters, gradients, optimizer state (each ZeRO-sharded from its stage up),
    activations at its peak, and their total."""
    experts = setting.held_experts(rank)
    dense = held_parameters(setting.units_of(rank), per_unit, tied) - experts
    weights, gradients, optimizer = model_state_bytes(setting.layout, setting.precision, dense, experts)
    if setting.shape is None:
        activations = stage_saved[0]  # microbatches one after another: one in flight
    else:  # its fullest state; with no stage of negative bytes, one that no other state covers
        states = setting.shape.rank_peak_states if min(stage_saved) >= 0 else setting.shape.rank_stage_counts
        stages = setting.stages_of(rank)
        activations = max(sum(n * stage_saved[s] for s, n in zip(stages, state, strict=True))
                          for state in states[rank])
    return {"pp_rank": rank, "parameters": weights, "gradients": gradients, "optimizer_state": optimizer,
            "activations": activations, "total": weights + gradients + optimizer + activations}
