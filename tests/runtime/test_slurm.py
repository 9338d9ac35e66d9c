"""Slurm on the namespace hosts (`mpiparallel cluster up --scheduler slurm`): a real Slurm — munged, slurmctld,
one slurmd per host, Debian's packages — and the project's commands under its `srun` and `sbatch`, unchanged.

What is checked: the cluster's Slurm sees its hosts as idle nodes and `down` stops every daemon and leaves no file;
`srun --mpi=pmi2` with MPICH starts ranks that MPI sees on two real nodes, whose launcher variables give each node's
rank count, whose mesh trains the serial model's numbers in float64, and whose dp bytes cross the links as the
formula says; a launch that gives every rank a world of 1 is one error naming the fix; `sbatch
scripts/slurm_train.sh`, signalled ahead of its time limit, saves, requeues itself and resumes, and ends equal to
the uninterrupted run. And Open MPI: under `srun --mpi=pmix` the same training equal to serial, under pmi2 the
world-of-1 error, its mpirun inside salloc on the allocation's nodes. A node killed under `train -n 4` in an
allocation: one line from the heartbeats and exit 6; with `salloc --no-kill … --elastic`, the run goes on on the
node left and equals the uninterrupted one.

Needs root, network namespaces and Debian's slurm-wlm, munge and libpmix-dev (.ci/run installs them; with CI=true a
missing one fails). About 2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from clusters import assert_no_processes_on
from mpi_harness import assert_equals_serial, parallel_training, run_on_ranks, run_with_timeout, serial_training
from processes import ended, start_job, wait_for_steps
from safetensors.numpy import load_file
from workers import topology_checks

from mpiparallel.errors import ExitCode
from mpiparallel.jobs import namespace_cluster, slurm_cluster

ROOT = Path(__file__).resolve().parents[2]


def slurm(made: namespace_cluster.Cluster, *command: str, timeout: float = 300,
          cwd: Path | None = None, **variables: str) -> subprocess.CompletedProcess:
    """A Slurm command (srun, sbatch, scontrol …) pointed at the cluster's own Slurm."""
    return run_with_timeout(list(command), timeout, env={**slurm_cluster.environment(made), **variables}, cwd=cwd)


def test_up_starts_a_slurm_whose_nodes_are_the_hosts_and_down_stops_every_daemon(cluster):
    made = cluster(nodes=2, ranks_per_node=2, scheduler="slurm")
    assert slurm_cluster.node_states(made) == {host: "idle" for host in made.hosts}
    assert len(slurm_cluster.own_processes(made.folder)) == 2 + len(made.hosts)  # munged, slurmctld, slurmds
    status = namespace_cluster.status(made.name)
    assert f"slurm ({slurm_cluster.conf_path(made)}): {made.hosts[0]} idle, {made.hosts[1]} idle" in status
    assert "no jobs" in status
    placed = slurm(made, "srun", "-N", "2", "-n", "4", "hostname")
    assert placed.returncode == 0, placed.stderr
    assert sorted(placed.stdout.split()) == sorted(made.hosts * 2)  # srun places two tasks on each host

    down = run_with_timeout([sys.executable, "-m", "mpiparallel", "cluster", "down", "--name", made.name], 120)
    assert down.returncode == 0 and "removed 4 Slurm daemons" in down.stdout, down.stdout + down.stderr
    assert not slurm_cluster.own_processes(made.folder) and not Path(made.folder).exists()


COMMON = {"n_layer": 2, "n_head": 4, "n_embd": 32, "seq_len": 16, "batch_size": 4, "steps": 3, "dtype": "float64",
          "grad_clip": 0.5, "weight_decay": 0.1, "vocab_size": 257, "lr": 1e-2}
TRAIN = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "8", "--steps", "1",
         "--dtype", "float64"]
SRUN_MPICH = ["srun", "-N", "2", "-n", "4", "--mpi=pmi2"]
SRUN_OPEN_MPI = ["srun", "-N", "2", "-n", "4", "--mpi=pmix"]


def test_srun_with_mpich_places_ranks_on_real_nodes_that_train_the_serial_models_numbers(cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2, scheduler="slurm")
    env = {"SLURM_CONF": str(slurm_cluster.conf_path(made))}
    placed = run_on_ranks(4, topology_checks.placement, launcher=SRUN_MPICH, env=env)
    assert [rank["host"] for rank in placed] == [made.hosts[0]] * 2 + [made.hosts[1]] * 2
    assert [rank["node"] for rank in placed] == [0, 0, 1, 1]
    assert all(rank["local_ranks"] == 2 for rank in placed)  # srun's own variables: 2 BLAS-thread shares a node

    (tmp_path / "serial").mkdir()
    reference = serial_training(COMMON, tmp_path / "serial")
    configs = [{"dp": 2, "tp": 2}, {"dp": 2, "tp": 2, "sp": True, "zero": 1}]
    for result in parallel_training(4, COMMON, configs, reference, launcher=SRUN_MPICH, env=env):
        assert_equals_serial(result, COMMON["steps"], 1e-9)


def test_train_under_srun_sees_two_nodes_and_sends_dp_bytes_over_the_links_as_the_formula_says(cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2, scheduler="slurm")
    before = {host: namespace_cluster.link_bytes(host) for host in made.hosts}
    result = slurm(made, *SRUN_MPICH, sys.executable, "-m", "mpiparallel", "train", *TRAIN, "--dp", "2", "--tp", "2",
                   "--show-mesh", "--log-json", str(tmp_path / "log.jsonl"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nodes: 2 nodes of 2, 2 ranks (MPI's shared-memory nodes)" in result.stdout
    assert "inside a node: tp; across nodes: dp" in result.stdout
    record = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert record["inter_node_bytes"]["tp"] == 0 and record["inter_node_bytes"]["dp"] > 0
    for host in made.hosts:  # the TaskProlog's UCX settings: two ranks' dp bytes each went over the host's veth
        assert namespace_cluster.link_bytes(host) - before[host] >= 2 * record["inter_node_bytes"]["dp"]
    assert_no_processes_on(made, within_s=10)


def test_srun_without_the_mpi_plugin_gives_worlds_of_one_and_that_is_one_error_naming_the_fix(cluster):
    """Without --mpi=pmi2 MPICH's ranks find no process manager and each starts a world of its own: unchecked,
    each would train the whole job alone."""
    made = cluster(nodes=2, ranks_per_node=1, scheduler="slurm")
    result = slurm(made, "srun", "-N", "2", "-n", "2", "--mpi=none", sys.executable, "-m", "mpiparallel", "train",
                   *TRAIN)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert sum(line.startswith("Error") for line in output.splitlines()) == 1, output
    assert "the launcher started 2 ranks, but MPI gives each a world of 1" in output and "--mpi=pmi2" in output
    assert "Traceback" not in output


def test_srun_with_open_mpi_over_pmix_trains_the_serial_models_numbers_and_pmi2_is_the_world_of_one_error(
        cluster, open_mpi, tmp_path):
    """Open MPI reaches Slurm through PMIx (Slurm's pmix plugin, libpmix from Debian); through pmi2 each of its
    ranks is a world of its own and would exit 0 having trained alone (measured): one error instead. And its
    mpirun inside salloc places the ranks on the allocation's nodes."""
    made = cluster(nodes=2, ranks_per_node=2, scheduler="slurm")
    env = {"SLURM_CONF": str(slurm_cluster.conf_path(made)), "OMPI_MCA_mpi_yield_when_idle": "1"}
    placed = run_on_ranks(4, topology_checks.placement, launcher=SRUN_OPEN_MPI, env=env,
                          python=open_mpi.python)
    assert [rank["node"] for rank in placed] == [0, 0, 1, 1] and all(rank["local_ranks"] == 2 for rank in placed)
    (tmp_path / "serial").mkdir()
    reference = serial_training(COMMON, tmp_path / "serial")
    for result in parallel_training(4, COMMON, [{"dp": 2, "tp": 2, "sp": True, "zero": 1}], reference,
                                    launcher=SRUN_OPEN_MPI, env=env, python=open_mpi.python):
        assert_equals_serial(result, COMMON["steps"], 1e-9)

    result = slurm(made, "srun", "-N", "2", "-n", "2", "--mpi=pmi2", open_mpi.python, "-m", "mpiparallel", "train",
                   *TRAIN)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and output.count("Error") == 1, output
    assert "MPI gives each a world of 1" in output and "(Open MPI v5.0" in output and "--mpi=pmix" in output

    # Open MPI's own mpirun inside an allocation: its runtime asks Slurm for the nodes and their slots (with the
    # oversubscribing policy a bare mpirun needs here, it put all four ranks on the first node: left out)
    inside = ["salloc", "-N", "2", "-n", "4", open_mpi.mpiexec, "-n", "4"]
    within = {name: value for name, value in open_mpi.environment(**env).items()
              if name != "PRTE_MCA_rmaps_default_mapping_policy"}
    placed = run_on_ranks(4, topology_checks.placement, launcher=inside, python=open_mpi.python,
                          env=within)
    assert [rank["host"] for rank in placed] == [made.hosts[0]] * 2 + [made.hosts[1]] * 2
    assert [rank["node"] for rank in placed] == [0, 0, 1, 1] and all(rank["local_ranks"] == 2 for rank in placed)


# -- sbatch, a signal ahead of the time limit, the requeue ------------------------------------------------------

BATCH = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
         "--microbatches", "2", "--steps", "150", "--checkpoint-every", "100", "--eval-every", "0", "--dtype",
         "float64", "--lr-schedule", "constant", "--warmup-steps", "0"]


def submit(made: namespace_cluster.Cluster, folder: Path, open_mpi) -> int:
    """sbatch scripts/slurm_train.sh on both hosts, run from `folder`, its ranks under Open MPI (srun --mpi=pmix,
    the script's default: MPICH's ranks, under an srun inside sbatch, twice spun in MPI_Init for good — see
    docs/clusters.md); returns the job's id."""
    folder.mkdir()
    shims = folder / "bin"  # the script runs `mpiparallel`: this environment's, whose MPI is Open MPI
    shims.mkdir()
    (shims / "mpiparallel").write_text(f'#!/bin/sh\nexec "{open_mpi.python}" -m mpiparallel "$@"\n')
    (shims / "mpiparallel").chmod(0o755)
    result = slurm(made, "sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "2",
                   str(ROOT / "scripts" / "slurm_train.sh"), *BATCH, "--save", str(folder / "model"), cwd=folder,
                   TP="2", CHECKPOINTS=str(folder / "ck"), OMPI_MCA_mpi_yield_when_idle="1",
                   PATH=os.pathsep.join([str(shims), os.environ["PATH"]]))
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip().split(";")[0])


def job_field(made: namespace_cluster.Cluster, job: int, field: str) -> str:
    shown = slurm(made, "scontrol", "show", "job", str(job), timeout=60).stdout
    return next((word.split("=", 1)[1] for word in shown.split() if word.startswith(f"{field}=")), "")


def wait_for(condition, what: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.25)


def losses(log: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in map(json.loads, log.read_text().splitlines())
            if "loss" in record and "step" in record}


def test_sbatch_signalled_before_its_limit_saves_requeues_itself_and_resumes_to_the_uninterrupted_run(
        cluster, open_mpi, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2, scheduler="slurm")
    whole = submit(made, tmp_path / "whole", open_mpi)
    wait_for(lambda: job_field(made, whole, "JobState") == "COMPLETED", "the uninterrupted job")

    cut = submit(made, tmp_path / "cut", open_mpi)
    log = tmp_path / "cut" / f"train-{cut}.jsonl"
    wait_for(lambda: log.exists() and len(losses(log)) >= 20, "20 steps of the job to signal")
    signalled = slurm(made, "scancel", "--batch", "--signal=USR1", str(cut), timeout=60)  # what --signal=B:USR1@T does
    assert signalled.returncode == 0, signalled.stderr
    wait_for(lambda: job_field(made, cut, "Restarts") == "1" and job_field(made, cut, "JobState") == "COMPLETED",
             "the requeued job to finish")

    output = (tmp_path / "cut" / f"mpiparallel-{cut}.out").read_text()
    assert "slurm_train.sh: SIGUSR1: the ranks save and stop" in output
    assert f"slurm_train.sh: requeueing job {cut} to continue from the checkpoint" in output
    stopped = int(output.split("stopped by SIGUSR1 after step ")[1].split("/")[0])
    assert 20 <= stopped < 150
    assert f"resumed from step {stopped} of {tmp_path / 'cut' / 'ck'}" in output
    assert output.count("slurm_train.sh: job") == 2 and "restart 1, device cpu" in output

    reference, resumed = losses(tmp_path / "whole" / f"train-{whole}.jsonl"), losses(log)
    assert sorted(resumed) == list(range(1, 151)) == sorted(reference)
    assert max(abs(resumed[step] - reference[step]) / abs(reference[step]) for step in reference) <= 1e-9
    expected, got = load_file(tmp_path / "whole" / "model" / "model.safetensors"), \
        load_file(tmp_path / "cut" / "model" / "model.safetensors")
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert np.max(np.abs(got[name] - tensor)) <= 1e-9 * np.max(np.abs(tensor)), name


# -- a node lost under Slurm: one line and exit 6, or --elastic on the nodes left --------------------------------

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "8", "--batch-size", "4", "--dtype",
        "float64", "--vocab-size", "257", "--threads", "1", "--steps", "300"]


def salloc_train(made: namespace_cluster.Cluster, folder: Path, open_mpi, *options: str, no_kill: bool = False,
                 **variables: str) -> subprocess.Popen:
    """`train -n 4` inside `salloc -N 2 -n 4` (its parent in the root namespace, as on a login node; its ranks
    started by srun on the two hosts), logging to folder/log.jsonl. Under Open MPI (srun --mpi=pmix): MPICH's
    ranks under srun now and then never finish MPI_Init (docs/clusters.md: its segmented PMI2 put) — twice in one
    suite run here, each time ended by these very heartbeats as an unreachable host."""
    tokens = folder / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 257, 2000))
    return start_job(["salloc", *(["--no-kill"] if no_kill else []), "-N", "2", "-n", "4", open_mpi.python, "-m",
                      "mpiparallel", "train", "-n", "4", *TINY, "--data", str(tokens), "--log-json",
                      str(folder / "log.jsonl"), *options], cwd=folder, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True, env={**slurm_cluster.environment(made),
                                                            "OMPI_MCA_mpi_yield_when_idle": "1", **variables})


def test_a_node_killed_under_salloc_is_named_by_the_heartbeats_in_one_line_with_exit_6(cluster, open_mpi, tmp_path):
    """Slurm alone notices a crashed node after SlurmdTimeout (30 s here; srun ended 41.5 s after the kill,
    measured) and MPICH's survivors wait in their collective until then; the heartbeats name it after 10 s."""
    made = cluster(nodes=2, ranks_per_node=2, scheduler="slurm")
    job = salloc_train(made, tmp_path, open_mpi, "--dp", "4", "--steps", "100000")
    wait_for_steps(tmp_path / "log.jsonl", 10, job)
    killed = time.monotonic()
    namespace_cluster.kill(made.name, made.hosts[1])
    status, _, stderr = ended(job, timeout=120)
    print(f"node killed under salloc: the job ended {time.monotonic() - killed:.1f} s later")
    assert status == ExitCode.UNREACHABLE_HOST, stderr
    # 10 s, the default bound, or a second more: srun's own kill of the other node's ranks silenced them too, and
    # that node was passed over first (`slurm_launch.nodes_whose_tasks_ended`)
    assert re.search(rf"mpiparallel: host {made.hosts[1]} \(ranks 2, 3\) is unreachable: no heartbeat for 1[01] s",
                     stderr), stderr
    said = [line for line in stderr.splitlines() if line.startswith(("srun:", "slurmstepd", "mpiparallel: rank"))]
    assert not said and "Traceback" not in stderr, stderr  # srun's and the survivors' lines give way to the one
    assert_no_processes_on(made, within_s=20)


def test_elastic_in_a_no_kill_allocation_relaunches_on_the_node_left_equal_to_the_uninterrupted_run(
        cluster, open_mpi, tmp_path):
    """dp 2 × tp 2 on two Slurm nodes; the second node killed mid-run: the parent names it (heartbeats), srun
    starts dp 1 × tp 2 on the node left (same global batch) from the newest checkpoint, and every step's loss
    equals the uninterrupted run's — itself `train -n 4` in an allocation, srun placing it on both nodes."""
    made = cluster(nodes=2, ranks_per_node=2, scheduler="slurm")
    (tmp_path / "straight").mkdir()
    straight = salloc_train(made, tmp_path / "straight", open_mpi, "--dp", "2", "--tp", "2", "--show-mesh")
    status, stdout, stderr = ended(straight, timeout=300)
    assert status == 0, stderr
    assert "nodes: 2 nodes of 2, 2 ranks (MPI's shared-memory nodes)" in stdout
    assert "inside a node: tp; across nodes: dp" in stdout

    (tmp_path / "cut").mkdir()
    log = tmp_path / "cut" / "log.jsonl"
    job = salloc_train(made, tmp_path / "cut", open_mpi, "--dp", "2", "--tp", "2", "--checkpoint-dir",
                       str(tmp_path / "cut" / "ck"), "--checkpoint-every", "5", "--elastic", no_kill=True,
                       MPIPARALLEL_HEARTBEAT_TIMEOUT="4")
    wait_for_steps(log, 20, job)
    namespace_cluster.kill(made.name, made.hosts[1])
    status, _, stderr = ended(job, timeout=300)
    assert status == 0, stderr
    events = [json.loads(line) for line in log.read_text().splitlines()]
    [restart] = [event for event in events if event.get("event") == "restart"]
    assert restart["lost"] == [{"host": made.hosts[1], "ranks": [2, 3]}], restart
    assert (restart["mesh"]["world_size"], restart["mesh"]["dp"], restart["mesh"]["tp"]) == (2, 1, 2)
    assert f"elastic: lost host {made.hosts[1]} (ranks 2, 3) after step {restart['step']}" in stderr
    assert restart["step"] < 300, "the node was lost after the run ended"
    final = {event["step"]: event["loss"] for event in events if "loss" in event}
    reference = losses(tmp_path / "straight" / "log.jsonl")
    assert sorted(final) == sorted(reference) == list(range(1, 301))
    assert max(abs(final[step] - reference[step]) / abs(reference[step]) for step in reference) <= 1e-9
    assert_no_processes_on(made, within_s=20)
