"""`mpiparallel train -n N` against PyTorch's own data parallelism on the same CPUs: DDP and FSDP2 over gloo.

Two comparisons (`--kind ddp|fsdp|both`, default both), each of one command against its PyTorch counterpart:

    ddp   `mpiparallel train -n N` (plain data parallelism, gradients all-reduced in buckets during backward)
          against torch.nn.parallel.DistributedDataParallel over gloo;
    fsdp  `mpiparallel train -n N --zero 3` (parameters, gradients and optimizer state sharded; each block's
          weights all-gathered before use, its gradients reduce-scattered) against FSDP2
          (torch.distributed.fsdp.fully_shard on every block and on the root) over gloo.

Both sides train the same GPT-2 (`--layers 4 --embd 256 --heads 4`, T = `--seq` 128, `--batch-per-rank` 8
sequences on each of N ranks, float32, byte vocabulary, AdamW with lr 3e-4, betas (0.9, 0.95), no weight decay)
from the same initial weights (our seed-0 initialization, copied into the nanoGPT-style twin of
`bench_train.py`), on the same tokens: this repository's source as bytes, rank r reading rows
[r·B, (r+1)·B) of step s's batch exactly as `train` does (`mpiparallel.data`). Every process runs one thread
(`train --threads 1`, `torch.set_num_threads(1)`). PyTorch's side uses fused AdamW where it runs on the
parameters (DDP); FSDP2's sharded DTensor parameters take the foreach AdamW (the fused one is tried first: the
header says which ran).

Reported for each: the median step time after `--warmup` steps (ours: `time_s` of `--log-json`, rank 0's wall time
of the whole step; theirs: rank 0's wall time of zero_grad + forward + backward + step, and the loss all-reduce
that `train` also does for its log), tokens/s, their ratio, and both first losses (they must agree to float32
rounding, 1e-4 relative, or the comparison stops: the two would not compute the same thing). The runs alternate
(ours, theirs, ours, theirs, … `--repeats` pairs) and the ratio is of the medians over all of them, so a noisy
spell on the machine hits both.

    python scripts/bench_torch_distributed.py                          # both kinds, 2 ranks, 20 steps
    python scripts/bench_torch_distributed.py --kind fsdp --ranks 2 --steps 30 --repeats 3

Needs torch (`pip install -e '.[interop]'`). The PyTorch processes start through torch.distributed.run
(torchrun) on this host's loopback interface, on a free port.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_LOSS_TOLERANCE = 1e-4
"""Relative difference allowed between the two first losses (float32, the same weights and tokens)."""


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("ddp", "fsdp", "both"), default="both")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="alternated (ours, theirs) pairs of runs")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch-per-rank", type=int, default=8)
    parser.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)  # a torchrun process (names that
    # no torchrun option begins with: its parser would take an abbreviation such as --log for --log-dir)
    parser.add_argument("--token-file", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--ranks must be at least 2, --steps and --repeats at least 1, --warmup at least 0")
    return args


def write_token_file(path: Path, tokens_needed: int) -> None:
    """This repository's source as bytes (`train` reads any other file as byte tokens), repeated to length."""
    text = b"".join(p.read_bytes() for p in sorted(ROOT.glob("**/*.py")) + [ROOT / "README.md"])
    path.write_bytes(text * (tokens_needed // len(text) + 1))


def model_flags(args: argparse.Namespace) -> list[str]:
    return ["--n-layer", str(args.layers), "--n-embd", str(args.embd), "--n-head", str(args.heads),
            "--seq-len", str(args.seq)]


def steps_of(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def run_ours(args: argparse.Namespace, kind: str, data: Path, log: Path) -> list[dict]:
    command = [sys.executable, "-m", "mpiparallel", "train", "-n", str(args.ranks), "--data", str(data),
               "--vocab-size", "256", *model_flags(args), "--batch-size", str(args.batch_per_rank * args.ranks),
               "--steps", str(args.warmup + args.steps), "--threads", "1", "--lr", "3e-4", "--weight-decay", "0",
               "--log-json", str(log)]
    if kind == "fsdp":
        command += ["--zero", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return steps_of(log)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_theirs(args: argparse.Namespace, kind: str, data: Path, log: Path) -> list[dict]:
    shape = {"layers": args.layers, "embd": args.embd, "heads": args.heads, "seq": args.seq,
             "batch-per-rank": args.batch_per_rank, "steps": args.steps, "warmup": args.warmup}
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    attempt = 0
    while True:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--tee", "3",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(Path(__file__).resolve()),
                   "--worker", kind, "--token-file", str(data), "--record", str(log),
                   *[f"--{key}={value}" for key, value in shape.items()]]
        result = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=ROOT, env=environment)
        if result.returncode == 0:
            return steps_of(log)
        # torchrun prefixes each worker's lines with [default<local rank>]: they say what went wrong, its own
        # summary only how each worker ended
        workers = "\n".join([line for line in result.stderr.splitlines() if line.startswith("[default")][-40:])
        exit_codes = [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)]
        crashed = "(SIGABRT)" in result.stderr and all(code < 0 for code in exit_codes)  # no worker's own error
        if not crashed or attempt == TORCH_RERUNS:
            sys.exit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{workers}\n{result.stderr[-1500:]}")
        print(f"  (torch's {kind} run: a worker aborted (SIGABRT) in torch's own code, not in the script's: run "
              f"again{'; it said: ' + workers.splitlines()[-1] if workers else ''})", flush=True)
        attempt += 1


TORCH_RERUNS = 2
"""How often a torchrun whose worker aborted is run again. gloo's transport aborts a process
(std::terminate from its I/O thread) when a peer's connection closes while it still holds it, which happens now
and then as workers leave (seen in 1 of ~50 runs of the tests' tiny FSDP2 job): a crash of torch's side, not a
measurement."""


# ---------------------------------------------------------------------------------------------------------------
# One PyTorch process (started by torchrun).
# ---------------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT))
    import bench_train

    from models.transformer import GPTConfig, Transformer
    from mpiparallel.data.dataset import open_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=256, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers,
                       n_head=args.heads)
    model = bench_train.TorchGPT(Transformer(config, seed=0, dtype=np.float32), "sdpa")
    optimizer_kind = "fused"
    if args.worker == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        wrapped = fully_shard(model)
    optimizer = bench_train.torch_adamw(wrapped, optimizer_kind, 0.0)
    batches = open_data(args.token_file).batches(args.batch_per_rank * ranks, args.seq, vocab_size=256)
    records = []
    for step in range(args.warmup + args.steps):
        inputs, targets = (torch.from_numpy(a) for a in batches.rows_for_rank(step, rank, ranks))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        loss = wrapped(inputs, targets)
        loss.backward()
        try:
            optimizer.step()
        except RuntimeError as failure:  # fused AdamW refusing DTensor parameters: the foreach one instead
            if optimizer_kind != "fused" or step:
                raise
            optimizer_kind = "foreach"
            print(f"fused AdamW did not run ({str(failure).splitlines()[0][:120]}); foreach instead", flush=True)
            optimizer = bench_train.torch_adamw(wrapped, optimizer_kind, 0.0)
            optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        records.append({"step": step, "loss": float(mean_loss) / ranks, "time_s": time.perf_counter() - start,
                        "optimizer": optimizer_kind})
    if rank == 0:
        Path(args.record).write_text("".join(json.dumps(record) + "\n" for record in records))
    dist.barrier()  # nobody closes its connections while another still uses them (see TORCH_RERUNS)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# The comparison.
# ---------------------------------------------------------------------------------------------------------------


def compare(args: argparse.Namespace, kind: str, data: Path, scratch: Path) -> float:
    ours_times, theirs_times, first_losses, optimizer, drift = [], [], None, None, 0.0
    for repeat in range(args.repeats):
        ours = run_ours(args, kind, data, scratch / f"ours-{kind}-{repeat}.jsonl")
        theirs = run_theirs(args, kind, data, scratch / f"theirs-{kind}-{repeat}.jsonl")
        ours_times += [record["time_s"] for record in ours[args.warmup:]]
        theirs_times += [record["time_s"] for record in theirs[args.warmup:]]
        first_losses, optimizer = (ours[0]["loss"], theirs[0]["loss"]), theirs[-1]["optimizer"]
        drift = max([drift] + [abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs, strict=True)])
        difference = abs(first_losses[0] - first_losses[1]) / abs(first_losses[1])
        if difference > FIRST_LOSS_TOLERANCE:
            sys.exit(f"{kind}: first losses differ (ours {first_losses[0]:.7f}, torch {first_losses[1]:.7f}, relative "
                     f"{difference:.1e} > {FIRST_LOSS_TOLERANCE:.0e}): the two do not compute the same thing, so "
                     "their timings are not compared")
    tokens = args.batch_per_rank * args.ranks * args.seq
    ours_step, theirs_step = statistics.median(ours_times), statistics.median(theirs_times)
    ours_name = f"train -n {args.ranks}" + (" --zero 3" if kind == "fsdp" else "")
    theirs_name = "DDP (gloo)" if kind == "ddp" else "FSDP2 (gloo)"
    print(f"\n{kind}: {ours_name} against {theirs_name}, AdamW {optimizer} on torch's side; first losses ours "
          f"{first_losses[0]:.6f}, torch {first_losses[1]:.6f}; largest loss difference over the steps {drift:.1e}")
    print(f"  ours  : {ours_step * 1e3:8.1f} ms/step  {tokens / ours_step:8.0f} tokens/s  (median of "
          f"{len(ours_times)} steps over {args.repeats} runs)")
    print(f"  theirs: {theirs_step * 1e3:8.1f} ms/step  {tokens / theirs_step:8.0f} tokens/s")
    print(f"  ratio ours/theirs (tokens/s): {theirs_step / ours_step:.3f}")
    return theirs_step / ours_step


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    if args.worker:
        worker(args)
        return
    try:
        import torch
    except ImportError:
        sys.exit("needs torch: pip install -e '.[interop]'")
    sys.path.insert(0, str(ROOT / "scripts"))
    import profile_step

    print("\n".join(profile_step.machine_lines(torch)))
    print(f"GPT-2 {args.layers} layers, n_embd {args.embd}, {args.heads} heads, T={args.seq}, {args.batch_per_rank} "
          f"sequences per rank, {args.ranks} ranks of one thread each, float32, vocab 256")
    kinds = ("ddp", "fsdp") if args.kind == "both" else (args.kind,)
    with tempfile.TemporaryDirectory(prefix="bench_torch_distributed_") as directory:
        scratch = Path(directory)
        data = scratch / "tokens.txt"
        write_token_file(data, (args.warmup + args.steps + 1) * args.batch_per_rank * args.ranks * args.seq + 1)
        ratios = {kind: compare(args, kind, data, scratch) for kind in kinds}
    print("\nsummary: " + ", ".join(f"{kind} {ratio:.3f}×" for kind, ratio in ratios.items()))


if __name__ == "__main__":
    main()
