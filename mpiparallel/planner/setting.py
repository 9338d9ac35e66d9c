"""One layout's units as `evaluate` sees them, derived once: the units' costs (`costs.unit_costs`, one per kind
of unit), the stages (the units split evenly over pp·chunks, `schedules.stage_units`) and the pipeline rank that
owns each, the pipeline's shape, the rows of a microbatch (batch / (dp·m)) and the routed experts' parameters of
each unit."""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .kernels import UnitCost
from .layout import Layout, Precision
from .pipeline import PipelineShape
from .shapes import Model


@dataclass(frozen=True)
class Setting:
    """Everything `evaluate` derives once per layout."""

    model: Model
    cluster: Cluster
    precision: Precision
    layout: Layout
    costs: list[UnitCost]
    stages: list[range]
    stage_ranks: tuple[int, ...]
    shape: PipelineShape | None
    rows: int
    """Sequences per microbatch on one rank."""
    kinds: tuple[int, ...]
    """Per unit, its cost's index in `costs` (`unit_kinds`)."""
    experts: tuple[float, ...] = ()
    """Per unit, the routed experts' parameters this rank holds (`expert_unit_parameters`)."""

    def held_experts(self, rank: int) -> float:
        return sum(self.experts[u] for u in self.units_of(rank)) if self.experts else 0.0

    def zero_shards(self, expert: bool) -> int:
        """Ranks one parameter's ZeRO state is sharded over: dp, or the dp/ep holding a routed expert."""
        return self.layout.dp // self.layout.ep if expert else self.layout.dp

    def cost_of(self, unit: int) -> UnitCost:
        return self.costs[self.kinds[unit]]

    def kind_counts(self, units: list[int] | range) -> list[int]:
        """How many units of each cost (embedding, each kind of block, head) are among `units`."""
        counts = [0] * len(self.costs)
        for unit in units:
            counts[self.kinds[unit]] += 1
        return counts

    def weighted(self, units: list[int] | range, values: list[float]) -> float:
        """Σ over `units` of the value of each one's kind (`values`: one per cost)."""
        return sum(n * v for n, v in zip(self.kind_counts(units), values, strict=True))

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, owner in enumerate(self.stage_ranks) if owner == rank]

    def units_of(self, rank: int) -> list[int]:
        return sorted(u for s in self.stages_of(rank) for u in self.stages[s])
