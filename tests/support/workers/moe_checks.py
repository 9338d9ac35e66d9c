"""Expert-parallel checks run on every rank (see mpi_harness): the EP layer and the EP model against the serial
ones, forced imbalanced routings against the per-token oracle, and the all-to-allv bytes. The EP group is the
whole world. Each check returns JSON-able numbers; the assertions live in tests/models/test_moe.py."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
from moe_oracle import copy_experts, forcing_inputs, forcing_weight, loop_reference, moe_layer, random_experts

import collectives as C
from collectives.backend import get_array_module
from models.moe import MixtureOfExperts, expert_index
from models.transformer import GPTConfig, Transformer
from mpiparallel.axes.expert_parallel import ExpertParallel, local_experts

from .arrays import host, parallel_array_module
from .errors import relative_error

SEED = 11
H, TOKENS = 8, 8  # channels; tokens per rank (one token set each)
BYTES = 8  # float64


def layer_against_union(n_experts: int, top_k: int) -> dict[str, Any]:
    """EP layer (aux off, capacity unlimited) on this rank's tokens vs the serial layer on every rank's tokens."""
    comm = C.world()
    rng = np.random.default_rng([SEED, n_experts, top_k])
    weight, experts = rng.standard_normal((H, n_experts)), random_experts(rng, H, n_experts)
    tokens, dout = rng.standard_normal((2, comm.size, TOKENS, H))
    serial = moe_layer(weight, copy_experts(experts), top_k)
    y_serial, saved = serial.forward(tokens.reshape(1, -1, H))
    dx_serial = serial.backward(saved, dout.reshape(1, -1, H)).reshape(tokens.shape)
    parallel = _parallel_layer(weight, experts, top_k, comm)
    result = _run_parallel(parallel, tokens[comm.rank], dout[comm.rank], comm)
    result["errors"] = {"y": relative_error(result.pop("y"), y_serial.reshape(tokens.shape)[comm.rank]),
                        "dx": relative_error(result.pop("dx"), dx_serial[comm.rank]),
                        **_gradient_errors(parallel, serial, comm)}
    return result


def layer_against_sets(n_experts: int, top_k: int, capacity_factor: float, aux_coef: float) -> dict[str, Any]:
    """EP layer with capacity and aux loss vs the serial layer run on each rank's token set in turn."""
    comm = C.world()
    rng = np.random.default_rng([SEED, n_experts, top_k, 1])
    weight, experts = rng.standard_normal((H, n_experts)), random_experts(rng, H, n_experts)
    tokens, dout = rng.standard_normal((2, comm.size, TOKENS, H))
    settings = {"capacity_factor": capacity_factor, "aux_coef": aux_coef, "aux_weight": 1.0 / comm.size}
    return _against_token_sets(weight, experts, top_k, tokens, dout, settings, comm)


def _against_token_sets(weight: np.ndarray, experts: list, top_k: int, tokens: np.ndarray, dout: np.ndarray,
                        settings: dict[str, float], comm: C.Communicator) -> dict[str, Any]:
    serial = moe_layer(weight, copy_experts(experts), top_k, **settings)
    y_serial, dx_serial, dropped = [], [], 0
    for token_set, dy in zip(tokens, dout, strict=True):
        y, saved = serial.forward(token_set[None])
        dropped += saved.stats.dropped_assignments
        y_serial.append(y[0])
        dx_serial.append(serial.backward(saved, dy[None])[0])
    parallel = _parallel_layer(weight, experts, top_k, comm, **settings)
    result = _run_parallel(parallel, tokens[comm.rank], dout[comm.rank], comm)
    result["errors"] = {"y": relative_error(result.pop("y"), y_serial[comm.rank]),
                        "dx": relative_error(result.pop("dx"), dx_serial[comm.rank]),
                        **_gradient_errors(parallel, serial, comm)}
    result["dropped"] = int(dropped)
    return result


def _parallel_layer(weight: np.ndarray, experts: list, top_k: int, comm: C.Communicator,
                    **settings: float) -> MixtureOfExperts:
    held = local_experts(len(experts), comm.rank, comm.size)
    return moe_layer(weight, copy_experts([experts[e] for e in held]), top_k, ep_comm=comm, **settings)


def _run_parallel(layer: MixtureOfExperts, tokens: np.ndarray, dout: np.ndarray,
                  comm: C.Communicator) -> dict[str, Any]:
    """Forward and backward of this rank's token set; the outputs, the plan and the all-to-allv bytes sent."""
    comm.ledger.reset()
    y, saved = layer.forward(tokens[None])
    forward = comm.ledger.sent["all_to_allv"]
    plan = saved.plan
    dx = layer.backward(saved, dout[None].copy())
    off_rank_sent = sum(plan.send_counts) - plan.send_counts[comm.rank]
    off_rank_received = sum(plan.recv_counts) - plan.recv_counts[comm.rank]
    return {"y": y[0], "dx": dx[0], "send_counts": plan.send_counts, "recv_counts": plan.recv_counts,
            "expert_counts": plan.expert_counts, "received_rows": off_rank_received,
            "ledger": {"forward": forward, "backward": comm.ledger.sent["all_to_allv"] - forward,
                       "routed_bytes": (off_rank_sent + off_rank_received) * H * BYTES,
                       "off_rank_rows_sent": off_rank_sent}}


def _gradient_errors(parallel: MixtureOfExperts, serial: MixtureOfExperts, comm: C.Communicator) -> dict[str, float]:
    """The router's gradient summed over the EP ranks (each saw its own tokens) and the held experts' gradients
    (complete: every token routed to them came to this rank), against the serial layer's."""
    errors = {"router": relative_error(C.all_reduce(parallel.router.weight.grad, comm), serial.router.weight.grad)}
    held = local_experts(serial.router.n_experts, comm.rank, comm.size)
    for mine, expert in zip(parallel.experts, held, strict=True):
        theirs = serial.experts[expert]
        for part in ("expand", "contract"):
            for kind in ("weight", "bias"):
                errors[f"expert {expert} {part} {kind}"] = relative_error(
                    getattr(getattr(mine, part), kind).grad, getattr(getattr(theirs, part), kind).grad)
    return errors


# -- the imbalance suite: routings forced through the router weights, checked against the oracle -------------

def _forced_case(case: str, rank: int, size: int) -> tuple[int, int, float, list[tuple[int, ...]]]:
    """(E, K, capacity factor, each token's choices on `rank`)."""
    if case == "all to one expert":
        return 4, 1, 0.0, [(3,)] * TOKENS
    if case == "one hot rank":  # experts 0 and 1 live on EP rank 0 for every ep here
        return 8, 2, 0.0, [(n % 2, 1 - n % 2) for n in range(TOKENS)]
    if case == "a hot spot per rank":  # rank r's tokens all go to an expert of rank r + 1
        return 8, 1, 0.0, [((rank + 1) % size * (8 // size),)] * TOKENS
    if case == "experts that receive nothing":
        return 8, 2, 0.0, [(0, 4) if n % 2 else (4, 0) for n in range(TOKENS)]
    if case == "everything past capacity":
        return 4, 1, 0.25, [(2,)] * TOKENS
    raise ValueError(f"unknown case {case!r}")


def forced_routing(case: str) -> dict[str, Any]:
    """A forced routing through the EP layer vs the serial layer per token set, and the rows exchanged vs what
    the per-token oracle's counts say each rank sends and receives."""
    comm = C.world()
    rng = np.random.default_rng([SEED, zlib.crc32(case.encode())])
    n_experts, top_k, capacity_factor, _ = _forced_case(case, 0, comm.size)
    weight, experts = forcing_weight(H, n_experts, rng), random_experts(rng, H, n_experts)
    tokens = np.stack([forcing_inputs(_forced_case(case, r, comm.size)[3], H, rng) for r in range(comm.size)])
    dout = rng.standard_normal(tokens.shape)
    settings = {"capacity_factor": capacity_factor, "aux_coef": 0.5, "aux_weight": 1.0 / comm.size}
    result = _against_token_sets(weight, experts, top_k, tokens, dout, settings, comm)
    capacity = math.ceil(capacity_factor * top_k * TOKENS / n_experts) if capacity_factor else None
    processed = np.stack([loop_reference(weight, experts, token_set, top_k, True, capacity, 0.5).processed
                          for token_set in tokens])  # [source rank, expert]
    by_rank = processed.reshape(comm.size, comm.size, -1)  # [source, destination, its local expert]
    result["counts_match_oracle"] = (result["send_counts"] == by_rank[comm.rank].sum(axis=1).tolist()
                                     and result["recv_counts"] == by_rank[:, comm.rank].sum(axis=1).tolist()
                                     and result["expert_counts"] == by_rank[:, comm.rank].sum(axis=0).tolist())
    return result


# -- the model -----------------------------------------------------------------------------------------------

def _perturbed(model: Transformer) -> Transformer:
    """Move every parameter away from its init by a draw seeded by its name (the same on every layout), so the
    router's choices are decisive and every path carries gradient."""
    for name, param in model.params.items():
        shift = 0.3 * np.random.default_rng([SEED, zlib.crc32(name.encode())]).standard_normal(param.data.shape)
        param.data += get_array_module(param.data).asarray(shift)
    return model


def model_against_serial(recompute: str) -> dict[str, Any]:
    """The MoE Transformer with an EP group of all ranks (this rank's rows of the batch, its E/ep experts; on the arrays
    of MPIPARALLEL_TEST_ARRAYS) vs the NumPy serial MoE Transformer run over the same token sets as microbatches: loss,
    every gradient (dense ones summed over the ranks, experts' held whole), and the held experts."""
    comm = C.world()
    config = GPTConfig(vocab_size=13, n_positions=8, n_embd=H, n_layer=2, n_head=2, n_experts=4, moe_top_k=2,
                       moe_aux_coef=0.3, moe_capacity_factor=1.5)
    window = np.random.default_rng([SEED, 3]).integers(0, config.vocab_size, (comm.size, 7))
    inputs, targets = window[:, :-1], window[:, 1:]
    serial = _perturbed(Transformer(config, seed=SEED, dtype=np.float64, moe_token_sets=comm.size))
    serial_loss = 0.0
    for row in range(comm.size):  # one microbatch per EP rank's rows: the same token sets
        loss, saved = serial.forward(inputs[row:row + 1], targets[row:row + 1], normalizer=inputs.size)
        serial_loss += loss
        serial.backward(saved)
    model = _perturbed(Transformer(config, seed=SEED, dtype=np.float64, moe_token_sets=comm.size, recompute=recompute,
                                   xp=parallel_array_module()).parallelize(ExpertParallel(comm)))
    rows = slice(comm.rank, comm.rank + 1)
    loss, saved = model.forward(inputs[rows], targets[rows], normalizer=inputs.size)
    model.backward(saved)
    errors = {"loss": relative_error(C.world().comm.allreduce(loss), serial_loss)}
    for name, param in model.params.items():
        grad = param.grad if expert_index(name) is not None else C.all_reduce(param.grad, comm)
        errors[name] = relative_error(host(grad), serial.params[name].grad)
    held = sorted({expert_index(name) for name in model.params} - {None})
    return {"errors": errors, "held_experts": held,
            "expected_experts": list(local_experts(config.n_experts, comm.rank, comm.size))}
