"""The MoE layer with the node-limited two-hop dispatch (`ep_dispatch="hierarchical"`,
mpiparallel/axes/expert_parallel.py over collectives/two_hop.py) on 2 emulated nodes of 2 ranks: forward, d(x) and
every gradient equal the serial layer's (float64, ≤ 1e-9) — with capacity dropping rows, so that some tokens reach
no expert — and so do the flat dispatch's; the two-hop one sends fewer bytes across nodes."""

from __future__ import annotations

from mpi_harness import run_on_ranks
from workers import two_hop_checks

TOLERANCE = 1e-9


def test_the_two_hop_moe_layer_equals_the_serial_layer_and_crosses_nodes_less():
    results = run_on_ranks(4, two_hop_checks.layer_against_sets, timeout=120,
                           env={"MPIPARALLEL_RANKS_PER_NODE": "2"}, n_experts=8, top_k=3, capacity_factor=0.5)
    for rank, result in enumerate(results):
        assert max(result["errors"].values()) <= TOLERANCE, (rank, result["errors"])
        assert len(result["errors"]) == 2 * (3 + 2 * 2), result["errors"]  # y, dx, router; 2 experts × 2 linears
    assert sum(result["dropped_tokens"] for result in results) > 0  # some tokens kept no expert at all
    flat, two_hop = (sum(result["across"][kind] for result in results) for kind in ("flat", "hierarchical"))
    assert 0 < two_hop < flat, (two_hop, flat)
