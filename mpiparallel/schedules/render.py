"""A simulated (or measured) timeline shown three ways: a text chart, a picture and JSON (the Chrome trace is
`mpiparallel.trace`).

The text chart has one row per rank and one column per time unit (scaled down to fit); each action prints
its kind and microbatch where it starts (`F3`, `I0`, `W2`, `B1`) and `-` for as long as it lasts; `.` is idle.
On a rank with two stages the second (higher) stage's actions print in lowercase; with more, the label is the
action string with its stage (`5F3`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, Action
from .simulator import Simulation

CHART_WIDTH = 150
"""Characters of time cells per line; longer timelines wrap into bands of this width."""

KIND_NAMES = {FORWARD: "forward", BACKWARD_INPUT: "input gradient", BACKWARD_WEIGHT: "weight gradient",
              FULL_BACKWARD: "full backward (I+W)"}


# -- text chart ---------------------------------------------------------------------------------------------

def text_chart(simulation: Simulation, width: int = CHART_WIDTH) -> str:
    """Ranks × time: one row per rank, wrapped into bands of `width` characters, the legend underneath."""
    labels = {interval.action: _label(simulation, interval.action)
              for rank in simulation.timeline for interval in rank if interval.action.is_compute}
    cell = max(map(len, labels.values()), default=1) + 1
    unit = _time_per_column(simulation)
    rows = [_cells(simulation, rank, labels, unit, cell) for rank in range(simulation.schedule.pp)]
    per_band, columns = max(1, width // cell), len(rows[0])
    bands = []
    for first in range(0, columns, per_band):
        ruler = "".join(f"{column * unit:g}".ljust(cell * 10)
                        for column in range(first, min(first + per_band, columns), 10))
        lines = [f"{'time':<{_name_width(simulation)}} |{ruler}"]
        lines += [f"{f'rank {rank}':<{_name_width(simulation)}} |" + "".join(row[first:first + per_band])
                  for rank, row in enumerate(rows)]
        bands.append("\n".join(line.rstrip() for line in lines))
    return "\n\n".join(bands) + "\n" + _legend(simulation, unit)


def _cells(simulation: Simulation, rank: int, labels: dict[Action, str], unit: float, cell: int) -> list[str]:
    """One string of `cell` characters per time unit: the label where an action starts, dashes while it runs."""
    columns = max(1, math.ceil(simulation.makespan / unit - 1e-9))
    cells = [".".ljust(cell)] * columns
    for interval in simulation.compute_timeline(rank):
        first = min(round(interval.start / unit), columns - 1)
        last = max(first + 1, round(interval.end / unit))
        cells[first:last] = [labels[interval.action].ljust(cell)] + ["-" * (cell - 1) + " "] * (last - first - 1)
    return cells


def _name_width(simulation: Simulation) -> int:
    return len(f"rank {simulation.schedule.pp - 1}")


def _label(simulation: Simulation, action: Action) -> str:
    schedule = simulation.schedule
    if schedule.virtual_stages > 2:
        return str(action)
    stages = schedule.stages_of(schedule.stage_ranks[action.stage])
    kind = action.kind if action.stage == stages[0] else action.kind.lower()
    return f"{kind}{action.microbatch}"


def _time_per_column(simulation: Simulation) -> float:
    """The shortest compute cost: every action then spans at least one column."""
    costs = simulation.costs
    return min((cost for cost in (costs.forward, costs.backward_input, costs.backward_weight) if cost > 0),
               default=1.0)


def kinds_used(simulation: Simulation) -> list[str]:
    """The compute kinds the timeline contains, in the order F, I, W, B."""
    present = {interval.action.kind for rank in simulation.timeline for interval in rank}
    return [kind for kind in KIND_NAMES if kind in present]


def _legend(simulation: Simulation, unit: float) -> str:
    used = kinds_used(simulation)
    kinds = ", ".join(f"{kind} {KIND_NAMES[kind]}" for kind in used)
    chunks = {1: "", 2: "lowercase: the rank's second stage; "}.get(simulation.schedule.virtual_stages,
                                                                    "labels: stage, kind, microbatch; ")
    return (f"legend: {kinds}; F3 = microbatch 3\n"
            f"        {chunks}'-' the action goes on, '.' idle; one column = {unit:g} time unit"
            f"{'' if unit == 1 else 's'}")


# -- JSON ---------------------------------------------------------------------------------------------------

def summary(simulation: Simulation, formula: float) -> dict[str, Any]:
    """The `mpiparallel schedule --json` document."""
    schedule = simulation.schedule
    return {
        "schedule": schedule.name,
        "pp": schedule.pp,
        "microbatches": schedule.microbatches,
        "virtual_stages": schedule.virtual_stages,
        "bubble": simulation.bubble,
        "formula": formula,
        "makespan": simulation.makespan,
        "peak_activations": list(simulation.peak_activations),
        "actions": {str(rank): [str(action) for action in actions] for rank, actions in enumerate(schedule.actions)},
    }


# -- picture ------------------------------------------------------------------------------------------------

COLORS = {FORWARD: "#4c78a8", BACKWARD_INPUT: "#72b7b2", BACKWARD_WEIGHT: "#f58518", FULL_BACKWARD: "#54a24b"}


def draw(simulation: Simulation, formula: float, path: Path) -> None:
    """The chart as an image (matplotlib): a bar per action, microbatch numbers inside, second stages hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule = simulation.schedule
    figure, axes = plt.subplots(figsize=(max(6.0, min(24.0, simulation.makespan * 0.25)), 0.5 * schedule.pp + 1.5))
    for rank in range(schedule.pp):
        first_stage = schedule.stages_of(rank)[0]
        for interval in simulation.compute_timeline(rank):
            action = interval.action
            axes.barh(rank, interval.end - interval.start, left=interval.start, color=COLORS[action.kind],
                      edgecolor="black", linewidth=0.5, hatch=None if action.stage == first_stage else "//")
            axes.text((interval.start + interval.end) / 2, rank, str(action.microbatch), ha="center",
                      va="center", fontsize=7)
    axes.set_yticks(range(schedule.pp), [f"rank {rank}" for rank in range(schedule.pp)])
    axes.invert_yaxis()
    axes.set_xlabel("time (cost units)")
    axes.set_title(f"{schedule.name}: pp {schedule.pp}, {schedule.microbatches} microbatches — bubble "
                   f"{simulation.bubble:.1%} simulated, {formula:.1%} formula")
    used = kinds_used(simulation)
    axes.legend(handles=[Patch(color=COLORS[kind], label=KIND_NAMES[kind]) for kind in used],
                loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(used), frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
