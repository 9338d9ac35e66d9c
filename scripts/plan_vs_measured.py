"""The planner's predictions against what `train` measures on this machine, run by run and rank by rank.

Calibrates the machine (`mpiparallel plan --calibrate -n 2`) right before every run, so that prediction and
measurement see the same load on a shared machine (or once, from --machine FILE), and trains a small Transformer for a
few steps on 1–4 ranks over several meshes and schedules with `--log-json` and `--memory-report`. Prints per
run the predicted and measured step time (median of the steps after the first) and per rank the predicted and
measured memory (parameters + gradients + optimizer state + activations, as the report counts them).
Targets: step time within 25 %, memory within 10 %.

    python scripts/plan_vs_measured.py [--machine FILE] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpiparallel.planner import Layout, Model, evaluate, load_machine, precision_with  # noqa: E402

MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 128, "vocab_size": 256}
BATCH = 16
RUNS = [  # (ranks, layout)
    (1, Layout()),
    (1, Layout(microbatches=2, recompute="full")),
    (2, Layout(dp=2)),
    (2, Layout(dp=2, zero=3)),
    (2, Layout(tp=2)),
    (2, Layout(tp=2, sp=True, recompute="selective")),
    (2, Layout(pp=2, microbatches=4, schedule="1f1b")),
    (2, Layout(pp=2, microbatches=4, schedule="zbv")),
    (4, Layout(dp=2, tp=2, zero=1)),
    (4, Layout(dp=2, pp=2, microbatches=2, schedule="gpipe")),
]
MEMORY_LINE = re.compile(r"^\s+(parameters|gradients|optimizer_state|activations)\s+([0-9.]+) MiB held")


def train_arguments(ranks: int, layout: Layout, log: Path, steps: int) -> list[str]:
    arguments = [sys.executable, "-m", "mpiparallel", "train", "-n", str(ranks), "--steps", str(steps),
                 "--batch-size", str(BATCH), "--optimizer", "adamw", "--dtype", "float32", "--memory-report",
                 "--log-json", str(log), "--dp", str(layout.dp), "--tp", str(layout.tp), "--pp", str(layout.pp),
                 "--zero", str(layout.zero), "--microbatches", str(layout.microbatches),
                 "--recompute", layout.recompute]
    for key, value in MODEL.items():
        arguments += [f"--{key.replace('_', '-')}", str(value)]
    if layout.pp > 1:
        arguments += ["--schedule", layout.schedule]
    if layout.sp:
        arguments.append("--sp")
    return arguments


def measure(ranks: int, layout: Layout, steps: int) -> tuple[float, dict[int, float]]:
    """Median step time after the first step, and each rank's reported bytes."""
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "log.jsonl"
        finished = subprocess.run(train_arguments(ranks, layout, log, steps), capture_output=True, text=True,
                                  timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if finished.returncode:
            raise RuntimeError(finished.stderr[-2000:])
        times = [json.loads(line)["time_s"] for line in log.read_text().splitlines()]
    memory: dict[int, float] = {}
    rank = None
    for line in finished.stdout.splitlines():
        if match := re.match(r"rank (\d+) \(", line):
            rank = int(match.group(1))
            memory[rank] = 0.0
        elif rank is not None and (match := MEMORY_LINE.match(line)):
            memory[rank] += float(match.group(2)) * 2**20
    return statistics.median(times[1:]), memory


def calibrate(machine: Path) -> None:
    subprocess.run([sys.executable, "-m", "mpiparallel", "plan", "--calibrate", "-n", "2", "--machine", str(machine),
                    "--n-embd", str(MODEL["n_embd"])], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machine", type=Path, default=None, help="plan --calibrate's file (default: measure now)")
    parser.add_argument("--steps", type=int, default=6)
    options = parser.parse_args()
    machine = options.machine or Path(tempfile.mkdtemp()) / "machine.json"
    model = Model(**MODEL, n_positions=1024)
    print(f"# model {MODEL}, batch {BATCH}, float32 AdamW; the machine "
          + (f"from {machine}" if options.machine else "calibrated before each run"))
    print(f"# {'run':<42} {'rank':>4} {'step pred':>10} {'measured':>10} {'ratio':>6} "
          f"{'mem pred MiB':>12} {'measured':>9} {'ratio':>6}")
    time_ratios, memory_ratios = [], []
    for ranks, layout in RUNS:
        if options.machine is None:
            calibrate(machine)
        plan = evaluate(model, load_machine(machine, ranks, 1e12), precision_with("float32"), layout, BATCH)
        measured_step, memory = measure(ranks, layout, options.steps)
        time_ratios.append(plan.step_s / measured_step)
        for rank in range(ranks):
            predicted = plan.rank_memory(rank)["total"]
            memory_ratios.append(predicted / memory[rank])
            step_columns = (f"{plan.step_s * 1e3:8.2f}ms {measured_step * 1e3:8.2f}ms {time_ratios[-1]:6.2f}"
                            if rank == 0 else " " * 33)
            print(f"  {f'-n {ranks} ' + layout.label():<42} {rank:>4} {step_columns} "
                  f"{predicted / 2**20:12.2f} {memory[rank] / 2**20:9.2f} {memory_ratios[-1]:6.3f}", flush=True)
    within_time = sum(abs(r - 1) <= 0.25 for r in time_ratios)
    within_memory = sum(abs(r - 1) <= 0.10 for r in memory_ratios)
    print(f"# step time within 25 %: {within_time}/{len(time_ratios)} runs; memory within 10 %: "
          f"{within_memory}/{len(memory_ratios)} ranks")


if __name__ == "__main__":
    main()
