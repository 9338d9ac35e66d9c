"""The time of one step of a layout: compute, the communication each unit waits for, the pipeline, the data-parallel
reduction and the optimizer.

    step = pipeline (or m microbatches one after another) + exposed dp + optimizer

- per unit and microbatch: F + B compute (`kernel_costs.compute_seconds`) + the tp, cp and ep collectives it blocks on
  (ep only beyond the compute beside it with `Software.chunk_overlap`, DualPipe's overlap);
- the busiest pipeline rank (compute + waits) gives the reported compute and communication; pp exposes its fill
  and drain, 2·(pp·chunks − 1) boundary messages (`pipeline`);
- dp: the gradients in 25 MiB buckets (train's --bucket-mb) all-reduced, or under ZeRO reduce-scattered and the
  parameters all-gathered (ZeRO-3: also for forward and backward); dense parameters over dp·cp ranks, routed
  experts over dp/ep·cp; exposed max(last bucket, dp − backward) where it overlaps the last backward, else all;
- optimizer: AdamW's ~12 elementwise passes (SGD's 2) + zeroing the gradients, over this rank's parameters (its
  ZeRO shard of them) at the memory rate.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from .communication import (
    axis_link,
    axis_nodes,
    axis_size,
    collective_bytes_sent,
    collective_seconds,
    ep_exchange,
    group_link,
    group_nodes,
)
from .hardware import Cluster
from .kernel_costs import UnitCost, compute_seconds
from .layout import AXES, Layout
from .pipeline import pipeline_seconds, stage_boundary, tied_gradient_bytes
from .results import Plan
from .setting import Setting
from .shapes import Model, held_parameters

BUCKET_BYTES = 25 * 2**20
"""train's default --bucket-mb: the data-parallel engine reduces gradients in buckets of this size."""


def timed_plan(setting: Setting, per_unit: list[float], tied: float, memory_per_rank: list[dict[str, float]],
               memory_per_stage: list[dict[str, Any]]) -> Plan:
    """The step's time, and its compute and communication on the busiest pipeline rank (compute + waits)."""
    layout, m = setting.layout, setting.layout.microbatches
    cluster, precision = setting.cluster, setting.precision
    compute_of = [compute_seconds(c, cluster, precision, False) + compute_seconds(c, cluster, precision, True)
                  for c in setting.costs]
    blocking_of = [_blocking(setting, c) for c in setting.costs]
    overlapped = cluster.software.chunk_overlap
    waits_of = [_waited(seconds, compute, overlapped) for (seconds, _, _), compute in zip(blocking_of, compute_of,
                                                                                            strict=True)]
    chunk_seconds = [setting.stage_weighted(stage, compute_of) + setting.stage_weighted(stage, waits_of)
                     for stage in range(len(setting.stages))]
    per_rank = [_rank_step(setting, rank, compute_of, blocking_of, waits_of) for rank in range(layout.pp)]
    busiest = max(range(layout.pp), key=lambda rank: per_rank[rank][0] + per_rank[rank][3])
    compute, comm_s, comm_bytes, exposed = per_rank[busiest]
    ep_across = m * setting.rank_weighted(busiest, [b[2] for b in blocking_of])
    if setting.shape is None:
        pipeline, bubble = m * chunk_seconds[0], 0.0
    else:
        comm_s["pp"], comm_bytes["pp"], pipeline, fill_and_drain = _pipeline(setting, busiest, tied, chunk_seconds)
        bubble = setting.shape.bubble
        exposed += fill_and_drain
    comm_s["dp"], comm_bytes["dp"], dp_exposed, optimizer = _after_backward(setting, busiest, per_unit, tied)
    exposed += dp_exposed
    step = pipeline + dp_exposed + optimizer
    return Plan(layout, memory_per_rank, memory_per_stage, compute, comm_s, comm_bytes, exposed, bubble, step,
                ep_inter_node_bytes=ep_across)


def _blocking(setting: Setting, cost: UnitCost) -> tuple[dict[str, float], dict[str, float], float]:
    """Per axis, seconds and bytes sent of the collectives one microbatch of a unit waits for, and the EP bytes
    that cross nodes (read-only: cached for the layouts with the same axes)."""
    layout = setting.layout
    axes = Layout(layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, ep_dispatch=layout.ep_dispatch)
    return _collective_waits(cost, setting.model, setting.cluster, axes)


@lru_cache(maxsize=16384)
def _collective_waits(cost: UnitCost, model: Model, cluster: Cluster,
                      layout: Layout) -> tuple[dict[str, float], dict[str, float], float]:
    seconds, bytes_sent, ep_across = dict.fromkeys(AXES, 0.0), dict.fromkeys(AXES, 0.0), 0.0
    for name, nbytes, axis, group in cost.collectives_forward + cost.collectives_backward:
        if name in ("dispatch", "combine"):
            time, sent, across = ep_exchange(model, layout, cluster, nbytes)
            seconds[axis], bytes_sent[axis], ep_across = seconds[axis] + time, bytes_sent[axis] + sent, \
                ep_across + across
            continue
        ranks = group or axis_size(layout, axis)
        seconds[axis] += collective_seconds(name, nbytes, ranks, axis_link(layout, axis, cluster),
                                            axis_nodes(layout, axis, cluster))
        bytes_sent[axis] += collective_bytes_sent(name, nbytes, ranks)
    return seconds, bytes_sent, ep_across


def _rank_step(setting: Setting, rank: int, compute_of: list[float], blocking_of: list[tuple[Any, ...]],
               waits_of: list[float]) -> tuple[float, dict[str, float], dict[str, float], float]:
    """Pipeline rank `rank`'s compute, communication seconds and bytes per axis, and the seconds it waits for
    them, over the m microbatches of its units."""
    m = setting.layout.microbatches
    seconds = {axis: m * setting.rank_weighted(rank, [b[0][axis] for b in blocking_of]) for axis in AXES}
    sent = {axis: m * setting.rank_weighted(rank, [b[1][axis] for b in blocking_of]) for axis in AXES}
    return m * setting.rank_weighted(rank, compute_of), seconds, sent, m * setting.rank_weighted(rank, waits_of)


def _pipeline(setting: Setting, busiest: int, tied: float,
              chunk_seconds: list[float]) -> tuple[float, float, float, float]:
    """The busiest rank's pp seconds and bytes (its stage boundaries' messages, 2·m·chunks, and the tied
    embedding's gradient), the pipeline's time and the fill and drain it exposes: each boundary once each way
    (all of its sends when they block; none when they run beside the paired chunks' compute)."""
    layout, cluster, m = setting.layout, setting.cluster, setting.layout.microbatches
    message, boundary = stage_boundary(setting.model, layout, cluster, setting.rows, setting.precision.activations)
    sends = 2 * m * layout.chunks
    tied_bytes = tied_gradient_bytes(setting.stage_ranks, busiest, tied, setting.precision.gradients)
    seconds = sends * boundary + collective_seconds("send", tied_bytes, 2, axis_link(layout, "pp", cluster))
    sent = sends * message + tied_bytes
    fill_and_drain = 2 * (layout.pp * layout.chunks - 1) * boundary
    if cluster.software.blocking_pipeline_sends:  # the steady state's sends wait too
        fill_and_drain = max(fill_and_drain, seconds)
    if cluster.software.chunk_overlap:
        fill_and_drain = 0.0
    return seconds, sent, pipeline_seconds(setting.shape, layout, chunk_seconds) + fill_and_drain, fill_and_drain


def _after_backward(setting: Setting, busiest: int, per_unit: list[float],
                    tied: float) -> tuple[float, float, float, float]:
    """The busiest rank's gradient reduction (seconds, bytes), what of it is exposed, and the optimizer's
    seconds."""
    count = held_parameters(setting.units_of(busiest), per_unit, tied)
    experts = setting.held_experts(busiest)
    dp_seconds, dp_bytes, last_bucket = _data_parallel(setting, count - experts, experts)
    overlap = setting.cluster.software.dp_overlap
    if overlap == "always" or overlap == "without-pipeline" and setting.shape is None:
        backward = setting.rank_weighted(busiest, [compute_seconds(c, setting.cluster, setting.precision, True)
                                                   for c in setting.costs])
        dp_exposed = max(last_bucket, dp_seconds - backward)  # overlapped with the last microbatch's backward
    else:  # reduced after the backward (or after the pipeline's schedule)
        dp_exposed = dp_seconds
    return dp_seconds, dp_bytes, dp_exposed, _optimizer_seconds(setting, count - experts, experts)


def _waited(seconds: dict[str, float], compute: float, overlapped: bool) -> float:
    """What a unit's microbatch waits for its collectives: all of them, or with `Software.chunk_overlap` the EP
    all-to-alls only beyond the compute they run beside."""
    if not overlapped:
        return sum(seconds.values())
    return sum(value for axis, value in seconds.items() if axis != "ep") + max(0.0, seconds["ep"] - compute)


def _data_parallel(setting: Setting, dense: float, experts: float = 0.0) -> tuple[float, float, float]:
    """Seconds, bytes sent and the last bucket's seconds of the gradient reductions: the dense parameters' over
    dp×cp, the routed experts' over the dp/ep×cp ranks holding the same experts (ep apart, train's expert_dp)."""
    layout = setting.layout
    seconds, sent, last_bucket = _reduction(setting, dense, layout.shard_ranks * layout.cp, layout.tp)
    hybrid = layout.replicas > 1 and layout.zero >= 1  # each shard then summed over the other groups
    if hybrid:
        more = _replica_reduction(setting, dense, layout.replicas, layout.shard_ranks * layout.cp * layout.tp,
                                  layout.shard_ranks * layout.cp)
        seconds, sent = seconds + more[0], sent + more[1]
    if experts:
        holders = layout.shard_ranks // layout.ep  # the ranks of a shard group holding the same experts
        more = _reduction(setting, experts, holders * layout.cp, layout.tp * layout.cp * layout.ep)
        seconds, sent, last_bucket = seconds + more[0], sent + more[1], max(last_bucket, more[2])
        if hybrid:
            more = _replica_reduction(setting, experts, layout.replicas, layout.shard_ranks * layout.cp * layout.tp,
                                      holders * layout.cp)
            seconds, sent = seconds + more[0], sent + more[1]
    return seconds, sent, last_bucket


def _reduction(setting: Setting, count: float, ranks: int, stride: int) -> tuple[float, float, float]:
    """One group's gradient reduction over `ranks` ranks `stride` apart (the ranks that hold the same
    parameters): all-reduce per bucket; ZeRO-1/2 reduce-scatter + all-gather of the updated parameters; ZeRO-3
    also all-gathers every parameter for forward and again for backward."""
    layout, precision = setting.layout, setting.precision
    if ranks == 1 or precision.gradients == 0 or count <= 0:
        return 0.0, 0.0, 0.0
    link, nodes = group_link(stride, ranks, setting.cluster), group_nodes(stride, ranks, setting.cluster)
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


def _replica_reduction(setting: Setting, count: float, replicas: int, stride: int,
                       shards: int) -> tuple[float, float]:
    """Hybrid sharding's all-reduce of each rank's reduced gradient shard (1/`shards` of each bucket: N·cp, or
    the N/ep·cp holders of an expert) over the `replicas` shard groups, `stride` ranks apart: seconds and bytes
    sent."""
    precision = setting.precision
    if precision.gradients == 0 or count <= 0:
        return 0.0, 0.0
    link, nodes = group_link(stride, replicas, setting.cluster), group_nodes(stride, replicas, setting.cluster)
    grad_bytes = count * precision.gradients
    buckets = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
    shard = grad_bytes / buckets / shards
    return (buckets * collective_seconds("all_reduce", shard, replicas, link, nodes),
            buckets * collective_bytes_sent("all_reduce", shard, replicas))


def _optimizer_seconds(setting: Setting, dense: float, experts: float = 0.0) -> float:
    """AdamW's elementwise passes over this rank's parameters, its ZeRO shard of them (about 12: moments,
    square root, division, decay); SGD's 2; plus zeroing the gradients."""
    layout, precision = setting.layout, setting.precision
    passes = 12 if precision.optimizer else 2
    local = dense + experts
    if layout.zero >= 1:
        local = dense / setting.zero_shards(False) + experts / setting.zero_shards(True)
    return (passes + 1) * local * precision.weights / setting.cluster.elementwise_bytes
