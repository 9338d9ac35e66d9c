"""Expert parallelism (EP) as the model asks for it (`models.axis`): over an EP group of n ranks, expert e lives on
EP rank e // (E/n) and every MoE layer moves each token to its experts' ranks and back.

    Transformer(config, …).parallelize(ExpertParallel(ep_comm))              flat: all-to-allv
    Transformer(config, …).parallelize(ExpertParallel(ep_comm, "hierarchical"))  DeepSeek-V3's two hops

What changes in the model: each rank builds only its E/n experts (their parameters placed `Held` on "ep": no other
rank has a copy, so their gradients are summed over expert_dp, not dp), and every `MixtureOfExperts` gets the group.
The exchanges themselves — the count exchange, dispatch and combine with their backward twins, the two-hop
relay — and their cost per layer are in `models.moe` (the layer that routes, moves and combines the tokens); what
they sent is counted in `traffic` (`ExpertTraffic`, read by the trainer's ep byte ledger).
"""

from __future__ import annotations

from typing import Any

from collectives import Communicator
from models.axis import ExpertAxis
from models.moe import EP_DISPATCHES, ExpertTraffic, MixtureOfExperts, Router, expert_placement, local_experts
from models.parameter import Placement


class ExpertParallel(ExpertAxis):
    """This rank's E/n experts, and tokens that reach experts on other ranks by `dispatch` ("flat" all-to-allv, or
    "hierarchical": node-limited, `collectives.two_hop`)."""

    def __init__(self, comm: Any, dispatch: str = "flat") -> None:
        if dispatch not in EP_DISPATCHES:
            raise ValueError(f"ep_dispatch must be one of {EP_DISPATCHES}, got {dispatch!r}")
        self.comm, self.dispatch = Communicator.of(comm), dispatch
        self.rank, self.size = self.comm.rank, self.comm.size
        self.traffic = ExpertTraffic(self.size)

    def fit(self, config: Any) -> None:
        local_experts(config.n_experts, self.rank, self.size)  # raises unless n divides the experts

    def held_experts(self, n_experts: int) -> range:
        return local_experts(n_experts, self.rank, self.size)

    def placement(self, name: str) -> dict[str, Placement]:
        return expert_placement(name, self.size)

    def mixture(self, router: Router, experts: list[Any], fp8_dispatch: bool) -> MixtureOfExperts:
        return MixtureOfExperts(router, experts, self.comm, fp8_dispatch=fp8_dispatch, ep_dispatch=self.dispatch,
                                traffic=self.traffic)
