"""`mpiparallel schedule`: build a pipeline schedule, simulate it, and show where the time goes. No MPI, no ranks.

Prints the ranks × time chart, the simulated bubble beside the schedule's formula, the makespan and the peak
activations per stage; `--json`, `--trace` and `--plot` write the same simulation to files.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import click

from .. import trace
from ..errors import ConfigError
from ..schedules import (
    FORMULAS,
    SCHEDULES,
    Costs,
    Simulation,
    bubble_formula,
    build_schedule,
    default_microbatches,
    default_virtual_stages,
    render,
    simulate,
)


class CostsParameter(click.ParamType):
    """`F,I,W`: three times (forward, input gradient, weight gradient), each >= 0, not all 0."""

    name = "F,I,W"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[float, ...]:
        if isinstance(value, tuple):
            return value
        try:
            costs = tuple(float(part) for part in str(value).split(","))
        except ValueError:
            costs = ()
        if len(costs) != 3 or not all(cost >= 0 for cost in costs) or not any(costs):
            self.fail(f"{value!r} is not three times F,I,W like 1,1,1 or 1.2,1,0.9 (each >= 0, not all 0)",
                      param, ctx)
        return costs


@click.command(context_settings={"show_default": True})
@click.option("--pp", type=click.IntRange(min=1), default=4, help="Pipeline ranks.")
@click.option("--microbatches", type=click.IntRange(min=1), default=None,
              help="Microbatches per step. [default: pp, the fewest that fill the pipeline, as in train]")
@click.option("--schedule", "name", type=click.Choice(SCHEDULES), default="1f1b", help="The schedule.")
@click.option("--virtual-stages", type=click.IntRange(min=1), default=None,
              help="Stages (chunks) per rank, for interleaved only; zbv and dualpipev always hold 2. "
                   "[default: 2 for interleaved, as in train]")
@click.option("--costs", type=CostsParameter(), default="1,1,1",
              help="Time of one stage's forward, input-gradient and weight-gradient pass per microbatch "
                   "(B = I + W), e.g. measured on this machine.")
@click.option("--transfer", type=click.FloatRange(min=0), default=0.0,
              help="Time a message between ranks is in flight.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the simulation's numbers and every rank's actions to this JSON file.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the simulated timeline as Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing), "
                   "in the format of `train --trace`.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw the chart to this image (needs matplotlib).")
def schedule(pp: int, microbatches: int | None, name: str, virtual_stages: int | None,
             costs: tuple[float, float, float], transfer: float, json_path: Path | None, trace_path: Path | None,
             plot_path: Path | None) -> None:
    """Simulate a pipeline schedule: chart, bubble beside its formula, peak activations.

    Builds every rank's list of actions (F forward, I input gradient, W weight gradient, B = I and W, sends and
    receives), replays it with the given costs under rendezvous semantics (a send completes only when its
    receive is posted), proves that no rank waits forever and no dependency is broken, and prints a ranks x
    time chart, the idle fraction (bubble) beside the schedule's analytic formula, the makespan and the most
    microbatches each stage holds activations for at once. Runs no ranks: no MPI needed.

    \b
    Examples:
      mpiparallel schedule --pp 4 --microbatches 8 --schedule 1f1b
      mpiparallel schedule --pp 4 --microbatches 8 --schedule interleaved --virtual-stages 2
      mpiparallel schedule --pp 4 --microbatches 8 --schedule zbv --costs 1,1.1,0.9 --trace zbv.json
      mpiparallel schedule --pp 8 --microbatches 32 --schedule dualpipev --plot dualpipev.png --json out.json
    """
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter("drawing needs matplotlib: pip install matplotlib", param_hint="'--plot'")
    microbatches = microbatches or default_microbatches(pp)
    virtual_stages = virtual_stages or default_virtual_stages(name)
    simulation_costs = Costs(*costs, transfer=transfer)
    try:
        built = build_schedule(name, pp, microbatches, virtual_stages)
        formula = bubble_formula(name, pp, microbatches, virtual_stages, simulation_costs)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    simulation = simulate(built, simulation_costs)
    try:
        if json_path is not None:
            json_path.write_text(json.dumps(render.summary(simulation, formula), indent=2) + "\n")
        if trace_path is not None:
            trace_path.write_text(json.dumps(trace.simulation_trace(simulation)) + "\n")
        if plot_path is not None:
            render.draw(simulation, formula, plot_path)
    except OSError as error:
        raise ConfigError(f"cannot write {error.filename}: {error.strerror}") from None
    click.echo(report(simulation, formula))


def report(simulation: Simulation, formula: float) -> str:
    """The header, chart and numbers `mpiparallel schedule` prints."""
    built, costs = simulation.schedule, simulation.costs
    chunks = f", {built.virtual_stages} stages per rank" if built.virtual_stages > 1 else ""
    header = (f"{built.name}: pp {built.pp}, {built.microbatches} microbatches{chunks}; costs F {costs.forward:g}, "
              f"I {costs.backward_input:g}, W {costs.backward_weight:g}, transfer {costs.transfer:g}")
    lines = [header, "", render.text_chart(simulation), "",
             f"bubble:   {simulation.bubble:.4f} simulated, {formula:.4f} formula {FORMULAS[built.name]}",
             f"makespan: {simulation.makespan:g}",
             f"peak activations per stage (microbatches between F and W/B): "
             f"{' '.join(map(str, simulation.peak_activations))}"]
    if built.virtual_stages > 1:
        lines.append(f"peak activations per rank (summed over its stages): "
                     f"{' '.join(map(str, simulation.peak_activations_per_rank))}")
    return "\n".join(lines)
