"""Context-parallel attention (mpiparallel/axes/context_parallel/attention.py): every variant computes full causal
attention's numbers in float64, sends exactly its stated volume, and under the zigzag layout gives every CP rank the
same work.

Two launches (2 and 4 ranks) run every multi-rank check (workers/context_parallel_checks.py); a group of one
(cp = 1) runs in this process. Byte counts are exact because the ledger checks run the ring all-gather and
reduce-scatter and the pairwise all-to-all, which send every byte once (the sizes here divide evenly).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_harness import call, run_on_ranks
from workers import context_parallel_checks
from workers.context_parallel_checks import (
    PARAMETERS,
    attention_problem,
    compare_with_full_attention,
    in_flight,
    projections,
)
from workers.errors import worst

from models.documents import Documents, skipped_chunk_pairs
from mpiparallel.axes.context_parallel.attention import (
    VARIANTS,
    causal_chunk_pairs,
    context_parallel_attention,
    zigzag_chunks,
    zigzag_positions,
    zigzag_shard,
    zigzag_split,
    zigzag_unsplit,
)

pytestmark = pytest.mark.gpu  # scripts/gpu_check.sh runs these on the GPU (tests group)

TOLERANCE = 1e-12
BYTES = 8  # float64
CASES = {  # (batch, length, n_embd, n_head) per cp: lengths of 1, 3 and 5 tokens per chunk; Ulysses needs cp | n_head
    1: [(2, 6, 16, 2), (1, 10, 24, 3)],
    2: [(2, 4, 16, 2), (2, 12, 16, 4), (1, 20, 24, 6)],
    4: [(2, 8, 16, 4), (1, 24, 32, 8), (2, 40, 16, 4)],
}
LEDGER = {"batch": 2, "length": 16, "n_embd": 16, "n_head": 4}
LEDGER_ALGO = {"ring": "auto", "all-gather": "ring", "ulysses": "pairwise"}  # ring attention is point-to-point
INDIVISIBLE_HEADS = {2: 3, 4: 6}


# packed documents (end-of-text id 0), 2 tokens per chunk (cp 4) or 4 (cp 2): documents open inside chunks, at a
# chunk's first token, and a document longer than a chunk; one row, so whole chunk pairs are skipped
DOCUMENT_TOKENS = {2: [[0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1]],
                   4: [[0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1]]}


def cases(cp: int) -> list[dict[str, int]]:
    return [dict(zip(("batch", "length", "n_embd", "n_head"), case, strict=True)) for case in CASES[cp]]


def checks(cp: int) -> dict:
    suite = {}
    for variant in VARIANTS:
        suite[variant] = call(context_parallel_checks.compare_with_full_attention, variant=variant, cases=cases(cp))
        suite[f"{variant} in flight"] = call(context_parallel_checks.in_flight, variant=variant, **cases(cp)[0])
        suite[f"{variant} bytes"] = call(context_parallel_checks.bytes_sent, variant=variant,
                                         algo=LEDGER_ALGO[variant], **LEDGER)
    suite["ulysses selective"] = call(context_parallel_checks.compare_with_full_attention, variant="ulysses",
                                      cases=cases(cp), keep_probabilities=False)
    suite["ulysses heads"] = call(context_parallel_checks.ulysses_heads_error, n_head=INDIVISIBLE_HEADS[cp])
    for variant in VARIANTS:
        suite[f"{variant} documents"] = call(context_parallel_checks.compare_documents_with_full_attention,
                                             variant=variant, tokens=DOCUMENT_TOKENS[cp])
    return suite


@pytest.fixture(scope="module")
def launches() -> dict[int, list[dict]]:
    return {cp: run_on_ranks(cp, checks(cp)) for cp in (2, 4)}


def worst_error(report: dict) -> float:
    return worst(report[name] for name in ("out", "dx", *PARAMETERS))


# -- equal to full causal attention ---------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", [*VARIANTS, "ulysses selective"])
def test_output_input_gradient_and_weight_gradients_equal_full_causal_attention(launches, cp, variant):
    for rank_result in launches[cp]:
        reports = rank_result[variant]
        assert len(reports) == len(CASES[cp])
        for case, report in zip(CASES[cp], reports, strict=True):
            assert worst_error(report) <= TOLERANCE, (case, report)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_with_packed_documents_every_variant_equals_serial_and_skips_the_pairs_between_documents(launches, cp,
                                                                                                variant):
    report = launches[cp][0][f"{variant} documents"]
    assert report["error"] <= TOLERANCE, report
    documents = Documents.of_tokens(np.array(DOCUMENT_TOKENS[cp]), 0)
    skipped = skipped_chunk_pairs(documents, cp)
    assert skipped >= cp  # the layout skips pairs at all
    if variant != "ulysses":  # Ulysses runs the serial layer's key blocks instead of chunk pairs
        assert report["pairs"] == cp * (2 * cp + 1) - skipped


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_group_of_one_equals_full_causal_attention(variant):
    for report in compare_with_full_attention(variant, cases(1)):
        assert worst_error(report) <= TOLERANCE, report


def test_on_the_cupy_test_double_with_host_staging_every_variant_equals_full_causal_attention():
    device = {"MPIPARALLEL_TEST_ARRAYS": "fake", "MPIPARALLEL_CUDA_AWARE": "0"}  # MPI never sees a device buffer
    suite = {variant: call(context_parallel_checks.compare_with_full_attention, variant=variant, cases=cases(2)[1:2])
             for variant in VARIANTS}
    for rank_result in run_on_ranks(2, suite, env=device):
        for variant in VARIANTS:
            (report,) = rank_result[variant]
            assert worst_error(report) <= TOLERANCE, (variant, report)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_layers_leave_dout_untouched_and_free_their_saved_state(launches, cp, variant):
    for rank_result in launches[cp]:
        for report in rank_result[variant]:
            assert report["dout_untouched"] and report["saved_freed"]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_microbatches_in_flight_with_deferred_weight_passes_match_one_at_a_time(launches, cp, variant):
    assert all(rank_result[f"{variant} in flight"] <= TOLERANCE for rank_result in launches[cp])
    assert in_flight(variant, **cases(1)[0]) <= TOLERANCE


# -- bytes sent ------------------------------------------------------------------------------------------------

def stated_elements(variant: str, cp: int, b: int, s: int, h: int) -> tuple[float, float]:
    """Elements one rank sends per layer, forward and backward: the formulas of the variants' docstrings."""
    bsh = b * s * h
    return {"ring": (2 * (cp - 1) * bsh / cp, 2 * (2 * cp - 1) * bsh / cp),
            "all-gather": (2 * (cp - 1) * bsh / cp, 4 * (cp - 1) * bsh / cp),
            "ulysses": (4 * (cp - 1) * bsh / cp**2, 4 * (cp - 1) * bsh / cp**2)}[variant]


OPERATIONS = {"ring": (["p2p"], ["p2p"]), "all-gather": (["all_gather"], ["all_gather", "reduce_scatter"]),
              "ulysses": (["all_to_all"], ["all_to_all"])}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_rank_sends_the_variants_stated_bytes_forward_and_backward(launches, cp, variant):
    forward, backward = stated_elements(variant, cp, LEDGER["batch"], LEDGER["length"], LEDGER["n_embd"])
    for rank_result in launches[cp]:
        sent = rank_result[f"{variant} bytes"]
        assert (sent["forward"], sent["backward"]) == (forward * BYTES, backward * BYTES)
        assert (sent["forward_operations"], sent["backward_operations"]) == OPERATIONS[variant]


# -- the zigzag layout and its balance -------------------------------------------------------------------------

def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r_with_their_positions():
    assert [zigzag_chunks(rank, 4) for rank in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert zigzag_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    every_position = np.concatenate([zigzag_positions(24, rank, 3) for rank in range(3)])
    assert sorted(every_position.tolist()) == list(range(24))


def test_zigzag_shard_split_and_unsplit_move_activations_between_sequence_order_and_the_ranks():
    x = np.random.default_rng(0).standard_normal((2, 16, 3))
    pieces = zigzag_split(x, 4)
    assert pieces.shape == (4, 2, 4, 3)
    for rank in range(4):
        assert np.array_equal(pieces[rank], x[:, zigzag_positions(16, rank, 4)])
        assert np.array_equal(zigzag_shard(x, rank, 4), pieces[rank])
    assert np.array_equal(zigzag_unsplit(pieces), x)
    tokens = np.arange(12).reshape(1, 12)
    assert zigzag_shard(tokens, 1, 3).tolist() == [[2, 3, 8, 9]]


def chunk_pairs_per_rank(cp: int, chunks_of) -> list[tuple[int, float]]:
    """(chunk pairs, work) each rank computes against every rank's chunks; a diagonal pair is half the work."""
    counts = []
    for rank in range(cp):
        pairs = [pair for source in range(cp) for pair in causal_chunk_pairs(chunks_of(rank), chunks_of(source))]
        counts.append((len(pairs), sum(0.5 if diagonal else 1.0 for _, _, diagonal in pairs)))
    return counts


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_under_zigzag_every_cp_rank_computes_the_same_chunk_pairs(cp):
    counts = chunk_pairs_per_rank(cp, lambda rank: zigzag_chunks(rank, cp))
    assert max(pairs for pairs, _ in counts) - min(pairs for pairs, _ in counts) <= 1
    assert counts == [(2 * cp + 1, 2 * cp)] * cp  # exactly: a 1/cp share of the causal (2cp)²/2 chunk pairs


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_a_contiguous_split_gives_the_last_rank_far_more_pairs_than_the_first(cp):
    counts = chunk_pairs_per_rank(cp, lambda rank: (2 * rank, 2 * rank + 1))
    assert [pairs for pairs, _ in counts] == [4 * rank + 3 for rank in range(cp)]
    assert counts[-1][1] / counts[0][1] == 2 * cp - 1  # work: the last rank's 4cp − 2 against the first's 2


def test_every_chunk_pair_in_the_causal_triangle_is_computed_exactly_once():
    cp = 4
    computed = [(zigzag_chunks(rank, cp)[q], zigzag_chunks(source, cp)[k])
                for rank in range(cp) for source in range(cp)
                for q, k, _ in causal_chunk_pairs(zigzag_chunks(rank, cp), zigzag_chunks(source, cp))]
    assert sorted(computed) == [(q, k) for q in range(2 * cp) for k in range(q + 1)]


# -- one clear error each --------------------------------------------------------------------------------------

def test_a_length_not_divisible_by_2cp_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 12 must be divisible by 8"):
        zigzag_positions(12, 0, 4)
    with pytest.raises(ValueError, match=r"sequence length 10 must be divisible by 4"):
        zigzag_shard(np.zeros((1, 10, 2)), 0, 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_layer_refuses_a_local_length_that_is_not_two_chunks(variant):
    problem = attention_problem(1, 5, 8, 2)
    layer = context_parallel_attention(variant, *projections(problem), 2, MPI.COMM_SELF)
    with pytest.raises(ValueError, match=r"local length 5 must be even"):
        layer.forward(problem["x"])


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_refuses_heads_not_divisible_by_cp(launches, cp):
    for rank_result in launches[cp]:
        message = rank_result["ulysses heads"]
        assert f"n_head ({INDIVISIBLE_HEADS[cp]};" in message and f"divisible by cp ({cp})" in message


def test_an_unknown_variant_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown context-parallel attention 'zigzag'; valid: ring, all-gather, "
                                         r"ulysses"):
        context_parallel_attention("zigzag", *projections(attention_problem(1, 4, 8, 2)), 2, MPI.COMM_SELF)
