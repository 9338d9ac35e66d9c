"""The mesh places ranks as the contract says and builds one communicator per axis."""

from __future__ import annotations

import pytest
from mpi_harness import run_on_ranks
from workers import mesh_checks

from mpiparallel.errors import ConfigError
from mpiparallel.mesh import Coordinates, MeshShape, coordinates_of, rank_of


def test_rank_layout_is_tp_innermost_then_cp_dp_pp():
    shape = MeshShape(dp=2, tp=2, pp=2, cp=3).resolve(24)
    for rank in range(24):
        c = coordinates_of(rank, shape)
        assert rank == ((c.pp * 2 + c.dp) * 3 + c.cp) * 2 + c.tp
        assert rank_of(c, shape) == rank
    assert coordinates_of(1, shape) == Coordinates(pp=0, dp=0, cp=0, tp=1)
    assert coordinates_of(2, shape) == Coordinates(pp=0, dp=0, cp=1, tp=0)
    assert coordinates_of(6, shape) == Coordinates(pp=0, dp=1, cp=0, tp=0)
    assert coordinates_of(12, shape) == Coordinates(pp=1, dp=0, cp=0, tp=0)


def test_dp_defaults_to_the_ranks_left_over():
    assert MeshShape(tp=2, pp=2).resolve(8).dp == 2


@pytest.mark.parametrize("shape, world, message", [
    (MeshShape(dp=3, tp=2), 8, "does not match"),
    (MeshShape(tp=3), 8, "cannot be split"),
    (MeshShape(dp=4, ep=3), 4, "must divide"),
    (MeshShape(tp=0), 4, "at least 1"),
])
def test_bad_meshes_are_clear_errors(shape, world, message):
    with pytest.raises(ConfigError, match=message):
        shape.resolve(world)


def test_every_axis_communicator_holds_the_ranks_that_differ_only_in_that_coordinate():
    results = run_on_ranks(8, mesh_checks.groups, dp=2, tp=2, pp=2, ep=2)
    for rank, found in enumerate(results):
        pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
        assert found["coordinates"] == {"pp": pp, "dp": dp, "cp": 0, "tp": tp}
        assert found["tp"] == [pp * 4 + dp * 2 + t for t in range(2)]
        assert found["dp"] == [pp * 4 + d * 2 + tp for d in range(2)]
        assert found["pp"] == [p * 4 + dp * 2 + tp for p in range(2)]
        assert found["dp_cp"] == found["dp"] and found["cp"] == [rank]
        assert found["ep"] == found["dp"] and found["expert_dp"] == [rank]  # ep = dp = 2
        assert found["axis_ranks"] == {"tp": tp, "cp": 0, "dp": dp, "pp": pp, "ep": dp}


def test_expert_groups_split_the_data_parallel_group():
    for rank, found in enumerate(run_on_ranks(4, mesh_checks.groups, ep=2)):
        assert found["ep"] == [r for r in range(4) if r // 2 == rank // 2]
        assert found["expert_dp"] == [r for r in range(4) if r % 2 == rank % 2]
