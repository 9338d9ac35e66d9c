"""Data at scale: a rank's memory against the dataset's size, and `data prepare`'s throughput.

    python scripts/bench_data.py memory --gigabytes 0.1 4       # peak RSS training on 0.1 GB and 4 GB of shards
    python scripts/bench_data.py prepare --megabytes 40        # prepare's tokens/s vs tokenizers' batch encoding

memory: for each size, writes shards of random uint16 tokens (100M tokens = 200 MB per shard, no tokenizing)
into a temporary folder, then trains a tiny model on them for --steps steps with --shuffle (so the batches come
from all over the dataset) in a child process, which reports VmRSS after its imports and setup and VmHWM (the
peak resident set) after training; then deletes the shards. A rank's memory should not depend on the size.

prepare: builds a text corpus of about --megabytes MB (Python's documentation topics, repeated, each repetition
one document), trains a byte-level BPE of --vocab-size tokens on it once, then times `data prepare` with that
tokenizer (read, encode, write shards) against `tokenizers`' own `encode_batch_fast` on the same documents held
in memory (encoding only): the ratio is what prepare's streaming and writing cost. Timings on a shared machine
are noisy: each is the best of --rounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_random_shards(folder: Path, total_tokens: int, shard_tokens: int = 100_000_000) -> None:
    from mpiparallel.data.shards import header_bytes

    rng = np.random.default_rng(0)
    index, left = 0, total_tokens
    while left > 0:
        count = min(shard_tokens, left)
        with open(folder / f"train_{index:06d}.bin", "wb") as file:
            file.write(header_bytes(1, count))
            for start in range(0, count, 10_000_000):  # 20 MB at a time
                file.write(rng.integers(0, 256, min(10_000_000, count - start), dtype=np.uint16).tobytes())
        index, left = index + 1, left - count


def child(folder: str, steps: int) -> None:
    """Train on `folder` in this process; print the resident set before and the peak after, as JSON."""
    from mpiparallel import train
    from mpiparallel.data.shards import resident_bytes

    settings = train.TrainSettings.from_options(
        data=folder, shuffle=True, steps=steps, n_layer=1, n_embd=32, n_head=2, seq_len=64, batch_size=8,
        vocab_size=256)
    from mpiparallel import data

    dataset = data.open_data(folder)  # what run() opens too: the maps exist, nothing is read yet
    before = resident_bytes()[0]
    del dataset
    train.run(settings)
    print(json.dumps({"rss_before": before, "peak": resident_bytes()[1]}))


def memory(sizes: list[float], steps: int) -> None:
    print(f"{'dataset':>10} {'tokens':>15} {'RSS before':>12} {'peak RSS':>10}")
    for gigabytes in sizes:
        with tempfile.TemporaryDirectory(dir=".") as folder:
            tokens = int(gigabytes * 1e9 / 2)
            write_random_shards(Path(folder), tokens)
            out = subprocess.run([sys.executable, __file__, "child", folder, "--steps", str(steps)],
                                 capture_output=True, text=True, check=True).stdout
            figures = json.loads(out.strip().splitlines()[-1])
            print(f"{gigabytes:>8.1f}GB {tokens:>15,} {figures['rss_before'] / 2**20:>9.1f}MiB "
                  f"{figures['peak'] / 2**20:>7.1f}MiB", flush=True)


def prepare_throughput(megabytes: float, vocab_size: int, rounds: int) -> None:
    from pydoc_data.topics import topics

    from mpiparallel.data import prepare as preparing
    from mpiparallel.data.tokenizer import train_bpe

    text = "\n\n".join(topics[key] for key in sorted(topics))
    copies = max(1, int(megabytes * 1e6 / len(text.encode())))
    with tempfile.TemporaryDirectory(dir=".") as work:
        work_path = Path(work)
        corpus = work_path / "corpus"
        corpus.mkdir()
        for i in range(copies):
            (corpus / f"doc_{i:04d}.txt").write_text(text, encoding="utf-8")
        start = time.perf_counter()
        tokenizer = train_bpe([text], vocab_size)
        print(f"BPE of {vocab_size} tokens trained on {len(text.encode()) / 1e6:.2f} MB in "
              f"{time.perf_counter() - start:.2f} s")
        tokenizer.tokenizer.save(str(work_path / "tokenizer.json"))
        documents = [text] * copies
        best_encode = best_prepare = float("inf")
        tokens = 0
        for _ in range(rounds):
            start = time.perf_counter()
            tokens = sum(len(ids) + 1 for ids in tokenizer.encode_batch(documents))
            best_encode = min(best_encode, time.perf_counter() - start)
            out = work_path / "out"
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            preparing.prepare([corpus], out, str(work_path / "tokenizer.json"), val_tokens=0,
                              progress=preparing.Progress(open("/dev/null", "w")))
            best_prepare = min(best_prepare, time.perf_counter() - start)
        print(f"{copies} documents, {copies * len(text.encode()) / 1e6:.1f} MB, {tokens:,} tokens")
        print(f"tokenizers encode_batch_fast (in memory): {tokens / best_encode:>12,.0f} tokens/s")
        print(f"data prepare (read, encode, write):       {tokens / best_prepare:>12,.0f} tokens/s "
              f"({best_encode / best_prepare:.2f} of the batch encoder's rate)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    mem = commands.add_parser("memory")
    mem.add_argument("--gigabytes", type=float, nargs="+", default=[0.1, 4.0])
    mem.add_argument("--steps", type=int, default=20)
    run_child = commands.add_parser("child")
    run_child.add_argument("folder")
    run_child.add_argument("--steps", type=int, default=20)
    prep = commands.add_parser("prepare")
    prep.add_argument("--megabytes", type=float, default=40)
    prep.add_argument("--vocab-size", type=int, default=8192)
    prep.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.command == "memory":
        memory(args.gigabytes, args.steps)
    elif args.command == "child":
        child(args.folder, args.steps)
    else:
        prepare_throughput(args.megabytes, args.vocab_size, args.rounds)


if __name__ == "__main__":
    main()
