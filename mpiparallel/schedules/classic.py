"""The schedules with a full backward B: GPipe, 1F1B and Megatron's interleaved 1F1B.

Convention (the whole package): F, I, W are the times of one stage's forward, input-gradient and
weight-gradient pass on one microbatch, B = I + W; p ranks, m microbatches, v stages (chunks) per rank, each
chunk 1/v of a rank's layers, so its costs are per chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .actions import FORWARD, FULL_BACKWARD, Action, Schedule, check_sizes, looped_placement, with_communication

if TYPE_CHECKING:
    from .simulator import Costs


def gpipe_schedule(pp: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al., 2019): every rank runs all its forwards, then all its backwards.

    Simple, and every microbatch's activations are held until the backward wave: m per stage. The pipeline
    fills for p−1 forwards and drains for p−1 backwards: idle per rank (p−1)(F+I+W), fraction (p−1)/(m+p−1).
    """
    check_sizes(pp, microbatches)
    compute = [[Action(rank, FORWARD, mb) for mb in range(microbatches)]
               + [Action(rank, FULL_BACKWARD, mb) for mb in range(microbatches)] for rank in range(pp)]
    return with_communication("gpipe", pp, microbatches, looped_placement(pp, 1), compute)


def one_f_one_b_schedule(pp: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): rank r runs p−1−r warmup forwards, then alternates one
    forward with one backward, then drains the remaining backwards.

    A backward starts as soon as the last stage has the loss, so rank r holds at most p−r microbatches (p on
    rank 0) instead of GPipe's m; the bubble is GPipe's: idle (p−1)(F+I+W), fraction (p−1)/(m+p−1).
    """
    check_sizes(pp, microbatches)
    compute = [_one_f_one_b_order([Action(rank, FORWARD, mb) for mb in range(microbatches)],
                                  [Action(rank, FULL_BACKWARD, mb) for mb in range(microbatches)],
                                  warmup=pp - 1 - rank) for rank in range(pp)]
    return with_communication("1f1b", pp, microbatches, looped_placement(pp, 1), compute)


def interleaved_schedule(pp: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al., 2021): each rank holds v chunks, stage s on rank s mod p,
    and runs them in groups of p microbatches (chunk 0 of microbatches 0..p−1, then chunk 1 of the same, …).

    Each rank starts after p−1 chunk forwards of 1/v the size: idle (p−1)(F+I+W) in chunk costs, fraction
    (p−1)/(v·m+p−1), the 1F1B bubble ÷ v for m ≫ p, at the price of v times the messages and a longer warmup
    of 2(p−1−r) + (v−1)·p chunk forwards. m must be a multiple of p (the groups); with m = p every forward is
    warmup, as Megatron does.
    """
    check_interleaved(pp, microbatches, virtual_stages)
    total = microbatches * virtual_stages
    compute = []
    for rank in range(pp):
        forwards = [_interleaved_action(pp, virtual_stages, rank, index, FORWARD) for index in range(total)]
        backwards = [_interleaved_action(pp, virtual_stages, rank, index, FULL_BACKWARD) for index in range(total)]
        warmup = total if microbatches == pp else 2 * (pp - 1 - rank) + (virtual_stages - 1) * pp
        compute.append(_one_f_one_b_order(forwards, backwards, warmup))
    return with_communication("interleaved", pp, microbatches, looped_placement(pp, virtual_stages), compute)


def check_interleaved(pp: int, microbatches: int, virtual_stages: int) -> None:
    """Megatron's grouping needs whole groups of pp microbatches."""
    check_sizes(pp, microbatches)
    if virtual_stages < 1:
        raise ValueError(f"virtual stages must be at least 1, not {virtual_stages}")
    if microbatches % pp:
        raise ValueError(f"interleaved needs microbatches divisible by pp (Megatron's groups of pp microbatches): "
                         f"{microbatches} microbatches, pp {pp}")


def _interleaved_action(pp: int, virtual_stages: int, rank: int, index: int, kind: str) -> Action:
    """The index-th forward (or backward) of `rank` in Megatron's order: groups of pp microbatches per chunk,
    chunks ascending for forwards and descending for backwards."""
    group, within = divmod(index, pp * virtual_stages)
    chunk, offset = divmod(within, pp)
    if kind != FORWARD:
        chunk = virtual_stages - 1 - chunk
    return Action(chunk * pp + rank, kind, group * pp + offset)


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward at a time, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    steady = [action for pair in zip(forwards[warmup:], backwards, strict=False) for action in pair]
    return forwards[:warmup] + steady + backwards[len(forwards) - warmup:]


def full_backward_bubble(pp: int, microbatches: int, virtual_stages: int, costs: Costs) -> float:
    """GPipe, 1F1B and interleaved: idle (p−1)(F+I+W) beside v·m(F+I+W) of work: (p−1)/(v·m+p−1)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)
