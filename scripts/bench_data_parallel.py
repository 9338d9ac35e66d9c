"""Data-parallel benchmark: weak scaling, exposed communication with and without overlap, ZeRO memory.

Runs `mpiparallel train` several times in one go and compares the runs side by side:

- weak scaling: one rank with B sequences per step (one BLAS thread) against n ranks with n·B (each rank one
  thread, its own B rows): efficiency = per-rank tokens/s of the n-rank run / tokens/s of the single rank;
- exposed communication: the n-rank step time minus the single-rank step time (same work per rank), with the
  gradient all-reduce overlapped with backward and with --no-overlap;
- memory: the bytes each rank holds in parameters + gradients + optimizer state under ZeRO 0-3
  (`--memory-report`), as a fraction of plain data parallelism.

    python scripts/bench_data_parallel.py --ranks 2 --steps 30
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def train(arguments: list[str], ranks: int, log: Path) -> list[dict]:
    command = [sys.executable, "-m", "mpiparallel", "train", *arguments, "--log-json", str(log)]
    if ranks > 1:
        command += ["-n", str(ranks)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return [json.loads(line) for line in log.read_text().splitlines()], result.stdout


def median_step_seconds(records: list[dict], warmup: int) -> float:
    return statistics.median(record["time_s"] for record in records[warmup:])


def model_states_mib(report: str) -> float:
    """Rank 0's 'model states … MiB held' line of --memory-report."""
    match = re.search(r"model states\s+([\d.]+) MiB held", report)
    if match is None:
        raise SystemExit(f"no memory report in:\n{report}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-per-rank", type=int, default=8)
    parser.add_argument("--model", default="--n-layer 4 --n-embd 256 --n-head 4 --seq-len 128",
                        help="model flags passed to mpiparallel train")
    options = parser.parse_args()
    n, b = options.ranks, options.batch_per_rank
    base = [*options.model.split(), "--steps", str(options.steps), "--threads", "1"]
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "log.jsonl"
        single, _ = train([*base, "--batch-size", str(b)], 1, log)
        overlapped, _ = train([*base, "--batch-size", str(n * b)], n, log)
        serialized, _ = train([*base, "--batch-size", str(n * b), "--no-overlap"], n, log)
        memory = {zero: model_states_mib(train([*base, "--batch-size", str(n * b), "--steps", "1", "--zero",
                                                str(zero), "--memory-report"], n, log)[1]) for zero in range(4)}
    t1 = median_step_seconds(single, options.warmup)
    tn = median_step_seconds(overlapped, options.warmup)
    tn_serial = median_step_seconds(serialized, options.warmup)
    tokens = single[-1]["tokens"]
    print(f"# data parallelism, {n} ranks, {b} sequences per rank per step, median of steps after {options.warmup}")
    print(f"single rank        : {t1 * 1e3:8.1f} ms/step  {tokens / t1:10,.0f} tok/s")
    print(f"{n} ranks, overlap   : {tn * 1e3:8.1f} ms/step  {tokens / tn:10,.0f} tok/s per rank  "
          f"weak-scaling efficiency {t1 / tn:6.1%}  exposed communication {max(tn - t1, 0) * 1e3:6.1f} ms")
    print(f"{n} ranks, no overlap: {tn_serial * 1e3:8.1f} ms/step  {tokens / tn_serial:10,.0f} tok/s per rank  "
          f"weak-scaling efficiency {t1 / tn_serial:6.1%}  exposed communication "
          f"{max(tn_serial - t1, 0) * 1e3:6.1f} ms")
    print(f"gradient bytes all-reduced per step per rank: {overlapped[-1]['comm_bytes']['dp']:,}")
    print("# parameters + gradients + optimizer state per rank (rank 0, measured from the arrays)")
    for zero, mib in memory.items():
        print(f"zero {zero}: {mib:8.2f} MiB  = {mib / memory[0]:6.1%} of plain DP  (1/{n} = {1 / n:.1%})")


if __name__ == "__main__":
    main()
