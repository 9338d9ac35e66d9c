"""A step's mixture-of-experts accounting: the aux loss and router statistics over the global batch, and
aux-loss-free balancing (`--moe-bias-rate`, DeepSeek-V3) moving each expert bias after the update.

Each rank's forwards see only their own token sets (a microbatch on one DP×CP rank; under --sp one TP rank's
slice of it): `RouterTally` adds up what they saw, and the sums over the mesh below make it the whole batch's.
A dense model's tally does nothing (`NoExperts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from models.moe import update_expert_bias
from models.tensors import expert_bias_name
from models.transformer import Transformer

from ..mesh import Mesh
from .metering import sum_array_over


class RouterTally:
    """A step's router statistics and aux loss, from the saved state of this rank's forwards (its token sets and
    layers)."""

    def __init__(self, experts: ExpertBalance) -> None:
        self.experts = experts
        self.layers: dict[int, Any] = {}
        self.aux_loss = 0.0
        self.bias_counts: dict[int, np.ndarray] = {}

    def add(self, saved: Any) -> None:
        self.aux_loss += saved.aux_loss
        for layer, stats in saved.router_stats.items():
            self.layers[layer] = stats if layer not in self.layers else self.layers[layer] + stats

    def finish(self) -> dict[str, Any]:
        return self.experts.balance(self)

    def apply(self) -> None:
        """With --moe-bias-rate: move each expert bias by the step's counts (after the step is committed: a step
        redone after a lost rank must find the biases as they were before it)."""
        rate = self.experts.model.config.moe_bias_rate
        for layer, counts in self.bias_counts.items():
            update_expert_bias(self.experts.model.expert_biases[expert_bias_name(layer)], counts, rate)


class ExpertBalance:
    """The step's aux loss and router statistics over the global batch; with --moe-bias-rate, each local layer's
    expert bias moved toward its under-loaded experts (its counts over every microbatch and rank); with
    --moe-aux-scope global, the routing counted over the whole step before its passes."""

    def __init__(self, model: Transformer, mesh: Mesh, sequence_parallel: bool,
                 sum_losses: Callable[[float], float]) -> None:
        self.model, self.mesh, self.sp, self.sum_losses = model, mesh, sequence_parallel, sum_losses
        self.last_traffic: dict[str, Any] | None = None

    def count_routing(self, passes: Any, pieces: list[Any], tokens: int) -> None:
        """--moe-aux-scope global: a forward-only pass over the step's microbatches (each routed as it will be:
        the same token sets, so the same capacities), then one all-reduce over the world of every MoE layer's
        assignments per expert; each router gets the step's counts and token count (`Transformer.set_step_routing`),
        so each token set's aux loss is its share of the step's. Costs one forward of the step (its bytes are
        logged apart, as `routing_bytes`) and n_layer·E numbers all-reduced. Local scope: nothing."""
        if self.model.moe_aux_scope != "global":
            return
        self.model.set_step_routing(None)  # the counting pass balances each set by its own (its loss is unused)
        tally = RouterTally(self)
        passes.forward_only_each(pieces, tokens, tally.add)
        counts = np.zeros((self.model.config.n_layer, self.model.config.n_experts))
        for layer, stats in tally.layers.items():
            counts[layer] = stats.assignments
        counts = sum_array_over(self.mesh.world, counts) / (1 if self.sp else self.mesh.tp.size)
        self.model.set_step_routing(dict(enumerate(counts)), tokens)

    def new_step(self) -> RouterTally:
        if self.model.ep.traffic is not None:  # what the forwards since the last step sent (validation) is not
            self.model.ep.traffic.take()       # in this step's bytes
        return RouterTally(self)

    def balance(self, tally: RouterTally) -> dict[str, Any]:
        config, mesh = self.model.config, self.mesh
        if self.model.ep.traffic is not None:  # the counts of the ep byte formula (`traffic.expert_parallel_bytes`)
            self.last_traffic = self.model.ep.traffic.take()
        if config.moe_bias_rate > 0:  # moved once the step is applied (`RouterTally.apply`), not before
            tally.bias_counts = {layer: self._over_token_sets(sum_array_over(mesh.dp_cp, stats.assignments))
                                 for layer, stats in tally.layers.items()}
        assignments = sum((stats.assignments for stats in tally.layers.values()), np.zeros(config.n_experts))
        dropped = sum(stats.dropped_tokens for stats in tally.layers.values())
        totals = sum_array_over(mesh.world, np.append(assignments, dropped))  # every layer and token …
        copies = 1 if self.sp else mesh.tp.size  # … once (without --sp the TP ranks route the same tokens)
        per_expert = totals[:-1] / copies
        load = float(per_expert.max() / per_expert.mean()) if per_expert.sum() else 0.0
        aux = self._over_token_sets(np.array([tally.aux_loss]))[0]
        return {"aux_loss": self.sum_losses(aux),
                "router": {"tokens_per_expert": per_expert.astype(int).tolist(),
                           "dropped_tokens": int(totals[-1] / copies), "max_over_mean_load": load}}

    def _over_token_sets(self, values: np.ndarray) -> np.ndarray:
        """With --sp each TP rank routes only its slice of the sequence: its own token set, summed over tp."""
        return sum_array_over(self.mesh.tp, values) if self.sp else values


class NoExperts:
    """A dense model's tallies: nothing to count, nothing logged."""

    def count_routing(self, passes: Any, pieces: list[Any], tokens: int) -> None:
        """No routers."""

    def new_step(self) -> NoExperts:
        return self

    def add(self, saved: Any) -> None:
        """A dense forward routes nothing."""

    def finish(self) -> dict[str, Any]:
        return {}

    def apply(self) -> None:
        """No expert biases to move."""


def expert_tallies(model: Transformer, mesh: Mesh, sequence_parallel: bool,
                   sum_losses: Callable[[float], float]) -> ExpertBalance | NoExperts:
    return ExpertBalance(model, mesh, sequence_parallel, sum_losses) if model.config.n_experts else NoExperts()
