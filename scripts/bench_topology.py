"""Hierarchical against flat collectives on emulated nodes with an emulated slow inter-node link: the two-tier cost
model's predictions beside the measured times, and what algo="auto" picks.

    python scripts/bench_topology.py                                   # 4 ranks as 2 nodes of 2
    python scripts/bench_topology.py --ranks 8 --ranks-per-node 4 --latency 100e-6 --bandwidth 2e9 --json out.json

One machine has one tier of links, so the script makes a second one (`collectives.topology`): the MPI job runs
with MPIPARALLEL_RANKS_PER_NODE=k (every k consecutive ranks a node) and MPIPARALLEL_EMULATED_INTER_NODE=
"latency,bandwidth", which makes every message to another node wait latency + bytes / bandwidth (a sleep on the
sender) before it leaves. That setting exists for benchmarks only; nothing sets it by default.

The job first calibrates the cost model in place (`cost_model.calibrate`: α and β between ranks of one node, and
between ranks of two nodes, delay included; γ), then times all_reduce, reduce_scatter and all_gather with every
algorithm "auto" may choose from (the flat ones and hierarchical) at each size: float32, out of place, each
call timed alone after a barrier, a loop's figure the median call of the slowest rank, the algorithms of one size
timed one after another in each of --rounds rounds (the order rotating), each keeping its best round. Rank 0
prints, per collective and size, the predicted and measured microseconds of every algorithm, auto's choice, the
measured fastest, and auto's time over the fastest's. The machine is shared: read the figures as noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def parse_bytes(text: str) -> int:
    """'8M' → 8388608 (K, M, G suffixes, powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--latency", type=float, default=200e-6, help="seconds per inter-node message")
    parser.add_argument("--bandwidth", type=float, default=1e9, help="inter-node bytes per second")
    parser.add_argument("--sizes", default="64,4K,64K,1M,8M", help="comma-separated collective sizes in bytes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    if args.worker is not None:
        return worker(args.worker, sizes, args.rounds)
    with tempfile.TemporaryDirectory(prefix="bench-topology-") as scratch:
        results = Path(scratch) / "results.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "MPIPARALLEL_RANKS_PER_NODE": str(args.ranks_per_node),
               "MPIPARALLEL_EMULATED_INTER_NODE": f"{args.latency},{args.bandwidth}",
               "MPIPARALLEL_CALIBRATION": str(Path(scratch) / "calibration.json")}  # never the user's file
        mpiexec = Path(sys.executable).parent / "mpiexec"
        command = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.ranks), sys.executable,
                   __file__, "--worker", str(results), "--sizes", args.sizes, "--rounds", str(args.rounds)]
        subprocess.run(command, env=env, check=True, timeout=3000)
        report = json.loads(results.read_text())
    report["settings"] = {"ranks": args.ranks, "ranks_per_node": args.ranks_per_node, "latency_s": args.latency,
                          "bandwidth_Bps": args.bandwidth}
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


# -- the MPI job --------------------------------------------------------------------------------------------

def worker(results: Path, sizes: list[int], rounds: int) -> int:
    import numpy as np
    from mpi4py import MPI

    import collectives as C
    from collectives import Communicator
    from collectives.cost_model import auto_algorithm, calibrate, candidates, predict

    comm = Communicator(MPI.COMM_WORLD)
    model = calibrate(comm)
    nodes = comm.topology.count
    calls = {"all_reduce": C.all_reduce, "reduce_scatter": C.reduce_scatter, "all_gather": C.all_gather}
    rows = []
    for collective in COLLECTIVES:
        algorithms = candidates(collective, nodes)
        for nbytes in sizes:
            count = max(nbytes // 4 // comm.size, 1) * comm.size  # whole elements per rank block
            x = np.ones(count // comm.size if collective == "all_gather" else count, np.float32)
            size = count * 4
            best = {algo: float("inf") for algo in algorithms}
            for round_index in range(rounds):
                order = algorithms[round_index % len(algorithms):] + algorithms[:round_index % len(algorithms)]
                for algo in order:
                    best[algo] = min(best[algo], _time(calls[collective], x, comm, algo, size))
            rows.append({"collective": collective, "bytes": size, "auto": auto_algorithm(comm, collective, size),
                         "measured_us": {a: t * 1e6 for a, t in best.items()},
                         "predicted_us": {a: predict(model, collective, a, size, comm.size, nodes) * 1e6
                                          for a in algorithms}})
    if comm.rank == 0:
        across = model.across()
        results.write_text(json.dumps({
            "model": {"alpha_us": model.alpha * 1e6, "beta_GBps": 1 / model.beta / 1e9,
                      "gamma_GBps": 1 / model.gamma / 1e9, "alpha_inter_us": across.alpha * 1e6,
                      "beta_inter_GBps": 1 / across.beta / 1e9, "ranks_per_core": model.ranks_per_core},
            "nodes": list(comm.nodes), "rows": rows}))
    return 0


def _time(call, x, comm, algo: str, nbytes: int) -> float:
    """Seconds of one call: the median over calls (as many as fit in about 0.3 s, 3 to 50) of the slowest rank."""
    import numpy as np

    call(x, comm, algo=algo)  # warm up: plans, scratch buffers
    start = time.perf_counter()
    call(x, comm, algo=algo)
    first = comm.comm.allreduce(time.perf_counter() - start, op=max_op())
    repeats = int(min(50, max(3, 0.3 / max(first, 1e-6))))
    samples = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        call(x, comm, algo=algo)
        samples.append(time.perf_counter() - start)
    return float(comm.comm.allreduce(float(np.median(samples)), op=max_op()))


def max_op():
    from mpi4py import MPI

    return MPI.MAX


# -- the table ----------------------------------------------------------------------------------------------

def print_report(report: dict) -> None:
    s = report["settings"]
    print(f"# {s['ranks']} ranks as nodes of {s['ranks_per_node']} (nodes {report['nodes']}); emulated inter-node "
          f"link: {s['latency_s'] * 1e6:.0f} us + bytes / {s['bandwidth_Bps'] / 1e9:.2f} GB/s per message")
    print_rows(report)


def print_rows(report: dict) -> None:
    """The calibrated model and, per collective and size, predicted / measured per algorithm and auto's pick."""
    m = report["model"]
    print(f"# calibrated: inside alpha {m['alpha_us']:.1f} us, beta {m['beta_GBps']:.2f} GB/s; across alpha "
          f"{m['alpha_inter_us']:.1f} us, beta {m['beta_inter_GBps']:.2f} GB/s; gamma {m['gamma_GBps']:.2f} GB/s; "
          f"ranks per core {m['ranks_per_core']:.1f}")
    print("# per algorithm: predicted / measured us;  auto: the model's pick;  fastest: measured;  "
          "auto/best = fastest's time / auto's (1.00: auto picked the fastest)")
    for row in report["rows"]:
        measured, predicted = row["measured_us"], row["predicted_us"]
        fastest = min(measured, key=measured.get)
        cells = "  ".join(f"{algo} {predicted[algo]:>8.0f} / {measured[algo]:>8.0f}" for algo in measured)
        ratio = measured[fastest] / measured[row["auto"]]
        print(f"{row['collective']:<15} {row['bytes']:>9} B  {cells}  | auto {row['auto']:<18} fastest "
              f"{fastest:<18} auto/best {ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
