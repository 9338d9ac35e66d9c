"""Replay a schedule with costs, no MPI: prove it cannot hang or break a dependency, and measure its bubble.

The model of communication is that of an executor built on nonblocking point-to-point messages with
rendezvous completion (MPI's Isend/Irecv for large messages):

- a SEND posts the message and the rank goes on at once; the data is in flight for `Costs.transfer`, and the
  send *completes* only when its matching RECV has been posted too — a step is over only when every send of
  every rank has completed, so an unmatched send is an error, not a leak;
- a RECV blocks its rank until the data has arrived.

So a rank waits forever exactly when it sits at a RECV whose SEND lies behind another rank's wait: a cycle of
receives. `simulate` finds such a cycle and names it; lists that pass here run on any executor that waits
for a message no earlier than its RECV action says.

Before timing anything, `validate` checks the lists themselves: every stage has exactly one F and one B (or
one I and one W) per microbatch, each on the rank that holds the stage; every SEND has exactly one RECV and
the other way round, only across ranks; and each action comes after what it needs (below). An error names
the first bad action and prints a step × rank grid of the action strings around it.

Dependencies: F of stage s needs the F of s−1 for its microbatch (run earlier on this rank, or a RECV_F
before it); I or B of s needs its own F and the I or B of s+1 (earlier on this rank, or a RECV_B), or only its
F on the last stage (the loss); W needs its own I; a SEND comes after the compute that produces its data.

Measures: `makespan` (the time from the first action to the last completion), `bubble` = 1 − compute time /
(ranks × makespan), and `peak_activations`: per stage, the most microbatches whose F has run and whose W (or
B) has not — the saved activations it must hold at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from .actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Schedule,
)


@dataclass(frozen=True)
class Costs:
    """Time of one action on one stage for one microbatch; B costs I + W. Units are yours (the Chrome trace
    reads them as milliseconds)."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    transfer: float = 0.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0:
                raise ValueError(f"cost {name} must be a number >= 0, not {value!r}")

    def of(self, kind: str) -> float:
        """The compute time of an action kind (0 for sends and receives: they run beside the compute)."""
        return {FORWARD: self.forward, BACKWARD_INPUT: self.backward_input, BACKWARD_WEIGHT: self.backward_weight,
                FULL_BACKWARD: self.backward_input + self.backward_weight}.get(kind, 0.0)


UNIT_COSTS = Costs()
"""F = I = W = 1, no transfer time: the costs the bubble formulas are usually quoted for."""


class ScheduleError(ValueError):
    """A schedule that would hang, break a dependency, or leave out or repeat work."""


class Interval(NamedTuple):
    """When an action ran: a compute action from start to end; a SEND from posting to completion; a RECV from
    posting to the arrival of its data."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What `simulate` found: the times of every action and the measures derived from them."""

    schedule: Schedule
    costs: Costs
    makespan: float
    bubble: float
    timeline: tuple[tuple[Interval, ...], ...]
    """Per rank, every action (compute and communication) in list order."""
    peak_activations: tuple[int, ...]
    """Per stage: the most microbatches whose F has run and whose W or B has not."""
    peak_activations_per_rank: tuple[int, ...]
    """Per rank: the same count over all its stages (in stage-sized units)."""

    def compute_timeline(self, rank: int) -> list[Interval]:
        return [interval for interval in self.timeline[rank] if interval.action.is_compute]


def simulate(schedule: Schedule, costs: Costs = UNIT_COSTS) -> Simulation:
    """Validate `schedule`, then replay every rank's list under `costs`; raise `ScheduleError` if it hangs."""
    validate(schedule)
    replay = _Replay(schedule, costs)
    replay.run()
    timeline = replay.timeline()
    makespan = max((interval.end for rank in timeline for interval in rank), default=0.0)
    compute = sum(costs.of(action.kind) for actions in schedule.actions for action in actions)
    bubble = 1.0 - compute / (schedule.pp * makespan) if makespan > 0 else 0.0
    per_stage, per_rank = peak_activations(schedule)
    return Simulation(schedule, costs, makespan, bubble, timeline, per_stage, per_rank)


def peak_activations(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage and per rank, the most microbatches held between their F and their W (or B).

    List order is time order on a rank, and a stage lives on one rank, so no timing is needed."""
    per_stage = [0] * schedule.num_stages
    per_rank = [0] * schedule.pp
    for rank, actions in enumerate(schedule.actions):
        held, held_on_rank = Counter(), 0
        for action in actions:
            change = {FORWARD: 1, BACKWARD_WEIGHT: -1, FULL_BACKWARD: -1}.get(action.kind, 0)
            held[action.stage] += change
            held_on_rank += change
            per_stage[action.stage] = max(per_stage[action.stage], held[action.stage])
            per_rank[rank] = max(per_rank[rank], held_on_rank)
    return tuple(per_stage), tuple(per_rank)


# -- replay under rendezvous semantics ------------------------------------------------------------------------

_PARTNERS = {SEND_F: (+1, RECV_F), RECV_F: (-1, SEND_F), SEND_B: (-1, RECV_B), RECV_B: (+1, SEND_B)}


def partner(action: Action) -> Action:
    """The action on the other rank that a SEND or RECV pairs with: SEND_F(s) with RECV_F(s+1), SEND_B(s) with
    RECV_B(s−1)."""
    offset, kind = _PARTNERS[action.kind]
    return Action(action.stage + offset, kind, action.microbatch)


class _Replay:
    """Every rank's position and clock; the posting time of every send and receive."""

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        self.schedule, self.costs = schedule, costs
        self.position = [0] * schedule.pp
        self.clock = [0.0] * schedule.pp
        self.started: list[list[float]] = [[] for _ in range(schedule.pp)]
        self.posted: dict[Action, float] = {}

    def run(self) -> None:
        moved = True
        while moved:  # a list, not a generator: every rank gets its turn in each round
            moved = any([self._advance(rank) for rank in range(self.schedule.pp)])
        stuck = [rank for rank, actions in enumerate(self.schedule.actions) if self.position[rank] < len(actions)]
        if stuck:
            raise ScheduleError(self._deadlock_message(stuck))

    def _advance(self, rank: int) -> bool:
        """Run rank's actions until it must wait for a message; True if it ran any."""
        actions, start = self.schedule.actions[rank], self.position[rank]
        while self.position[rank] < len(actions):
            action = actions[self.position[rank]]
            now = self.clock[rank]
            if action.kind in (RECV_F, RECV_B):
                send = partner(action)
                if send not in self.posted:
                    break
                self.clock[rank] = max(now, self.posted[send] + self.costs.transfer)
            else:
                self.clock[rank] = now + self.costs.of(action.kind)
            self.posted[action] = now
            self.started[rank].append(now)
            self.position[rank] += 1
        return self.position[rank] > start

    def timeline(self) -> tuple[tuple[Interval, ...], ...]:
        return tuple(tuple(self._interval(action, start) for action, start in zip(actions, starts, strict=True))
                     for actions, starts in zip(self.schedule.actions, self.started, strict=True))

    def _interval(self, action: Action, start: float) -> Interval:
        if action.kind in (SEND_F, SEND_B):
            return Interval(action, start, max(start + self.costs.transfer, self.posted[partner(action)]))
        if action.kind in (RECV_F, RECV_B):
            return Interval(action, start, max(start, self.posted[partner(action)] + self.costs.transfer))
        return Interval(action, start, start + self.costs.of(action.kind))

    def _deadlock_message(self, stuck: list[int]) -> str:
        lines = [f"{self.schedule.name}: deadlock: every unfinished rank waits at a receive whose send comes after "
                 f"another rank's wait"]
        for rank in stuck:
            step = self.position[rank]
            waiting = self.schedule.actions[rank][step]
            send = partner(waiting)
            sender = self.schedule.stage_ranks[send.stage]
            lines.append(f"  rank {rank} step {step}: {waiting} waits for {send}, which rank {sender} reaches only "
                         f"at step {self.schedule.actions[sender].index(send)}, behind its own wait at step "
                         f"{self.position[sender]}")
        return "\n".join(lines) + "\n" + step_grid(self.schedule, {rank: self.position[rank] for rank in stuck})


# -- validation -------------------------------------------------------------------------------------------------

def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` at the first structural, counting, pairing or ordering error."""
    _check_shape(schedule)
    for check in (_placement_errors, _count_errors, _pairing_errors, _order_errors):
        for message, rank, step in check(schedule):
            marks = {} if rank is None else {rank: step}
            raise ScheduleError(f"{schedule.name}: {message}" + ("\n" + step_grid(schedule, marks) if marks else ""))


def _check_shape(schedule: Schedule) -> None:
    if schedule.pp < 1 or len(schedule.actions) != schedule.pp:
        raise ScheduleError(f"{schedule.name}: pp is {schedule.pp} but there are {len(schedule.actions)} action lists")
    if schedule.num_stages != schedule.pp * schedule.virtual_stages:
        raise ScheduleError(f"{schedule.name}: {schedule.num_stages} stages placed, expected pp × virtual stages = "
                            f"{schedule.pp * schedule.virtual_stages}")
    if any(not 0 <= rank < schedule.pp for rank in schedule.stage_ranks):
        raise ScheduleError(f"{schedule.name}: stage placement {schedule.stage_ranks} names a rank outside "
                            f"0..{schedule.pp - 1}")


_Problem = tuple[str, "int | None", int]


def _numbered(schedule: Schedule) -> Iterator[tuple[int, int, Action]]:
    for rank, actions in enumerate(schedule.actions):
        for step, action in enumerate(actions):
            yield rank, step, action


def _placement_errors(schedule: Schedule) -> Iterator[_Problem]:
    for rank, step, action in _numbered(schedule):
        if not 0 <= action.stage < schedule.num_stages:
            yield f"{action} names stage {action.stage}, but there are {schedule.num_stages}", rank, step
        elif not 0 <= action.microbatch < schedule.microbatches:
            yield f"{action} names microbatch {action.microbatch}, but there are {schedule.microbatches}", rank, step
        elif schedule.stage_ranks[action.stage] != rank:
            yield (f"{action} is on rank {rank}, but stage {action.stage} lives on rank "
                   f"{schedule.stage_ranks[action.stage]}"), rank, step


def _count_errors(schedule: Schedule) -> Iterator[_Problem]:
    where = {action: (rank, step) for rank, step, action in reversed(list(_numbered(schedule)))}
    counts = Counter(action for _, _, action in _numbered(schedule))
    for action, count in counts.items():
        if count > 1:
            yield f"{action} appears {count} times", *where[action]
    for stage in range(schedule.num_stages):
        for microbatch in range(schedule.microbatches):
            yield from _work_errors(stage, microbatch, counts, where)


def _work_errors(stage: int, microbatch: int, counts: Counter, where: dict) -> Iterator[_Problem]:
    """Exactly one F and one B, or one I and one W, for this stage and microbatch."""
    forward, backward_input, weight, full = (Action(stage, kind, microbatch)
                                             for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD))
    anchor = next((where[action] for action in (forward, full, backward_input, weight) if action in where),
                  (None, 0))
    if forward not in counts:
        yield f"{forward} is missing: stage {stage} never runs microbatch {microbatch} forward", *anchor
    elif full in counts and (backward_input in counts or weight in counts):
        yield f"{full} and a split backward ({backward_input}, {weight}) both appear: it would run twice", *anchor
    elif full not in counts and backward_input not in counts:
        yield f"{forward} has no backward: neither {full} nor {backward_input} and {weight} appear", *anchor
    elif backward_input in counts and weight not in counts:
        yield f"{backward_input} has no {weight}: stage {stage}'s weight gradient is never computed", *anchor
    elif weight in counts and backward_input not in counts:
        yield f"{weight} has no {backward_input}: a weight gradient without its input gradient", *anchor


def _pairing_errors(schedule: Schedule) -> Iterator[_Problem]:
    """Sends and receives only across ranks, each with exactly one partner."""
    present = {action for _, _, action in _numbered(schedule)}
    for rank, step, action in _numbered(schedule):
        if action.is_compute:
            continue
        other = partner(action)
        if not 0 <= other.stage < schedule.num_stages:
            yield f"{action} pairs with stage {other.stage}, which does not exist", rank, step
        elif schedule.stage_ranks[other.stage] == rank:
            yield (f"{action} talks to stage {other.stage} on its own rank {rank}: neighbouring stages on one rank "
                   f"hand over locally, without SEND or RECV"), rank, step
        elif other not in present:
            yield f"{action} has no matching {other} on rank {schedule.stage_ranks[other.stage]}", rank, step


def _order_errors(schedule: Schedule) -> Iterator[_Problem]:
    """Each action after what it needs, on its own rank's list."""
    for rank, actions in enumerate(schedule.actions):
        done: set[Action] = set()
        for step, action in enumerate(actions):
            missing = _unmet_need(schedule, action, done)
            if missing is not None:
                yield missing, rank, step
            done.add(action)


def _unmet_need(schedule: Schedule, action: Action, done: set[Action]) -> str | None:
    """Why `action` cannot run yet after the actions in `done` (same rank), or None."""
    stage, microbatch, kind = action.stage, action.microbatch, action.kind
    forward = Action(stage, FORWARD, microbatch)
    backward = {Action(stage, BACKWARD_INPUT, microbatch), Action(stage, FULL_BACKWARD, microbatch)}
    if kind == SEND_F and forward not in done:
        return f"{action} sends an output not computed yet: {forward} comes later"
    if kind == SEND_B and not backward & done:
        return f"{action} sends an input gradient not computed yet: no {stage}I{microbatch} or B before it"
    if kind == BACKWARD_WEIGHT and Action(stage, BACKWARD_INPUT, microbatch) not in done:
        return f"{action} runs before {Action(stage, BACKWARD_INPUT, microbatch)}, the input gradient it follows"
    if kind == FORWARD and stage > 0:
        return _input_missing(schedule, action, done, Action(stage - 1, FORWARD, microbatch), RECV_F)
    if kind in (BACKWARD_INPUT, FULL_BACKWARD):
        if forward not in done:
            return f"{action} runs before its forward {forward}"
        if stage < schedule.num_stages - 1:
            return _input_missing(schedule, action, done, Action(stage + 1, BACKWARD_INPUT, microbatch), RECV_B)
    return None


def _input_missing(schedule: Schedule, action: Action, done: set[Action], producer: Action,
                   receive_kind: str) -> str | None:
    """The data `action` consumes comes from `producer`'s stage: run earlier here, or received earlier."""
    stage, microbatch = action.stage, action.microbatch
    producer_rank = schedule.stage_ranks[producer.stage]
    if producer_rank != schedule.stage_ranks[stage]:
        receive = Action(stage, receive_kind, microbatch)
        if receive not in done:
            return f"{action} needs data from stage {producer.stage} on rank {producer_rank}: no {receive} before it"
        return None
    if producer.kind == FORWARD:
        alternatives = {producer}
    else:
        alternatives = {producer, Action(producer.stage, FULL_BACKWARD, microbatch)}
    if not alternatives & done:
        return f"{action} runs before {producer}, which computes its input on the same rank"
    return None


# -- the step x rank grid ----------------------------------------------------------------------------------------

def step_grid(schedule: Schedule, marks: dict[int, int], context: int = 3) -> str:
    """The action strings of every rank at the steps around each marked (rank: step), marked ones in >…<."""
    longest = max((len(actions) for actions in schedule.actions), default=0)
    rows = sorted({row for step in marks.values() for row in range(step - context, step + context + 1)
                   if 0 <= row < longest})
    cells = [[_cell(schedule, rank, row, marks) for rank in range(schedule.pp)] for row in rows]
    width = max([len(f"rank {schedule.pp - 1}")] + [len(cell) for line in cells for cell in line])
    lines = ["step  " + " ".join(f"rank {rank}".ljust(width) for rank in range(schedule.pp))]
    for index, (row, line) in enumerate(zip(rows, cells, strict=True)):
        if index and row != rows[index - 1] + 1:
            lines.append(" ...")
        lines.append(f"{row:>4}  " + " ".join(cell.ljust(width) for cell in line))
    return "\n".join(line.rstrip() for line in lines)


def _cell(schedule: Schedule, rank: int, step: int, marks: dict[int, int]) -> str:
    actions = schedule.actions[rank]
    text = str(actions[step]) if step < len(actions) else ""
    return f">{text}<" if marks.get(rank) == step else f" {text}"
