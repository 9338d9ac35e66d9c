"""Context-parallel attention checks run on every rank of a CP group (see mpi_harness), or in the pytest process
itself as a group of one: each variant against `CausalSelfAttention` on the whole sequence with the same weights,
the bytes each variant sends, and the layer protocol (dout untouched, saved state freed, microbatches in flight).
Each returns JSON-able numbers; the assertions live in tests/models/test_context_parallel.py."""

from __future__ import annotations

from typing import Any

import numpy as np

import collectives as C
from models.layers import CausalSelfAttention, Linear
from models.parameter import Parameter
from mpiparallel.axes.context_parallel.attention import context_parallel_attention, zigzag_shard, zigzag_unsplit

from .arrays import host, parallel_array_module
from .errors import relative_error, worst

SEED = 13
PARAMETERS = ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias")


def attention_problem(batch: int, length: int, n_embd: int, n_head: int) -> dict[str, np.ndarray]:
    """Weights, input and output gradient, the same on every rank for the same shape (float64)."""
    rng = np.random.default_rng([SEED, batch, length, n_embd, n_head])
    shapes = {"c_attn.weight": (n_embd, 3 * n_embd), "c_attn.bias": (3 * n_embd,),
              "c_proj.weight": (n_embd, n_embd), "c_proj.bias": (n_embd,),
              "x": (batch, length, n_embd), "dout": (batch, length, n_embd)}
    return {name: rng.standard_normal(shape) * 0.5 for name, shape in shapes.items()}


def projections(problem: dict[str, np.ndarray], xp: Any = np) -> tuple[Linear, Linear]:
    """Fresh qkv and output projections holding copies of the problem's weights (on `xp`), zero gradients."""
    def linear(name: str) -> Linear:
        return Linear(Parameter(f"{name}.weight", xp.array(problem[f"{name}.weight"])),
                      Parameter(f"{name}.bias", xp.array(problem[f"{name}.bias"])))
    return linear("c_attn"), linear("c_proj")


def gradients(qkv: Linear, projection: Linear) -> dict[str, np.ndarray]:
    return dict(zip(PARAMETERS, (qkv.weight.grad, qkv.bias.grad, projection.weight.grad, projection.bias.grad),
                    strict=True))


def full_attention(problem: dict[str, np.ndarray], n_head: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Output, d(input) and weight gradients of serial causal attention on the whole sequence."""
    qkv, projection = projections(problem)
    layer = CausalSelfAttention(qkv, projection, n_head)
    out, saved = layer.forward(problem["x"])
    dx = layer.backward(saved, problem["dout"])
    return out, dx, gradients(qkv, projection)


def gather_sequence(local: Any, comm: C.Communicator) -> np.ndarray:
    """Every CP rank's zigzag piece, back in sequence order, on the host."""
    return zigzag_unsplit(host(C.all_gather(local[None], comm)))


def compare_with_full_attention(variant: str, cases: list[dict[str, int]], algo: str = "auto",
                                keep_probabilities: bool = True) -> list[dict[str, Any]]:
    """Per case (batch, length, n_embd, n_head): worst relative errors of the CP layer's output and d(input)
    (gathered to sequence order) and of its weight gradients (summed over the group) against full attention;
    whether dout was left untouched and the saved state emptied. The CP layer runs on the arrays of
    MPIPARALLEL_TEST_ARRAYS, the reference on NumPy."""
    return [_compare_one(variant, algo, keep_probabilities, **case) for case in cases]


def _compare_one(variant: str, algo: str, keep_probabilities: bool, batch: int, length: int, n_embd: int,
                 n_head: int) -> dict[str, Any]:
    comm, xp = C.world(), parallel_array_module()
    problem = attention_problem(batch, length, n_embd, n_head)
    want_out, want_dx, want_grads = full_attention(problem, n_head)
    qkv, projection = projections(problem, xp)
    layer = context_parallel_attention(variant, qkv, projection, n_head, comm, algo=algo, query_block=3,
                                       keep_probabilities=keep_probabilities)
    dout = xp.asarray(zigzag_shard(problem["dout"], comm.rank, comm.size))
    dout_before = dout.copy()
    out, saved = layer.forward(xp.asarray(zigzag_shard(problem["x"], comm.rank, comm.size)))
    dx = layer.backward_input(saved, dout)
    layer.backward_weights(saved)
    report = {"out": relative_error(gather_sequence(out, comm), want_out),
              "dx": relative_error(gather_sequence(dx, comm), want_dx),
              "dout_untouched": bool(np.array_equal(host(dout), host(dout_before))), "saved_freed": not vars(saved)}
    for name, grad in gradients(qkv, projection).items():
        report[name] = relative_error(host(C.all_reduce(grad, comm)), want_grads[name])
    return report


def in_flight(variant: str, batch: int, length: int, n_embd: int, n_head: int) -> float:
    """Two microbatches forward, their input passes in reverse order, then the weight passes: the worst relative
    difference of d(input) and weight gradients from running them one at a time."""
    comm = C.world()
    problem = attention_problem(2 * batch, length, n_embd, n_head)
    pieces = np.split(zigzag_shard(problem["x"], comm.rank, comm.size), 2)
    douts = np.split(zigzag_shard(problem["dout"], comm.rank, comm.size), 2)

    def layer_and_gradients() -> tuple[Any, dict[str, np.ndarray]]:
        qkv, projection = projections(problem)
        return context_parallel_attention(variant, qkv, projection, n_head, comm), gradients(qkv, projection)

    layer, one_at_a_time = layer_and_gradients()
    want_dx = [layer.backward(layer.forward(x)[1], dout) for x, dout in zip(pieces, douts, strict=True)]
    layer, interleaved = layer_and_gradients()
    saved = [layer.forward(x)[1] for x in pieces]
    got_dx = [layer.backward_input(saved[i], douts[i]) for i in (1, 0)][::-1]
    for state in saved:
        layer.backward_weights(state)
    errors = [relative_error(got, want) for got, want in zip(got_dx, want_dx, strict=True)]
    errors += [relative_error(interleaved[name], one_at_a_time[name]) for name in PARAMETERS]
    return worst(errors)


def bytes_sent(variant: str, algo: str, batch: int, length: int, n_embd: int, n_head: int) -> dict[str, Any]:
    """Bytes this rank sends in the layer's forward and in its backward, in all and per operation."""
    comm = C.world()
    problem = attention_problem(batch, length, n_embd, n_head)
    layer = context_parallel_attention(variant, *projections(problem), n_head, comm, algo=algo)
    ledger = comm.ledger
    ledger.reset()
    out, saved = layer.forward(zigzag_shard(problem["x"], comm.rank, comm.size))
    forward = dict(ledger.sent)
    ledger.reset()
    layer.backward(saved, zigzag_shard(problem["dout"], comm.rank, comm.size))
    backward = dict(ledger.sent)
    return {"forward": sum(forward.values()), "backward": sum(backward.values()),
            "forward_operations": sorted(forward), "backward_operations": sorted(backward)}


def ulysses_heads_error(n_head: int) -> str:
    """The message of Ulysses built with heads the group cannot split."""
    qkv, projection = projections(attention_problem(1, 4, 2 * n_head, n_head))
    try:
        context_parallel_attention("ulysses", qkv, projection, n_head, C.world())
    except ValueError as error:
        return str(error)
    return "no error"


def compare_documents_with_full_attention(variant: str, tokens: list[list[int]], n_embd: int = 16,
                                          n_head: int = 4) -> dict[str, Any]:
    """Packed documents (end-of-text id 0 in `tokens`, (B, s)): the CP layer's output, d(input) and weight
    gradients against serial attention over the whole windows with the same documents, worst relative error; and
    the chunk pairs this rank attended forward (ring, all-gather: `OnlineSoftmax.add` calls), to sum over the
    group."""
    from models.documents import Documents
    from mpiparallel.axes.context_parallel import attention

    comm, xp = C.world(), parallel_array_module()
    tokens = np.asarray(tokens)
    documents = Documents.of_tokens(tokens, 0)
    problem = attention_problem(*tokens.shape, n_embd, n_head)
    qkv, projection = projections(problem)
    serial = CausalSelfAttention(qkv, projection, n_head, query_block=3)
    out, saved = serial.forward(problem["x"], documents)
    want_dx, want = serial.backward(saved, problem["dout"]), gradients(qkv, projection)
    qkv, projection = projections(problem, xp)
    layer = context_parallel_attention(variant, qkv, projection, n_head, comm, query_block=3)
    pairs, add = [0], attention.OnlineSoftmax.add

    def counting(self, *args: Any) -> None:
        pairs[0] += 1
        add(self, *args)

    attention.OnlineSoftmax.add = counting
    try:
        got, saved = layer.forward(xp.asarray(zigzag_shard(problem["x"], comm.rank, comm.size)), documents)
    finally:
        attention.OnlineSoftmax.add = add
    dx = layer.backward(saved, xp.asarray(zigzag_shard(problem["dout"], comm.rank, comm.size)))
    errors = [relative_error(gather_sequence(got, comm), out), relative_error(gather_sequence(dx, comm), want_dx)]
    errors += [relative_error(host(C.all_reduce(grad, comm)), want[name])
               for name, grad in gradients(qkv, projection).items()]
    return {"error": worst(errors), "pairs": int(C.all_reduce(np.array([pairs[0]]), comm)[0])}
