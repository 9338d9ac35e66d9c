"""Pipeline schedules as data, and a simulator that proves them.

A schedule is every rank's list of `Action`s for one training step — compute (F, I, W, B) and the sends and
receives between ranks — plus the placement of stages on ranks. It prints like torch.distributed.pipelining's
(`1F0`, `3SEND_F1`), so lists can be read, diffed and compared; `simulate` replays them with costs, proves that
no rank waits forever and no dependency is broken, and measures the bubble and the activations held.

Convention: the model is cut into pp·v stages (chunks); F, I and W are the times of one stage's forward,
input-gradient and weight-gradient pass on one microbatch, and B = I + W the full backward. p = pp ranks,
m microbatches, v stages per rank. Idle is per rank (every rank does the same work: m·v·(F+I+W)); the bubble
is the idle fraction of the makespan, 1 − work / makespan.

| schedule      | stages per rank  | idle per rank                       | bubble, F = I = W | peak held, rank 0 |
|---------------|------------------|-------------------------------------|-------------------|-------------------|
| `gpipe`       | 1                | (p−1)(F+I+W)                        | (p−1)/(m+p−1)     | m                 |
| `1f1b`        | 1                | (p−1)(F+I+W)                        | (p−1)/(m+p−1)     | p                 |
| `interleaved` | v (s on s mod p) | (p−1)(F+I+W)                        | (p−1)/(v·m+p−1)   | v·p+p−1 chunks    |
| `zb` (ZB-H1)  | 1                | (p−1)(F+I−W), if W ≤ F              | (p−1)/(3m+p−1)    | p, on every rank  |
| `zbv` (ZB-V)  | 2 (r, 2p−1−r)    | (p−1)·F, m ≥ 2p−1, exact if F=I=W   | (p−1)/(6m+p−1)    | 2p chunks         |
| `dualpipev`   | 2 (r, 2p−1−r)    | (p−1)(F&B+B−3W), F&B = F+B, m ≥ 2p  | (p−1)/(3m+p−1)    | 2p+1 chunks       |

(ZB-V's idle is the warmup ramp that no schedule on the V placement avoids; below 2p−1 microbatches it and
DualPipeV run their full schedule with the missing microbatches left out. DualPipeV's formula is the authors'
(PP/2−1)(F&B+B−3W) for PP = 2p stages, with its overlapped forward-backward pairs run in sequence.)

Modules: `actions` (Action, Schedule, placements, inserting sends and receives), `classic` (gpipe, 1f1b,
interleaved), `zero_bubble` (zb, zbv), `dualpipe` (dualpipev), `build` (by name, argument checks, formulas),
`simulator` (validation, rendezvous replay, bubble and memory), `render` (text chart, trace, JSON, picture).
"""

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
                      stage_units,
)
from .build import (
    FORMULAS,
    SCHEDULES,
    bubble_formula,
    build_schedule,
    default_microbatches,
    default_virtual_stages,
)
from .classic import gpipe_schedule, interleaved_schedule, one_f_one_b_schedule
from .dualpipe import dualpipev_schedule
from .simulator import Costs, Interval, ScheduleError, Simulation, simulate, validate
from .zero_bubble import zb_h1_schedule, zbv_schedule

__all__ = [
    "stage_units",
    "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FORWARD", "FULL_BACKWARD", "RECV_B", "RECV_F", "SEND_B", "SEND_F",
    "FORMULAS", "SCHEDULES", "Action", "Costs", "Interval", "Schedule", "ScheduleError", "Simulation", "bubble_formula",
    "build_schedule", "default_microbatches", "default_virtual_stages", "dualpipev_schedule", "gpipe_schedule",
    "interleaved_schedule", "one_f_one_b_schedule",
    "simulate", "validate", "zb_h1_schedule", "zbv_schedule",
]
