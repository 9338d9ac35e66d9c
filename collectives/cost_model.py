"""The α-β-γ cost model behind algo="auto".

A message of m bytes costs α + m·β (latency plus inverse bandwidth); reducing or copying m bytes locally
costs m·γ. Each algorithm's predicted time is its formula from the module that implements it; "auto" picks the
smallest.

More ranks than cores. When k ranks share each core of a node (k = ranks on the node / its cores > 1), they
take turns, and an algorithm in which every rank works at every step (ring, recursive doubling and halving,
Bruck, pairwise) runs k times slower. A binomial tree keeps fewer ranks busy: its n−1 messages spread over
⌈log2 n⌉ rounds, each busying a sender and a receiver, so on average a fraction 2(n−1)/(n·⌈log2 n⌉) of the ranks
work at once, and it slows by max(1, k × that fraction) only. On 4 ranks on 2 cores this makes the tree
broadcast beat scatter + all-gather at every size, as measured (scripts/bench_collectives.py).

Two tiers. On a cluster a message inside a node costs α + m·β, one to another node α_inter + m·β_inter (the
`collectives.topology` nodes of the communicator). An algorithm that is not hierarchical is priced at the inter
tier as soon as its communicator spans nodes: its rounds are synchronous and each round that has a message
crossing a node boundary waits for it (every step of a ring has one). Recursive doubling and halving are the
exception: with N nodes of k consecutive ranks, the rounds at distance d < t (t = the largest power of two that
divides k) pair ranks of one node, so log2(t) rounds run at the inner tier — the small-message rounds of the
doubling all-gather (S·d/p bytes), the last ones of the halving. The hierarchical algorithms pay each tier for
what it carries (`collectives.hierarchical`). "auto" considers them when the communicator spans nodes.

The constants are measured on the machine by `mpiparallel bench --calibrate` (ping-pong of tiny and 1 MiB
messages between ranks of one node and, where the job spans nodes, between ranks of two nodes; and a timed local
reduction), stored per rank count in a JSON file (MPIPARALLEL_CALIBRATION, default
~/.cache/mpiparallel/calibration.json), and broadcast from rank 0 with k so that every rank makes the same
choice — a disagreement would deadlock. A job on one node cannot measure the inter tier: it comes from the
planner's machine file (`alpha_inter`, `beta_inter` in MPIPARALLEL_MACHINE, default
~/.cache/mpiparallel/machine.json, the file `plan --calibrate` writes and `plan --machine` reads), else it is
taken equal to the tier inside.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .backend import NARROW_FLOATS
from .communicator import Communicator
from .faults import raising_peer_failure
from .mpi import MPI


@dataclass(frozen=True)
class CostModel:
    """Seconds per message (alpha), per byte sent (beta), per byte reduced or copied (gamma).

    The defaults (used when no calibration is stored) are a least-squares fit of every algorithm's formula to
    its measured times on two ranks of a 2-core machine, 8 B to 64 MiB (scripts/bench_collectives.py); α
    includes this package's Python cost of one step, a few microseconds.
    """

    alpha: float = 4.8e-6
    beta: float = 1 / 13.6e9
    gamma: float = 1 / 15.4e9
    ranks_per_core: float = 1.0
    """Ranks on the node / its cores, where above 1 (set by `model_for` from the communicator, not stored)."""
    alpha_inter: float | None = None
    """Seconds per message to another node (None: as inside the node)."""
    beta_inter: float | None = None
    """Seconds per byte sent to another node (None: as inside the node)."""

    def across(self) -> CostModel:
        """The model of a message that crosses nodes: the inter tier's α and β, the same γ."""
        if self.alpha_inter is None and self.beta_inter is None:
            return self
        return CostModel(self.alpha if self.alpha_inter is None else self.alpha_inter,
                         self.beta if self.beta_inter is None else self.beta_inter, self.gamma, self.ranks_per_core)


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _fold(m: CostModel, s: float, n: int) -> float:
    """Extra cost of folding n ranks onto a power of two and handing the result back."""
    p = 1 << (n.bit_length() - 1)
    return 0.0 if n == p else 2 * (m.alpha + s * m.beta) + s * m.gamma


def _pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


Formula = Callable[[CostModel, float, int], float]

# S is the collective's message size in bytes: the input for all_reduce, reduce_scatter, all_to_all, broadcast
# and reduce; the gathered output for all_gather. Two terms go beyond the modules' textbook formulas, each for
# work the implementation does: recursive halving copies the rank's block out of its work buffer (S/n·γ), and
# each Bruck all-to-all round packs and unpacks its slots in Python, about as long as a step (a second α;
# measured on 4 ranks: 3.4 µs of Python per Bruck round against 1.0 µs per pairwise step). The pairwise
# reductions add n blocks of S/n into an accumulator and round it once: S·γ (`collectives.pairwise`); never
# cheaper than the ring, auto runs them for their rounding only (`precision_choice`).
FORMULAS: dict[str, dict[str, Formula]] = {
    "all_reduce": {
        "ring": lambda m, s, n: 2 * (n - 1) * m.alpha + 2 * (n - 1) / n * s * m.beta + (n - 1) / n * s * m.gamma,
        "recursive_doubling": lambda m, s, n: math.log2(_pow2(n)) * (m.alpha + s * m.beta + s * m.gamma)
        + _fold(m, s, n),
        "rabenseifner": lambda m, s, n: 2 * math.log2(_pow2(n)) * m.alpha
        + (_pow2(n) - 1) / _pow2(n) * s * (2 * m.beta + m.gamma) + _fold(m, s, n),
        "pairwise": lambda m, s, n: 2 * (n - 1) * m.alpha + 2 * (n - 1) / n * s * m.beta + s * m.gamma,
    },
    "reduce_scatter": {
        "ring": lambda m, s, n: (n - 1) * m.alpha + (n - 1) / n * s * (m.beta + m.gamma),
        "recursive_halving": lambda m, s, n: math.log2(_pow2(n)) * m.alpha
        + (_pow2(n) - 1) / _pow2(n) * s * (m.beta + m.gamma) + s / n * m.gamma + _fold(m, s, n),
        "pairwise": lambda m, s, n: (n - 1) * m.alpha + (n - 1) / n * s * m.beta + s * m.gamma,
    },
    "all_gather": {
        "ring": lambda m, s, n: (n - 1) * m.alpha + (n - 1) / n * s * m.beta,
        "recursive_doubling": lambda m, s, n: math.log2(_pow2(n)) * m.alpha
        + (_pow2(n) - 1) / _pow2(n) * s * m.beta + _fold(m, s, n),
        "bruck": lambda m, s, n: _log2(n) * m.alpha + (n - 1) / n * s * m.beta + s * m.gamma,
    },
    "all_to_all": {
        "pairwise": lambda m, s, n: (n - 1) * m.alpha + (n - 1) / n * s * m.beta,
        "bruck": lambda m, s, n: _log2(n) * (2 * m.alpha + s / 2 * m.beta + s * m.gamma),
    },
    "broadcast": {
        "binomial": lambda m, s, n: _log2(n) * (m.alpha + s * m.beta),
        "scatter_allgather": lambda m, s, n: (_log2(n) + n - 1) * m.alpha + 2 * (n - 1) / n * s * m.beta,
    },
    "reduce": {
        "binomial": lambda m, s, n: _log2(n) * (m.alpha + s * (m.beta + m.gamma)),
        "rabenseifner": lambda m, s, n: (math.log2(_pow2(n)) + _pow2(n) - 1) * m.alpha
        + (_pow2(n) - 1) / _pow2(n) * s * (2 * m.beta + m.gamma) + _fold(m, s, n),
    },
}


def _hierarchical(passes: int, gamma_passes: float, copies: int) -> Callable[[CostModel, float, int, int], float]:
    """The hierarchical algorithms' time on N nodes of k ranks (`collectives.hierarchical`): `passes` = 2 for
    all-reduce (reduce-scatter then all-gather), 1 otherwise; `gamma_passes` reductions of (n−1)/n·S; `copies`
    passes of S·γ to lay the blocks out lane by lane and back."""

    def formula(m: CostModel, s: float, nodes: int, k: int) -> float:
        e, n = m.across(), nodes * k
        inside = passes * ((k - 1) * m.alpha + (k - 1) / k * s * m.beta)
        across = passes * ((nodes - 1) * e.alpha + (nodes - 1) / nodes * s / k * e.beta)
        return inside + across + gamma_passes * (n - 1) / n * s * m.gamma + copies * s * m.gamma

    return formula


def _recursive_two_tier(collective: str, algo: str, m: CostModel, s: float, n: int, nodes: int) -> float | None:
    """Recursive doubling / halving on `nodes` nodes of n/nodes consecutive ranks: the log2(t) rounds at distance
    below t inside nodes, the rest across; the fold of a rank count that is not a power of two (neighbour pairs)
    inside. None for the other algorithms."""
    p, k = _pow2(n), max(n // nodes, 1)
    inside = min(k & -k, p)  # rounds at distances 1, 2, …, inside/2 stay in a node
    e = m.across()
    near, far = math.log2(inside), math.log2(p) - math.log2(inside)
    near_bytes, far_bytes = (inside - 1) / p * s, (p - inside) / p * s  # Σ S·d/p over the rounds of each tier
    windows = near * m.alpha + far * e.alpha + near_bytes * m.beta + far_bytes * e.beta
    if (collective, algo) == ("all_reduce", "recursive_doubling"):
        total = near * (m.alpha + s * m.beta) + far * (e.alpha + s * e.beta) + math.log2(p) * s * m.gamma
    elif (collective, algo) == ("all_gather", "recursive_doubling"):
        total = windows
    elif (collective, algo) == ("reduce_scatter", "recursive_halving"):
        total = windows + (p - 1) / p * s * m.gamma + s / n * m.gamma
    elif (collective, algo) == ("all_reduce", "rabenseifner"):
        total = 2 * windows + (p - 1) / p * s * m.gamma
    else:
        return None
    return total + _fold(m, s, n)


HIERARCHICAL: dict[str, Callable[[CostModel, float, int, int], float]] = {
    "all_reduce": _hierarchical(2, 1, 0),
    "reduce_scatter": _hierarchical(1, 1, 1),
    "all_gather": _hierarchical(1, 0, 1),
}
"""Formulas of algo="hierarchical", which need the node count N and ranks per node k besides S."""


TREES = {("broadcast", "binomial"), ("reduce", "binomial")}
"""The algorithms in which only some ranks work at a time (the others wait for their parent or child)."""


def busy_fraction(collective: str, algo: str, n: int) -> float:
    """The mean fraction of the n ranks working at once: 1, or 2(n−1)/(n·⌈log2 n⌉) for a binomial tree."""
    if (collective, algo) not in TREES or n < 2:
        return 1.0
    return 2 * (n - 1) / (n * _log2(n))


def predict(model: CostModel, collective: str, algo: str, nbytes: int, size: int, nodes: int = 1) -> float:
    """Predicted seconds for one call on `size` ranks spread over `nodes` nodes (its formula, at the inter tier
    when it spans nodes unless hierarchical, slowed down where ranks share cores)."""
    two_tier = _recursive_two_tier(collective, algo, model, float(nbytes), size, nodes) if nodes > 1 else None
    if algo == "hierarchical":
        time = HIERARCHICAL[collective](model, float(nbytes), nodes, max(size // nodes, 1))
    elif two_tier is not None:
        time = two_tier
    else:
        time = FORMULAS[collective][algo](model.across() if nodes > 1 else model, float(nbytes), size)
    if model.ranks_per_core > 1:
        time *= max(1.0, model.ranks_per_core * busy_fraction(collective, algo, size))
    return time


def candidates(collective: str, nodes: int = 1) -> list[str]:
    """The algorithms "auto" chooses from: the flat ones, and hierarchical where the ranks span nodes."""
    flat = list(FORMULAS[collective])
    return flat + ["hierarchical"] if nodes > 1 and collective in HIERARCHICAL else flat


ROUNDING_ONCE = {"all_reduce": "pairwise", "reduce_scatter": "pairwise"}
"""The algorithm of each collective that rounds each element of a 16-bit float sum once (`collectives.pairwise`)."""


def precision_choice(collective: str, dtype: np.dtype, op: str | None) -> str | None:
    """auto's choice where accuracy decides, not time: the algorithm that rounds once for sums and averages of
    bfloat16 and float16 (the others round each partial sum on its way, up to n−1 times), else None.

    Over several nodes this gives up the hierarchical algorithms' smaller inter-node volume for the rounding."""
    if op in ("sum", "avg") and dtype in NARROW_FLOATS:
        return ROUNDING_ONCE.get(collective)
    return None


def choose(model: CostModel, collective: str, nbytes: int, size: int, nodes: int = 1) -> str:
    """The algorithm with the smallest predicted time; near-ties (rounding) go to the first listed."""
    costs = {algo: predict(model, collective, algo, nbytes, size, nodes) for algo in candidates(collective, nodes)}
    best = min(costs.values())
    return next(algo for algo, cost in costs.items() if cost <= best * (1 + 1e-9))


# -- measured constants -------------------------------------------------------------------------------------

_STORED = ("alpha", "beta", "gamma")  # ranks_per_core belongs to the job, not the machine
_INTER_TIER = ("alpha_inter", "beta_inter")  # stored when measured (a job that spans nodes)


def calibration_path() -> Path:
    default = Path.home() / ".cache" / "mpiparallel" / "calibration.json"
    return Path(os.environ.get("MPIPARALLEL_CALIBRATION", default))


def machine_path() -> Path:
    """The planner's machine file (`plan --calibrate` writes it, `plan --machine` reads it)."""
    default = Path.home() / ".cache" / "mpiparallel" / "machine.json"
    return Path(os.environ.get("MPIPARALLEL_MACHINE", default))


def inter_tier_from_machine(path: Path | None = None) -> dict[str, float]:
    """`alpha_inter` and `beta_inter` from the planner's machine file, where it states them (else empty)."""
    try:
        machine = json.loads((path or machine_path()).read_text())
        return {key: float(machine[key]) for key in _INTER_TIER if machine.get(key) is not None}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def load_calibration(size: int, path: Path | None = None) -> CostModel:
    """The model stored for `size` ranks (or the nearest stored rank count); defaults if none is stored. The
    inter-node tier is the stored one if it was measured, else the planner's machine file's, else none."""
    path = path or calibration_path()
    try:
        stored = json.loads(path.read_text())
        nearest = stored[min(stored, key=lambda key: abs(int(key) - size))]
        values = {key: float(nearest[key]) for key in _STORED}
        values |= {key: float(nearest[key]) for key in _INTER_TIER if nearest.get(key) is not None}
    except (OSError, ValueError, TypeError, KeyError):
        values = {}
    if not all(key in values for key in _INTER_TIER):
        values = inter_tier_from_machine() | values
    return CostModel(**values)


def save_calibration(model: CostModel, size: int, path: Path | None = None) -> Path:
    path = path or calibration_path()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[str(size)] = {key: value for key, value in asdict(model).items()
                         if key in _STORED or key in _INTER_TIER and value is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    return path


def auto_algorithm(comm: Communicator, collective: str, nbytes: int) -> str:
    """The algorithm algo="auto" runs for this call; decided once per (collective, size) per communicator."""
    key = (collective, nbytes)
    choice = comm.auto_choices.get(key)
    if choice is None:
        choice = comm.auto_choices[key] = choose(model_for(comm), collective, nbytes, comm.size, comm.topology.count)
    return choice


@raising_peer_failure
def ranks_per_core(comm: Communicator) -> float:
    """Ranks of `comm` on this rank's node per core of the node (collective: every rank of comm calls it; a failed
    peer raises `PeerFailure`, as in the collectives)."""
    node = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() / (os.cpu_count() or 1)
    finally:
        node.Free()


def model_for(comm: Communicator) -> CostModel:
    """The cost model of `comm`: loaded on its rank 0 once, with rank 0's node's ranks per core, broadcast, then
    cached on the communicator."""
    if comm.cost_model is None:
        sharing = ranks_per_core(comm)
        values = np.full(6, np.nan)
        if comm.rank == 0:
            loaded = load_calibration(comm.size)
            values[:] = (loaded.alpha, loaded.beta, loaded.gamma, sharing, *_or_nan(loaded))
        comm.comm.Bcast(values, root=0)
        comm.cost_model = _model_of(values)
    return comm.cost_model


def _or_nan(model: CostModel) -> tuple[float, float]:
    return tuple(np.nan if v is None else v for v in (model.alpha_inter, model.beta_inter))


def _model_of(values: np.ndarray) -> CostModel:
    """The CostModel of (α, β, γ, ranks per core, α_inter, β_inter) as broadcast (NaN: no inter tier)."""
    alpha, beta, gamma, sharing, alpha_inter, beta_inter = values.tolist()
    return CostModel(alpha, beta, gamma, sharing, None if math.isnan(alpha_inter) else alpha_inter,
                     None if math.isnan(beta_inter) else beta_inter)


def _partners(comm: Communicator) -> tuple[int, int | None]:
    """This rank's partner in the timed exchanges: inside its node (local rank XOR 1) and on another node (the
    same local rank on node index XOR 1; None when the communicator lives on one node). A rank without a
    partner exchanges with itself, so that every rank takes part in every round."""
    layout = comm.topology
    node, local = layout.node_index[comm.rank], layout.local_rank[comm.rank]
    members = layout.members[node]
    inside = members[local ^ 1] if (local ^ 1) < len(members) else comm.rank
    if not layout.spans_nodes:
        return inside, None
    other = node ^ 1
    across = layout.members[other][local] if other < layout.count and local < len(layout.members[other]) \
        else comm.rank
    return inside, across


def _time_exchanges(comm: Communicator, nbytes: int, repeats: int, partner: int) -> float:
    """Seconds per exchange of `nbytes` with `partner`, the median of several rounds."""
    buf, arrived = np.ones(max(nbytes // 8, 1)), np.empty(max(nbytes // 8, 1))
    samples = []
    for _ in range(5):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            comm.sendrecv(buf, partner, arrived, partner)  # through this package: α includes its per-step cost
        samples.append((time.perf_counter() - start) / repeats)
    return float(np.median(samples))


def _link(comm: Communicator, partner: int, repeats: int) -> tuple[float, float]:
    """(α, β) of the link to `partner`: an 8-byte exchange, and the extra time per byte of a 1 MiB one."""
    large = 1 << 20
    alpha = _time_exchanges(comm, 8, repeats, partner)
    return alpha, max(_time_exchanges(comm, large, max(repeats // 40, 5), partner) - alpha, 1e-9) / large


def calibrate(comm: Communicator) -> CostModel:
    """Measure α, β, γ on this machine with this many ranks; every rank returns rank 0's figures.

    Where the communicator spans nodes, α and β are measured twice: between ranks of one node and between
    ranks of two nodes (the inter tier); otherwise the inter tier comes from the planner's machine file, if it
    states one. Every rank is busy during the measurement, which the model counts as slowed down by the ranks
    per core k: the constants kept are the measured ones / k (those of a rank with a core to itself).
    """
    large = 1 << 20
    inside, across = _partners(comm)
    alpha, beta = _link(comm, inside, 2000)
    inter = _link(comm, across, 400) if across is not None else None
    if inter is None:
        machine = inter_tier_from_machine()
        inter = (machine.get("alpha_inter", np.nan), machine.get("beta_inter", np.nan))
    a, b = np.ones(large // 8), np.ones(large // 8)
    start = time.perf_counter()
    for _ in range(50):
        np.add(a, b, out=a)
    gamma = (time.perf_counter() - start) / 50 / large
    sharing = ranks_per_core(comm)
    slowdown = max(sharing, 1.0)  # what the model applies to an all-busy algorithm such as this measurement
    measured = across is not None  # a tier from the machine file is already per rank: not divided again
    values = np.array([alpha / slowdown, beta / slowdown, gamma / slowdown, sharing,
                       *(v / slowdown if measured else v for v in inter)])
    comm.comm.Bcast(values, root=0)
    comm.cost_model = _model_of(values)
    comm.auto_choices.clear()
    comm.call_plans.clear()
    return comm.cost_model
