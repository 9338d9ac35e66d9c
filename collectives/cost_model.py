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

The three constants are measured on the machine by `mpiparallel bench --calibrate` (ping-pong of tiny and 1 MiB
messages, and a timed local reduction), stored per rank count in a JSON file (MPIPARALLEL_CALIBRATION, default
~/.cache/mpiparallel/calibration.json), and broadcast from rank 0 with k so that every rank makes the same
choice — a disagreement would deadlock.
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
from mpi4py import MPI

from .communicator import Communicator


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
# measured on 4 ranks: 3.4 µs of Python per Bruck round against 1.0 µs per pairwise step).
FORMULAS: dict[str, dict[str, Formula]] = {
    "all_reduce": {
        "ring": lambda m, s, n: 2 * (n - 1) * m.alpha + 2 * (n - 1) / n * s * m.beta + (n - 1) / n * s * m.gamma,
        "recursive_doubling": lambda m, s, n: math.log2(_pow2(n)) * (m.alpha + s * m.beta + s * m.gamma)
        + _fold(m, s, n),
        "rabenseifner": lambda m, s, n: 2 * math.log2(_pow2(n)) * m.alpha
        + (_pow2(n) - 1) / _pow2(n) * s * (2 * m.beta + m.gamma) + _fold(m, s, n),
    },
    "reduce_scatter": {
        "ring": lambda m, s, n: (n - 1) * m.alpha + (n - 1) / n * s * (m.beta + m.gamma),
        "recursive_halving": lambda m, s, n: math.log2(_pow2(n)) * m.alpha
        + (_pow2(n) - 1) / _pow2(n) * s * (m.beta + m.gamma) + s / n * m.gamma + _fold(m, s, n),
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


TREES = {("broadcast", "binomial"), ("reduce", "binomial")}
"""The algorithms in which only some ranks work at a time (the others wait for their parent or child)."""


def busy_fraction(collective: str, algo: str, n: int) -> float:
    """The mean fraction of the n ranks working at once: 1, or 2(n−1)/(n·⌈log2 n⌉) for a binomial tree."""
    if (collective, algo) not in TREES or n < 2:
        return 1.0
    return 2 * (n - 1) / (n * _log2(n))


def predict(model: CostModel, collective: str, algo: str, nbytes: int, size: int) -> float:
    """Predicted seconds for one call (its formula, slowed down where ranks share cores)."""
    time = FORMULAS[collective][algo](model, float(nbytes), size)
    if model.ranks_per_core > 1:
        time *= max(1.0, model.ranks_per_core * busy_fraction(collective, algo, size))
    return time


def choose(model: CostModel, collective: str, nbytes: int, size: int) -> str:
    """The algorithm with the smallest predicted time; near-ties (rounding) go to the first listed."""
    costs = {algo: predict(model, collective, algo, nbytes, size) for algo in FORMULAS[collective]}
    best = min(costs.values())
    return next(algo for algo, cost in costs.items() if cost <= best * (1 + 1e-9))


# -- measured constants -------------------------------------------------------------------------------------

_STORED = ("alpha", "beta", "gamma")  # ranks_per_core belongs to the job, not the machine


def calibration_path() -> Path:
    default = Path.home() / ".cache" / "mpiparallel" / "calibration.json"
    return Path(os.environ.get("MPIPARALLEL_CALIBRATION", default))


def load_calibration(size: int, path: Path | None = None) -> CostModel:
    """The model stored for `size` ranks (or the nearest stored rank count); defaults if none is stored."""
    path = path or calibration_path()
    try:
        stored = json.loads(path.read_text())
        nearest = min(stored, key=lambda key: abs(int(key) - size))
        return CostModel(**{key: float(stored[nearest][key]) for key in _STORED})
    except (OSError, ValueError, TypeError, KeyError):
        return CostModel()


def save_calibration(model: CostModel, size: int, path: Path | None = None) -> Path:
    path = path or calibration_path()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[str(size)] = {key: asdict(model)[key] for key in _STORED}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    return path


def auto_algorithm(comm: Communicator, collective: str, nbytes: int) -> str:
    """The algorithm algo="auto" runs for this call; decided once per (collective, size) per communicator."""
    key = (collective, nbytes)
    choice = comm.auto_choices.get(key)
    if choice is None:
        choice = comm.auto_choices[key] = choose(model_for(comm), collective, nbytes, comm.size)
    return choice


def ranks_per_core(comm: Communicator) -> float:
    """Ranks of `comm` on this rank's node per core of the node (collective: every rank of comm calls it)."""
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
        values = np.zeros(4)
        if comm.rank == 0:
            loaded = load_calibration(comm.size)
            values[:] = (loaded.alpha, loaded.beta, loaded.gamma, sharing)
        comm.comm.Bcast(values, root=0)
        comm.cost_model = CostModel(*values.tolist())
    return comm.cost_model


def _time_exchanges(comm: Communicator, nbytes: int, repeats: int) -> float:
    """Seconds per exchange of `nbytes` between rank pairs (0↔1, 2↔3, …), the median of several rounds."""
    buf, arrived = np.ones(max(nbytes // 8, 1)), np.empty(max(nbytes // 8, 1))
    partner = comm.rank ^ 1
    if partner >= comm.size:
        partner = comm.rank  # an odd rank count leaves the last rank talking to itself
    samples = []
    for _ in range(5):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            comm.sendrecv(buf, partner, arrived, partner)  # through this package: α includes its per-step cost
        samples.append((time.perf_counter() - start) / repeats)
    return float(np.median(samples))


def calibrate(comm: Communicator) -> CostModel:
    """Measure α, β, γ on this machine with this many ranks; every rank returns rank 0's figures.

    Every rank is busy during the measurement, which the model counts as slowed down by the ranks per core k:
    the constants kept are the measured ones / k (those of a rank with a core to itself).
    """
    large = 1 << 20
    alpha = _time_exchanges(comm, 8, 2000)
    beta = max(_time_exchanges(comm, large, 50) - alpha, 1e-9) / large
    a, b = np.ones(large // 8), np.ones(large // 8)
    start = time.perf_counter()
    for _ in range(50):
        np.add(a, b, out=a)
    gamma = (time.perf_counter() - start) / 50 / large
    sharing = ranks_per_core(comm)
    slowdown = max(sharing, 1.0)  # what the model applies to an all-busy algorithm such as this measurement
    values = np.array([alpha / slowdown, beta / slowdown, gamma / slowdown, sharing])
    comm.comm.Bcast(values, root=0)
    comm.cost_model = CostModel(*values.tolist())
    comm.auto_choices.clear()
    comm.call_plans.clear()
    return comm.cost_model
