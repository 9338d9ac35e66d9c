"""Our collectives against the MPI library's own, and algo="auto" against the best hand-written algorithm.

    python scripts/bench_collectives.py                          # 2 and 4 ranks, 8 B – 64 MiB, 7 rounds
    python scripts/bench_collectives.py --ranks 2 --maxbytes 4K --rounds 3 --json results.json

For each rank count this starts one MPI job (mpiexec -n N this script --worker) that runs every collective
(all_reduce, reduce_scatter, all_gather, alltoall, broadcast, reduce) at every size from --minbytes to
--maxbytes (×4 per step, and --maxbytes itself), out of place, in float32 with op=sum and root 0, through the
calls of `mpiparallel bench` (mpiparallel/commands/bench.py): sizes in nccl-tests' convention (rounded down to
whole elements per rank; a size with fewer elements than ranks is left out, "-"), preallocated buffers, each
each loop started after a barrier and timed call by call: a loop's figure is the median call, the slowest
rank's (a call during which another process held the core does not count). The variants of one size — ours
with algo="auto", the MPI library's collective (straight mpi4py), and every hand-written algorithm — are timed
one after the other in each of --rounds rounds (the order rotating from round to round), so that load from
other processes hits all of them alike; each variant keeps its best round.

The tables (rank 0 of each job writes JSON; this process prints):

- time (µs) of ours (algo=auto) and of MPI, for the small sizes (≤ 4 KiB);
- where our time goes on the smallest size: the steps of one call of auto's algorithm are recorded on every
  rank and their MPI calls replayed alone (Sendrecv, Send, Recv, as Communicator.run makes them), timed like
  the rest; ours − that is the Python around them and the local work (reductions, copies);
- vs-mpi = MPI's time / ours at every size: above 1 ours is faster. For the same bytes this is also our busbw
  over MPI's busbw, so it is the latency ratio at small sizes and the bandwidth ratio at large ones;
- auto vs best: the fastest hand-written algorithm's time / the time of the one auto picks, each timed with
  algo= its name (1.00 when auto picked the fastest; below 0.90 auto's choice is more than 10 % off), and the
  two algorithms where they differ;
- the issue's goals (≤ 4 KiB: vs-mpi ≥ 1/1.5; ≥ 1 MiB: vs-mpi ≥ 1.0, all_reduce ≥ 1.2; auto ≥ 0.9 of best)
  checked against the measured figures. Timings on a shared machine are noisy: read them as such.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "alltoall", "broadcast", "reduce")
SMALL_BYTES = 4 << 10   # the latency goal holds up to here
LARGE_BYTES = 1 << 20   # the bandwidth goal holds from here
GOALS = {"small": 1 / 1.5, "large": 1.0, "large all_reduce": 1.2, "auto": 0.9}


# -- the parent: one MPI job per rank count, then the tables ------------------------------------------------

def parse_bytes(text: str) -> int:
    """'64M' → 67108864 (K, M, G suffixes, powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def sizes(minbytes: int, maxbytes: int, factor: int = 4) -> list[int]:
    """minbytes, ×factor while ≤ maxbytes, and maxbytes itself."""
    found, size = [], minbytes
    while size < maxbytes:
        found.append(size)
        size *= factor
    return [*found, maxbytes]


def mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else "mpiexec"


def run_job(ranks: int, args: argparse.Namespace) -> dict:
    """Run the worker on `ranks` ranks and return its results (rank 0's JSON)."""
    with tempfile.TemporaryDirectory(prefix="bench-collectives-") as directory:
        path = Path(directory) / "results.json"
        command = [mpiexec(), "-n", str(ranks), sys.executable, __file__, "--worker", str(path),
                   "--minbytes", str(args.minbytes), "--maxbytes", str(args.maxbytes),
                   "--rounds", str(args.rounds), "--target-ms", str(args.target_ms),
                   "--collectives", *args.collectives]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                 os.environ.get("PYTHONPATH")])),
                       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        subprocess.run(command, check=True, timeout=args.timeout, env=environment)
        return json.loads(path.read_text())


def human(nbytes: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def table(title: str, results: list[dict], shown: list[int], cell) -> list[str]:
    """One row per (ranks, collective), one column per size; `cell(entry)` formats one measurement."""
    if not shown:
        return []
    rows = []
    for job in results:
        for name in job["collectives"]:
            entries = {e["size"]: e for e in job["measurements"] if e["collective"] == name}
            rows.append((job["ranks"], name, [cell(entries[s]) if s in entries else "-" for s in shown]))
    width = max(len(c) for *_, cells in rows for c in cells) + 2
    lines = [f"## {title}", f"{'ranks':>5}  {'collective':<15}" + "".join(f"{human(s):>{width}}" for s in shown)]
    lines += [f"{ranks:>5}  {name:<15}" + "".join(f"{c:>{width}}" for c in cells) for ranks, name, cells in rows]
    return [*lines, ""]


def vs_mpi(entry: dict) -> float:
    return entry["mpi_us"] / entry["auto_us"]


def auto_vs_best(entry: dict) -> float:
    """The best algorithm's time over the time of the one auto picks, both timed with algo= that algorithm."""
    return min(entry["algorithms"].values()) / entry["algorithms"][entry["auto_algorithm"]]


def best_algorithm(entry: dict) -> str:
    return min(entry["algorithms"], key=entry["algorithms"].get)


def goal_lines(results: list[dict]) -> list[str]:
    """Each goal: the worst measured figure and where it occurs."""
    checks = {
        "<= 4 KiB, vs-mpi >= 0.67": (lambda e: e["size"] <= SMALL_BYTES, vs_mpi, GOALS["small"]),
        ">= 1 MiB, vs-mpi >= 1.0 (all_reduce 1.2)": (lambda e: e["size"] >= LARGE_BYTES,
                                                     lambda e: vs_mpi(e) / (1.2 if e["collective"] == "all_reduce"
                                                                            else 1.0), 1.0),
        "auto within 10 % of best": (lambda e: True, auto_vs_best, GOALS["auto"]),
    }
    lines = ["## goals (worst case; for the bandwidth goal all_reduce's ratio is divided by 1.2)"]
    for label, (where, figure, goal) in checks.items():
        found = [(figure(e), job["ranks"], e["collective"], e["size"])
                 for job in results for e in job["measurements"] if where(e)]
        if not found:
            continue
        worst = min(found)
        short = sum(value < goal for value, *_ in found)
        lines.append(f"{label:<42} worst {worst[0]:.2f} ({worst[2]}, {human(worst[3])} B, {worst[1]} ranks); "
                     f"{short} of {len(found)} cells below the goal")
    return [*lines, ""]


def floor_lines(results: list[dict]) -> list[str]:
    """Where our time goes on the smallest message: the MPI calls of its steps, and the rest."""
    lines = ["## where our time goes on the smallest size (us): its steps' MPI calls replayed alone, and the rest "
             "(Python and local work)",
             f"{'ranks':>5}  {'collective':<15}{'size':>6}{'algorithm':>20}{'steps':>6}{'ours':>8}"
             f"{'its MPI calls':>15}{'rest':>8}{'MPI':>8}"]
    for job in results:
        for name in job["collectives"]:
            entries = [e for e in job["measurements"] if e["collective"] == name and "steps" in e]
            if entries:
                e = min(entries, key=lambda entry: entry["size"])
                lines.append(f"{job['ranks']:>5}  {name:<15}{human(e['size']):>6}{e['auto_algorithm']:>20}"
                             f"{e['steps']:>6}{e['auto_us']:>8.1f}{e['steps_us']:>15.1f}"
                             f"{e['auto_us'] - e['steps_us']:>8.1f}{e['mpi_us']:>8.1f}")
    return [*lines, ""]


def report(results: list[dict]) -> list[str]:
    every_size = sorted({e["size"] for job in results for e in job["measurements"]})
    small = [s for s in every_size if s <= SMALL_BYTES]
    lines = [f"# bench_collectives: MPI {results[0]['mpi_library']}, float32, op=sum, root 0, out of place; "
             f"best of {results[0]['rounds']} rounds", ""]
    if small:
        lines += table("time (us) ours (algo=auto) / MPI, small sizes", results, small,
                       lambda e: f"{e['auto_us']:.1f}/{e['mpi_us']:.1f}")
    if small:
        lines += floor_lines(results)
    lines += table("vs-mpi = MPI time / ours (= our busbw / MPI busbw); above 1 ours is faster", results,
                   every_size, lambda e: f"{vs_mpi(e):.2f}")
    lines += table("our busbw (GB/s, algo=auto) / MPI busbw, sizes >= 1 MiB", results,
                   [s for s in every_size if s >= LARGE_BYTES],
                   lambda e: f"{e['auto_busbw']:.1f}/{e['mpi_busbw']:.1f}")
    lines += table("auto vs best = best hand-written time / auto's time (1.00: auto ran the best)", results,
                   every_size, lambda e: f"{auto_vs_best(e):.2f}")
    lines += ["## auto's choice where another algorithm was faster by more than 10 %"]
    for job in results:
        for e in job["measurements"]:
            if auto_vs_best(e) < GOALS["auto"]:
                lines.append(f"{job['ranks']} ranks {e['collective']:<15}{human(e['size']):>6} B: auto ran "
                             f"{e['auto_algorithm']} ({e['algorithms'][e['auto_algorithm']]:.1f} us), best "
                             f"{best_algorithm(e)} ({min(e['algorithms'].values()):.1f} us)")
    return [*lines, "", *goal_lines(results)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--minbytes", type=parse_bytes, default=8)
    parser.add_argument("--maxbytes", type=parse_bytes, default=64 << 20)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per variant; the best one counts")
    parser.add_argument("--target-ms", type=float, default=1.5, help="length of one timed loop")
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES)
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a job counts as hung")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set when started under mpiexec
    args = parser.parse_args()
    if args.worker is not None:
        run_worker(args)
        return
    results = [run_job(ranks, args) for ranks in args.ranks]
    print("\n".join(report(results)))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


# -- the worker: every rank of one MPI job ------------------------------------------------------------------

def run_worker(args: argparse.Namespace) -> None:
    import numpy as np

    import collectives
    from mpiparallel.commands import bench

    comm = collectives.world()
    measurements = []
    for name in args.collectives:
        collective = bench.COLLECTIVES[name]
        for nbytes in sizes(args.minbytes, args.maxbytes):
            buffers = bench.allocate(collective, nbytes, comm.size, np.dtype("float32"))
            if buffers.size == 0:
                continue  # fewer elements than ranks: no block to send
            measurements.append({"size": nbytes, **measure_size(collective, buffers, comm, args)})
    if comm.rank == 0:
        document = {"ranks": comm.size, "mpi_library": bench.mpi_library(), "rounds": args.rounds,
                    "collectives": args.collectives, "measurements": measurements}
        args.worker.write_text(json.dumps(document))


def measure_size(collective, buffers, comm, args: argparse.Namespace) -> dict:
    """Every variant of one collective and size, alternated over the rounds; the best round of each."""
    from mpi4py import MPI

    from mpiparallel.commands import bench

    bench.fill_input(buffers.x, comm.rank, comm.size, bench.value_pattern(collective, bench.BenchSettings(None)))
    variants = {"auto": _ours(collective, buffers, comm, "auto"), "mpi": _native(collective, buffers, comm)}
    for algo in collectives_algorithms(collective.api_name):
        variants[algo] = _ours(collective, buffers, comm, algo)
    iters = _iterations(variants["auto"], comm, args.target_ms)
    best = dict.fromkeys(variants, math.inf)
    order = list(variants)
    for round_ in range(args.rounds):
        for name in order[round_ % len(order):] + order[:round_ % len(order)]:
            best[name] = min(best[name], median_call_seconds(variants[name], comm, iters))
    factor = collective.bus_factor(comm.size)
    settings = bench.BenchSettings(collective.name)
    floor = {}
    if buffers.size <= SMALL_BYTES:
        steps = recorded_steps(variants["auto"], comm)
        floor = {"steps": comm.comm.allreduce(len(steps), op=MPI.MAX),
                 "steps_us": median_call_seconds(lambda: replay(steps, comm), comm, iters) * 1e6}
    return {**floor,
        "collective": collective.name, "bytes": buffers.size, "iters": iters,
        "auto_algorithm": bench.algorithm_used(collective, comm, settings, buffers.size),
        "auto_us": best["auto"] * 1e6, "mpi_us": best["mpi"] * 1e6,
        "auto_busbw": buffers.size / best["auto"] / 1e9 * factor,
        "mpi_busbw": buffers.size / best["mpi"] / 1e9 * factor,
        "algorithms": {algo: best[algo] * 1e6 for algo in collectives_algorithms(collective.api_name)},
    }


def median_call_seconds(call, comm, iters: int) -> float:
    """The median duration of `iters` calls after one warm-up call and a barrier, the slowest rank's.

    Each call is timed on its own: on a shared machine a call during which another process held the core
    takes many times longer, and the median leaves such calls out where a mean would not.
    """
    import time

    from mpi4py import MPI

    call()
    comm.barrier()
    durations = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        durations.append(time.perf_counter() - start)
    durations.sort()
    return comm.comm.allreduce(durations[len(durations) // 2], op=MPI.MAX)


def recorded_steps(call, comm) -> list:
    """The steps one call of ours runs on this rank, collected instead of sent (no MPI call is made)."""
    steps = []
    comm.run = lambda generator, name: steps.extend(generator)  # shadows Communicator.run for one call
    try:
        call()
    finally:
        del comm.run
    return steps


def replay(steps: list, comm) -> None:
    """The MPI calls of recorded steps alone, as Communicator.run makes them: our algorithm without its Python."""
    from mpi4py import MPI

    mpi, byte = comm.comm, MPI.BYTE
    for step in steps:
        if step.send is not None and step.recv is not None:
            mpi.Sendrecv([step.send, byte], step.dest, 0, [step.recv, byte], step.source, 0)
        elif step.send is not None:
            mpi.Send([step.send, byte], step.dest, 0)
        elif step.recv is not None:
            mpi.Recv([step.recv, byte], step.source, 0)


def collectives_algorithms(api_name: str) -> list[str]:
    import collectives

    return [algo for algo in collectives.ALGORITHMS[api_name] if algo != "mpi"]


def _ours(collective, buffers, comm, algo: str):
    from mpiparallel.commands.bench import BenchSettings

    settings = BenchSettings(collective.name, algo=algo)
    return lambda: collective.ours(buffers.x, buffers.out, comm, settings, False)


def _native(collective, buffers, comm):
    from mpiparallel.commands.bench import BenchSettings

    settings = BenchSettings(collective.name)
    return lambda: collective.native(buffers.x, buffers.out, comm, settings, False)


def _iterations(call, comm, target_ms: float) -> int:
    """Calls per timed loop: about `target_ms` of ours, the same on every rank, at least 3."""
    seconds = median_call_seconds(call, comm, 3)
    return int(min(1000, max(3, target_ms / 1e3 / seconds)))


if __name__ == "__main__":
    main()
