"""Mixture of experts measured: an MoE block against a dense MLP of the same active FLOPs, and expert parallelism's
dispatch and combine (time and bytes) at ep = 2 and 4.

    python scripts/bench_moe.py                       # E=8, top-2, 2048 tokens of 256 channels
    python scripts/bench_moe.py --experts 8 --top-k 1 --ep 2 4

One BLAS thread per rank. Dense vs MoE (one process): forward + backward of `MixtureOfExperts` with E GPT-2 MLP
experts and top-K routing, beside one GPT-2 MLP K times as wide (the FLOPs a token's K experts do); the ratio is
the MoE overhead (routing, permutation, one GEMM per expert instead of one). Expert parallelism (under mpiexec,
ep ranks, each with its own tokens): the same layer with E/ep experts per rank; the time spent in dispatch and
combine (forward and backward, all-to-allv) and the bytes its EP communicator sent, per rank and step.
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


def mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else "mpiexec"


def mlp(rng, name: str, channels: int, hidden: int):
    import numpy as np

    from models.layers import MLP, Linear
    from models.parameter import Parameter

    def linear(part: str, n_in: int, n_out: int) -> Linear:
        weight = (rng.standard_normal((n_in, n_out)) * 0.02).astype(np.float32)
        return Linear(Parameter(f"{name}.{part}.weight", weight), Parameter(f"{name}.{part}.bias",
                                                                             np.zeros(n_out, np.float32)))

    return MLP(linear("c_fc", channels, hidden), linear("c_proj", hidden, channels))


def moe_layer(args, ep_comm=None):
    import numpy as np

    from models.moe import MixtureOfExperts, Router
    from models.parameter import Parameter
    from mpiparallel.axes.expert_parallel import exchange_over, local_experts

    rng = np.random.default_rng(0)
    router = Router(Parameter("router.weight", (rng.standard_normal((args.embd, args.experts)) * 0.02)
                              .astype(np.float32)), args.top_k)
    experts = [mlp(rng, f"experts.{e}", args.embd, 4 * args.embd) for e in range(args.experts)]
    if ep_comm is not None:
        experts = [experts[e] for e in local_experts(args.experts, ep_comm.rank, ep_comm.size)]
    return MixtureOfExperts(router, experts, None if ep_comm is None else exchange_over(ep_comm))


def timed(layer, x, reps: int, before=None) -> float:
    import numpy as np

    dout = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    times = []
    for rep in range(reps + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        layer.backward(layer.forward(x)[1], dout)
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def dense_against_moe(args) -> None:
    import numpy as np

    x = np.random.default_rng(2).standard_normal((1, args.tokens, args.embd)).astype(np.float32)
    dense = mlp(np.random.default_rng(3), "dense", args.embd, 4 * args.embd * args.top_k)
    moe_time, dense_time = timed(moe_layer(args), x, args.reps), timed(dense, x, args.reps)
    print(f"{args.tokens} tokens × {args.embd} channels, float32, one thread; forward + backward, medians of "
          f"{args.reps}")
    print(f"  MoE, {args.experts} experts, top-{args.top_k}:       {moe_time * 1e3:8.1f} ms")
    print(f"  dense MLP {args.top_k}× as wide (same FLOPs): {dense_time * 1e3:8.1f} ms   MoE / dense "
          f"{moe_time / dense_time:.2f}")


def expert_parallel_worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    import mpiparallel.axes.expert_parallel as moe
    from collectives import Communicator

    comm = Communicator(MPI.COMM_WORLD)
    spent = {"seconds": 0.0}

    def clocked(function):
        def run(*arguments, **options):
            start = time.perf_counter()
            try:
                return function(*arguments, **options)
            finally:
                spent["seconds"] += time.perf_counter() - start
        return run

    for name in ("dispatch_to_experts", "combine_from_experts"):  # their backward twins call these two
        setattr(moe, name, clocked(getattr(moe, name)))
    x = np.random.default_rng(10 + comm.rank).standard_normal((1, args.tokens // comm.size, args.embd))
    layer = moe_layer(args, comm)
    sent_before = comm.ledger.total_sent()
    spent["seconds"] = 0.0
    total = timed(layer, x.astype(np.float32), args.reps, before=comm.barrier)
    exchange = spent["seconds"] / (args.reps + 1)
    sent = (comm.ledger.total_sent() - sent_before) / (args.reps + 1)
    rows = comm.comm.gather((total, exchange, sent), root=0)
    if comm.rank == 0:
        print(f"  ep {comm.size}: {args.tokens // comm.size} tokens per rank; MoE forward + backward "
              f"{max(r[0] for r in rows) * 1e3:7.1f} ms (slowest rank), dispatch + combine "
              f"{max(r[1] for r in rows) * 1e3:6.1f} ms, {max(r[2] for r in rows) / 2**20:6.2f} MiB sent per rank")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step, all ranks together")
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ep", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        expert_parallel_worker(args)
        return
    os.environ.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    sys.path.insert(0, str(ROOT))
    dense_against_moe(args)
    print("expert parallelism (the same global batch split over the EP ranks):")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for ep in args.ep:
        options = ["--experts", str(args.experts), "--top-k", str(args.top_k), "--tokens", str(args.tokens),
                   "--embd", str(args.embd), "--reps", str(args.reps)]
        subprocess.run([mpiexec(), "-n", str(ep), sys.executable, __file__, *options, "--worker"], env=env,
                       check=True)


if __name__ == "__main__":
    main()
