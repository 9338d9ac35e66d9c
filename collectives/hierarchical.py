"""Hierarchical all-reduce, reduce-scatter and all-gather: the slow links between nodes carry 1/k of the data.

On a cluster the links inside a node (NVLink, shared memory) are much faster than those between nodes. A flat
ring over n = N·k ranks (N nodes of k ranks) moves every byte across the slowest link on its way: each of its
2(n−1) steps waits for the messages that cross a node boundary. The hierarchical algorithms split the work by
tier (the `NodeLayout` of the communicator says which rank is where):

1. inside each node, a ring reduce-scatter over the node's k ranks: local rank l holds the node's sum of lane l;
2. across nodes, a ring collective among the N ranks with the same local rank (a *lane*) on that 1/k part;
3. inside each node, a ring all-gather of the k parts.

all_reduce = 1 + (ring all-reduce of S/k across nodes) + 3; reduce_scatter = 1 + (ring reduce-scatter of the lane
across nodes), its blocks laid out lane by lane first; all_gather = (ring all-gather of the lane across nodes) + 3,
then the blocks put back in rank order. With α, β inside (i) and across (e) nodes:

    all_reduce      2(k−1)·αi + 2(k−1)/k·S·βi + 2(N−1)·αe + 2(N−1)/N·S/k·βe + (n−1)/n·S·γ
    reduce_scatter   (k−1)·αi +  (k−1)/k·S·βi +  (N−1)·αe +  (N−1)/N·S/k·βe + (n−1)/n·S·γ + S·γ (layout copy)
    all_gather       (k−1)·αi +  (k−1)/k·S·βi +  (N−1)·αe +  (N−1)/N·S/k·βe + S·γ (layout copy)

against the flat ring's 2(n−1)·αe + 2(n−1)/n·S·βe (all-reduce): the bytes that cross nodes fall from
2(n−1)/n·S to 2(N−1)/N·S/k per rank, and the inter-node latency terms from 2(n−1) to 2(N−1).

Unequal nodes (say a last node with fewer ranks): with k the smallest node's size, a node's ranks from local
rank k on fold into the rank with local rank (theirs mod k) before the algorithm (their input, reduced in, or
their block, gathered in) and get their result back after it: 2(αi + S·βi) more for those pairs, all inside a
node. Ranks need not be numbered node by node; a sub-communicator's nodes come from the world's.
"""

from __future__ import annotations

from .backend import Array
from .blocks import Reducer, even_bounds
from .communicator import DEFAULT_SEGMENT_BYTES, Step, Steps
from .ring import ring_all_gather_phase, ring_reduce_scatter_phase
from .scratch import scratch
from .topology import NodeLayout


def among(steps: Steps, ranks: tuple[int, ...]) -> Steps:
    """An algorithm's steps written for ranks 0..len(ranks)−1 of a group, sent to `ranks` of the communicator."""
    for step in steps:
        if step.send is not None:
            step.dest = ranks[step.dest]
        if step.recv is not None:
            step.source = ranks[step.source]
        yield step


def _largest(bounds: list[int]) -> int:
    return max(bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1))


def _cumulative(sizes: list[int]) -> list[int]:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds


def _extra_hands_over(x: Array, out: Array, layout: NodeLayout, rank: int) -> Steps:
    """An extra rank (beyond the smallest node's size) sends its input to its core rank and gets its result."""
    core = layout.core_of(rank)
    yield Step(send=x, dest=core)
    yield Step(recv=out, source=core)


def hierarchical_all_reduce(x: Array, out: Array, rank: int, size: int, reduce: Reducer, layout: NodeLayout,
                            segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """All-reduce of flat `x` into flat `out` (which may be `x`): reduce-scatter in the node, all-reduce of this
    rank's 1/k across nodes, all-gather in the node."""
    if layout.is_extra(rank):
        yield from _extra_hands_over(x, out, layout, rank)
        return
    local, node, k = layout.local_rank[rank], layout.node_index[rank], layout.k
    current = x
    extras = layout.extras_of(rank)
    if extras:
        with scratch(x, len(x)) as arrived:
            for extra in extras:
                yield Step(recv=arrived, source=extra)
                reduce(current, arrived, out)
                current = out
    if k == 1 and current is not out:  # no reduce-scatter inside the node to write out
        out[...] = current
        current = out
    lanes = even_bounds(len(x), k)

    def into_out(step: int, block: int) -> Array:
        return out[lanes[block]:lanes[block + 1]]

    core, lane = layout.core(rank), layout.lane(local)
    yield from among(ring_reduce_scatter_phase(current, lanes, local, k, reduce, into_out,
                                               segment_bytes=segment_bytes), core)
    part = out[lanes[local]:lanes[local + 1]]
    parts = even_bounds(len(part), layout.count)

    def in_place(step: int, block: int) -> Array:
        return part[parts[block]:parts[block + 1]]

    yield from among(ring_reduce_scatter_phase(part, parts, node, layout.count, reduce, in_place,
                                               segment_bytes=segment_bytes), lane)
    yield from among(ring_all_gather_phase(part, parts, node, layout.count, segment_bytes=segment_bytes), lane)
    yield from among(ring_all_gather_phase(out, lanes, local, k, segment_bytes=segment_bytes), core)
    for extra in extras:
        yield Step(send=out, dest=extra)


def _work_bounds(layout: NodeLayout, rank: int, block: int) -> tuple[list[int], list[int], int]:
    """Where the work buffer's parts lie (elements): the k lanes, the N chunks of this rank's lane (relative to
    the lane's start), and the start of this rank's chunk (relative too)."""
    lanes = _cumulative([blocks * block for blocks in layout.lane_blocks])
    local, node = layout.local_rank[rank], layout.node_index[rank]
    chunks = _cumulative([len(layout.owned[r]) * block for r in layout.lane(local)])
    return lanes, chunks, chunks[node]


def hierarchical_reduce_scatter(x: Array, out: Array, rank: int, size: int, reduce: Reducer, layout: NodeLayout,
                                segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """Reduce-scatter of flat `x` into `out` (block `rank`): x's blocks laid out lane by lane, reduce-scattered
    over the lanes inside the node, then over the nodes' chunks of the lane across nodes."""
    if layout.is_extra(rank):
        yield from _extra_hands_over(x, out, layout, rank)
        return
    block, local, node, k = len(out), layout.local_rank[rank], layout.node_index[rank], layout.k
    with scratch(x, len(x)) as work:
        for position, owner in enumerate(layout.block_order):
            work[position * block:(position + 1) * block] = x[owner * block:(owner + 1) * block]
        extras = layout.extras_of(rank)
        if extras:
            with scratch(x, len(x)) as arrived:
                for extra in extras:
                    yield Step(recv=arrived, source=extra)
                    for position, owner in enumerate(layout.block_order):
                        target = work[position * block:(position + 1) * block]
                        reduce(target, arrived[owner * block:(owner + 1) * block], target)
        lanes, chunks, mine = _work_bounds(layout, rank, block)

        def in_work(step: int, part: int) -> Array:
            return work[lanes[part]:lanes[part + 1]]

        yield from among(ring_reduce_scatter_phase(work, lanes, local, k, reduce, in_work,
                                                   segment_bytes=segment_bytes, largest_block=_largest(lanes)),
                         layout.core(rank))
        lane = work[lanes[local]:lanes[local + 1]]

        def in_lane(step: int, part: int) -> Array:
            return lane[chunks[part]:chunks[part + 1]]

        yield from among(ring_reduce_scatter_phase(lane, chunks, node, layout.count, reduce, in_lane,
                                                   segment_bytes=segment_bytes, largest_block=_largest(chunks)),
                         layout.lane(local))
        out[...] = lane[mine:mine + block]
        for i, extra in enumerate(extras, start=1):
            yield Step(send=lane[mine + i * block:mine + (i + 1) * block], dest=extra)


def hierarchical_all_gather(x: Array, out: Array, rank: int, size: int, layout: NodeLayout,
                            segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """All-gather of flat `x` into flat `out`: the lane's chunks all-gathered across nodes, then the lanes inside
    the node, then the blocks put back in rank order."""
    if layout.is_extra(rank):
        yield from _extra_hands_over(x, out, layout, rank)
        return
    block, local, node, k = len(x), layout.local_rank[rank], layout.node_index[rank], layout.k
    with scratch(x, len(out)) as work:
        lanes, chunks, mine = _work_bounds(layout, rank, block)
        lane = work[lanes[local]:lanes[local + 1]]
        lane[mine:mine + block] = x
        extras = layout.extras_of(rank)
        for i, extra in enumerate(extras, start=1):
            yield Step(recv=lane[mine + i * block:mine + (i + 1) * block], source=extra)
        yield from among(ring_all_gather_phase(lane, chunks, node, layout.count, segment_bytes=segment_bytes,
                                               largest_block=_largest(chunks)), layout.lane(local))
        yield from among(ring_all_gather_phase(work, lanes, local, k, segment_bytes=segment_bytes,
                                               largest_block=_largest(lanes)), layout.core(rank))
        for position, owner in enumerate(layout.block_order):
            out[owner * block:(owner + 1) * block] = work[position * block:(position + 1) * block]
    for extra in extras:
        yield Step(send=out, dest=extra)
