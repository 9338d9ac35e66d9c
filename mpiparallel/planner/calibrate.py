"""`plan --calibrate`: measure this machine per rank, with every rank busy at once as in training.

α and β: ping-pong between ranks 0 and 1 (`collectives.cost_model.calibrate`: 8-byte and 1 MiB Sendrecv); γ: a
local reduction. The matmul rate: FLOP/s of the model's own product shapes (rows × n_embd by n_embd × 4·n_embd,
and back), timed on every rank at once; the elementwise rate: output bytes per second of NumPy adds and
multiplies on arrays of the MLP's hidden size (rows × 4·n_embd: GELU's passes dominate). Last, the compute
efficiency: one real training step of the serial model at the given shape (`models`' layers, AdamW) timed against
the planner's prediction for it at those rates — the share of the raw rates that real layers reach (Python's cost
per operation, attention's small per-head products, the optimizer's passes). `plan --machine` scales both rates by
it, so it anchors the one-rank prediction; meshes, schedules and rank counts are predicted from there. The figures
are rank 0's (every rank runs the same work), written with the core count to a JSON file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from .hardware import physical_memory


def _timed(work, repeats: int, barrier, rounds: int = 5) -> float:
    """Median seconds of one call of `work` over `rounds` rounds, all ranks starting together."""
    samples = []
    for _ in range(rounds):
        barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        samples.append((time.perf_counter() - start) / repeats)
    return float(np.median(samples))


def matmul_rate(n_embd: int, rows: int, barrier, repeats: int = 20, rounds: int = 5) -> float:
    """FLOP/s of float32 products of the MLP's shapes: (rows, h) @ (h, 4h) and (rows, 4h) @ (4h, h)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((rows, n_embd), np.float32), rng.standard_normal((n_embd, 4 * n_embd), np.float32)
    hidden, back = np.empty((rows, 4 * n_embd), np.float32), np.empty((rows, n_embd), np.float32)

    def work() -> None:
        np.matmul(x, w, out=hidden)
        np.matmul(hidden, w.T, out=back)

    return 2 * 2 * rows * n_embd * 4 * n_embd / _timed(work, repeats, barrier, rounds)


def elementwise_rate(elements: int, barrier) -> float:
    """Output bytes per second of float32 elementwise passes (an add and a multiply; the planner counts GELU's
    tanh and softmax's exp as several such passes)."""
    a, b = np.ones(elements, np.float32), np.full(elements, 0.5, np.float32)
    out = np.empty_like(a)

    def work() -> None:
        np.add(a, b, out=out)
        np.multiply(out, b, out=out)

    return 2 * elements * 4 / _timed(work, 50, barrier)


def serial_step_seconds(shape: dict[str, int], rows: int, barrier) -> float:
    """Seconds of one training step (forward, backward, AdamW) of the serial float32 model on `rows` sequences."""
    from models.transformer import GPTConfig, Transformer

    from ..optim import AdamW
    from ..process import keep_freed_memory

    keep_freed_memory()  # as `train` does: without it each step's activations cost fresh pages from the OS

    config = GPTConfig(vocab_size=shape["vocab_size"], n_positions=max(1024, shape["seq_len"]),
                       n_embd=shape["n_embd"], n_layer=shape["n_layer"], n_head=shape["n_head"])
    model = Transformer(config, dtype=np.float32)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    window = np.random.default_rng(0).integers(0, config.vocab_size, (rows, shape["seq_len"] + 1))
    inputs, targets = window[:, :-1], window[:, 1:]

    def work() -> None:
        for param in model.parameters():
            param.grad[...] = 0
        _, saved = model.forward(inputs, targets, normalizer=inputs.size)
        model.backward(saved)
        optimizer.step()

    return _timed(work, 2, barrier)


def compute_efficiency(shape: dict[str, int], rows: int, matmul_flops: float, elementwise_bytes: float,
                       barrier) -> float:
    """The planner's predicted seconds for one serial step at the measured rates, over the measured seconds."""
    from .hardware import Cluster
    from .layout import Layout, precision_with
    from .search import evaluate
    from .shapes import Model

    model = Model(shape["n_layer"], shape["n_embd"], shape["n_head"], shape["seq_len"], shape["vocab_size"])
    cluster = Cluster(gpus=1, gpus_per_node=1, matmul_flops=matmul_flops, elementwise_bytes=elementwise_bytes)
    predicted = evaluate(model, cluster, precision_with("float32"), Layout(), rows).step_s
    return predicted / serial_step_seconds(shape, rows, barrier)


def calibrate_machine(path: Path, n_embd: int, rows: int = 2048, shape: dict[str, int] | None = None,
                      step_rows: int = 8) -> dict[str, float]:
    """Measure on the running MPI ranks; rank 0 writes `path` and prints the figures."""
    from mpi4py import MPI

    from collectives import Communicator
    from collectives.cost_model import calibrate

    comm = Communicator(MPI.COMM_WORLD)
    link = calibrate(comm)
    barrier = comm.comm.Barrier
    measured = {"alpha": link.alpha, "beta": link.beta, "gamma": link.gamma,
                "matmul_flops": matmul_rate(n_embd, rows, barrier),
                "elementwise_bytes": elementwise_rate(4 * rows * n_embd, barrier),
                "ranks": comm.size, "cores": len(os.sched_getaffinity(0)), "memory_bytes": physical_memory(),
                "matmul_shape": [rows, n_embd, 4 * n_embd], "dtype": "float32",
                "alpha_inter": link.alpha_inter, "beta_inter": link.beta_inter}  # None on one node
    shape = shape or {"n_layer": 4, "n_embd": n_embd, "n_head": 4, "seq_len": 128, "vocab_size": 256}
    measured["efficiency_shape"] = {**shape, "rows": step_rows}
    measured["compute_efficiency"] = compute_efficiency(shape, step_rows, measured["matmul_flops"],
                                                        measured["elementwise_bytes"], barrier)
    if comm.rank == 0:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measured, indent=2) + "\n")
        print(f"alpha {measured['alpha'] * 1e6:.2f} us, beta {1 / measured['beta'] / 1e9:.2f} GB/s, gamma "
              f"{1 / measured['gamma'] / 1e9:.2f} GB/s, matmul {measured['matmul_flops'] / 1e9:.2f} GFLOP/s, "
              f"elementwise {measured['elementwise_bytes'] / 1e9:.2f} GB/s per rank; a real training step reaches "
              f"{measured['compute_efficiency']:.0%} of them; {comm.size} ranks on "
              f"{measured['cores']} cores; wrote {path}", flush=True)
    return measured
