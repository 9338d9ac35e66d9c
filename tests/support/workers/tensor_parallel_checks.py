"""Tensor-parallel checks run on every rank (see mpi_harness): the parallel model against the serial one, the
bytes each block sends, and the activation memory sequence parallelism saves. Each returns JSON-able numbers;
the assertions live in tests/models/test_tensor_parallel.py."""

from __future__ import annotations

from typing import Any

import numpy as np

import collectives as C
from models.layers import Saved, block_activation_elements
from models.parameter import gather_tensor, reduce_partial_gradients
from models.transformer import GPTConfig, ParameterHooks, Transformer
from mpiparallel.axes.tensor_parallel import TensorParallel, full_state_dict
from mpiparallel.mesh import Mesh, MeshShape
from mpiparallel.optim import AdamW

from .arrays import host, parallel_array_module
from .errors import relative_error, worst

SEED = 7


def tiny_config(vocab_size: int = 64) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, n_positions=16, n_embd=32, n_layer=2, n_head=4)


def batch(config: GPTConfig, batch_size: int, length: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The same (tokens, targets) on every rank for a given step."""
    window = np.random.default_rng([SEED, step]).integers(0, config.vocab_size, (batch_size, length + 1))
    return window[:, :-1], window[:, 1:]


def compare_training(runs: list[dict[str, Any]], steps: int = 3) -> list[dict[str, Any]]:
    """Train the TP model (on a tp × dp mesh of this world) and the serial one side by side; per run, the worst
    relative errors of loss, gathered gradients and gathered weights over `steps` AdamW steps."""
    return [_compare_one(steps=steps, **run) for run in runs]


def _compare_one(tp: int, dp: int, sequence_parallel: bool, vocab_size: int, steps: int,
                 microbatches: int = 1) -> dict[str, Any]:
    mesh = Mesh(C.world(), MeshShape(tp=tp, dp=dp))
    config = tiny_config(vocab_size)
    batch_size, length = 2 * dp, 8
    serial = Transformer(config, seed=SEED, dtype=np.float64)
    model = Transformer(config, seed=SEED, dtype=np.float64, xp=parallel_array_module()).parallelize(
        TensorParallel(mesh.tp, sequence_parallel))
    initial = full_state_dict(model)
    report = {"initial_weights_exact": all(np.array_equal(host(initial[n]), v) for n, v in serial.state_dict().items()),
              "losses": [], "loss_error": 0.0, "grad_error": 0.0, "weight_error": 0.0,
              "worst_grad": "", "checked_grads": 0}
    serial_optimizer = AdamW(serial.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rows = slice(mesh.coordinates.dp * batch_size // dp, (mesh.coordinates.dp + 1) * batch_size // dp)
    for step in range(steps):
        tokens, targets = batch(config, batch_size, length, step)
        serial.zero_grad()
        want_loss, saved = serial.forward(tokens, targets)
        serial.backward(saved)
        model.zero_grad()
        local_loss = 0.0
        for microbatch in np.array_split(np.arange(rows.start, rows.stop), microbatches):
            loss, saved = model.forward(tokens[microbatch], targets[microbatch], normalizer=batch_size * length)
            local_loss += loss
            model.backward(saved)
        reduce_partial_gradients(model.parameters(), {"tp": mesh.tp})  # once, after the microbatches
        for param in model.parameters():  # data parallelism: sum the DP ranks' gradients
            param.grad[...] = C.all_reduce(param.grad, mesh.dp)
        loss = float(C.all_reduce(np.array([local_loss]), mesh.dp)[0])
        report["losses"].append(loss)
        report["loss_error"] = worst([report["loss_error"], relative_error(loss, want_loss)])
        for param, serial_param in zip(model.parameters(), serial.parameters(), strict=True):
            error = relative_error(gather_tensor(param.grad, param.placement, {"tp": mesh.tp}, param.full_shape),
                                   serial_param.grad)
            report["checked_grads"] += 1
            if error >= report["grad_error"]:
                report["grad_error"], report["worst_grad"] = error, param.name
        serial_optimizer.step()
        optimizer.step()
        gathered = full_state_dict(model)
        for name, value in serial.state_dict().items():
            report["weight_error"] = worst([report["weight_error"], relative_error(gathered[name], value)])
    return report


class LedgerByUnit(ParameterHooks):
    """Bytes sent on one communicator inside each unit's forward and backward, per collective."""

    def __init__(self, comm: C.Communicator) -> None:
        self.ledger = comm.ledger
        self.forward: dict[int, dict[str, int]] = {}
        self.backward: dict[int, dict[str, int]] = {}

    def _snapshot(self) -> None:
        self._before = dict(self.ledger.sent)

    def _difference(self) -> dict[str, int]:
        sent = {op: self.ledger.sent[op] - self._before.get(op, 0) for op in self.ledger.sent}
        return {op: count for op, count in sent.items() if count}

    def before_forward(self, unit: int) -> None:
        self._snapshot()

    def after_forward(self, unit: int) -> None:
        self.forward[unit] = self._difference()

    def before_backward(self, unit: int) -> None:
        self._snapshot()

    def after_backward(self, unit: int) -> None:
        self.backward[unit] = self._difference()


def ledger_and_memory(sequence_parallel: bool, batch_size: int = 2, length: int = 8) -> dict[str, Any]:
    """With every TP collective on the ring: the bytes each unit sends forward and backward; and the bytes the
    LayerNorms keep for backward, next to the serial model's."""
    config = tiny_config()
    tp_comm = C.world()
    model = Transformer(config, seed=SEED, dtype=np.float64).parallelize(
        TensorParallel(tp_comm, sequence_parallel, algo="ring"))
    tokens, targets = batch(config, batch_size, length, step=0)
    hooks = LedgerByUnit(tp_comm)
    tp_comm.ledger.reset()
    saved = model.forward(tokens, targets, hooks=hooks)[1]
    forward_total = tp_comm.ledger.total_sent()
    layer_norm_bytes = _layer_norm_bytes(saved)
    model.backward(saved, hooks=hooks)
    serial = Transformer(config, seed=SEED, dtype=np.float64)
    before_head = range(serial.unit_count - 1)
    return {"forward": hooks.forward, "backward": hooks.backward, "forward_total": forward_total,
            "backward_total": tp_comm.ledger.total_sent() - forward_total,
            "layer_norm_bytes": layer_norm_bytes,
            "serial_layer_norm_bytes": _layer_norm_bytes(serial.forward(tokens, targets)[1]),
            "hidden_bytes": int(model.forward(tokens, units=before_head)[0].nbytes),
            "serial_hidden_bytes": int(serial.forward(tokens, units=before_head)[0].nbytes)}


def _layer_norm_bytes(saved: Saved) -> int:
    """Bytes of the arrays every LayerNorm keeps for backward (its normalized input and 1/std)."""
    units = saved.per_unit
    norms = [units[u].ln_1 for u in range(1, len(units) - 1)] + [units[u].ln_2 for u in range(1, len(units) - 1)]
    norms.append(units[len(units) - 1].ln_f)
    return sum(int(norm.normalized.nbytes + norm.rstd.nbytes) for norm in norms)


def checkpoint_round_trip() -> dict[str, Any]:
    """load_state_dict cuts full tensors into this rank's shards; full_state_dict gathers them back unchanged."""
    config = tiny_config(vocab_size=61)
    model = Transformer(config, seed=SEED, dtype=np.float64).parallelize(TensorParallel(C.world()))
    other = Transformer(config, seed=SEED + 1, dtype=np.float64).state_dict()
    model.load_state_dict({name.removeprefix("transformer."): value for name, value in other.items()})
    gathered = full_state_dict(model)
    return {"exact": all(np.array_equal(gathered[name], value) for name, value in other.items()),
            "local_wte_rows": int(model.state_dict()["transformer.wte.weight"].shape[0])}


def errors(indivisible_heads: dict[str, int]) -> dict[str, str]:
    """The messages of the configurations tensor parallelism over this world cannot split: a model whose heads
    do not divide by tp, and with sequence parallelism a sequence of 7 tokens."""
    messages = {}
    try:
        Transformer(GPTConfig(**indivisible_heads), dtype=np.float64).parallelize(TensorParallel(C.world()))
    except ValueError as error:
        messages["heads"] = str(error)
    model = Transformer(tiny_config(), dtype=np.float64).parallelize(TensorParallel(C.world(), sequence_parallel=True))
    tokens, targets = batch(tiny_config(), 2, 7, step=0)
    try:
        model.forward(tokens, targets)
    except ValueError as error:
        messages["sequence"] = str(error)
    return messages


def _perturbed(config: GPTConfig, sequence_parallel: bool, **options: Any) -> Transformer:
    """The TP model with every weight moved off its ones/zeros init (the same move on every rank)."""
    model = Transformer(config, seed=SEED, dtype=np.float64, **options).parallelize(
        TensorParallel(C.world(), sequence_parallel))
    serial = Transformer(config, seed=SEED, dtype=np.float64)
    moved = {name: value + 0.05 * np.random.default_rng(len(name)).standard_normal(value.shape)
             for name, value in serial.state_dict().items()}
    model.load_state_dict(moved)
    return model


def _gathered_gradients(model: Transformer) -> dict[str, np.ndarray]:
    return {p.name: host(gather_tensor(p.grad, p.placement, {"tp": model.tp.comm}, p.full_shape))
            for p in model.parameters()}


def _worst(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    return worst(relative_error(got[name], value) for name, value in want.items())


def _one_at_a_time(model: Transformer, pieces: list, normalizer: int) -> tuple[float, dict]:
    model.zero_grad()
    loss = 0.0
    for tokens, targets in pieces:
        piece_loss, saved = model.forward(tokens, targets, normalizer)
        loss += piece_loss
        model.backward(saved)
    reduce_partial_gradients(model.parameters(), {"tp": model.tp.comm})
    return loss, _gathered_gradients(model)


def stateless(sequence_parallel: bool) -> dict[str, Any]:
    """Microbatches in flight with weight passes deferred (reverse and scrambled order), two ranges of units with
    the boundary handed over, and recomputation: worst relative errors against one microbatch at a time; and each
    recompute mode's saved bytes per block next to `block_activation_elements`."""
    config = GPTConfig(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=4)
    tokens, targets = batch(config, 6, 8, step=1)
    model = _perturbed(config, sequence_parallel)
    report: dict[str, Any] = {}
    for count, order in ((1, [0]), (3, [2, 1, 0]), (3, [1, 2, 0])):
        pieces = list(zip(np.array_split(tokens, count), np.array_split(targets, count), strict=True))
        want_loss, want = _one_at_a_time(model, pieces, tokens.size)
        model.zero_grad()
        forwards = [model.forward(x, y, tokens.size) for x, y in pieces]
        for i in order:
            model.backward_input(forwards[i][1])
        for i in reversed(order):
            model.backward_weights(forwards[i][1])
        reduce_partial_gradients(model.parameters(), {"tp": model.tp.comm})
        loss = sum(loss for loss, _ in forwards)
        report[f"in_flight_{count}_{order}"] = worst([relative_error(loss, want_loss),
                                                       _worst(_gathered_gradients(model), want)])
    want_loss, want = _one_at_a_time(model, [(tokens, targets)], tokens.size)
    for cut in (1, 2, 3):
        model.zero_grad()
        boundary, first = model.forward(tokens, units=range(cut))
        loss, second = model.forward(boundary, targets, units=range(cut, model.unit_count))
        model.backward(first, model.backward(second))
        reduce_partial_gradients(model.parameters(), {"tp": model.tp.comm})
        report[f"ranges_cut_at_{cut}"] = worst([relative_error(loss, want_loss),
                                                 _worst(_gathered_gradients(model), want)])
    report["saved_bytes"], report["formula_bytes"] = {}, {}
    for mode in ("none", "selective", "full"):
        recomputing = _perturbed(config, sequence_parallel, recompute=mode, query_block=3)
        loss, got = _one_at_a_time(recomputing, [(tokens, targets)], tokens.size)
        report[f"recompute_{mode}"] = worst([relative_error(loss, want_loss), _worst(got, want)])
        saved = recomputing.forward(tokens, targets)[1]
        report["saved_bytes"][mode] = [saved.per_unit[u].nbytes() for u in range(1, config.n_layer + 1)]
        report["formula_bytes"][mode] = 8 * block_activation_elements(
            6, 8, config.n_embd, config.n_head, C.world().size, sequence_parallel, mode, query_block=3)
    return report
