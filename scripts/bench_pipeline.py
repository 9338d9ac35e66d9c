"""Pipeline parallelism measured: the bubble each schedule leaves, next to the simulator's prediction, and the speed
of a two-stage pipeline against one rank.

    python scripts/bench_pipeline.py bubble --pp 4 --microbatches 8       # every schedule, measured vs simulated
    python scripts/bench_pipeline.py speed --microbatches 8                # pp = 2 vs serial, tokens/s

`bubble` starts `--pp` ranks under mpiexec (one BLAS thread each). Every rank builds its stages of the same GPT-2
and runs the schedule's actions with `PipelineExecutor`, which records when each action started and ended. After
warmup steps, each timed step starts behind a barrier; its measured bubble is 1 − (time in F, I, W, B summed over
ranks) / (ranks × step time). The per-stage costs of F, I and W measured in the same steps (medians) are fed to the
simulator (`mpiparallel.schedules.simulate`), whose bubble is printed beside the measured one.

`speed` runs `mpiparallel train` twice on the same global batch, one thread per rank: one rank, and two ranks with
`--pp 2 --microbatches M` for 1f1b, zb and zbv; tokens/s are medians of the steps after the first, and the ratio
is the pipeline's over the single rank's (theory for 1F1B: 2·M / (M + 1) with two equal stages).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
MODEL = ["--n-layer", "8", "--n-embd", "256", "--n-head", "4", "--seq-len", "128"]


def mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else "mpiexec"


# -- bubble: runs on every rank under mpiexec ------------------------------------------------------------------

def measure_bubbles(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    from collectives import Communicator
    from models.transformer import GPTConfig, Transformer
    from mpiparallel.axes.pipeline_parallel import PipelineExecutor, PipelineStages
    from mpiparallel.data import microbatches
    from mpiparallel.process import keep_freed_memory
    from mpiparallel.schedules import bubble_formula, build_schedule, simulate

    keep_freed_memory()  # as `mpiparallel train` does
    comm = Communicator(MPI.COMM_WORLD)
    config = GPTConfig(vocab_size=256, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers, n_head=args.heads)
    rows = args.batch // args.microbatches
    rng = np.random.default_rng(0)
    window = rng.integers(0, 256, (args.batch, args.seq + 1))
    pieces = microbatches(window[:, :-1], window[:, 1:], args.microbatches)
    lines = []
    for name in args.schedules:
        virtual = 2 if name == "interleaved" else 1
        schedule = build_schedule(name, comm.size, args.microbatches, virtual)
        model = Transformer(config, seed=0).parallelize(PipelineStages(schedule, comm.rank))
        executor = PipelineExecutor(model, schedule, comm, (rows, args.seq, args.embd), np.float32)
        bubbles, spans = [], []
        for step in range(args.warmup + args.steps):
            model.zero_grad()
            comm.barrier()
            executor.step(pieces, args.batch * args.seq)
            if step >= args.warmup:
                timeline = executor.timeline
                everyone = comm.comm.allgather((timeline.compute_time(), timeline.makespan()))
                busy, makespan = sum(b for b, _ in everyone), max(m for _, m in everyone)
                bubbles.append(1 - busy / (comm.size * makespan))
                spans += [(action.kind, end - start) for action, start, end in timeline.spans if action.is_compute]
        costs = _median_costs(comm.comm.allgather(spans), schedule.num_stages, comm.size)
        simulated = simulate(schedule, costs).bubble
        formula = bubble_formula(name, comm.size, args.microbatches, virtual, costs)
        lines.append(f"{name:12s} {statistics.median(bubbles):9.1%} {simulated:10.1%} {formula:9.1%}   "
                     f"F {costs.forward * 1e3:6.2f}  I {costs.backward_input * 1e3:6.2f}  "
                     f"W {costs.backward_weight * 1e3:6.2f} ms")
    if comm.rank == 0:
        print(f"pp {comm.size}, {args.microbatches} microbatches of {rows}×{args.seq} tokens, GPT-2 {args.layers} "
              f"layers × {args.embd}; medians of {args.steps} steps")
        print(f"{'schedule':12s} {'measured':>9s} {'simulated':>10s} {'formula':>9s}   per-stage costs measured "
              f"(÷ stages per rank)")
        print("\n".join(lines))


def _median_costs(all_spans: list[list[tuple[str, float]]], stages: int, ranks: int):
    """Median seconds of F, I and W per stage (B counts as I + W, split by the I:W ratio measured elsewhere or
    evenly)."""
    from mpiparallel.schedules import Costs

    spans = [span for rank_spans in all_spans for span in rank_spans]

    def median(kind: str) -> float | None:
        values = [seconds for k, seconds in spans if k == kind]
        return statistics.median(values) if values else None

    forward, backward_input, backward_weight, full = median("F"), median("I"), median("W"), median("B")
    if backward_input is None:  # only full backward passes: split B like a matrix product's two halves
        backward_input = backward_weight = full / 2
    return Costs(forward=forward, backward_input=backward_input, backward_weight=backward_weight, transfer=0.0)


# -- speed: one rank against a two-stage pipeline ------------------------------------------------------------

def measure_speed(args: argparse.Namespace) -> None:
    model = [*MODEL, "--batch-size", str(args.batch), "--steps", str(args.steps), "--threads", "1"]
    serial = _tokens_per_second(model + ["--microbatches", "1"], ranks=1)
    print(f"GPT-2 8 layers × 256, T=128, global batch {args.batch}, one thread per rank; tokens/s are medians "
          f"of steps 2…{args.steps}")
    print(f"serial (1 rank):                    {serial:9,.0f} tokens/s")
    for name in args.schedules:
        pipeline = _tokens_per_second(model + ["--pp", "2", "--schedule", name, "--microbatches",
                                               str(args.microbatches)], ranks=2)
        print(f"pp 2, {name:9s} {args.microbatches:3d} microbatches: {pipeline:9,.0f} tokens/s   "
              f"{pipeline / serial:5.2f}× serial (1F1B theory {2 * args.microbatches / (args.microbatches + 1):.2f}×)")


def _tokens_per_second(options: list[str], ranks: int) -> float:
    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / "log.jsonl"
        command = [sys.executable, "-m", "mpiparallel", "train", "-n", str(ranks), *options, "--log-json", str(log)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in log.read_text().splitlines()][1:]
    return statistics.median(record["tokens"] / record["time_s"] for record in records)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["bubble", "speed"])
    parser.add_argument("--pp", type=int, default=4, help="bubble: pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="global batch, sequences")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", nargs="+", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "speed":
        args.schedules = args.schedules or ["1f1b", "zb", "zbv"]
        measure_speed(args)
    elif args.worker:
        args.schedules = args.schedules or list(SCHEDULES)
        measure_bubbles(args)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        command = [mpiexec(), "-n", str(args.pp), sys.executable, __file__, *sys.argv[1:], "--worker"]
        sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
