"""Packed documents measured on real data: the attention work document masking removes, against its formula, and
what it does to the time of an attention layer.

    python scripts/bench_documents.py                                   # the default corpus, T 1024
    python scripts/bench_documents.py --data DIR --seq-len 2048 --cp 2 4 8

Reads the training batches of a data folder (`data prepare`'s or llm.c's; its data.json names the end-of-text id,
else give --eot-id) in the order `train` reads them, --batch-size windows of --seq-len tokens a step, and prints:

- documents per window, and their lengths (a document cut by a window's edge counts as the piece inside it);
- the attention scores per head: causal's T(T+1)/2 per window against document attention's Σ L(L+1)/2 over the
  window's documents (`models.documents.attention_scores`), and the serial layer's own count of what it
  multiplied, measured by running it with one query per block (equal to the formula: every key outside a query's
  document is skipped) and with blocks of --query-block rows (what training runs: a block sees the keys from its
  first row's document on, so its later rows see some they then mask);
- for each --cp, the chunk pairs of cp(2cp+1) per step skipped whole because a document boundary separates them in
  every row of the batch (`skipped_chunk_pairs`), their share, and the K/V bytes that still travel (all of them:
  the ring passes every block on, and all-gather gathers it, whoever attends to it);
- one attention layer's forward + backward (--n-embd channels, --n-head heads) on a batch, causal against document,
  medians of --reps, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

for _threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one BLAS thread, before NumPy loads
    os.environ.setdefault(_threads, "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from models.documents import (  # noqa: E402
    ONE_DOCUMENT,
    Documents,
    attention_scores,
    document_lengths,
    skipped_chunk_pairs,
)
from models.layers import CausalSelfAttention, Linear  # noqa: E402
from models.parameter import Parameter  # noqa: E402
from mpiparallel import data  # noqa: E402


def windows(args: argparse.Namespace) -> tuple[list[np.ndarray], int]:
    """Every step's input rows (B, T) of the data's training batches, and its end-of-text id."""
    path = args.data or str(data.cached_default_corpus())
    dataset = data.open_data(path)
    eot = args.eot_id if args.eot_id is not None else dataset.info.get("eot_id")
    if eot is None:
        raise SystemExit(f"{path} has no data.json that names its end-of-text id: give --eot-id")
    batches = dataset.batches(args.batch_size, args.seq_len)
    steps = min(batches.batch_count, args.steps or batches.batch_count)
    return [batches.batch(step)[0] for step in range(steps)], int(eot)


def counted_scores(layer: CausalSelfAttention, x: np.ndarray, documents) -> int:
    """The scores the serial layer multiplies for `x` (per head), counted as it computes them."""
    count, probabilities = [0], CausalSelfAttention._probabilities

    def counting(*arguments):
        probs = probabilities(*arguments)
        count[0] += probs.shape[-1] * probs.shape[-2]
        return probs

    layer._probabilities = counting
    try:
        layer.forward(x, documents)
    finally:
        del layer._probabilities
    return count[0]


def attention_layer(n_embd: int, n_head: int, query_block: int, rng: np.random.Generator) -> CausalSelfAttention:
    def linear(name: str, rows: int, columns: int) -> Linear:
        return Linear(Parameter(f"{name}.weight", (rng.standard_normal((rows, columns)) * 0.02).astype(np.float32)))
    return CausalSelfAttention(linear("qkv", n_embd, 3 * n_embd), linear("proj", n_embd, n_embd), n_head,
                               query_block=query_block)


def scores_table(rows: list[np.ndarray], eot: int, args: argparse.Namespace) -> None:
    lengths = [length for batch in rows for row in batch
               for length in document_lengths(Documents.of_tokens(row[None], eot).starts[0])]
    windows_read = sum(len(batch) for batch in rows)
    print(f"{windows_read} windows of {args.seq_len} tokens: {len(lengths) / windows_read:.2f} documents per window "
          f"(median piece {int(np.median(lengths))} tokens, longest {max(lengths)})")
    causal = sum(attention_scores(ONE_DOCUMENT, args.seq_len) for batch in rows for _ in batch)
    formula = sum(attention_scores(Documents.of_tokens(row[None], eot), args.seq_len)
                  for batch in rows for row in batch)
    rng = np.random.default_rng(0)
    sample = rows[:args.count_steps]
    measured = {}
    for block in (1, args.query_block):
        layer = attention_layer(8 * args.n_head, args.n_head, block, rng)
        total = 0
        for batch in sample:
            for row in batch:
                x = rng.standard_normal((1, args.seq_len, 8 * args.n_head)).astype(np.float32)
                total += counted_scores(layer, x, Documents.of_tokens(row[None], eot))
        measured[block] = total
    sampled_formula = sum(attention_scores(Documents.of_tokens(row[None], eot), args.seq_len)
                          for batch in sample for row in batch)
    print(f"scores per head, all windows: causal {causal:,}, document (formula Σ L(L+1)/2) {formula:,} = "
          f"{formula / causal:.1%} of causal")
    verdict = "equal" if measured[1] == sampled_formula else "DIFFERENT"
    blocked = measured[args.query_block]
    print(f"measured on the first {len(sample)} steps ({sum(len(b) for b in sample)} windows): one query per block "
          f"{measured[1]:,} against the formula's {sampled_formula:,} ({verdict}); blocks of {args.query_block}: "
          f"{blocked:,} ({blocked / sampled_formula:.2f}× the formula)")


def chunk_pairs_table(rows: list[np.ndarray], eot: int, args: argparse.Namespace) -> None:
    for cp in args.cp:
        if args.seq_len % (2 * cp):
            print(f"cp {cp}: --seq-len {args.seq_len} is not divisible by 2·cp")
            continue
        pairs = cp * (2 * cp + 1)
        skipped = [skipped_chunk_pairs(Documents.of_tokens(batch, eot), cp) for batch in rows]
        single = [skipped_chunk_pairs(Documents.of_tokens(row[None], eot), cp) for batch in rows for row in batch]
        print(f"cp {cp}: chunk pairs skipped per step {statistics.mean(skipped):.2f} of {pairs} "
              f"({statistics.mean(skipped) / pairs:.1%}); with one window per microbatch "
              f"{statistics.mean(single):.2f} ({statistics.mean(single) / pairs:.1%}); K/V bytes saved: none")


def timing_table(rows: list[np.ndarray], eot: int, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(1)
    layer = attention_layer(args.n_embd, args.n_head, args.query_block, rng)
    batch = rows[0]
    x = rng.standard_normal((*batch.shape, args.n_embd)).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    documents = Documents.of_tokens(batch, eot)
    times = {}
    for name, case in (("causal", ONE_DOCUMENT), ("document", documents)):
        samples = []
        for _ in range(args.reps + 1):
            start = time.perf_counter()
            _, saved = layer.forward(x, case)
            layer.backward(saved, dout.copy())
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples[1:])
    print(f"attention forward + backward, {batch.shape[0]}×{args.seq_len} tokens, {args.n_embd} channels, "
          f"{args.n_head} heads, query blocks of {args.query_block}: causal {times['causal'] * 1e3:.1f} ms, document "
          f"{times['document'] * 1e3:.1f} ms ({times['causal'] / times['document']:.2f}× faster)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="a data folder or shard [default: the default corpus]")
    parser.add_argument("--eot-id", type=int, help="the end-of-text id [default: data.json's]")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=0, help="steps of batches to read [default: all]")
    parser.add_argument("--count-steps", type=int, default=2, help="steps whose scores the layer counts")
    parser.add_argument("--query-block", type=int, default=64)
    parser.add_argument("--cp", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows, eot = windows(args)
    scores_table(rows, eot, args)
    chunk_pairs_table(rows, eot, args)
    timing_table(rows, eot, args)


if __name__ == "__main__":
    main()
