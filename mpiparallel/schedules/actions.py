"""Pipeline actions and schedules as plain values: what each rank does, in order, printable and diffable.

An `Action` is (stage, kind, microbatch), printed as torch.distributed.pipelining prints it: `1F0` is the forward
of stage 1 on microbatch 0, `3SEND_F1` sends stage 3's output of microbatch 1 on to stage 4. A `Schedule` holds
the stage placement and one tuple of actions per rank; the schedule functions build the compute order and
`with_communication` inserts the sends and receives that the placement makes necessary.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

FORWARD = "F"
BACKWARD_INPUT = "I"
BACKWARD_WEIGHT = "W"
FULL_BACKWARD = "B"
SEND_F = "SEND_F"
RECV_F = "RECV_F"
SEND_B = "SEND_B"
RECV_B = "RECV_B"

COMPUTE_KINDS = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD)
COMMUNICATION_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE_KINDS + COMMUNICATION_KINDS

_ACTION_TEXT = re.compile(rf"(\d+)({'|'.join(sorted(KINDS, key=len, reverse=True))})(\d+)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: `kind` applied to global stage `stage` for microbatch `microbatch`.

    F runs the stage forward; I computes the gradient of the stage's input (what the previous stage waits for);
    W the gradient of its weights (needs its I, can wait); B is I and W at once. SEND_F(s, m) sends stage s's
    output to the rank of stage s+1 and RECV_F(s, m) receives stage s's input from the rank of stage s−1;
    SEND_B(s, m) sends stage s's input gradient to the rank of stage s−1 and RECV_B(s, m) receives the gradient
    of stage s's output from the rank of stage s+1.
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The inverse of `str`: `Action.parse("3SEND_F1") == Action(3, SEND_F, 1)`."""
        match = _ACTION_TEXT.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not an action like 1F0, 2I3, 0W2, 1B0 or 3SEND_F1 "
                             f"(stage, one of {', '.join(KINDS)}, microbatch)")
        stage, kind, microbatch = match.groups()
        return cls(int(stage), kind, int(microbatch))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


@dataclass(frozen=True)
class Schedule:
    """Every rank's actions for one training step, and which rank holds which stage.

    `stage_ranks[s]` is the rank of global stage s (stage 0 holds the embedding, stage pp·V−1 the head and
    loss); `actions[r]` is rank r's list in execution order, sends and receives included.
    """

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    stage_ranks: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` holds, in model order."""
        return [stage for stage, owner in enumerate(self.stage_ranks) if owner == rank]

    def to_text(self) -> str:
        """One line per rank of its action strings: easy to read, diff and paste into `from_text`."""
        return "\n".join(" ".join(map(str, actions)) for actions in self.actions)

    @classmethod
    def from_text(cls, text: str, name: str, microbatches: int, stage_ranks: Sequence[int]) -> Schedule:
        """A schedule from `to_text`'s format: one line per rank (written by hand, or edited)."""
        actions = tuple(tuple(Action.parse(word) for word in line.split()) for line in text.strip().splitlines())
        pp = len(actions)
        return cls(name, pp, microbatches, len(stage_ranks) // max(pp, 1), tuple(stage_ranks), actions)


def check_sizes(pp: int, microbatches: int) -> None:
    """Every schedule needs at least one rank and one microbatch."""
    if pp < 1:
        raise ValueError(f"pp must be at least 1, not {pp}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, not {microbatches}")


def looped_placement(pp: int, virtual_stages: int) -> tuple[int, ...]:
    """Stage s on rank s mod pp: each rank holds every pp-th stage (1F1B, interleaved)."""
    return tuple(stage % pp for stage in range(pp * virtual_stages))


def v_placement(pp: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank r holds stages r and 2·pp−1−r, so the last rank holds the middle two
    stages (handed over locally) and rank 0 holds both the embedding and the loss."""
    return tuple(range(pp)) + tuple(reversed(range(pp)))


Unit = Action | tuple[Action, ...]
"""An entry of a compute order: one compute action, or a group meant to run overlapped (DualPipeV's pairs)."""


def below(microbatches: int, order: Iterable[Unit]) -> list[Unit]:
    """`order` without the actions of microbatches `microbatches` and up: a schedule built for more
    microbatches than asked for, cut down (removing whole microbatches keeps every dependency)."""
    kept: list[Unit] = []
    for unit in order:
        group = tuple(action for action in _group(unit) if action.microbatch < microbatches)
        if group:
            kept.append(group if isinstance(unit, tuple) else group[0])
    return kept


def with_communication(name: str, pp: int, microbatches: int, stage_ranks: Sequence[int],
                       compute: Sequence[Iterable[Unit]]) -> Schedule:
    """A `Schedule` from each rank's compute order, with a receive right before each compute action whose input
    lives on another rank and a send right after each one whose output another rank needs.

    A tuple in the order is a group meant to run overlapped (DualPipeV's forward-backward pairs): all its
    receives come before its first action and all its sends after its last, as one unit.
    """
    stage_ranks = tuple(stage_ranks)
    actions = tuple(tuple(action for unit in rank_compute for action in _with_transfers(unit, stage_ranks))
                    for rank_compute in compute)
    return Schedule(name, pp, microbatches, len(stage_ranks) // pp, stage_ranks, actions)


def _group(unit: Unit) -> tuple[Action, ...]:
    return unit if isinstance(unit, tuple) else (unit,)


def _with_transfers(unit: Unit, stage_ranks: tuple[int, ...]) -> list[Action]:
    group = _group(unit)
    receives, sends = [], []
    for action in group:
        receive, send = _transfers(action, stage_ranks)
        receives += receive
        sends += send
    return receives + list(group) + sends


def _transfers(action: Action, stage_ranks: tuple[int, ...]) -> tuple[list[Action], list[Action]]:
    """The receive `action` needs first and the send it owes after, when its neighbour is on another rank."""
    stage, microbatch = action.stage, action.microbatch
    previous_remote = stage > 0 and stage_ranks[stage - 1] != stage_ranks[stage]
    next_remote = stage < len(stage_ranks) - 1 and stage_ranks[stage + 1] != stage_ranks[stage]
    if action.kind == FORWARD:
        return ([Action(stage, RECV_F, microbatch)] if previous_remote else [],
                [Action(stage, SEND_F, microbatch)] if next_remote else [])
    if action.kind in (BACKWARD_INPUT, FULL_BACKWARD):
        return ([Action(stage, RECV_B, microbatch)] if next_remote else [],
                [Action(stage, SEND_B, microbatch)] if previous_remote else [])
    return [], []


def stage_units(n_layer: int, stages: int) -> list[range]:
    """The units of each stage: n_layer blocks over `stages` chunks as evenly as possible (earlier chunks take the
    extra block), the embedding (unit 0) with the first and the head (unit n_layer + 1) with the last."""
    if stages > n_layer:
        raise ConfigError(f"{stages} pipeline stages (pp × virtual stages) but only {n_layer} layers: every stage "
                          f"needs at least one transformer block")
    base, extra = divmod(n_layer, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    units = [range(1 + start, 1 + stop) for start, stop in zip(bounds, bounds[1:], strict=False)]
    units[0] = range(0, units[0].stop)
    units[-1] = range(units[-1].start, n_layer + 2)
    return units
