"""One layout's units as `evaluate` sees them, derived once: the units' costs (`costs.unit_costs`, one per kind
of unit), the stages (the units split evenly over pp·chunks, `schedules.stage_units`) and the pipeline rank that
owns each, the pipeline's shape, the rows of a microbatch (batch / (dp·m)) and the routed experts' parameters of
each unit."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .hardware import Cluster
from .kernel_costs import UnitCost
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

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, owner in enumerate(self.stage_ranks) if owner == rank]

    def units_of(self, rank: int) -> list[int]:
        """The units of pipeline rank `rank`'s stages, in order (one list per rank: not to be changed)."""
        return self._rank_units[rank]

    def held_experts(self, rank: int) -> float:
        """The routed experts' parameters pipeline rank `rank` holds."""
        return self._rank_experts[rank]

    def zero_shards(self, expert: bool) -> int:
        """Ranks one parameter's ZeRO state is sharded over: dp (a shard group with hybrid sharding), or the dp/ep
        holding a routed expert."""
        return self.layout.shard_ranks // self.layout.ep if expert else self.layout.shard_ranks

    def kind_counts(self, units: list[int] | range) -> list[int]:
        """How many units of each cost (embedding, each kind of block, head) are among `units`."""
        counts = [0] * len(self.costs)
        for unit in units:
            counts[self.kinds[unit]] += 1
        return counts

    def stage_weighted(self, stage: int, values: list[float]) -> float:
        """Σ over the units of `stage` of the value of each one's kind (`values`: one per cost)."""
        return _weighted(self._stage_kind_counts[stage], values)

    def rank_weighted(self, rank: int, values: list[float]) -> float:
        """Σ over the units of pipeline rank `rank` of the value of each one's kind (`values`: one per cost)."""
        return _weighted(self._rank_kind_counts[rank], values)

    # computed once per layout: the search and the timing ask for them many times

    @cached_property
    def _rank_units(self) -> tuple[list[int], ...]:
        return tuple(sorted(u for s in self.stages_of(rank) for u in self.stages[s]) for rank in range(self.layout.pp))

    @cached_property
    def _rank_experts(self) -> tuple[float, ...]:
        return tuple(sum(self.experts[u] for u in units) if self.experts else 0.0 for units in self._rank_units)

    @cached_property
    def _rank_kind_counts(self) -> tuple[list[int], ...]:
        return tuple(self.kind_counts(units) for units in self._rank_units)

    @cached_property
    def _stage_kind_counts(self) -> tuple[list[int], ...]:
        return tuple(self.kind_counts(units) for units in self.stages)


def _weighted(counts: list[int], values: list[float]) -> float:
    return sum(n * v for n, v in zip(counts, values, strict=True))
