"""The hand-written collectives compute exactly what the MPI library computes, and send what the theory says."""

from __future__ import annotations

import pytest
from mpi_harness import RankFailure, call, run_on_ranks, worker_job
from workers import collective_checks

RANK_COUNTS = [1, 2, 3, 4, 5, 8]


def _assert_no_failures(results: list[list[str]]) -> None:
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: {len(failures)} failures, first: {failures[:5]}"


@pytest.mark.parametrize("ranks", RANK_COUNTS)
def test_every_collective_and_algorithm_matches_native_mpi(ranks):
    """Sizes 0, 1, 7, 1000 × float16/32/64, bfloat16, int32/64 × sum/prod/max/min/avg × every algorithm; the
    inputs are small integers, so every result is exact, bfloat16's too, and must equal the reference's.

    On one rank, where every call is local and so equals algo="mpi" trivially, each algorithm must also return a
    new array equal to its input (the reduction of one contribution) and send nothing."""
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_against_native, sizes=[0, 1, 7, 1000]))


LARGE_DTYPES = ["float16", "float32", "float64", "int32", "int64"]


@pytest.mark.parametrize("ranks", RANK_COUNTS)
def test_every_collective_matches_native_mpi_on_a_million_and_three_elements(ranks):
    """As above on one large size; on one rank, each algorithm returns a copy of its input and sends nothing.
    Eight ranks on two cores take a minute over all five dtypes: there the narrowest and the widest element
    stand for them (every dtype is checked on eight ranks at the small sizes above, and at this size on 1–5)."""
    dtypes = ["float16", "int64"] if ranks == 8 else LARGE_DTYPES
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_against_native, timeout=400, sizes=[1_000_003],
                                     dtypes=dtypes))


@pytest.mark.parametrize("ranks", [3, 4, 5])
def test_messages_cut_into_many_segments_still_match_native(ranks):
    """A 40-byte segment limit sends every block in pieces (uneven, some empty): the pipelining paths."""
    results = run_on_ranks(ranks, collective_checks.check_against_native, env={"MPIPARALLEL_SEGMENT_BYTES": "40"},
                           sizes=[7, 1000], dtypes=["float64", "int32", "bfloat16"], ops=["sum", "avg"])
    _assert_no_failures(results)


@pytest.mark.parametrize("ranks", [2, 3])
def test_multidimensional_noncontiguous_and_out_arguments(ranks):
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_multidimensional))


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_bytes(ranks):
    count = 840 * ranks  # divisible: every rank sends exactly the textbook volume
    nbytes = count * 8
    for rank, volumes in enumerate(run_on_ranks(ranks, collective_checks.ledger_volumes, count=count)):
        expected = 2 * (ranks - 1) * nbytes // ranks
        assert volumes["all_reduce"]["sent"] == expected, f"rank {rank}"
        assert volumes["all_reduce"]["received"] == expected, f"rank {rank}"
        assert volumes["all_reduce"]["by_operation"] == {"all_reduce": expected}


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_ring_reduce_scatter_and_all_gather_send_n_minus_1_over_n_bytes(ranks):
    count = 840 * ranks
    nbytes = count * 8
    for volumes in run_on_ranks(ranks, collective_checks.ledger_volumes, count=count):
        assert volumes["reduce_scatter"]["sent"] == (ranks - 1) * nbytes // ranks
        assert volumes["reduce_scatter"]["received"] == (ranks - 1) * nbytes // ranks
        gathered = nbytes * ranks  # all_gather's S is the gathered output
        assert volumes["all_gather"]["sent"] == (ranks - 1) * gathered // ranks
        assert volumes["all_to_all"]["sent"] == (ranks - 1) * nbytes // ranks


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_bfloat16_collectives_send_2_bytes_per_element_and_pairwise_the_ring_volume(ranks):
    count = 840 * ranks
    for volumes in run_on_ranks(ranks, collective_checks.ledger_volumes, count=count, dtype="bfloat16"):
        one_pass = (ranks - 1) * count * 2 // ranks
        assert volumes["all_reduce"]["sent"] == volumes["pairwise_all_reduce"]["sent"] == 2 * one_pass
        assert volumes["pairwise_all_reduce"]["received"] == 2 * one_pass
        assert volumes["reduce_scatter"]["sent"] == volumes["pairwise_reduce_scatter"]["sent"] == one_pass
        assert volumes["all_gather"]["sent"] == (ranks - 1) * count * 2
        assert volumes["all_to_all"]["sent"] == one_pass


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_pairwise_reduction_is_the_rank_order_float32_sum_rounded_once(ranks):
    """On random bfloat16, float16 and float32 data (not exactly representable sums), bit for bit; also async,
    in place, and as algo="auto"'s choice for 16-bit sums and averages."""
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_pairwise_rounds_once, count=1001))
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_pairwise_rounds_once, count=7,
                                     env={"MPIPARALLEL_SEGMENT_BYTES": "4"}))


def test_rabenseifner_on_a_power_of_two_sends_the_ring_volume():
    count = 4 * 1000
    for volumes in run_on_ranks(4, collective_checks.ledger_volumes, count=count):
        assert volumes["rabenseifner"]["sent"] == 2 * 3 * count * 8 // 4


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_async_collectives_in_flight_together_equal_the_sync_forms(ranks):
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_async_equals_sync, count=10_001))
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_async_equals_sync, count=3,
                                     env={"MPIPARALLEL_SEGMENT_BYTES": "8"}))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_pooled_scratch_buffers_are_never_shared_by_collectives_in_flight(ranks):
    """Every temporary from the scratch pool (normally only those of 1 MiB or more): async handles in flight
    together still equal the sync forms, in place too, and their buffers are back in the pool at the end."""
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_async_equals_sync, count=1001,
                                     pool_everything=True))
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_out_aliasing_input, pool_everything=True))


def test_bad_arguments_raise_value_errors_naming_the_valid_choices():
    messages = run_on_ranks(2, collective_checks.check_errors_are_clear)[0]
    assert "median" in messages["bad_op"] and "sum, prod, max, min, avg" in messages["bad_op"]
    assert "hypercube" in messages["bad_algo"]
    for algo in ("ring", "recursive_doubling", "rabenseifner", "mpi", "auto"):
        assert algo in messages["bad_algo"]
    assert "bruck" in messages["bad_algo_for_collective"]
    assert "divisible" in messages["not_divisible"] and "shape" in messages["not_divisible"]
    assert "divisible" in messages["alltoall_not_divisible"]
    assert "dtype" in messages["bad_out_dtype"]
    assert "root" in messages["bad_root"]
    assert "send_counts" in messages["bad_counts"]
    assert "dtype" in messages["string_dtype"]
    assert "valid" in messages["async_mpi"]


def test_bad_arguments_raise_on_every_rank():
    results = run_on_ranks(3, collective_checks.check_errors_are_clear)
    for messages in results:
        assert "NO ERROR" not in messages.values(), messages


def test_check_mode_reports_mismatched_shapes_on_every_rank():
    results = run_on_ranks(3, collective_checks.mismatched_shapes, env={"MPIPARALLEL_CHECK": "1"})
    for message in results:
        assert "ranks disagree" in message
        assert "rank 0: all_reduce(shape=(4,)" in message and "rank 2: all_reduce(shape=(6,)" in message


def test_check_mode_names_bfloat16_in_a_dtype_mismatch():
    for message in run_on_ranks(2, collective_checks.mismatched_dtypes, env={"MPIPARALLEL_CHECK": "1"}):
        assert "rank 0: all_reduce(shape=(4,), dtype=bfloat16" in message
        assert "rank 1: all_reduce(shape=(4,), dtype=float16" in message


def test_an_exception_on_one_rank_ends_the_job_instead_of_hanging():
    # The other ranks sit in a collective, then sleep 60 s: only MPI_Abort ends the job before the 50 s timeout
    # (a timeout would raise "hung", which does not match).
    with pytest.raises(RankFailure, match="deliberate failure on rank 1"):
        run_on_ranks(3, collective_checks.raise_on_rank, timeout=50, rank=1)


def test_a_hang_fails_after_the_timeout_instead_of_stalling():
    with pytest.raises(RankFailure, match="hung"):
        run_on_ranks(2, collective_checks.raise_on_rank, timeout=3, rank=5)  # nobody raises; both sleep


def test_a_group_of_calls_runs_in_one_launch_and_answers_by_name():
    results = run_on_ranks(2, {"size 1000": call(collective_checks.ledger_volumes, count=1000),
                               "size 8": call(collective_checks.ledger_volumes, count=8)})
    assert [sorted(result) for result in results] == [["size 1000", "size 8"]] * 2
    assert results[0]["size 1000"] != results[0]["size 8"]


def test_a_function_no_rank_can_import_is_refused_before_the_launch():
    def inside_a_test() -> None:  # a rank imports what it runs: a function defined here has no importable name
        pass

    with pytest.raises(ValueError, match="must be defined at module level"):
        worker_job(inside_a_test)
    with pytest.raises(TypeError, match="carries its arguments in each call"):
        worker_job({"a": call(collective_checks.ledger_volumes, count=3)}, count=3)


def test_point_to_point_ledger_and_split_communicators():
    _assert_no_failures(run_on_ranks(4, collective_checks.check_point_to_point_and_split))


@pytest.mark.parametrize("ranks", [2, 3])
def test_out_may_alias_the_input_for_every_algorithm(ranks):
    _assert_no_failures(run_on_ranks(ranks, collective_checks.check_out_aliasing_input))
