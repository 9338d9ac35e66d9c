"""The two-hop (node-limited) all-to-all of `collectives.two_hop` on emulated nodes: every assignment's row and value
arrive at its expert's rank, the combine sums each token's weighted copies (the dispatch's transpose), and the bytes
that cross nodes equal the module's formula counted from the routing — fewer than the flat all-to-allv's when a
token's experts share nodes."""

from __future__ import annotations

import pytest
from mpi_harness import run_on_ranks
from workers import two_hop_checks


@pytest.mark.parametrize("ranks, k, slots, top_k, nodes_per_token", [
    (4, 2, 2, 3, 1),   # 2 nodes of 2: every token on one node, 3 experts there
    (6, 2, 1, 4, 2),   # 3 nodes of 2, one expert per rank: 4 experts on 2 of the 3 nodes
    (4, 1, 3, 2, 2),   # 4 nodes of 1: no second hop inside a node
])
def test_two_hop_all_to_all_delivers_every_assignment_and_sends_its_formulas_bytes_across_nodes(
        ranks, k, slots, top_k, nodes_per_token):
    results = run_on_ranks(ranks, two_hop_checks.exchanges, timeout=120,
                           env={"MPIPARALLEL_RANKS_PER_NODE": str(k)}, tokens=12, top_k=top_k, slots=slots, width=64,
                           nodes_per_token=nodes_per_token, seed=7)
    for rank, result in enumerate(results):
        assert not result["failures"], f"rank {rank}: {result['failures'][:5]}"
        assert result["two_hop_inter_node"] == result["formula"], (rank, result)
        assert result["flat_inter_node"] == result["flat_formula"], (rank, result)
    rows = sum(result["two_hop_rows"] for result in results)
    two_hop = sum(result["two_hop_inter_node"] for result in results)
    flat = sum(result["flat_inter_node"] for result in results)
    assert rows < two_hop < flat, (rows, two_hop, flat)  # the rows, with the plan and values, still fewer
    # per token at most M rows of 64 float64 across nodes each way (M: the nodes of its experts)
    assert rows <= 2 * ranks * 12 * nodes_per_token * 64 * 8
