"""Schedules by name: argument checks with one clear message each, and the analytic bubble of each."""

from __future__ import annotations

from collections.abc import Callable

from .actions import Schedule, check_sizes
from .classic import check_interleaved, full_backward_bubble, gpipe_schedule, interleaved_schedule, one_f_one_b_schedule
from .dualpipe import dualpipev_bubble, dualpipev_schedule
from .simulator import UNIT_COSTS, Costs
from .zero_bubble import check_zb_h1, zb_h1_bubble, zb_h1_schedule, zbv_bubble, zbv_schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")

V_SHAPED = ("zbv", "dualpipev")
"""Schedules with exactly two stages per rank in a V (rank r holds r and 2·pp−1−r)."""

_BUILDERS: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda pp, microbatches, _: gpipe_schedule(pp, microbatches),
    "1f1b": lambda pp, microbatches, _: one_f_one_b_schedule(pp, microbatches),
    "interleaved": interleaved_schedule,
    "zb": lambda pp, microbatches, _: zb_h1_schedule(pp, microbatches),
    "zbv": lambda pp, microbatches, _: zbv_schedule(pp, microbatches),
    "dualpipev": lambda pp, microbatches, _: dualpipev_schedule(pp, microbatches),
}

FORMULAS = {
    "gpipe": "(p-1)/(m+p-1)",
    "1f1b": "(p-1)/(m+p-1)",
    "interleaved": "(p-1)/(v*m+p-1)",
    "zb": "(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W)), for W <= F",
    "zbv": "(p-1)F / (2m(F+I+W) + (p-1)F), exact for F = I = W and m >= 2p-1, else a lower bound",
    "dualpipev": "(p-1)(F&B+B-3W) / (2m(F+I+W) + (p-1)(F&B+B-3W)), F&B = F+B, exact for F = I >= W, m >= 2p",
}
"""Each schedule's bubble (idle fraction) as text, with the conditions under which it is exact."""

_BUBBLES: dict[str, Callable[[int, int, int, Costs], float]] = {
    "gpipe": full_backward_bubble, "1f1b": full_backward_bubble, "interleaved": full_backward_bubble,
    "zb": zb_h1_bubble, "zbv": zbv_bubble, "dualpipev": dualpipev_bubble,
}


def default_microbatches(pp: int) -> int:
    """Microbatches when none are given: pp, the fewest that fill a pipeline (`train` and `schedule` alike)."""
    return pp


def default_virtual_stages(name: str) -> int:
    """Stages per rank when none are given: 2 for interleaved (1 would be plain 1F1B), else 1 (the V-shaped
    schedules hold 2 whatever is given)."""
    return 2 if name == "interleaved" else 1


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule `name` for `pp` ranks and `microbatches` microbatches, sends and receives included.

    `virtual_stages` is the number of chunks per rank of `interleaved`; the V-shaped schedules always have
    2 (passing 2 is accepted), the others 1. Raises ValueError with one message for any invalid input.
    """
    check_arguments(name, pp, microbatches, virtual_stages)
    return _BUILDERS[name](pp, microbatches, virtual_stages)


def check_arguments(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError for any combination `build_schedule` refuses; silent otherwise."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if name in V_SHAPED and virtual_stages not in (1, 2):
        raise ValueError(f"{name} always holds 2 stages per rank (a V); leave out the virtual stages")
    if name not in V_SHAPED and name != "interleaved" and virtual_stages != 1:
        raise ValueError(f"{name} has one stage per rank; virtual stages are for interleaved only")
    if name == "interleaved":
        check_interleaved(pp, microbatches, virtual_stages)
    elif name == "zb":
        check_zb_h1(pp, microbatches)
    else:
        check_sizes(pp, microbatches)


def bubble_formula(name: str, pp: int, microbatches: int, virtual_stages: int = 1, costs: Costs = UNIT_COSTS) -> float:
    """The schedule's analytic idle fraction (see each schedule's docstring for the assumptions)."""
    check_arguments(name, pp, microbatches, virtual_stages)
    chunks = 2 if name in V_SHAPED else virtual_stages
    return _BUBBLES[name](pp, microbatches, chunks, costs)
