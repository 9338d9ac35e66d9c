"""The FP8 training matrix's runs (tests/runtime/test_fp8_training.py): each mesh trains as the composition matrix's do
(`workers.composition_checks`), and rank 0 compares it with the serial FP8 run step by step — the first step's
loss and gradients (before any update: what the tiles alone change) apart from the later steps' losses (after
AdamW, whose m/√v turns a small difference in a near-zero gradient into a whole step of lr)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from .composition_checks import _losses, _train
from .errors import relative_error


def matches_serial_per_step(models: dict[str, dict[str, Any]], runs: list[tuple[str, dict[str, Any]]],
                            references: str) -> list[dict]:
    """Train each run (a model's name and mesh options); on rank 0 return per run its step count, every step's
    loss error, and each parameter's relative error of the first step's gradient, against the serial run in
    `references`/<model name> (`workers.composition_checks.serial_references`)."""
    world = MPI.COMM_WORLD
    results = []
    for model, options in runs:
        directory = Path(world.bcast(tempfile.mkdtemp(prefix="fp8-") if world.rank == 0 else None))
        gradients = _train({**models[model], **options}, directory)
        world.barrier()
        if world.rank == 0:
            reference = Path(references) / model
            serial_gradients = np.load(reference / "gradients.npz")
            losses, serial_losses = _losses(directory), _losses(reference)
            results.append({
                "model": model, "options": options, "steps": len(gradients),
                "loss_errors": [relative_error(a, b) for a, b in zip(losses, serial_losses, strict=True)],
                "first_step_gradient_errors": {name: relative_error(grad, serial_gradients[f"0/{name}"])
                                               for name, grad in gradients[0].items()}})
    return results


def fp8_dispatch(n_embd: int = 256, tokens_per_rank: int = 96, seed: int = 0) -> dict:
    """One MoE layer (4 experts of a mixtral-shaped model in FP8, top-2) on an EP group of all ranks against the
    same layer holding every expert on one rank, fed the ranks' tokens one after another (so every expert sees its
    tokens in the same order and tiles). Returns, per rank: the relative errors of y, dx and the held experts'
    gradients, the rows this rank's dispatch sent and received off-rank, and the all-to-allv bytes of the forward
    (dispatch in FP8, combine in bfloat16)."""
    from collectives import Communicator
    from models.transformer import GPTConfig, Transformer
    from mpiparallel.axes.expert_parallel import ExpertParallel

    comm = Communicator(MPI.COMM_WORLD)
    config = GPTConfig(vocab_size=64, n_positions=16, n_embd=n_embd, n_layer=1, n_head=4, arch="llama", n_kv_head=4,
                       ffn_hidden=128, n_experts=4, moe_top_k=2)
    common = {"seed": seed, "compute_dtype": "bfloat16", "fp8": "blockwise"}
    layer = Transformer(config, **common).parallelize(ExpertParallel(comm)).blocks[0].mlp
    whole = Transformer(config, **common).blocks[0].mlp
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((comm.size, tokens_per_rank, n_embd)).astype(layer.experts[0].expand.dtype)
    dy = rng.standard_normal(x.shape).astype(x.dtype)
    mine = slice(comm.rank * tokens_per_rank, (comm.rank + 1) * tokens_per_rank)
    y_whole, saved_whole = whole.forward(x.reshape(1, -1, n_embd))
    dx_whole = whole.backward(saved_whole, dy.reshape(1, -1, n_embd))
    comm.ledger.reset()
    y, saved = layer.forward(x[comm.rank][None])
    forward_bytes = comm.ledger.sent["all_to_allv"]
    plan = saved.plan
    dx = layer.backward(saved, dy[comm.rank][None])
    held = range(comm.rank * len(layer.experts), (comm.rank + 1) * len(layer.experts))
    gradients = {f"expert {e} {part}": relative_error(getattr(mine_expert, part).weights[0].grad
                                                      if part == "expand" else mine_expert.contract.weight.grad,
                                                      getattr(whole.experts[e], part).weights[0].grad
                                                      if part == "expand" else whole.experts[e].contract.weight.grad)
                 for mine_expert, e in zip(layer.experts, held, strict=True) for part in ("expand", "contract")}
    return {"y": relative_error(y[0], y_whole[0, mine]), "dx": relative_error(dx[0], dx_whole[0, mine]),
            "gradients": gradients, "forward_bytes": int(forward_bytes),
            "rows_sent": sum(plan.send_counts) - plan.send_counts[comm.rank],
            "rows_received": sum(plan.recv_counts) - plan.recv_counts[comm.rank]}
