"""What the ranks learn from their launcher before MPI starts: how many share a node (each rank's BLAS threads),
and a launch whose MPI gives every rank a world of its own (Open MPI under `srun --mpi=pmi2`: every task trains
alone and exits 0, measured) — one clear error instead. And what `-n N` does inside a Slurm allocation: the srun
line it runs, the relaunch on the nodes left, too many ranks for the allocation."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mpiparallel.errors import ConfigError
from mpiparallel.jobs import slurm_launch
from mpiparallel.process import limit_blas_threads, local_rank_count, slurm_tasks_on_this_node

SRUN_TASK = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "0",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("counts, tasks", [("2(x2)", 2), ("4", 4), ("3,1", 3), ("1(x3),2", 2)])
def test_an_srun_steps_tasks_per_node_are_read_from_its_compressed_list(counts, tasks):
    assert slurm_tasks_on_this_node({"SLURM_STEP_TASKS_PER_NODE": counts}) == tasks


def test_a_node_shares_its_cores_among_the_ranks_every_launcher_says_it_runs():
    """hydra's and Open MPI's own counts first (an mpiexec inside an allocation), then srun's step, then what the
    allocation asked for; a batch shell (no step) alone is one process."""
    assert local_rank_count({"MPI_LOCALNRANKS": "3", **SRUN_TASK}) == 3
    assert local_rank_count({"OMPI_COMM_WORLD_LOCAL_SIZE": "5"}) == 5
    assert local_rank_count(SRUN_TASK) == 2
    assert local_rank_count({"SLURM_NTASKS_PER_NODE": "8"}) == 8
    assert local_rank_count({"SLURM_TASKS_PER_NODE": "8", "SLURM_JOB_ID": "1"}) == 1
    cores = len(os.sched_getaffinity(0))
    assert limit_blas_threads(None, environ=dict(SRUN_TASK), load=0.0) == max(1, cores // 2)


def _as_srun_task(rank: int) -> dict[str, str]:
    """This process's environment as a task of a 2-task srun step whose MPI did not reach Slurm's PMI."""
    clean = {name: value for name, value in os.environ.items()
             if not name.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_", "MPIPARALLEL_RANK"))}
    return {**clean, **SRUN_TASK, "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2"}


def test_a_launch_that_gives_every_rank_a_world_of_one_is_one_clear_error(tmp_path):
    """Each process is MPI's singleton (what Open MPI makes of an srun step it cannot reach), as srun's task 0 and
    task 1: task 0 says what is wrong and how to fix it, task 1 exits with the same status in silence; neither
    trains."""
    command = [sys.executable, "-m", "mpiparallel", "train", "--steps", "1", "--n-layer", "1"]
    first = subprocess.run(command, cwd=tmp_path, env=_as_srun_task(0), capture_output=True, text=True, timeout=120)
    assert first.returncode == 2, first.stderr
    assert re.fullmatch(re.escape(
        "Error: the launcher started 2 ranks, but MPI gives each a world of 1: every one would run the whole job "
        "alone. Give srun the --mpi of the MPI library mpi4py loads (") + r"(MPICH Version: |Open MPI v)[\d.]+"
        + re.escape("): --mpi=pmix for Open MPI, --mpi=pmi2 for MPICH (`srun --mpi=list` shows what this Slurm "
                    "offers)"), first.stderr.strip()), first.stderr
    assert "step" not in first.stdout, first.stdout
    second = subprocess.run(command, cwd=tmp_path, env=_as_srun_task(1), capture_output=True, text=True, timeout=120)
    assert (second.returncode, second.stdout, second.stderr) == (2, "", "")


# -- `-n N` inside a Slurm allocation: srun starts the ranks ----------------------------------------------------

ALLOCATION = slurm_launch.Allocation("7", ("n-0", "n-1"), (2, 2))


@pytest.mark.parametrize("compressed, counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("3,1", [3, 1]), ("", [])])
def test_slurms_compressed_per_node_counts_expand_to_one_per_node(compressed, counts):
    assert slurm_launch.expand_counts(compressed) == counts


def test_the_srun_line_asks_for_the_pmi_of_the_mpi_that_mpi4py_loads_unless_slurm_mpi_type_says():
    mpich = ALLOCATION.command(4, ["train", "--dp", "4"], open_mpi=False, environ={})
    assert mpich == ["srun", "--ntasks=4", "--mpi=pmi2", "--kill-on-bad-exit=1", sys.executable, "-m", "mpiparallel",
                     "train", "--dp", "4"]
    assert "--mpi=pmix" in ALLOCATION.command(4, ["train"], open_mpi=True, environ={})
    assert not any(word.startswith("--mpi") for word in ALLOCATION.command(4, ["train"], True,
                                                                           {"SLURM_MPI_TYPE": "pmix_v4"}))


def test_a_relaunch_names_the_nodes_left_overlaps_the_lost_step_and_drops_the_allocations_stale_shape():
    left = ALLOCATION.without(["n-1"])
    assert (left.nodes, left.tasks_per_node, left.tasks) == (("n-0",), (2,), 2)
    assert left.command(2, ["train"], open_mpi=False, environ={})[1:5] == [
        "--ntasks=2", "--nodes=1", "--nodelist=n-0", "--overlap"]
    shape = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n-[0-1]", "SLURM_TASKS_PER_NODE": "2(x2)",
             "SLURM_JOB_ID": "7", "PATH": "/bin"}
    assert left.environment(False, shape) == {"SLURM_JOB_ID": "7", "PATH": "/bin"}
    assert ALLOCATION.environment(False, shape) == shape  # the first launch: the allocation as it is


def test_open_mpis_ranks_yield_when_a_node_runs_more_of_them_than_it_has_cpus():
    crowded = ALLOCATION.environment(True, {"SLURM_JOB_CPUS_PER_NODE": "1(x2)"})
    assert crowded["OMPI_MCA_mpi_yield_when_idle"] == "1" and crowded["OMPI_MCA_btl"] == "^ofi"
    assert "OMPI_MCA_mpi_yield_when_idle" not in ALLOCATION.environment(True, {"SLURM_JOB_CPUS_PER_NODE": "2(x2)"})


def test_more_ranks_than_the_allocation_has_tasks_is_one_error_naming_both_ways_out():
    with pytest.raises(ConfigError, match=re.escape(
            "-n 5 asks for more ranks than Slurm job 7 has tasks: 4 on 2 nodes (n-0,n-1); ask salloc/sbatch for "
            "-n 5, or set MPIPARALLEL_LAUNCHER=mpiexec")):
        ALLOCATION.check_ranks(5)
    ALLOCATION.check_ranks(4)


def test_outside_slurm_or_with_mpiexec_asked_for_there_is_no_allocation_and_srun_outside_one_is_an_error():
    assert slurm_launch.current({}) is None
    assert slurm_launch.current({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n-[0-1]",
                                 "MPIPARALLEL_LAUNCHER": "mpiexec"}) is None
    with pytest.raises(ConfigError, match="MPIPARALLEL_LAUNCHER=srun needs a Slurm allocation"):
        slurm_launch.current({"MPIPARALLEL_LAUNCHER": "srun"})
    with pytest.raises(ConfigError, match="MPIPARALLEL_LAUNCHER='ssh': srun or mpiexec"):
        slurm_launch.current({"MPIPARALLEL_LAUNCHER": "ssh"})


def test_the_nodes_whose_tasks_srun_ended_are_read_from_its_lines_and_a_node_failure_is_not_one():
    said = [b"srun: error: c1-0: tasks 0-1: Killed\n", b"srun: error: c1-2: task 5: Exited with exit code 1\n",
            b"srun: error: Node failure on c1-1\n", b"slurmstepd-c1-0: error: *** STEP 2.0 ON c1-0 CANCELLED ***\n"]
    assert slurm_launch.nodes_whose_tasks_ended(said) == {"c1-0", "c1-2"}
