"""Tensor parallelism (Megatron, vocab-parallel embedding and cross-entropy) and sequence parallelism compute the
serial GPT-2's numbers in float64, and send exactly the textbook's volumes.

Two launches (2 and 4 ranks) run every multi-rank check (workers/tensor_parallel_checks.py); the tests below read
their results. Byte counts are deterministic because the ledger checks build the model with algo="ring": every
TP collective then runs the ring, whose all-reduce sends 2(n−1)/n·S bytes per rank for S bytes (the sizes here
divide by n, so every ring block is the same size).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_harness import call, run_on_ranks
from workers import tensor_parallel_checks

from models.parameter import gather_tensor, shard_tensor
from models.transformer import GPTConfig, Transformer
from mpiparallel.axes.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel_shape,
    full_state_dict,
    tensor_parallel_placement,
)

pytestmark = pytest.mark.gpu  # scripts/gpu_check.sh runs these on the GPU (tests group)

TOLERANCE = 1e-9
B, T, C, N_LAYER = 2, 8, 32, 2  # tensor_parallel_checks.tiny_config and the ledger batch
BYTES = 8  # float64
ACTIVATION = B * T * C * BYTES  # S = b·s·h elements of one activation, in bytes


def ring_all_reduce_bytes(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n


def training_runs(tp: int, dp: int, vocab_sizes: tuple[int, ...], microbatches: int = 1) -> dict:
    return {f"train tp{tp} dp{dp} sp{int(sp)} vocab{v}": call(tensor_parallel_checks.compare_training, runs=[
        {"tp": tp, "dp": dp, "sequence_parallel": sp, "vocab_size": v, "microbatches": microbatches}])
        for sp in (False, True) for v in vocab_sizes}


def ledger_checks() -> dict:
    return {f"ledger sp{int(sp)}": call(tensor_parallel_checks.ledger_and_memory, sequence_parallel=sp)
            for sp in (False, True)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    checks = {**training_runs(2, 1, (64, 61)), **ledger_checks(),
              "checkpoint": call(tensor_parallel_checks.checkpoint_round_trip),
              **{f"stateless sp{int(sp)}": call(tensor_parallel_checks.stateless, sequence_parallel=sp)
                 for sp in (False, True)},
              "errors": call(tensor_parallel_checks.errors,
                             indivisible_heads={"n_embd": 24, "n_head": 3, "vocab_size": 64})}
    return run_on_ranks(2, checks)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    checks = {**training_runs(4, 1, (64, 61)), **training_runs(2, 2, (61,), microbatches=2), **ledger_checks(),
              "errors": call(tensor_parallel_checks.errors,
                             indivisible_heads={"n_embd": 32, "n_head": 2, "vocab_size": 64})}
    return run_on_ranks(4, checks)


def results_of(two_ranks: list[dict], four_ranks: list[dict], world: int) -> list[dict]:
    return two_ranks if world == 2 else four_ranks


TRAINING = [(2, 2, 1, sp, v) for sp in (False, True) for v in (64, 61)] + \
           [(4, 4, 1, sp, v) for sp in (False, True) for v in (64, 61)] + \
           [(4, 2, 2, sp, 61) for sp in (False, True)]  # each DP rank in 2 microbatches of 1 sequence


@pytest.mark.parametrize("world, tp, dp, sp, vocab", TRAINING,
                         ids=[f"tp{tp}-dp{dp}-{'sp' if sp else 'nosp'}-vocab{v}" for _, tp, dp, sp, v in TRAINING])
def test_parallel_training_equals_serial_loss_gradients_and_weights(two_ranks, four_ranks, world, tp, dp, sp, vocab):
    results = results_of(two_ranks, four_ranks, world)
    name = f"train tp{tp} dp{dp} sp{int(sp)} vocab{vocab}"
    for rank_result in results:
        (report,) = rank_result[name]
        assert report["initial_weights_exact"]
        assert report["checked_grads"] == 3 * 28  # every parameter after each of the 3 steps
        assert report["loss_error"] <= TOLERANCE
        assert report["grad_error"] <= TOLERANCE, report["worst_grad"]
        assert report["weight_error"] <= TOLERANCE
    assert all(r[name][0]["losses"] == results[0][name][0]["losses"] for r in results)  # bit-identical on all ranks


@pytest.mark.parametrize("world", [2, 4])
def test_each_block_sends_two_all_reduces_of_bsh_forward_and_two_backward(two_ranks, four_ranks, world):
    per_block = 2 * ring_all_reduce_bytes(ACTIVATION, world)
    for rank_result in results_of(two_ranks, four_ranks, world):
        ledger = rank_result["ledger sp0"]
        for block in range(1, N_LAYER + 1):
            assert ledger["forward"][str(block)] == {"all_reduce": per_block}
            assert ledger["backward"][str(block)] == {"all_reduce": per_block}


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_sends_the_same_volume_as_all_gather_plus_reduce_scatter(two_ranks, four_ranks, world):
    gather_or_scatter = (world - 1) * ACTIVATION // world  # per rank, ring
    assert 2 * gather_or_scatter == ring_all_reduce_bytes(ACTIVATION, world)
    for rank_result in results_of(two_ranks, four_ranks, world):
        ledger = rank_result["ledger sp1"]
        for block in range(1, N_LAYER + 1):
            for direction in ("forward", "backward"):
                assert ledger[direction][str(block)] == {"all_gather": 2 * gather_or_scatter,
                                                         "reduce_scatter": 2 * gather_or_scatter}
        assert ledger["forward_total"] == rank_result["ledger sp0"]["forward_total"]
        assert ledger["backward_total"] == rank_result["ledger sp0"]["backward_total"]


@pytest.mark.parametrize("world", [2, 4])
def test_a_whole_step_sends_the_blocks_embedding_head_and_three_cross_entropy_numbers_per_token(two_ranks,
                                                                                                 four_ranks, world):
    activation_all_reduce = ring_all_reduce_bytes(ACTIVATION, world)
    cross_entropy = ring_all_reduce_bytes(B * T * BYTES, world) + ring_all_reduce_bytes(2 * B * T * BYTES, world)
    for rank_result in results_of(two_ranks, four_ranks, world):
        ledger = rank_result["ledger sp0"]
        assert ledger["forward_total"] == (2 * N_LAYER + 1) * activation_all_reduce + cross_entropy  # + embedding
        assert ledger["backward_total"] == (2 * N_LAYER + 1) * activation_all_reduce  # + the head's input


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_divides_layer_norm_and_residual_memory_by_tp(two_ranks, four_ranks, world):
    for rank_result in results_of(two_ranks, four_ranks, world):
        plain, sequence_parallel = rank_result["ledger sp0"], rank_result["ledger sp1"]
        assert plain["layer_norm_bytes"] == plain["serial_layer_norm_bytes"]
        assert sequence_parallel["layer_norm_bytes"] * world == sequence_parallel["serial_layer_norm_bytes"]
        assert sequence_parallel["hidden_bytes"] * world == sequence_parallel["serial_hidden_bytes"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_microbatches_in_flight_deferred_weight_passes_and_ranges_equal_one_at_a_time(two_ranks, sp):
    for rank in two_ranks:
        report = rank[f"stateless sp{int(sp)}"]
        checked = [key for key in report if key.startswith(("in_flight", "ranges"))]
        assert len(checked) == 6
        for key in checked:
            assert report[key] <= 1e-12, key


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_recomputation_equals_none_and_saves_the_formulas_bytes(two_ranks, sp):
    for rank in two_ranks:
        report = rank[f"stateless sp{int(sp)}"]
        for mode in ("none", "selective", "full"):
            assert report[f"recompute_{mode}"] <= 1e-12, mode
            assert report["saved_bytes"][mode] == [report["formula_bytes"][mode]] * 2, mode
        assert report["formula_bytes"]["full"] < report["formula_bytes"]["selective"] < report["formula_bytes"]["none"]


def test_full_state_dict_gathers_what_load_state_dict_cut(two_ranks):
    for rank_result in two_ranks:
        assert rank_result["checkpoint"] == {"exact": True, "local_wte_rows": 31}  # 61 padded to 62, over 2


@pytest.mark.parametrize("world, heads", [(2, 3), (4, 2)])
def test_indivisible_heads_and_sequence_are_clear_errors(two_ranks, four_ranks, world, heads):
    messages = results_of(two_ranks, four_ranks, world)[0]["errors"]
    assert f"n_head ({heads}) divisible by tp ({world})" in messages["heads"]
    assert f"sequence length 7 must be divisible by tp ({world})" in messages["sequence"]


def test_mlp_width_not_divisible_by_tp_is_named():
    with pytest.raises(ValueError, match=r"4·n_embd \(4\) divisible by tp \(8\)"):
        check_tensor_parallel_shape(GPTConfig(n_embd=1, n_head=1), 8)


def test_qkv_shard_holds_the_ranks_heads_of_q_k_and_v():
    heads, head_dim, tp = 4, 2, 2
    channels = heads * head_dim
    full = np.arange(channels * 3 * channels, dtype=np.float64).reshape(channels, 3 * channels)
    placement = tensor_parallel_placement("transformer.h.0.attn.c_attn.weight")
    for rank in range(tp):
        columns = [part * channels + head * head_dim + i for part in range(3)  # q, k, v
                   for head in range(rank * heads // tp, (rank + 1) * heads // tp) for i in range(head_dim)]
        np.testing.assert_array_equal(shard_tensor(full, placement, {"tp": (rank, tp)}), full[:, columns])


def test_vocabulary_is_padded_with_zero_rows_on_the_last_rank():
    full = np.arange(5 * 3, dtype=np.float64).reshape(5, 3) + 1
    placement = tensor_parallel_placement("transformer.wte.weight")
    shards = [shard_tensor(full, placement, {"tp": (rank, 4)}) for rank in range(4)]
    assert [s.shape for s in shards] == [(2, 3)] * 4
    np.testing.assert_array_equal(np.concatenate(shards)[:5], full)
    assert not np.concatenate(shards)[5:].any()


def test_one_rank_tensor_parallel_model_is_the_serial_model():
    config = GPTConfig(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    tokens = np.random.default_rng(0).integers(0, 61, (2, 9))
    serial = Transformer(config, seed=3, dtype=np.float64)
    model = Transformer(config, seed=3, dtype=np.float64).parallelize(
        TensorParallel(MPI.COMM_SELF, sequence_parallel=True))
    (loss, saved), (serial_loss, serial_saved) = model.forward(tokens[:, :-1], tokens[:, 1:]), serial.forward(
        tokens[:, :-1], tokens[:, 1:])
    assert loss == pytest.approx(serial_loss, rel=TOLERANCE)
    serial.backward(serial_saved)
    model.backward(saved)
    for param, serial_param in zip(model.parameters(), serial.parameters(), strict=True):
        gathered = gather_tensor(param.grad, param.placement, {"tp": MPI.COMM_SELF}, serial_param.grad.shape)
        np.testing.assert_allclose(gathered, serial_param.grad, rtol=TOLERANCE, atol=1e-14)
    assert all(np.array_equal(v, serial.state_dict()[k]) for k, v in full_state_dict(model).items())
