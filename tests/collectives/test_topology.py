"""Nodes: hierarchical collectives, the two-tier cost model, and the ledger's count of bytes that cross nodes.

Nodes are emulated with MPIPARALLEL_RANKS_PER_NODE=k (every k consecutive world ranks a node), so one machine
shows a cluster's behaviour.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from mpi_harness import run_on_ranks, run_with_timeout
from workers import device_checks, topology_checks

from collectives.cost_model import CostModel, choose, load_calibration, predict
from collectives.topology import NodeLayout, inter_node_bytes
from mpiparallel.mesh import MeshShape, axes_spanning_nodes
from mpiparallel.planner.core import Cluster, collective_seconds, group_nodes

S = 1 << 20


# -- node layouts and formulas (no MPI) ---------------------------------------------------------------------

def test_unequal_nodes_fold_the_ranks_beyond_the_smallest_node_into_its_lanes():
    layout = NodeLayout((0, 0, 0, 0, 1, 1))
    assert (layout.count, layout.k, layout.even) == (2, 2, False)
    assert layout.lane(0) == (0, 4) and layout.lane(1) == (1, 5)
    assert [layout.is_extra(r) for r in range(6)] == [False, False, True, True, False, False]
    assert layout.core_of(2) == 0 and layout.core_of(3) == 1 and layout.extras_of(0) == (2,)
    assert layout.block_order == (0, 2, 4, 1, 3, 5)  # lane 0: rank 0 with its extra 2, then 4; lane 1 likewise


def test_nodes_of_a_sub_communicator_need_not_be_consecutive():
    layout = NodeLayout((3, 5, 3, 5))
    assert layout.node_index == (0, 1, 0, 1) and layout.members == ((0, 2), (1, 3))
    assert layout.lane(1) == (2, 3)


def test_ring_inter_node_bytes_are_the_whole_volume_where_the_right_neighbour_is_on_another_node():
    nodes = (0, 0, 0, 0, 1, 1, 1, 1)
    for rank in range(8):
        crosses = rank in (3, 7)
        assert inter_node_bytes("all_reduce", "ring", S, nodes, rank) == (2 * 7 / 8 * S if crosses else 0)
        assert inter_node_bytes("all_gather", "ring", S, nodes, rank) == (7 / 8 * S if crosses else 0)


def test_hierarchical_all_reduce_sends_2_n_minus_1_over_n_of_s_over_k_across_nodes():
    for nodes, big_n, k in (((0, 0, 1, 1), 2, 2), ((0, 0, 0, 0, 1, 1, 1, 1), 2, 4), ((0, 0, 1, 1, 2, 2), 3, 2)):
        for rank in range(len(nodes)):
            assert inter_node_bytes("all_reduce", "hierarchical", S, nodes, rank) == pytest.approx(
                2 * (big_n - 1) / big_n * S / k)
            assert inter_node_bytes("reduce_scatter", "hierarchical", S, nodes, rank) == pytest.approx(
                (big_n - 1) / big_n * S / k)


def test_every_collective_inside_one_node_sends_nothing_across():
    for algo in ("ring", "hierarchical", "recursive_doubling", "rabenseifner"):
        assert inter_node_bytes("all_reduce", algo, S, (2, 2, 2, 2), 1) == 0


# -- the two-tier cost model --------------------------------------------------------------------------------

FAST_INSIDE = CostModel(alpha=5e-6, beta=1 / 10e9, gamma=1 / 15e9, alpha_inter=100e-6, beta_inter=1 / 1e9)


def test_with_equal_tiers_the_two_tier_model_is_the_one_tier_model():
    same = CostModel(alpha=5e-6, beta=1 / 10e9, gamma=1 / 15e9, alpha_inter=5e-6, beta_inter=1 / 10e9)
    plain = CostModel(alpha=5e-6, beta=1 / 10e9, gamma=1 / 15e9)
    for collective, algo in (("all_reduce", "ring"), ("all_reduce", "rabenseifner"),
                             ("all_gather", "recursive_doubling"), ("reduce_scatter", "recursive_halving")):
        for n in (4, 6, 8):
            assert predict(same, collective, algo, S, n, 2) == pytest.approx(predict(plain, collective, algo, S, n))


def test_hierarchical_all_reduce_formula_pays_each_tier_for_what_it_carries():
    m, e, (big_n, k) = FAST_INSIDE, FAST_INSIDE.across(), (2, 4)
    n = big_n * k
    expected = (2 * (k - 1) * m.alpha + 2 * (k - 1) / k * S * m.beta + 2 * (big_n - 1) * e.alpha
                + 2 * (big_n - 1) / big_n * S / k * e.beta + (n - 1) / n * S * m.gamma)
    assert predict(FAST_INSIDE, "all_reduce", "hierarchical", S, n, big_n) == pytest.approx(expected)


def test_auto_picks_hierarchical_for_large_messages_across_slow_links_and_never_on_one_node():
    for collective in ("all_reduce", "reduce_scatter", "all_gather"):
        assert choose(FAST_INSIDE, collective, 16 << 20, 8, 2) == "hierarchical"
        assert choose(FAST_INSIDE, collective, 16 << 20, 8, 1) != "hierarchical"
    assert choose(FAST_INSIDE, "all_reduce", 8, 8, 2) == "recursive_doubling"  # few rounds, most inside nodes


def test_without_a_measured_inter_tier_calibration_takes_it_from_the_planners_machine_file(tmp_path, monkeypatch):
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({"alpha": 1e-6, "beta": 1e-10, "gamma": 1e-10, "alpha_inter": 3e-5,
                                   "beta_inter": 4e-9}))
    monkeypatch.setenv("MPIPARALLEL_MACHINE", str(machine))
    model = load_calibration(4, tmp_path / "no-calibration.json")
    assert (model.alpha_inter, model.beta_inter) == (3e-5, 4e-9)
    monkeypatch.setenv("MPIPARALLEL_MACHINE", str(tmp_path / "absent.json"))
    assert load_calibration(4, tmp_path / "no-calibration.json").across() == CostModel()


def test_the_planner_prices_a_group_that_spans_nodes_with_the_same_model():
    cluster = Cluster(gpus_per_node=4, intra=CostModel(alpha=5e-6, beta=1 / 10e9, gamma=1 / 15e9),
                      inter=CostModel(alpha=100e-6, beta=1 / 1e9, gamma=1 / 15e9))
    assert group_nodes(1, 8, cluster) == 2 and group_nodes(2, 4, cluster) == 2 and group_nodes(1, 4, cluster) == 1
    link = CostModel(alpha=5e-6, beta=1 / 10e9, gamma=1 / 15e9, alpha_inter=100e-6, beta_inter=1 / 1e9)
    assert collective_seconds("all_reduce", 16 << 20, 8, link, 2) == pytest.approx(
        predict(link, "all_reduce", "hierarchical", 16 << 20, 8, 2))


def test_mesh_axes_inside_and_across_nodes():
    nodes = (0, 0, 0, 0, 1, 1, 1, 1)
    assert axes_spanning_nodes(MeshShape(dp=2, tp=2, pp=2).resolve(8), nodes) == {"pp"}
    assert axes_spanning_nodes(MeshShape(dp=4, tp=2).resolve(8), (0, 0, 1, 1, 2, 2, 3, 3)) == {"dp"}
    assert axes_spanning_nodes(MeshShape(dp=1, tp=8).resolve(8), nodes) == {"tp"}
    # ep: groups of ep consecutive dp ranks, inside a node at ep 4, across the two at ep 8
    assert axes_spanning_nodes(MeshShape(dp=8, ep=4).resolve(8), nodes) == {"dp"}
    assert axes_spanning_nodes(MeshShape(dp=8, ep=8).resolve(8), nodes) == {"dp", "ep"}


# -- on ranks: results, and the ledger against the formulas -------------------------------------------------

def _emulated(k: int) -> dict[str, str]:
    return {"MPIPARALLEL_RANKS_PER_NODE": str(k)}


@pytest.mark.parametrize("ranks, k", [(8, 4), (6, 4)])
def test_ledger_inter_node_bytes_equal_the_formulas_for_ring_and_hierarchical(ranks, k):
    algorithms = ["ring", "hierarchical"] + (["recursive_doubling", "recursive_halving", "rabenseifner"]
                                             if ranks == 8 else [])
    results = run_on_ranks(ranks, topology_checks.ledger_against_formulas, timeout=240,
                           env=_emulated(k), algorithms=algorithms, block=2048)
    for rank, result in enumerate(results):
        assert result["nodes"] == [r // k for r in range(ranks)]
        assert result["half_nodes"] == [r // k for r in range(rank % 2, ranks, 2)]  # from the world's nodes
        for row in result["world"] + result["half"]:
            assert row["equal"] and row["input_kept"], (rank, row)
            if row["formula"] is not None:
                assert row["inter_node"] == pytest.approx(row["formula"]), (rank, row)
            assert row["inter_node"] <= row["sent"]
        hierarchical = [row for row in result["world"] if row["algo"] == "hierarchical"]
        assert all(row["formula"] is not None for row in hierarchical)
    if ranks == 8:  # equal nodes: every rank's hierarchical all-reduce sends 2(N−1)/N·S/k across, S = 8·2048·8 B
        assert {r["world"][1]["inter_node"] for r in results} == {2 * 1 / 2 * 8 * 2048 * 8 / 4}
        assert {r["async_inter_node"] for r in results} == {2 * 1 / 2 * 8 * 2048 * 8 / 4}


def test_verify_finds_the_hierarchical_algorithms_right_on_unequal_nodes():
    command = [sys.executable, "-m", "mpiparallel", "verify", "-n", "6", "--max-count", "300", "-d", "float64",
               "-d", "int32", "--collective", "all_reduce", "--collective", "reduce_scatter", "--collective",
               "all_gather"]
    result = run_with_timeout(command, 600, env={**os.environ, **_emulated(4)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 nodes of 4, 2 ranks" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if " hierarchical " in line]
    assert {row[0] for row in rows} == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(row[-1] == "0" for row in rows)


TRAIN = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "8", "--steps", "1",
         "--dtype", "float64"]
ACROSS = re.compile(r"(\w+) (\d+\.\d+) MB \(formula (\d+\.\d+) MB, ratio (\S+)\)")


@pytest.mark.parametrize("ranks, k, mesh, spanning", [
    (8, 4, ["--dp", "2", "--tp", "2", "--pp", "2"], {"pp"}),
    (4, 2, ["--dp", "2", "--tp", "2"], {"dp"}),
])
def test_train_prints_each_axis_inter_node_bytes_beside_the_formula_and_tp_inside_a_node_sends_none(
        tmp_path, ranks, k, mesh, spanning):
    log = tmp_path / "log.jsonl"
    command = [sys.executable, "-m", "mpiparallel", "train", "-n", str(ranks), *TRAIN, *mesh, "--show-mesh",
               "--log-json", str(log)]
    result = run_with_timeout(command, 600, env={**os.environ, **_emulated(k)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stdout
    assert f"across nodes: {', '.join(sorted(spanning))}" in result.stdout
    lines = [line for line in result.stdout.splitlines() if " across nodes: " in line and line.startswith("rank")]
    assert len(lines) == ranks
    for line in lines:
        axes = {axis: (float(counted), float(formula), ratio) for axis, counted, formula, ratio in ACROSS.findall(line)}
        assert set(axes) == {"dp", "tp", "pp"} & {a for a in ("dp", "tp", "pp") if f"--{a}" in mesh}, line
        assert all(ratio == "1.0000" for _, _, ratio in axes.values()), line
        assert axes["tp"][0] == 0.0
        for axis in spanning:
            assert axes[axis][0] > 0, line
    record = json.loads(log.read_text().splitlines()[0])
    assert record["inter_node_bytes"]["tp"] == 0 and record["inter_node_bytes"][next(iter(spanning))] > 0


@pytest.mark.parametrize("cuda_aware", [True, False])
def test_hierarchical_collectives_on_device_arrays_across_emulated_nodes(cuda_aware):
    """The CuPy path (tests/support/fake_cupy.py's double) with nodes of 2 on 3 ranks: every collective and algorithm,
    hierarchical included, against native MPI, staged or synchronized as the device contract says."""
    results = run_on_ranks(3, device_checks.collectives_on_device, timeout=240, env=_emulated(2),
                           cuda_aware=cuda_aware, sizes=[0, 1, 7, 1000])
    for rank, result in enumerate(results):
        assert not result["failures"], f"rank {rank}: {result['failures'][:5]}"
        assert result["traffic"]["unsynchronized_mpi_calls"] == 0


def test_the_topology_benchmark_prints_predictions_beside_measurements_and_auto_s_pick(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_topology.py")
    out = tmp_path / "topology.json"
    result = run_with_timeout([sys.executable, script, "--ranks", "4", "--ranks-per-node", "2", "--latency", "1e-4",
                               "--sizes", "64,64K", "--rounds", "1", "--json", str(out)], 600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["nodes"] == [0, 0, 1, 1] and report["model"]["alpha_inter_us"] > report["model"]["alpha_us"]
    for row in report["rows"]:
        assert "hierarchical" in row["measured_us"] and set(row["predicted_us"]) == set(row["measured_us"])
        assert row["auto"] in row["measured_us"]
    assert "emulated inter-node link: 100 us" in result.stdout
