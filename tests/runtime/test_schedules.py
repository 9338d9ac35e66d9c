"""Pipeline schedules and their simulator: every schedule is proved hang-free, its bubble equals its formula,
planted deadlocks and dependency errors are named, and `mpiparallel schedule` writes well-formed files.

Pure Python, no MPI: the command-line tests run `python -m mpiparallel schedule` as a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from functools import cache
from pathlib import Path

import pytest
from mpi_harness import run_with_timeout

from mpiparallel.schedules import (
    FORWARD,
    SCHEDULES,
    Action,
    Costs,
    Schedule,
    ScheduleError,
    Simulation,
    bubble_formula,
    build_schedule,
    simulate,
)
from mpiparallel.schedules.actions import looped_placement
from mpiparallel.schedules.simulator import UNIT_COSTS

REPOSITORY = Path(__file__).resolve().parents[2]


def virtual_stage_choices(name: str) -> tuple[int, ...]:
    return (1, 2) if name == "interleaved" else (1,)


def allowed(name: str, pp: int, microbatches: int, virtual_stages: int) -> bool:
    """What build_schedule accepts (the tests below check the refusals separately)."""
    return name not in ("interleaved", "zb") or microbatches >= pp


@cache
def simulated(name: str, pp: int, microbatches: int, virtual_stages: int = 1, costs: Costs = UNIT_COSTS) -> Simulation:
    return simulate(build_schedule(name, pp, microbatches, virtual_stages), costs)


# -- actions and schedules as values ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, action", [("1F0", Action(1, "F", 0)), ("3SEND_F1", Action(3, "SEND_F", 1)),
                                          ("0W2", Action(0, "W", 2)), ("12RECV_B10", Action(12, "RECV_B", 10)),
                                          ("2I3", Action(2, "I", 3)), ("1B0", Action(1, "B", 0))])
def test_actions_print_as_torch_prints_them_and_parse_back(text, action):
    assert str(action) == text
    assert Action.parse(text) == action


@pytest.mark.parametrize("text", ["F0", "1X0", "1F", "1SEND0", "one F zero"])
def test_parse_refuses_what_is_not_an_action(text):
    with pytest.raises(ValueError, match="is not an action like 1F0"):
        Action.parse(text)


def test_schedule_text_round_trips_and_names_the_stages_of_each_rank():
    schedule = build_schedule("zbv", 3, 6)
    again = Schedule.from_text(schedule.to_text(), "zbv", 6, schedule.stage_ranks)
    assert again == schedule
    assert schedule.to_text().splitlines()[0].startswith("0F0 0SEND_F0 0F1")
    assert [schedule.stages_of(rank) for rank in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert build_schedule("interleaved", 3, 6, 2).stages_of(1) == [1, 4]


def test_sends_and_receives_appear_only_between_ranks():
    zbv = build_schedule("zbv", 2, 4)
    last_rank = {str(action) for action in zbv.actions[1]}
    assert "1F0" in last_rank and "2F0" in last_rank
    assert not {"1SEND_F0", "2RECV_F0", "2SEND_B0", "1RECV_B0"} & last_rank
    assert not any(not action.is_compute for action in build_schedule("1f1b", 1, 3).actions[0])


# -- every schedule is accepted -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
def test_simulator_accepts_every_schedule_for_pp_1_to_8(name):
    for pp in range(1, 9):
        for microbatches in (pp, 2 * pp, 3 * pp, 4 * pp):
            for virtual_stages in virtual_stage_choices(name):
                simulation = simulated(name, pp, microbatches, virtual_stages)
                chunks = 2 if name in ("zbv", "dualpipev") else virtual_stages
                compute = [action for actions in simulation.schedule.actions for action in actions
                           if action.kind == FORWARD]
                assert len(compute) == pp * chunks * microbatches
                assert 0 <= simulation.bubble < 1


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv", "dualpipev"])
def test_schedules_that_allow_it_run_fewer_microbatches_than_ranks(name):
    for microbatches in range(1, 6):
        assert simulated(name, 6, microbatches).makespan > 0


# -- the bubble equals the formula ---------------------------------------------------------------------------------

def exact_regime(name: str, pp: int) -> list[int]:
    """Microbatch counts (of p, 2p, 3p, 4p) where the schedule's formula is exact."""
    least = {"zbv": 2 * pp - 1, "dualpipev": 2 * pp}.get(name, pp)
    return [m for m in (pp, 2 * pp, 3 * pp, 4 * pp) if m >= least]


@pytest.mark.parametrize("name", SCHEDULES)
def test_simulated_bubble_equals_the_formula_with_unit_costs(name):
    for pp in range(1, 9):
        for microbatches in exact_regime(name, pp):
            for virtual_stages in virtual_stage_choices(name):
                simulation = simulated(name, pp, microbatches, virtual_stages)
                formula = bubble_formula(name, pp, microbatches, virtual_stages)
                assert simulation.bubble == pytest.approx(formula, abs=1e-12), (name, pp, microbatches)


def test_one_f_one_b_and_gpipe_idle_p_minus_1_times_f_plus_b():
    for name in ("gpipe", "1f1b"):
        simulation = simulated(name, 4, 8, costs=Costs(1.0, 1.5, 0.5))
        assert simulation.makespan == pytest.approx(8 * 3 + 3 * 3)


def test_interleaved_divides_the_one_f_one_b_bubble_by_v_as_m_grows():
    for pp, microbatches in ((4, 32), (8, 64)):
        ratio = bubble_formula("1f1b", pp, microbatches) / bubble_formula("interleaved", pp, microbatches, 2)
        assert 1.9 < ratio <= 2
        assert simulated("interleaved", pp, microbatches, 2).bubble == pytest.approx(
            (pp - 1) / (2 * microbatches + pp - 1))


@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(2, 1, 1), Costs(1, 2, 0.5), Costs(3, 2, 1)])
def test_zb_h1_idles_p_minus_1_times_f_plus_i_minus_w_when_w_at_most_f(costs):
    for pp in (2, 4, 7):
        simulation = simulated("zb", pp, 3 * pp, costs=costs)
        work = 3 * pp * (costs.forward + costs.backward_input + costs.backward_weight)
        idle = (pp - 1) * (costs.forward + costs.backward_input - costs.backward_weight)
        assert simulation.makespan - work == pytest.approx(idle)
        assert simulation.bubble == pytest.approx(bubble_formula("zb", pp, 3 * pp, costs=costs))


def test_zbv_idles_only_its_warmup_ramp_below_one_thirteenth_for_m_at_least_2p():
    for pp in range(1, 9):
        for microbatches in (2 * pp, 4 * pp):
            simulation = simulated("zbv", pp, microbatches)
            assert simulation.makespan == 6 * microbatches + pp - 1
            assert simulation.bubble < 1 / 13


@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(1, 1, 0.5), Costs(2, 2, 1)])
def test_dualpipev_bubble_is_the_authors_formula_with_its_pairs_in_sequence(costs):
    for pp in (2, 3, 4, 6):
        simulation = simulated("dualpipev", pp, 3 * pp, costs=costs)
        f, i, w = costs.forward, costs.backward_input, costs.backward_weight
        forward_and_backward = f + i + w
        idle = (pp - 1) * (forward_and_backward + (i + w) - 3 * w)
        assert simulation.makespan - 2 * 3 * pp * (f + i + w) == pytest.approx(idle)


def test_transfer_time_is_paid_on_every_message_the_critical_path_waits_for():
    simulation = simulated("1f1b", 2, 1, costs=Costs(transfer=0.5))
    assert simulation.makespan == pytest.approx(6 + 2 * 0.5)
    rank_1 = [(str(action), start, end) for action, start, end in simulation.timeline[1]]
    assert rank_1[:2] == [("1RECV_F0", 0.0, 1.5), ("1F0", 1.5, 2.5)]


# -- peak activations ------------------------------------------------------------------------------------------------

def test_one_f_one_b_holds_p_microbatches_on_rank_0_where_gpipe_holds_m():
    assert simulated("1f1b", 4, 16).peak_activations == (4, 3, 2, 1)
    assert simulated("gpipe", 4, 16).peak_activations == (16, 16, 16, 16)


def test_zero_bubble_schedules_keep_one_f_one_b_peak_memory():
    assert simulated("zb", 4, 16).peak_activations == (4, 4, 4, 4)
    assert simulated("zbv", 4, 16).peak_activations_per_rank == (8, 8, 8, 8)
    assert simulated("dualpipev", 4, 16).peak_activations_per_rank == (9, 9, 9, 9)
    assert simulated("interleaved", 4, 16, 2).peak_activations_per_rank == (11, 9, 7, 5)


# -- planted errors are named -----------------------------------------------------------------------------------------

def planted(text: str, microbatches: int = 2) -> Schedule:
    return Schedule.from_text(text, "planted", microbatches, looped_placement(2, 1))


def test_a_planted_deadlock_names_both_receives_that_wait_for_each_other():
    # Each rank waits for a message the other sends only after its own wait: rank 0 for microbatch 0's
    # gradient before sending microbatch 1's activation, rank 1 for that activation before sending the gradient.
    crossing = planted("0F0 0SEND_F0 0F1 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1\n"
                       "1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1F1 1B1 1SEND_B1")
    with pytest.raises(ScheduleError) as error:
        simulate(crossing)
    message = str(error.value)
    assert message.startswith("planted: deadlock")
    assert "rank 0 step 3: 0RECV_B0 waits for 1SEND_B0" in message
    assert "rank 1 step 3: 1RECV_F1 waits for 0SEND_F1" in message
    assert ">0RECV_B0<" in message and ">1RECV_F1<" in message


def test_the_same_lists_with_the_gradient_sent_first_run():
    untangled = planted("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
                        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")
    assert simulate(untangled).makespan == pytest.approx(9)


GOOD = ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0W0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")


@pytest.mark.parametrize("rank, old, new, expected", [
    (0, "0RECV_B0 0I0", "0I0 0RECV_B0", "0I0 needs data from stage 1 on rank 1: no 0RECV_B0 before it"),
    (0, "0I0 0W0", "0W0 0I0", "0W0 runs before 0I0"),
    (0, " 0W0", "", "0I0 has no 0W0"),
    (0, "0F1 0SEND_F1", "0SEND_F1 0F1", "0SEND_F1 sends an output not computed yet"),
    (1, "1B0 1SEND_B0", "1SEND_B0 1B0", "1SEND_B0 sends an input gradient not computed yet"),
    (1, "1RECV_F1 1F1 1B1", "1RECV_F1 1B1 1F1", "1B1 runs before its forward 1F1"),
    (1, "1RECV_F0 1F0", "1F0 1RECV_F0", "1F0 needs data from stage 0 on rank 0: no 1RECV_F0 before it"),
    (0, "0B1", "0B1 0W1", "0B1 and a split backward"),
    (0, "0B1", "0B1 0B1", "0B1 appears 2 times"),
    (0, "0F0 ", "0F0 1F0 ", "1F0 is on rank 0, but stage 1 lives on rank 1"),
    (1, " 1SEND_B1", "", "0RECV_B1 has no matching 1SEND_B1 on rank 1"),
    (0, "0F1", "0F1 0F2", "0F2 names microbatch 2, but there are 2"),
])
def test_a_planted_dependency_error_names_the_action(rank, old, new, expected):
    lines = list(GOOD)
    assert old in lines[rank]
    lines[rank] = lines[rank].replace(old, new, 1)
    with pytest.raises(ScheduleError, match="^planted: ") as error:
        simulate(planted("\n".join(lines)))
    assert expected in str(error.value)


def test_errors_print_a_step_by_rank_grid_marking_the_bad_action():
    lines = GOOD[0].replace("0I0 0W0", "0W0 0I0"), GOOD[1]
    with pytest.raises(ScheduleError) as error:
        simulate(planted("\n".join(lines)))
    grid = str(error.value).splitlines()[1:]
    assert grid[0].split() == ["step", "rank", "0", "rank", "1"]
    assert any(">0W0<" in line and line.split()[0] == "5" for line in grid)


def test_stage_placement_must_place_pp_times_v_stages():
    with pytest.raises(ScheduleError, match="short: 3 stages placed, expected pp × virtual stages = 2"):
        simulate(Schedule.from_text("0F0 0B0\n1F0 1B0", "short", 1, (0, 1, 1)))


def test_messages_between_stages_on_the_same_rank_are_refused():
    both_on_rank_0 = Schedule.from_text("0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0", "chain", 1, (0, 0))
    with pytest.raises(ScheduleError, match="0SEND_F0 talks to stage 1 on its own rank 0: neighbouring stages"):
        simulate(both_on_rank_0)


# -- arguments -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arguments, message", [
    (("pipedream", 4, 8), "unknown schedule 'pipedream'; valid: gpipe, 1f1b, interleaved, zb, zbv, dualpipev"),
    (("1f1b", 0, 8), "pp must be at least 1, not 0"),
    (("gpipe", 2, 0), "microbatches must be at least 1, not 0"),
    (("zb", 4, 3), "zb needs at least pp microbatches to fill its cooldown: 3 < pp = 4"),
    (("interleaved", 4, 6, 2), "interleaved needs microbatches divisible by pp"),
    (("interleaved", 4, 2, 2), "interleaved needs microbatches divisible by pp"),
    (("1f1b", 4, 8, 2), "1f1b has one stage per rank; virtual stages are for interleaved only"),
    (("zbv", 4, 8, 3), "zbv always holds 2 stages per rank (a V); leave out the virtual stages"),
    (("interleaved", 4, 8, 0), "virtual stages must be at least 1, not 0"),
])
def test_invalid_arguments_get_one_clear_message(arguments, message):
    with pytest.raises(ValueError) as error:
        build_schedule(*arguments)
    assert message in str(error.value)
    with pytest.raises(ValueError):
        bubble_formula(*arguments)


def test_costs_refuse_negative_times():
    with pytest.raises(ValueError, match="cost backward_weight must be a number >= 0"):
        Costs(1, 1, -1)


def test_v_shaped_schedules_accept_two_virtual_stages_and_report_them():
    assert build_schedule("dualpipev", 2, 4, 2) == build_schedule("dualpipev", 2, 4)
    assert build_schedule("zbv", 2, 4).virtual_stages == 2


# -- the command line ------------------------------------------------------------------------------------------------

def run_schedule(*arguments: str, cwd: Path = REPOSITORY):
    """`python -m mpiparallel schedule ARGUMENTS` with this checkout's package first on the path."""
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    return run_with_timeout([sys.executable, "-m", "mpiparallel", "schedule", *arguments], timeout=60, cwd=cwd,
                            env={**os.environ, "PYTHONPATH": path})


def test_schedule_command_prints_the_chart_the_bubble_beside_the_formula_and_the_peaks():
    finished = run_schedule("--pp", "4", "--microbatches", "8", "--schedule", "1f1b")
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.splitlines()
    assert lines[0] == "1f1b: pp 4, 8 microbatches; costs F 1, I 1, W 1, transfer 0"
    assert [line[:7] for line in lines[3:7]] == ["rank 0 ", "rank 1 ", "rank 2 ", "rank 3 "]
    assert lines[3].startswith("rank 0 |F0 F1 F2 F3 .  ")
    assert "bubble:   0.2727 simulated, 0.2727 formula (p-1)/(m+p-1)" in lines
    assert "makespan: 33" in lines
    assert lines[-1].endswith(": 4 3 2 1")


def test_schedule_command_writes_json_trace_and_plot(tmp_path):
    finished = run_schedule("--pp", "3", "--microbatches", "6", "--schedule", "zbv", "--costs", "1,1.5,0.5",
                            "--transfer", "0.1", "--json", "out.json", "--trace", "trace.json",
                            *(("--plot", "chart.png") if importlib.util.find_spec("matplotlib") else ()),
                            cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    simulation = simulated("zbv", 3, 6, costs=Costs(1, 1.5, 0.5, 0.1))
    document = json.loads((tmp_path / "out.json").read_text())
    assert list(document) == ["schedule", "pp", "microbatches", "virtual_stages", "bubble", "formula", "makespan",
                              "peak_activations", "actions"]
    assert (document["schedule"], document["pp"], document["microbatches"], document["virtual_stages"]) == \
        ("zbv", 3, 6, 2)
    assert document["bubble"] == pytest.approx(simulation.bubble)
    assert document["makespan"] == pytest.approx(simulation.makespan)
    assert document["peak_activations"] == list(simulation.peak_activations)
    assert "\n".join(" ".join(actions) for actions in document["actions"].values()) == simulation.schedule.to_text()
    check_trace(json.loads((tmp_path / "trace.json").read_text()), simulation)
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_trace(trace: dict, simulation: Simulation) -> None:
    """One process per rank with a compute thread and pipeline communication lanes, an "X" event per action with
    its times in microseconds (one cost unit = 1 ms), and an arrow from each send to its receive."""
    events = trace["traceEvents"]
    names = {(event["pid"], event["tid"]): event["args"]["name"] for event in events if event["name"] == "thread_name"}
    assert {names[rank, 0] for rank in range(3)} == {"compute"}
    assert {name.split(" #")[0] for name in names.values()} == {"compute", "pp"}
    complete = {(event["pid"], event["name"]): event for event in events if event["ph"] == "X"}
    expected = [(rank, str(interval.action), interval.start * 1000, (interval.end - interval.start) * 1000)
                for rank, intervals in enumerate(simulation.timeline) for interval in intervals]
    assert len(complete) == len(expected)
    for rank, name, start, duration in expected:
        event = complete[rank, name]
        assert event["ts"] == pytest.approx(start) and event["dur"] == pytest.approx(duration)
        assert names[rank, event["tid"]].startswith("compute" if Action.parse(name).is_compute else "pp")
    starts = {event["id"]: event for event in events if event["ph"] == "s"}
    finishes = {event["id"]: event for event in events if event["ph"] == "f"}
    sends = sum(1 for event in complete.values() if "SEND" in event["name"])
    assert len(starts) == len(finishes) == sends > 0
    assert all(starts[key]["pid"] != finishes[key]["pid"] for key in starts)
    assert all(starts[key]["ts"] <= finishes[key]["ts"] for key in starts)


@pytest.mark.parametrize("arguments, message", [
    (("--schedule", "zb", "--pp", "4", "--microbatches", "3"),
     "Error: zb needs at least pp microbatches to fill its cooldown: 3 < pp = 4"),
    (("--schedule", "1f1b", "--virtual-stages", "2"),
     "Error: 1f1b has one stage per rank; virtual stages are for interleaved only"),
    (("--schedule", "pipedream"), "Error: Invalid value for '--schedule': 'pipedream' is not one of"),
    (("--costs", "1,2"), "Error: Invalid value for '--costs': '1,2' is not three times F,I,W"),
    (("--json", "no/such/folder/out.json"), "Error: cannot write no/such/folder/out.json: No such file or directory"),
])
def test_schedule_command_reports_bad_input_in_one_line_with_status_2(arguments, message):
    finished = run_schedule(*arguments)
    errors = [line for line in finished.stderr.splitlines() if line.startswith("Error")]
    assert (finished.returncode, finished.stdout, len(errors)) == (2, "", 1), finished.stderr
    assert errors[0].startswith(message)
