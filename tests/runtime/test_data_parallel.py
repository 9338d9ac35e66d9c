"""Data parallelism and ZeRO compute exactly what the serial model computes, and send the textbook volumes."""

from __future__ import annotations

import pytest
from mpi_harness import run_on_ranks
from workers import data_parallel_checks
from workers.data_parallel_checks import CONFIG

from models.transformer import GPTConfig, Transformer
from mpiparallel.axes.data_parallel import build_buckets

pytestmark = pytest.mark.gpu  # scripts/gpu_check.sh runs these on the GPU (tests group)



@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_data_parallel_equals_serial_in_float64(ranks, zero, microbatches):
    """3 AdamW steps with clipping and weight decay: loss, every gathered gradient and every weight."""
    for rank, failures in enumerate(run_on_ranks(ranks, data_parallel_checks.check_equals_serial, zero=zero,
                                                 microbatch_count=microbatches)):
        assert not failures, f"rank {rank}: {failures[:5]}"


@pytest.mark.parametrize("zero", [0, 2])
def test_without_overlap_the_result_is_the_same(zero):
    for failures in run_on_ranks(2, data_parallel_checks.check_equals_serial, zero=zero, microbatch_count=2,
                                 overlap=False):
        assert not failures, failures[:5]


def test_buckets_follow_backward_order_and_never_split_a_unit():
    model = Transformer(GPTConfig(vocab_size=61, n_positions=16, n_embd=16, n_layer=3, n_head=2))
    units = model.unit_parameters()
    buckets = build_buckets(units, bucket_bytes=1, ranks=4)  # 1 byte: one bucket per unit
    assert [b.final_after for b in buckets] == [4, 3, 2, 1, 0]
    assert [p.name for p in buckets[0].params] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert {p.name for p in buckets[-1].params} == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert buckets[-1].used_by == {0, 4}  # the tied wte is read by the embedding and by the head
    assert all(b.padded % 4 == 0 and b.padded - b.size < 4 for b in buckets)
    everything = build_buckets(units, bucket_bytes=1 << 40, ranks=4)
    assert len(everything) == 1 and everything[0].final_after == 0


@pytest.mark.parametrize("ranks", [2, 4])
def test_data_parallel_all_reduce_sends_2_n_minus_1_over_n_gradient_bytes(ranks):
    for result in run_on_ranks(ranks, data_parallel_checks.ledger_of_one_step, zero=0):
        gradient_bytes = sum(result["bucket_bytes"])
        assert result["sent"] == {"all_reduce": 2 * (ranks - 1) * gradient_bytes // ranks}


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_reduce_scatter_and_all_gather_the_same_total(zero):
    ranks = 4
    for result in run_on_ranks(ranks, data_parallel_checks.ledger_of_one_step, zero=zero):
        total = sum(result["bucket_bytes"])
        assert result["sent"] == {"reduce_scatter": (ranks - 1) * total // ranks,
                                  "all_gather": (ranks - 1) * total // ranks}
        assert sum(result["sent"].values()) == 2 * (ranks - 1) * total // ranks  # = the DP all-reduce


def gathers_per_microbatch(used_by: list[int], units: int) -> int:
    """How often ZeRO-3 gathers a bucket in one forward + backward: once per run of consecutive unit visits
    (forward 0…U−1, then backward U−1…0) that read it — it stays gathered while the next visit needs it."""
    visits = list(range(units)) + list(reversed(range(units)))
    needed = [unit in used_by for unit in visits]
    return sum(1 for i, need in enumerate(needed) if need and (i == 0 or not needed[i - 1]))


def test_zero_3_adds_the_parameter_gathers_of_forward_and_backward():
    ranks = 4
    for result in run_on_ranks(ranks, data_parallel_checks.ledger_of_one_step, zero=3):
        sizes, units = result["bucket_bytes"], result["units"]
        counts = [gathers_per_microbatch(used_by, units) for used_by in result["used_by"]]
        # a block's bucket: once before its forward, once before its backward; the head's stays gathered from
        # its forward into its backward; the bucket of the tied wte is read by the embedding and by the head
        assert counts[0] == 1 and counts[-1] == 3 and set(counts[1:-1]) == {2}
        gathered = sum(size * count for size, count in zip(sizes, counts, strict=True))
        assert result["sent"] == {"reduce_scatter": (ranks - 1) * sum(sizes) // ranks,
                                  "all_gather": (ranks - 1) * gathered // ranks}


def test_zero_shrinks_what_each_rank_holds_to_the_byte():
    """Parameters, gradients and AdamW's two moments each rank holds (float64), exactly: with P parameters in
    buckets padded to a multiple of the n ranks (B elements in all), plain DP holds 8P + 8B + 16P bytes; ZeRO-1
    shards the moments (16B/n) but keeps the full parameter and gradient buffers (ZeRO-1 writes the reduced shard
    into its gradient buffer: the textbook P + G + 2P/n); ZeRO-2 shards the gradients (8B/n); ZeRO-3 the
    parameters too (8B/n)."""
    ranks, itemsize = 3, 8  # 3 ranks: some buckets need padding
    launches = {zero: run_on_ranks(ranks, data_parallel_checks.ledger_of_one_step, zero=zero, batch=6)[0]
                for zero in (0, 1, 2, 3)}
    parameters = CONFIG.parameter_count()
    elements = launches[0]["bucket_elements"]
    assert sum(elements) == parameters
    padded = sum(-(-used // ranks) * ranks for used in elements)  # each bucket rounded up to a multiple of n
    assert 0 < padded - parameters < ranks * len(elements)
    full, shard = itemsize * padded, itemsize * padded // ranks
    want = {0: {"parameters": itemsize * parameters, "gradients": full, "optimizer_state": 2 * itemsize * parameters},
            1: {"parameters": full, "gradients": full, "optimizer_state": 2 * shard},
            2: {"parameters": full, "gradients": shard, "optimizer_state": 2 * shard},
            3: {"parameters": shard, "gradients": shard, "optimizer_state": 2 * shard}}
    for zero, launch in launches.items():
        assert launch["bucket_elements"] == elements, zero  # the same buckets at every stage
        assert launch["memory"] == want[zero], zero
