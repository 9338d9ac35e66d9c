"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward split in two.

The input gradient I is what the previous stage waits for; the weight gradient W is needed only by the
optimizer step. Running I at once and W later lets W passes fill the gaps where 1F1B waits.
Costs per stage (chunk) and microbatch as in `classic`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    Schedule,
    below,
    check_sizes,
    looped_placement,
    v_placement,
    with_communication,
)

if TYPE_CHECKING:
    from .simulator import Costs


def zb_h1_schedule(pp: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with B split into I and W, rank r deferring each W by r microbatches.

    Rank r runs p−1−r warmup forwards, then per microbatch k: the next F, I of k, and W of k−r; the r deferred
    W passes fill the cooldown, where 1F1B would wait for gradients. Every rank holds at most p microbatches
    (F run, W not yet): 1F1B's peak, on every rank rather than only on rank 0. Idle per rank: the ramp-up of
    forwards (p−1)F and the ramp-down of input gradients (p−1)I, less the (p−1)W of deferred weight passes
    that run inside them: (p−1)(F+I−W), the paper's number, exact for m ≥ p when W ≤ F (with F = I = W:
    (p−1)·F, a third of 1F1B's).
    """
    check_zb_h1(pp, microbatches)
    compute = []
    for rank in range(pp):
        forwards = [Action(rank, FORWARD, mb) for mb in range(microbatches)]
        order = forwards[:pp - 1 - rank]
        for mb in range(microbatches):
            next_forward = pp - 1 - rank + mb
            order += forwards[next_forward:next_forward + 1] + [Action(rank, BACKWARD_INPUT, mb)]
            if mb >= rank:
                order.append(Action(rank, BACKWARD_WEIGHT, mb - rank))
        order += [Action(rank, BACKWARD_WEIGHT, mb) for mb in range(microbatches - rank, microbatches)]
        compute.append(order)
    return with_communication("zb", pp, microbatches, looped_placement(pp, 1), compute)


def check_zb_h1(pp: int, microbatches: int) -> None:
    """Each rank r defers r W passes into a cooldown that m < pp microbatches would not have."""
    check_sizes(pp, microbatches)
    if microbatches < pp:
        raise ValueError(f"zb needs at least pp microbatches to fill its cooldown: {microbatches} < pp = {pp}")


def zb_h1_bubble(pp: int, microbatches: int, virtual_stages: int, costs: Costs) -> float:
    """Idle (p−1)(F+I−W) beside m(F+I+W) of work per rank."""
    idle = (pp - 1) * (costs.forward + costs.backward_input - costs.backward_weight)
    return idle / (microbatches * (costs.forward + costs.backward_input + costs.backward_weight) + idle)


def zbv_schedule(pp: int, microbatches: int) -> Schedule:
    """ZB-V (the paper's Section 6): two chunks per rank in a V, rank r holding stages r and 2p−1−r.

    The V puts the last forward chunk and the first backward chunk on the same rank (the last rank holds the
    two middle stages, rank 0 the first and the loss), so the pipeline turns around without a message and
    every rank reaches its first backward early. Rank r runs 2(p−r)−1 forwards of its first chunk, then r
    pairs of second- and first-chunk forwards, then p−r rounds of (F, I, W) of its second chunk; in the
    steady state each round is F, I, W of the first chunk and F, I, W of the second; the cooldown runs the
    remaining I passes and fills the gaps with the W passes. Peak: 2p chunk-microbatches on every rank, the
    activations of p full stages, 1F1B's peak.

    With F = I = W the only idle time is the warmup ramp, (p−1)·F per rank, which no schedule on this
    placement avoids (the last rank's first forward needs p−1 forwards before it): a fraction (p−1)/(6m+p−1),
    a sixth of 1F1B's idle time at the same memory, below 1/13 ≈ 7.7 % for any p once m ≥ 2p. With unequal
    costs this fixed order idles longer (the ramp is then a lower bound). Fewer microbatches than 2p−1 run the
    2p−1 schedule with the missing ones left out.
    """
    check_sizes(pp, microbatches)
    filled = max(microbatches, 2 * pp - 1)
    compute = [below(microbatches, _zbv_order(pp, filled, rank)) for rank in range(pp)]
    return with_communication("zbv", pp, microbatches, v_placement(pp), compute)


def _zbv_order(pp: int, microbatches: int, rank: int) -> list[Action]:
    down, up = rank, 2 * pp - 1 - rank
    order: list[Action] = []
    done = {(stage, kind): 0 for stage in (down, up) for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)}

    def run(stage: int, kind: str) -> None:
        """The next microbatch of `kind` on `stage`."""
        order.append(Action(stage, kind, done[stage, kind]))
        done[stage, kind] += 1

    for _ in range(2 * (pp - rank) - 1):
        run(down, FORWARD)
    for _ in range(rank):
        run(up, FORWARD)
        run(down, FORWARD)
    for _ in range(pp - rank):
        for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            run(up, kind)
    while done[up, FORWARD] < microbatches:
        if done[down, FORWARD] < microbatches:
            run(down, FORWARD)
        run(down, BACKWARD_INPUT)
        run(down, BACKWARD_WEIGHT)
        for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            run(up, kind)
    for _ in range(rank):
        run(down, BACKWARD_INPUT)
        run(up, BACKWARD_INPUT)
    for _ in range(pp - rank):
        run(down, BACKWARD_INPUT)
        run(down, BACKWARD_WEIGHT)
    for stage in (up, down):
        while done[stage, BACKWARD_WEIGHT] < done[stage, BACKWARD_INPUT]:
            run(stage, BACKWARD_WEIGHT)
    return order


def zbv_bubble(pp: int, microbatches: int, virtual_stages: int, costs: Costs) -> float:
    """The warmup ramp (p−1)·F beside 2m(F+I+W) of work per rank: exact for F = I = W and m ≥ 2p−1, a lower
    bound otherwise."""
    idle = (pp - 1) * costs.forward
    return idle / (2 * microbatches * (costs.forward + costs.backward_input + costs.backward_weight) + idle)
