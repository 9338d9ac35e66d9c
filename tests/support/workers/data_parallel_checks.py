"""Data-parallel and ZeRO checks run on every rank: the parallel run against a serial run of the same model."""

from __future__ import annotations

import numpy as np

import collectives as C
from models.parameter import counts_once
from models.transformer import GPTConfig, Transformer
from mpiparallel import data, optim
from mpiparallel.axes.data_parallel import DataParallel, data_parallel

from .arrays import host, parallel_array_module
from .errors import relative_error

CONFIG = GPTConfig(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2)
BATCH, LENGTH, LR, CLIP = 8, 8, 1e-2, 0.5


def _tokens() -> np.ndarray:
    return np.random.default_rng(7).integers(0, CONFIG.vocab_size, BATCH * LENGTH * 3 + 1)


def _serial_step(model: Transformer, optimizer: optim.AdamW, inputs, targets) -> tuple[float, dict]:
    model.zero_grad()
    loss, saved = model.forward(inputs, targets)
    model.backward(saved)
    grads = {p.name: p.grad.copy() for p in model.parameters()}
    optim.clip_grad_norm(model.parameters(), CLIP)
    optimizer.step()
    return loss, grads


def _parallel_step(model: Transformer, engine: DataParallel, optimizer: optim.AdamW, inputs, targets,
                   microbatch_count: int) -> tuple[float, dict]:
    comm = engine.comm
    rows = data.rows_for_rank(inputs, targets, comm.rank, comm.size)
    engine.zero_grad()
    loss = 0.0
    pieces = data.microbatches(*rows, microbatch_count)
    for i, (x, y, _) in enumerate(pieces):
        with engine.microbatch(last=i == len(pieces) - 1):
            microbatch_loss, saved = model.forward(x, y, normalizer=BATCH * LENGTH, hooks=engine)
            loss += microbatch_loss
            model.backward(saved, hooks=engine)
    engine.finish_gradients()
    grads = engine.full_gradients()
    optim.clip_grad_norm(engine.optimizer_parameters(), CLIP,
                         lambda local: float(C.all_reduce(np.array([local]), comm, algo="mpi")[0]),
                         counts=lambda piece: counts_once(piece.placement, {"dp": comm.rank}))
    optimizer.step()
    engine.after_update()
    total = float(C.all_reduce(np.array([loss]), comm, algo="mpi")[0])
    return total, grads


def check_equals_serial(zero: int, microbatch_count: int, overlap: bool = True, steps: int = 3) -> list[str]:
    """dp ranks × ZeRO stage × microbatches: loss, gathered gradients and weights equal serial (float64)."""
    comm = C.world()
    serial = Transformer(CONFIG, seed=3, dtype=np.float64)
    serial_optimizer = optim.AdamW(serial.parameters(), lr=LR, weight_decay=0.1)
    model = Transformer(CONFIG, seed=3, dtype=np.float64, xp=parallel_array_module())
    engine = data_parallel(model, comm, zero=zero, bucket_mb=0.004, overlap=overlap)  # ≈4 KB: several buckets
    optimizer = optim.AdamW(engine.optimizer_parameters(), lr=LR, weight_decay=0.1)
    tokens, failures = _tokens(), []
    for step in range(steps):
        inputs, targets = data.batch_for_step(tokens, step, BATCH, LENGTH)
        want_loss, want_grads = _serial_step(serial, serial_optimizer, inputs, targets)
        loss, grads = _parallel_step(model, engine, optimizer, inputs, targets, microbatch_count)
        tag = f"zero {zero} microbatches {microbatch_count} step {step}"
        if abs(loss - want_loss) > 1e-9 * abs(want_loss):
            failures.append(f"{tag}: loss {loss} != {want_loss}")
        for name, want in want_grads.items():
            if (error := relative_error(grads[name], want)) > 1e-9:
                failures.append(f"{tag}: gradient {name} relative error {error:.2e}")
        weights = engine.full_parameters()
        for name, want in serial.state_dict().items():
            if (error := relative_error(weights[name], want)) > 1e-9:
                failures.append(f"{tag}: weight {name} relative error {error:.2e}")
        checksum = np.array([float(host(w).sum()) for w in weights.values()])
        every = C.all_gather(checksum[None], comm, algo="mpi")
        if not (every == every[0]).all():
            failures.append(f"{tag}: DP replicas hold different weights")
    return failures


def ledger_of_one_step(zero: int, batch: int = BATCH) -> dict:
    """Bytes this rank sent per operation in one step (ring algorithms), the bucket sizes behind them, and the
    bytes it holds."""
    comm = C.world()
    model = Transformer(CONFIG, seed=3, dtype=np.float64)
    engine = data_parallel(model, comm, zero=zero, bucket_mb=0.004, algo="ring")
    optimizer = optim.AdamW(engine.optimizer_parameters(), lr=LR)
    inputs, targets = data.batch_for_step(_tokens(), 0, batch, LENGTH)
    comm.ledger.reset()
    _parallel_step(model, engine, optimizer, inputs, targets, microbatch_count=1)
    last_unit = len(model.unit_parameters()) - 1
    return {"sent": dict(comm.ledger.sent),
            "bucket_bytes": [b.padded * 8 for b in engine.buckets],
            "bucket_elements": [b.size for b in engine.buckets],
            "used_by": [sorted(b.used_by) for b in engine.buckets],
            "units": last_unit + 1,
            "memory": engine.memory(optimizer)}
