"""Context-parallel attention measured: per-rank time under the zigzag layout against a contiguous split, and the
three variants' time and bytes side by side at a long sequence.

    python scripts/bench_context_parallel.py --cp 2 --seq 2048
    python scripts/bench_context_parallel.py --cp 4 --seq 2048 --reps 3

Starts `--cp` ranks under mpiexec (one BLAS thread each). Every rank builds the same attention layer (fused qkv
and projection of n_embd channels) and times forward + backward of its share of a (batch, seq) sequence, median of
`--reps` after one warmup. Balance: ring attention with the zigzag layout (rank r holds chunks r and 2cp−1−r) and
with a contiguous split (chunks 2r and 2r+1) — with causal masking the contiguous split gives the last rank far
more key blocks; the table shows each rank's time and the slowest over the fastest. Variants: ring, all-gather
and Ulysses, each rank's time and the bytes its CP communicator sent per layer (the ledger), beside one rank
running serial causal attention on the whole sequence.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RINGS: dict = {}


def mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else "mpiexec"


def build(kind: str, comm, args):
    """The attention layer `kind` with weights that are the same on every rank."""
    import numpy as np

    from models.layers import CausalSelfAttention, Linear
    from models.parameter import Parameter
    from mpiparallel.axes.context_parallel import attention as cp

    rng = np.random.default_rng(0)
    channels = args.embd

    def linear(name: str, n_in: int, n_out: int) -> Linear:
        return Linear(Parameter(f"{name}.weight", rng.standard_normal((n_in, n_out)).astype(np.float32) * 0.02),
                      Parameter(f"{name}.bias", np.zeros(n_out, np.float32)))

    qkv, projection = linear("c_attn", channels, 3 * channels), linear("c_proj", channels, channels)
    if kind == "serial":
        return CausalSelfAttention(qkv, projection, args.heads)
    if kind in RINGS:
        return RINGS[kind](qkv, projection, args.heads, comm)
    return cp.context_parallel_attention(kind if kind != "zigzag" else "ring", qkv, projection, args.heads, comm)


def ring_classes():
    """Ring attention that clocks its attention work (the time between the K/V blocks the ring hands it, waits
    excluded), with the zigzag layout and with a contiguous split (rank r holding chunks 2r and 2r+1)."""
    from mpiparallel.axes.context_parallel.attention import RingAttention, causal_chunk_pairs

    class ClockedRing(RingAttention):
        compute = 0.0

        def _key_value_blocks(self, kv):
            for item in super()._key_value_blocks(kv):
                start = time.perf_counter()
                yield item
                self.compute += time.perf_counter() - start

        def _key_value_blocks_backward(self, kv, dkv):
            for item in super()._key_value_blocks_backward(kv, dkv):
                start = time.perf_counter()
                yield item
                self.compute += time.perf_counter() - start

    class ContiguousRing(ClockedRing):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.chunks = (2 * self.comm.rank, 2 * self.comm.rank + 1)

        def _pairs(self, source: int) -> list[tuple[int, int, bool]]:
            return causal_chunk_pairs(self.chunks, (2 * source, 2 * source + 1))

    return ClockedRing, ContiguousRing


def time_layer(layer, local, comm, reps: int) -> tuple[float, int, float]:
    """Median seconds of forward + backward on this rank, the bytes sent on `comm` in one of them, and the
    median attention work of a clocked ring layer (0 otherwise)."""
    import numpy as np

    dout = np.random.default_rng(1).standard_normal(local.shape).astype(np.float32)
    times, work, sent = [], [], 0
    for rep in range(reps + 1):
        comm.barrier()
        before = comm.ledger.total_sent()
        layer.compute = 0.0
        start = time.perf_counter()
        out, saved = layer.forward(local)
        layer.backward(saved, dout)
        elapsed = time.perf_counter() - start
        sent = comm.ledger.total_sent() - before
        if rep:
            times.append(elapsed)
            work.append(layer.compute)
    return statistics.median(times), sent, statistics.median(work)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    from collectives import Communicator
    from mpiparallel.axes.context_parallel.attention import zigzag_shard

    RINGS["zigzag"], RINGS["contiguous"] = ring_classes()
    comm = Communicator(MPI.COMM_WORLD)
    cp, rank = comm.size, comm.rank
    full = np.random.default_rng(2).standard_normal((args.batch, args.seq, args.embd)).astype(np.float32)
    chunk = args.seq // (2 * cp)
    rows = {}
    for kind in ("zigzag", "contiguous", "all-gather", "ulysses"):
        contiguous = full[:, 2 * rank * chunk:(2 * rank + 2) * chunk]
        local = contiguous if kind == "contiguous" else zigzag_shard(full, rank, cp)
        rows[kind] = comm.comm.gather(time_layer(build(kind, comm, args), np.ascontiguousarray(local), comm,
                                                 args.reps), root=0)
    serial = None
    if rank == 0:
        self_comm = Communicator(MPI.COMM_SELF)
        serial = time_layer(build("serial", self_comm, args), full, self_comm, args.reps)[0]
    if rank == 0:
        report(args, cp, rows, serial)


def report(args, cp: int, rows: dict, serial: float) -> None:
    print(f"attention forward + backward, B={args.batch}, T={args.seq}, C={args.embd}, {args.heads} heads, float32, "
          f"cp {cp}, one thread per rank; medians of {args.reps}")
    print("\nbalance (ring attention): attention work per rank, ms (waiting for K/V blocks excluded)")
    for kind in ("zigzag", "contiguous"):
        times = [work for _, _, work in rows[kind]]
        print(f"  {kind:10s} " + " ".join(f"{t * 1e3:8.1f}" for t in times) +
              f"   slowest/fastest {max(times) / min(times):5.2f}")
    print(f"\nvariants (serial attention on one rank, whole sequence: {serial * 1e3:.1f} ms)")
    print(f"  {'variant':10s} {'slowest rank ms':>16s} {'bytes sent per rank':>20s} {'vs serial':>10s}")
    for kind, name in (("zigzag", "ring"), ("all-gather", "all-gather"), ("ulysses", "ulysses")):
        slowest = max(t for t, _, _ in rows[kind])
        sent = max(b for _, b, _ in rows[kind])
        print(f"  {name:10s} {slowest * 1e3:16.1f} {sent:20,d} {serial / slowest:9.2f}×")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [mpiexec(), "-n", str(args.cp), sys.executable, __file__, *sys.argv[1:], "--worker"]
    sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
