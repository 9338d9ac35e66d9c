"""Chrome traces: `train --trace` and `schedule --trace` write trace-event JSON that Perfetto opens, with the
pipeline actions of the run in the simulator's order, collectives with their bytes, and send → receive arrows.

`validate_trace` checks what the viewers rely on: the keys each phase needs, numeric times, one process per rank
with every thread named, slices of one thread nested (never partly overlapping), and each flow arrow starting
in a SEND slice and finishing in a RECV slice of another rank.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from mpi_harness import run_with_timeout

from mpiparallel.schedules import build_schedule, simulate
from mpiparallel.trace import THREADS, untangle

TINY = ["--n-layer", "4", "--n-embd", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "8",
        "--dtype", "float64", "--threads", "1"]
REQUIRED = {"X": ("name", "pid", "tid", "ts", "dur"), "M": ("name", "pid", "tid", "args"),
            "s": ("name", "pid", "tid", "ts", "id"), "f": ("name", "pid", "tid", "ts", "id")}


def mpiparallel(*args: str, cwd: Path) -> str:
    finished = run_with_timeout([sys.executable, "-m", "mpiparallel", *args], 120, cwd=cwd)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return finished.stdout


def validate_trace(document: dict, ranks: int) -> list[dict]:
    """Assert that `document` is well-formed trace-event JSON for `ranks` ranks; return its "X" events. (Ranks on
    one machine share one clock, so even a run's arrows never point backwards in time.)"""
    events = document["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert event["ph"] in REQUIRED, event
        assert all(key in event for key in REQUIRED[event["ph"]]), event
        if event["ph"] in "Xsf":
            assert isinstance(event["ts"], int | float) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert isinstance(event["dur"], int | float) and event["dur"] >= 0, event
    processes = {event["pid"]: event["args"]["name"] for event in events if event["name"] == "process_name"}
    assert processes == {rank: f"rank {rank}" for rank in range(ranks)}
    threads = {(event["pid"], event["tid"]): event["args"]["name"]
               for event in events if event["name"] == "thread_name"}
    used = {(event["pid"], event["tid"]) for event in events if event["ph"] in "Xsf"}
    assert used <= set(threads), used - set(threads)
    assert all(name.split(" #")[0] in THREADS for name in threads.values()), threads
    complete = [event for event in events if event["ph"] == "X"]
    _assert_nested(complete)
    _assert_flows(events, complete)
    return complete


def _assert_nested(complete: list[dict]) -> None:
    """On every thread, a slice that starts inside another also ends inside it."""
    by_thread = defaultdict(list)
    for event in complete:
        by_thread[event["pid"], event["tid"]].append(event)
    for slices in by_thread.values():
        open_ends: list[float] = []
        for event in sorted(slices, key=lambda event: (event["ts"], -event["dur"])):
            while open_ends and open_ends[-1] <= event["ts"]:
                open_ends.pop()
            end = event["ts"] + event["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-6, event
            open_ends.append(end)


def _assert_flows(events: list[dict], complete: list[dict]) -> None:
    """Every flow id has one start inside a SEND slice and one finish inside a RECV slice, on another rank."""
    flows: dict[object, dict[str, dict]] = defaultdict(dict)
    for event in events:
        if event["ph"] in "sf":
            assert event["ph"] not in flows[event["id"]], event
            flows[event["id"]][event["ph"]] = event
    for pair in flows.values():
        assert set(pair) == {"s", "f"}, pair
        start, finish = pair["s"], pair["f"]
        assert start["pid"] != finish["pid"] and start["ts"] <= finish["ts"]
        assert _enclosing(complete, start, "SEND") and _enclosing(complete, finish, "RECV")
    sends = sum("SEND" in event["name"] for event in complete)
    assert len(flows) == sends


def _enclosing(complete: list[dict], flow: dict, kind: str) -> bool:
    return any(event["pid"] == flow["pid"] and event["tid"] == flow["tid"] and kind in event["name"]
               and event["ts"] <= flow["ts"] <= event["ts"] + event["dur"] for event in complete)


def actions_by_rank(complete: list[dict], step: int) -> dict[int, list[str]]:
    """Each rank's pipeline actions of one step (compute, sends and receives) in the order they started."""
    order = defaultdict(list)
    for event in sorted(complete, key=lambda event: event["ts"]):
        if event.get("cat") not in ("step", "collective") and event["args"]["step"] == step:
            order[event["pid"]].append(event["name"])
    return dict(order)


def test_a_4_rank_1f1b_run_traces_the_simulators_order_and_its_plan_has_the_same_format(tmp_path):
    mpiparallel("train", "-n", "4", *TINY, "--pp", "4", "--schedule", "1f1b", "--steps", "2",
                "--trace", "run.json", cwd=tmp_path)
    mpiparallel("schedule", "--pp", "4", "--microbatches", "4", "--schedule", "1f1b", "--trace", "plan.json",
                cwd=tmp_path)
    run = validate_trace(json.loads((tmp_path / "run.json").read_text()), 4)
    plan = validate_trace(json.loads((tmp_path / "plan.json").read_text()), 4)

    schedule = build_schedule("1f1b", 4, 4, 1)
    simulation = simulate(schedule)
    simulated_compute = {rank: [str(interval.action) for interval in simulation.compute_timeline(rank)]
                         for rank in range(4)}
    for step in (0, 1):
        ran = actions_by_rank(run, step)
        assert ran == {rank: list(map(str, actions)) for rank, actions in enumerate(schedule.actions)}
        ran_compute = {rank: [name for name in names if "SEND" not in name and "RECV" not in name]
                       for rank, names in ran.items()}
        assert ran_compute == simulated_compute
    planned = actions_by_rank(plan, 0)  # the plan in the same format: the same events, compute in the same order
    assert {rank: sorted(names) for rank, names in planned.items()} == \
        {rank: sorted(names) for rank, names in actions_by_rank(run, 0).items()}
    assert {rank: [name for name in names if "SEND" not in name and "RECV" not in name]
            for rank, names in planned.items()} == simulated_compute
    steps = [event for event in run if event.get("cat") == "step"]
    assert sorted((event["pid"], event["name"]) for event in steps) == \
        sorted((rank, f"step {step}") for rank in range(4) for step in (0, 1))


@pytest.mark.parametrize("mesh, arrows", [
    (["--pp", "2", "--dp", "2", "--schedule", "gpipe"], {(0, 2), (2, 0), (1, 3), (3, 1)}),
    (["--dp", "4", "--zero", "2", "--bucket-mb", "0.01"], set()),
], ids=["pp2-dp2", "dp4-zero2-async-buckets"])
def test_collectives_carry_their_axis_and_the_bytes_the_ledger_counted(tmp_path, mesh, arrows):
    mpiparallel("train", "-n", "4", *TINY, *mesh, "--steps", "2", "--trace", "run.json", "--log-json", "log.jsonl",
                cwd=tmp_path)
    document = json.loads((tmp_path / "run.json").read_text())
    complete = validate_trace(document, 4)
    flows = defaultdict(dict)
    for event in document["traceEvents"]:
        if event["ph"] in "sf":
            flows[event["id"]][event["ph"]] = event["pid"]
    # with pp2·dp2 the pipelines are ranks {0, 2} and {1, 3} (rank = pp·dp + dp_i): arrows stay inside each
    assert {(pair["s"], pair["f"]) for pair in flows.values()} == arrows
    collectives = [event for event in complete if event.get("cat") == "collective"]
    assert {event["args"]["axis"] for event in collectives} == {"dp"}
    assert {event["tid"] % 100 for event in collectives} == {THREADS.index("dp")}
    logged = [json.loads(line)["comm_bytes"]["dp"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    traced = sum(event["args"]["bytes"] for event in collectives if event["pid"] == 0)
    assert traced == sum(logged) > 0


def test_the_validator_rejects_an_unmatched_flow_and_untangle_gives_overlaps_their_own_lane():
    document = json.loads(json.dumps(_two_rank_trace()))
    validate_trace(document, 2)
    document["traceEvents"] = [event for event in document["traceEvents"] if event["ph"] != "f"]
    with pytest.raises(AssertionError):
        validate_trace(document, 2)

    dp = THREADS.index("dp")
    overlapping = [{"name": name, "ph": "X", "pid": 0, "tid": dp, "ts": ts, "dur": 10.0}
                   for name, ts in (("a", 0.0), ("b", 5.0), ("c", 12.0))]
    assert [event["tid"] for event in untangle(overlapping)] == [dp, dp + 100, dp]


def _two_rank_trace() -> dict:
    from mpiparallel.schedules import Costs
    from mpiparallel.trace import simulation_trace

    return simulation_trace(simulate(build_schedule("gpipe", 2, 2, 1), Costs(1, 1, 1, transfer=0.5)))
