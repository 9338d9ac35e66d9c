"""DualPipeV (DeepSeek-AI, the DeepSeek-V3 report and github.com/deepseek-ai/DualPipe's `dualpipev.py`).

DualPipe feeds microbatches from both ends of the pipeline; DualPipeV is its V-shaped half (Sea AI Lab's
"cut-in-half"): p ranks hold 2p stages, rank r holding r and 2p−1−r as in ZB-V, and the steady state pairs
the forward of one microbatch on one chunk with the full backward of another on the other chunk. On a GPU the
pair runs overlapped, so that one's communication (MoE all-to-all, pipeline sends) hides under the other's
compute; here the pair is its two actions in sequence, F then B, and an executor may overlap them.
Costs per stage (chunk) and microbatch as in `classic`.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

from .actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    Action,
    Schedule,
    Unit,
    below,
    check_sizes,
    v_placement,
    with_communication,
)

if TYPE_CHECKING:
    from .simulator import Costs


def dualpipev_schedule(pp: int, microbatches: int) -> Schedule:
    """DualPipeV in eight phases per rank r (the "down" chunk is stage r, the "up" chunk stage 2p−1−r):

    1. 2(p−1−r) forwards of the down chunk;
    2. r+1 times: F down, F up;
    3. p−1−r times: I up, its W, F up (zero bubble: the gradient leaves before the W runs);
    4. m−2p+1+r times: the pairs (F down, B up) and (F up, B down) — the steady state;
    5. p−1−r times: B up, then the pair (F up, B down);
    6. r+1 times: B up, B down, the later half split into I with its W deferred;
    7. p−1−r times: a deferred W, then I down (its W deferred);
    8. the r+1 deferred W that remain.

    A pair's receives all come before its forward and its sends after its backward, as in DeepSeek's code,
    where the two run overlapped. The authors state the bubble as (PP/2−1)(F&B + B − 3W) for PP stages, F&B
    the time of an overlapped pair; here PP = 2p and F&B = F + B (the pair in sequence): idle (p−1)(F + 2I − W)
    per rank for m ≥ 2p, which the simulation meets exactly when F = I ≥ W. Peak activations 2p+1
    chunk-microbatches on every rank (the authors' PP+1). Fewer microbatches than 2p run the 2p schedule with
    the missing ones left out.
    """
    check_sizes(pp, microbatches)
    filled = max(microbatches, 2 * pp)
    compute = [below(microbatches, _DualPipeVRank(pp, filled, rank).order()) for rank in range(pp)]
    return with_communication("dualpipev", pp, microbatches, v_placement(pp), compute)


class _DualPipeVRank:
    """One rank's order, built phase by phase; microbatches are numbered in order per chunk and pass kind."""

    def __init__(self, pp: int, microbatches: int, rank: int) -> None:
        self.pp, self.microbatches, self.rank = pp, microbatches, rank
        self.down, self.up = rank, 2 * pp - 1 - rank
        self.order_so_far: list[Unit] = []
        self.started = Counter()
        self.deferred: deque[Action] = deque()

    def forward(self, stage: int) -> None:
        self.order_so_far.append(self._next(stage, FORWARD))

    def backward(self, stage: int, split: bool = False) -> None:
        """B, or with `split` only I, its W queued for a later `weight` (first in, first out)."""
        self.order_so_far.append(self._next_backward(stage, split))

    def pair(self, forward_stage: int, backward_stage: int) -> None:
        """A forward and the full backward of another microbatch, as one overlapped unit."""
        self.order_so_far.append((self._next(forward_stage, FORWARD), self._next_backward(backward_stage)))

    def weight(self) -> None:
        self.order_so_far.append(self.deferred.popleft())

    def _next_backward(self, stage: int, split: bool = False) -> Action:
        backward = self._next(stage, BACKWARD_INPUT)
        if not split:
            return Action(stage, FULL_BACKWARD, backward.microbatch)
        self.deferred.append(Action(stage, BACKWARD_WEIGHT, backward.microbatch))
        return backward

    def _next(self, stage: int, kind: str) -> Action:
        """The next microbatch of `kind` on `stage` (I counts full backwards too)."""
        action = Action(stage, kind, self.started[stage, kind])
        self.started[stage, kind] += 1
        return action

    def order(self) -> list[Unit]:
        pp, rank, down, up = self.pp, self.rank, self.down, self.up
        for _ in range(2 * (pp - 1 - rank)):
            self.forward(down)
        for _ in range(rank + 1):
            self.forward(down)
            self.forward(up)
        for _ in range(pp - 1 - rank):
            self.backward(up, split=True)
            self.weight()
            self.forward(up)
        for index in range(self.microbatches - 2 * pp + 1 + rank):
            if index == 0 and rank == pp - 1:
                # DeepSeek runs the last rank's first pair unpaired "to further reduce bubble size": its forward
                # then does not wait for the backward's gradient.
                self.forward(down)
                self.backward(up)
            else:
                self.pair(down, up)
            self.pair(up, down)
        for _ in range(pp - 1 - rank):
            self.backward(up)
            self.pair(up, down)
        self._drain_both_chunks()
        for _ in range(pp - 1 - rank):
            self.weight()
            self.backward(down, split=True)
        while self.deferred:
            self.weight()
        return self.order_so_far

    def _drain_both_chunks(self) -> None:
        """Phase 6: r+1 pairs of backwards, the later half split. The split starts one backward earlier on odd
        ranks than on even ones, so that exactly r+1 W passes are deferred for phase 8."""
        half = (self.rank + 1) // 2
        for index in range(self.rank + 1):
            self.backward(self.up, split=index > half or (index == half and self.rank % 2 == 1))
            self.backward(self.down, split=index >= half)


def dualpipev_bubble(pp: int, microbatches: int, virtual_stages: int, costs: Costs) -> float:
    """Idle (p−1)(F&B + B − 3W) with F&B = F + B, beside 2m(F+I+W) of work per rank."""
    backward = costs.backward_input + costs.backward_weight
    idle = (pp - 1) * (costs.forward + 2 * backward - 3 * costs.backward_weight)
    return idle / (2 * microbatches * (costs.forward + backward) + idle)
