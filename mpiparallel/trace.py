"""Chrome trace-event JSON of a training run (`train --trace`) and of a simulated schedule (`schedule --trace`).

The file opens in ui.perfetto.dev and chrome://tracing: `{"traceEvents": [...]}` with

- one process per rank (pid = rank, "M" metadata naming it "rank r") and named threads: "compute" (tid 0), then
  one per mesh axis's communication — "pp" (the pipeline's sends and receives), "dp", "tp", "cp", "ep", "dp_cp",
  "expert_dp", "expert_dp_cp", "world" (the loss and the gradient norm);
- an "X" (complete) event per pipeline action, named as the schedule prints it (`1F0`, `2I3`, `0W2`, `1B0`,
  `3SEND_F1`, `4RECV_F1`), with its stage, microbatch and step in `args`; per collective (`all_reduce`,
  `reduce_scatter`, …) with its axis and the bytes this rank sent; per training step on the compute thread;
- a flow arrow ("s" on the send, "f" on the receive, sharing an id) from every pipeline send to its receive.

The simulator's timeline (one cost unit drawn as one millisecond) and a measured run use the same names, threads
and layout, so the plan and the run can be opened side by side. A receive lasts from its posting until its data
has arrived: in the simulation the arrival itself, in a run the start of the compute action that reads it (the
executor waits for the data right before that action). A send lasts from its posting until it completes in the
simulation, and while `Isend` returns in a run (it completes in the background).

Trace viewers want the slices of one thread to nest; asynchronous collectives and posted receives overlap
without nesting, so each communication thread is spread over as many lanes as it needs ("dp", "dp #2", …).

Cost in a run: a `time.perf_counter()` pair and a small dict per event on each rank (no communication while
training); at the end one gather of every rank's events to rank 0, which writes the file.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action, Simulation
from .schedules.simulator import partner

if TYPE_CHECKING:  # no MPI at import: `mpiparallel schedule --trace` runs without it
    from collectives import Communicator

    from .mesh import Mesh
    from .pipeline_parallel import Timeline

COMPUTE = "compute"
THREADS = (COMPUTE, "pp", "dp", "tp", "cp", "ep", "dp_cp", "expert_dp", "expert_dp_cp", "world")
"""Thread names in tid order; a lane beyond a thread's first gets tid + LANE_STRIDE · lane."""

LANE_STRIDE = 100
MICROSECONDS_PER_UNIT = 1000.0
"""A simulated cost unit is drawn as one millisecond."""

Event = dict[str, Any]


# -- events -----------------------------------------------------------------------------------------------------

def action_event(rank: int, action: Action, start_us: float, end_us: float, step: int,
                 peer: int | None = None) -> Event:
    """The "X" event of one pipeline action: compute on the compute thread, sends and receives on "pp", with the
    rank (pid) they exchange with as `peer`."""
    args = {"stage": action.stage, "microbatch": action.microbatch, "step": step}
    return {"name": str(action), "cat": action.kind, "ph": "X", "pid": rank,
            "tid": THREADS.index(COMPUTE if action.is_compute else "pp"), "ts": start_us,
            "dur": max(end_us - start_us, 0.0), "args": args if peer is None else args | {"peer": peer}}


def peer_stage(action: Action) -> int:
    """The stage a send goes to or a receive comes from."""
    return action.stage + (1 if action.kind in (SEND_F, RECV_B) else -1)


def collective_event(rank: int, axis: str, name: str, start_us: float, end_us: float, sent: int) -> Event:
    """The "X" event of one collective on the thread of its mesh axis, with the bytes this rank sent."""
    return {"name": name, "cat": "collective", "ph": "X", "pid": rank, "tid": THREADS.index(axis), "ts": start_us,
            "dur": max(end_us - start_us, 0.0), "args": {"axis": axis, "bytes": sent}}


def trace_document(events: Iterable[Event], other: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every rank's "X" events -> the whole trace: lanes untangled, flow arrows added, processes and threads
    named."""
    complete = untangle(list(events))
    body = complete + flow_events(complete)
    return {"traceEvents": metadata_events(body) + body, "displayTimeUnit": "ms", "otherData": other or {}}


def untangle(events: list[Event]) -> list[Event]:
    """Move each communication event that overlaps an earlier one on its thread (without nesting in it) to the
    first lane of that thread where it does not: viewers draw only properly nested slices."""
    lanes: dict[tuple[int, int], list[float]] = defaultdict(list)  # (pid, tid) -> end of the last slice per lane
    placed = []
    for event in sorted(events, key=lambda event: (event["ts"], -event["dur"])):
        if event["tid"] == THREADS.index(COMPUTE):
            placed.append(event)
            continue
        ends = lanes[event["pid"], event["tid"]]
        lane = next((i for i, end in enumerate(ends) if end <= event["ts"]), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = event["ts"] + event["dur"]
        placed.append({**event, "tid": event["tid"] + LANE_STRIDE * lane})
    return placed


def flow_events(events: Sequence[Event]) -> list[Event]:
    """An arrow from each SEND event to the RECV event on its peer of the same step that matches it: "s" where
    the send starts, "f" (bound to the enclosing slice) where the data can first have arrived — not before the
    send, not after the receive ends."""
    receives = {(event["pid"], event["args"]["step"], Action.parse(event["name"])): event for event in events
                if event.get("cat") in (RECV_F, RECV_B)}
    flows: list[Event] = []
    for event in events:
        if event.get("cat") not in (SEND_F, SEND_B):
            continue
        args = event["args"]
        receive = receives[args["peer"], args["step"], partner(Action.parse(event["name"]))]
        arrival = min(max(receive["ts"], event["ts"]), receive["ts"] + receive["dur"])
        common = {"name": "p2p", "cat": "p2p", "id": len(flows) // 2}
        flows.append({**common, "ph": "s", "pid": event["pid"], "tid": event["tid"], "ts": event["ts"]})
        flows.append({**common, "ph": "f", "bp": "e", "pid": receive["pid"], "tid": receive["tid"], "ts": arrival})
    return flows


def metadata_events(events: Iterable[Event]) -> list[Event]:
    """"M" events naming each process "rank r" and each thread its axis (lanes: "dp #2"); compute always."""
    threads = {(event["pid"], event["tid"]) for event in events} | {(event["pid"], 0) for event in events}
    metadata = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}}
                for pid in sorted({pid for pid, _ in threads})]
    for pid, tid in sorted(threads):
        lane, base = divmod(tid, LANE_STRIDE)
        name = THREADS[base] + (f" #{lane + 1}" if lane else "")
        metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        metadata.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"sort_index": base * LANE_STRIDE + lane}})
    return metadata


# -- the simulator's timeline -------------------------------------------------------------------------------

def simulation_trace(simulation: Simulation) -> dict[str, Any]:
    """`mpiparallel schedule --trace`: the simulated timeline, one cost unit drawn as one millisecond."""
    schedule = simulation.schedule
    events = [action_event(rank, interval.action, interval.start * MICROSECONDS_PER_UNIT,
                           interval.end * MICROSECONDS_PER_UNIT, step=0,
                           peer=None if interval.action.is_compute else
                           schedule.stage_ranks[peer_stage(interval.action)])
              for rank, intervals in enumerate(simulation.timeline) for interval in intervals]
    return trace_document(events, {"source": "simulation", "schedule": schedule.name, "pp": schedule.pp,
                                   "microbatches": schedule.microbatches,
                                   "virtual_stages": schedule.virtual_stages, "bubble": simulation.bubble})


# -- a training run -----------------------------------------------------------------------------------------

def common_start(world: Communicator) -> float:
    """Rank 0's `perf_counter()` after a barrier, on every rank of its machine; elsewhere the rank's own time
    after that barrier (one barrier and one small broadcast)."""
    import socket

    world.barrier()
    here = (socket.gethostname(), time.perf_counter())
    host, start = world.comm.bcast(here, root=0)
    return start if host == here[0] else here[1]


class Tracer:
    """Records this rank's events during training; `write` gathers every rank's to rank 0 and writes the file.

    Times are `time.perf_counter()` offsets from a common start. Ranks on rank 0's machine share its clock
    (Linux's CLOCK_MONOTONIC is one clock for every process), so they use rank 0's start itself; ranks on other
    machines take the moment they left a common barrier (their times then agree to within its exit skew).
    """

    def __init__(self, world: Communicator, axes: dict[str, Communicator], pipeline_ranks: Sequence[int] = (),
                 other: dict[str, Any] | None = None) -> None:
        """`axes`: the communicators whose collectives to record, by axis; `pipeline_ranks`: the world rank of each
        rank of this rank's pipeline (`pp`) group."""
        self.world, self.rank, self.other = world, world.rank, other or {}
        self.pipeline_ranks = list(pipeline_ranks)
        self.events: list[Event] = []
        for axis, comm in axes.items():
            comm.observer = self._collective_observer(axis)
        self.origin = common_start(world)

    @classmethod
    def for_mesh(cls, mesh: Mesh, other: dict[str, Any] | None = None) -> Tracer:
        """A tracer recording the collectives of every communicator of `mesh` with more than one rank (a single
        rank's collectives send nothing), each on its axis's thread."""
        axes = {axis: getattr(mesh, axis) for axis in THREADS if axis != COMPUTE}
        return cls(mesh.world, {axis: comm for axis, comm in axes.items() if comm.size > 1},
                   mesh.pp.comm.allgather(mesh.world.rank), other)

    def _us(self, seconds: float) -> float:
        return (seconds - self.origin) * 1e6

    def _collective_observer(self, axis: str) -> Any:
        def observe(name: str, start: float, end: float, sent: int) -> None:
            self.events.append(collective_event(self.rank, axis, name, self._us(start), self._us(end), sent))
        return observe

    def step(self, step: int, start: float, end: float) -> None:
        """One training step (perf_counter times) on the compute thread, around its actions."""
        self.events.append({"name": f"step {step}", "cat": "step", "ph": "X", "pid": self.rank,
                            "tid": THREADS.index(COMPUTE), "ts": self._us(start), "dur": (end - start) * 1e6,
                            "args": {"step": step}})

    def pipeline_actions(self, timeline: Timeline, stage_ranks: Sequence[int], step: int) -> None:
        """A pipeline step's actions (`PipelineExecutor.timeline`; `stage_ranks`: the schedule's pipeline rank of
        each stage). A receive is drawn until the compute action that reads it started (when the executor had
        waited for its data)."""
        spans, started = timeline.spans, timeline.started
        reader_start = {(action.stage, action.kind, action.microbatch): start for action, start, _ in spans}
        for action, start, end in spans:
            peer = None if action.is_compute else self.pipeline_ranks[stage_ranks[peer_stage(action)]]
            if action.kind in (RECV_F, RECV_B):
                readers = ("F",) if action.kind == RECV_F else ("I", "B")
                end = max(end, next(reader_start[action.stage, kind, action.microbatch] for kind in readers
                                    if (action.stage, kind, action.microbatch) in reader_start))
            self.events.append(action_event(self.rank, action, self._us(started + start), self._us(started + end),
                                            step, peer))

    def write(self, path: str | Path) -> None:
        """Gather every rank's events to rank 0 (one gather of Python lists) and write the trace there."""
        gathered = self.world.comm.gather(self.events, root=0)
        if self.rank == 0:
            document = trace_document((event for events in gathered for event in events),
                                      {"source": "run", **self.other})
            Path(path).write_text(json.dumps(document) + "\n")
