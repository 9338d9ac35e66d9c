"""The process mesh: which world rank holds which coordinates, and one communicator per parallel axis.

A run with dp·tp·pp·cp ranks places them innermost first as tp, cp, dp, pp (a fixed layout that scripts and
checkpoints rely on):

    rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i

so the ranks of one tensor-parallel group are neighbours (the chattiest axis gets the closest ranks: on a
cluster, the same node) and pipeline stages are the farthest apart (they exchange the least). Each axis gets a
`Communicator` holding the ranks that differ only in that coordinate:

- `tp`, `cp`, `dp`, `pp`: the four axes;
- `dp_cp`: data and context parallel together — the ranks whose gradients are summed (CP ranks see different
  tokens of the same sequences, DP ranks different sequences);
- `ep` and `expert_dp`: expert parallelism splits each DP group into dp/ep groups of ep consecutive DP ranks
  (`ep`: the all-to-all of tokens to experts); `expert_dp` joins the ranks that hold the same experts, whose
  expert gradients are summed;
- `dp_shard` and `dp_replicate` (hybrid sharding, `--dp-shard N`): ZeRO shards over groups of N consecutive DP
  ranks (`dp_shard`; `dp_shard_cp` with cp, whose ranks shard with them) and the groups hold replicas, summed over
  `dp_replicate` (the ranks with the same shard in every group). dp = dp_replicate·N, the DP coordinate being
  dp_replicate_i·N + dp_shard_i: a shard group is N·cp·tp consecutive world ranks — one node when that is the
  node's rank count.

Nodes. The world communicator knows the node of every rank (`collectives.topology`); `describe` shows it and
says which axes keep every group inside one node, and `topology_warning` flags a tensor-parallel group (and so
its sequence-parallel exchanges) that spans nodes: the chattiest axis on the slowest links.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mpi4py import MPI

from collectives import Communicator
from collectives.topology import describe_nodes

from .errors import ConfigError
from .text import plural

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the axes; `dp=None` means world / (tp·pp·cp)."""

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int | None = None  # hybrid sharding: ZeRO shards over groups of this many DP ranks (None: all of dp)

    @property
    def dp_replicate(self) -> int:
        """The shard groups, each a replica of the sharded state (1 without hybrid sharding)."""
        return (self.dp or 1) // (self.dp_shard or self.dp or 1)

    @property
    def hybrid(self) -> bool:
        return self.dp_replicate > 1

    def resolve(self, world_size: int) -> MeshShape:
        """The shape with dp filled in, after checking that it tiles `world_size` ranks."""
        for axis in ("tp", "pp", "cp", "ep"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"--{axis} must be at least 1, got {getattr(self, axis)}")
        model_parallel = self.tp * self.pp * self.cp
        dp = self.dp
        if dp is None:
            if world_size % model_parallel:
                raise ConfigError(f"{world_size} ranks cannot be split into tp·pp·cp = {self.tp}·{self.pp}·{self.cp}"
                                  f" = {model_parallel} model-parallel groups")
            dp = world_size // model_parallel
        if dp < 1 or dp * model_parallel != world_size:
            raise ConfigError(f"the mesh dp·tp·pp·cp = {dp}·{self.tp}·{self.pp}·{self.cp} = {dp * model_parallel} "
                              f"ranks does not match the {world_size} ranks running")
        if dp % self.ep:
            raise ConfigError(f"--ep {self.ep} must divide the data-parallel size {dp}")
        dp_shard = dp if self.dp_shard is None else self.dp_shard
        if dp_shard < 1 or dp % dp_shard:
            divisors = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
            raise ConfigError(f"--dp-shard {dp_shard} must divide the data-parallel size {dp} (dp = dp_replicate × "
                              f"dp_shard; the divisors of {dp}: {divisors})")
        if dp_shard < dp and dp_shard % self.ep:
            raise ConfigError(f"--dp-shard {dp_shard} must be a multiple of --ep {self.ep}: the experts' states shard "
                              f"inside a shard group too, so an EP group must lie inside one")
        return MeshShape(dp=dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, dp_shard=dp_shard)


@dataclass(frozen=True)
class Coordinates:
    pp: int
    dp: int
    cp: int
    tp: int


def coordinates_of(rank: int, shape: MeshShape) -> Coordinates:
    """Invert rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i."""
    rank, tp_i = divmod(rank, shape.tp)
    rank, cp_i = divmod(rank, shape.cp)
    pp_i, dp_i = divmod(rank, shape.dp)
    return Coordinates(pp=pp_i, dp=dp_i, cp=cp_i, tp=tp_i)


def rank_of(coordinates: Coordinates, shape: MeshShape) -> int:
    return ((coordinates.pp * shape.dp + coordinates.dp) * shape.cp + coordinates.cp) * shape.tp + coordinates.tp


class Mesh:
    """The mesh of this run: its shape, this rank's coordinates, and a Communicator per axis."""

    def __init__(self, world: MPI.Comm | Communicator, shape: MeshShape) -> None:
        self.world = Communicator.of(world)
        self.shape = shape.resolve(self.world.size)
        self.coordinates = coordinates_of(self.world.rank, self.shape)
        c = self.coordinates
        # Split colors: ranks with equal color form a group; the key orders them by the axis coordinate.
        self.tp = self._split((c.pp, c.dp, c.cp), c.tp, "tp")
        self.cp = self._split((c.pp, c.dp, c.tp), c.cp, "cp")
        self.dp = self._split((c.pp, c.cp, c.tp), c.dp, "dp")
        self.pp = self._split((c.dp, c.cp, c.tp), c.pp, "pp")
        self.dp_cp = self._split((c.pp, c.tp), c.dp * self.shape.cp + c.cp, "dp_cp")
        ep = self.shape.ep
        self.ep = self._split((c.pp, c.cp, c.tp, c.dp // ep), c.dp % ep, "ep")
        self.expert_dp = self._split((c.pp, c.cp, c.tp, c.dp % ep), c.dp // ep, "expert_dp")
        self.expert_dp_cp = self._split((c.pp, c.tp, c.dp % ep), (c.dp // ep) * self.shape.cp + c.cp,
                                        "expert_dp_cp")
        shards = self.shape.dp_shard or self.shape.dp
        group, inside = divmod(c.dp, shards)
        self.dp_shard = self._split((c.pp, c.cp, c.tp, group), inside, "dp_shard")
        self.dp_shard_cp = self._split((c.pp, c.tp, group), inside * self.shape.cp + c.cp, "dp_shard_cp")
        self.dp_replicate = self._split((c.pp, c.cp, c.tp, inside), group, "dp_replicate")
        # the experts' shard group: the ranks of this shard group that hold the same experts (every ep-th)
        self.expert_dp_shard = self._split((c.pp, c.cp, c.tp, group, c.dp % ep), inside // ep, "expert_dp_shard")
        self.expert_dp_shard_cp = self._split((c.pp, c.tp, group, c.dp % ep), (inside // ep) * self.shape.cp + c.cp,
                                              "expert_dp_shard_cp")
        self.world.label = self.world.label or "world"

    def _split(self, color: tuple[int, ...], key: int, label: str) -> Communicator:
        flat_color = 0
        for part in color:  # a unique integer per color tuple (each part < world size)
            flat_color = flat_color * self.world.size + part
        return self.world.split(flat_color, key, label)

    def expert_coordinates(self) -> dict[str, int]:
        """This rank's coordinates on the two axes expert parallelism splits dp into: dp = expert_dp·ep + ep."""
        ep = self.shape.ep
        return {"ep": self.coordinates.dp % ep, "expert_dp": self.coordinates.dp // ep}

    def dp_coordinates(self) -> dict[str, int]:
        """This rank's coordinates on the two axes hybrid sharding splits dp into: dp = dp_replicate·N + dp_shard."""
        shards = self.shape.dp_shard or self.shape.dp
        return {"dp_replicate": self.coordinates.dp // shards, "dp_shard": self.coordinates.dp % shards}

    def coordinates_for(self, placement: dict) -> dict[str, int]:
        """This rank's coordinate on every axis that decides whether it holds the copy of a piece so placed that
        counts once (`models.parameter.counts_once`): the mesh's axes, and the axes that expert parallelism and
        hybrid sharding split dp into where the placement names them — dp itself then described by those two."""
        found = asdict(self.coordinates)
        split = {axis: coordinate for axis, coordinate in (self.expert_coordinates() | self.dp_coordinates()).items()
                 if axis in placement}
        if "dp_shard" in split:
            del found["dp"]
        return found | split

    def communicators(self) -> dict[str, Communicator]:
        """Axis name -> Communicator, for per-axis byte counts ("dp_cp": the gradient sums when cp > 1; with
        hybrid sharding, the shard groups' and the replicas' communicators)."""
        axes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "ep": self.ep}
        if self.shape.cp > 1:
            axes["dp_cp"] = self.dp_cp
        if self.shape.hybrid:
            axes |= {"dp_shard_cp" if self.shape.cp > 1 else "dp_shard": self.shard_group(),
                     "dp_replicate": self.dp_replicate}
        experts = self.expert_shard_group()
        if self.shape.ep > 1 and experts.size > 1:  # the experts' own gradient reductions
            axes[experts.label] = experts
        return axes

    def shard_group(self) -> Communicator:
        """The ranks ZeRO shards the dense parameters' states over: the dp (×cp) ranks, or with hybrid sharding
        those of this rank's shard group."""
        if self.shape.hybrid:
            return self.dp_shard if self.shape.cp == 1 else self.dp_shard_cp
        return self.dp if self.shape.cp == 1 else self.dp_cp

    def expert_shard_group(self) -> Communicator:
        """The ranks ZeRO shards a routed expert's states over: those holding the same experts (expert_dp, ×cp),
        or with hybrid sharding those of them in this rank's shard group."""
        if self.shape.hybrid:
            return self.expert_dp_shard if self.shape.cp == 1 else self.expert_dp_shard_cp
        return self.expert_dp if self.shape.cp == 1 else self.expert_dp_cp

    def describe(self) -> str:
        """A table of every world rank's coordinates and node (for --show-mesh), and which axes stay in nodes."""
        s, nodes = self.shape, self.world.nodes
        lines = [f"mesh: dp {s.dp} × tp {s.tp} × pp {s.pp} × cp {s.cp} = {plural(self.world.size, 'rank')}"
                 f"{f', ep {s.ep}' if s.ep > 1 else ''}; rank = ((pp·{s.dp} + dp)·{s.cp} + cp)·{s.tp} + tp",
                 f"nodes: {describe_nodes(nodes)}",
                 "  rank    pp    dp    cp    tp    ep  node"]
        for rank in range(self.world.size):
            c = coordinates_of(rank, s)
            lines.append(f"  {rank:>4}  {c.pp:>4}  {c.dp:>4}  {c.cp:>4}  {c.tp:>4}  {c.dp % s.ep:>4}  {nodes[rank]:>4}")
        if s.hybrid:
            lines.append(f"hybrid sharding: ZeRO shards over dp_shard groups of {plural(s.dp_shard, 'DP rank')} "
                         f"(dp_shard = dp mod {s.dp_shard}), {s.dp_replicate} replicas summed over dp_replicate")
        spanning = axes_spanning_nodes(s, nodes)
        axes = ("tp", "cp", "dp", "pp", "ep") + (("dp_shard", "dp_replicate") if s.hybrid else ())
        inside = [axis for axis in axes if _axis_size(s, axis) > 1 and axis not in spanning]
        lines.append(f"inside a node: {', '.join(inside) or 'no axis'}; across nodes: "
                     f"{', '.join(a for a in axes if a in spanning) or 'no axis'}")
        return "\n".join(lines)

    def topology_warning(self) -> str | None:
        """One line when a tensor-parallel (and sequence-parallel) group spans nodes, else None."""
        if "tp" not in axes_spanning_nodes(self.shape, self.world.nodes):
            return None
        return (f"warning: tensor-parallel groups of {self.shape.tp} ranks span nodes (their all-reduces, and "
                f"--sp's exchanges, cross the slow links every layer); use a --tp that divides the ranks per node")


def axes_spanning_nodes(shape: MeshShape, nodes: tuple[int, ...]) -> set[str]:
    """The axes with a group whose ranks are on more than one node (nodes[r]: the node of world rank r)."""
    groups: dict[tuple[str, tuple[int, ...]], set[int]] = {}
    for rank, node in enumerate(nodes):
        c = coordinates_of(rank, shape)
        for axis in ("tp", "cp", "dp", "pp"):
            others = tuple(getattr(c, a) for a in ("pp", "dp", "cp", "tp") if a != axis)
            groups.setdefault((axis, others), set()).add(node)
        if shape.ep > 1:  # ep groups: ep consecutive dp ranks
            groups.setdefault(("ep", (c.pp, c.cp, c.tp, c.dp // shape.ep)), set()).add(node)
        if shape.hybrid:  # shard groups: dp_shard consecutive dp ranks; replicas: one in each group
            group, inside = divmod(c.dp, shape.dp_shard)
            groups.setdefault(("dp_shard", (c.pp, c.cp, c.tp, group)), set()).add(node)
            groups.setdefault(("dp_replicate", (c.pp, c.cp, c.tp, inside)), set()).add(node)
    return {axis for (axis, _), members in groups.items() if len(members) > 1}


def _axis_size(shape: MeshShape, axis: str) -> int:
    return shape.dp_replicate if axis == "dp_replicate" else getattr(shape, axis)
