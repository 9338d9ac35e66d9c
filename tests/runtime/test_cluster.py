"""A cluster on one machine (`mpiparallel cluster`): hosts made of network namespaces, launched from a hostfile.

Real hosts, no emulation variable: each host has its own network stack, address and host name, and the bytes
between hosts cross its veth. On them: a 2-host launch that MPI sees as two nodes, a dp-across/tp-inside mesh
that trains the serial model's numbers in float64, the ledger's inter-node bytes equal to the formulas, and the
faults: a killed host and a cut link each end the job in bounded time with one line naming the host and its
ranks. A bad hostfile is one error before anything starts.

These tests need root and network namespaces (CI has both; with CI=true they fail instead of skipping). Every
cluster gets a name unique to this test process, its state folder is the test's own, and the `cluster` fixture
takes it down after the test, even a failed one, and checks that no namespace, bridge or veth of it is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from clusters import assert_no_processes_on
from mpi_harness import assert_equals_serial, parallel_training, run_on_ranks, run_with_timeout, serial_training
from processes import start_job
from workers import topology_checks

from mpiparallel.errors import ConfigError, ExitCode
from mpiparallel.jobs import hosts as multi_host
from mpiparallel.jobs import launch, namespace_cluster


def mpiparallel(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_with_timeout([sys.executable, "-m", "mpiparallel", *args], timeout)


# -- making hosts -------------------------------------------------------------------------------------------------

def test_up_makes_hosts_with_their_own_names_and_addresses_on_a_free_subnet_and_down_leaves_nothing(cluster):
    used = namespace_cluster.addresses_in_use()
    made = cluster(nodes=2, ranks_per_node=3, link_rate="800mbit")
    assert not any(namespace_cluster.ipaddress.ip_network(made.subnet).overlaps(network) for network in used)
    assert made.hostfile.read_text() == "".join(f"{host}:3\n" for host in made.hosts)
    for host in made.hosts:  # hydra calls the launcher as it would call ssh: options, host, command
        said = subprocess.run([str(made.launcher), "-x", host, "hostname; ip -o -4 addr show dev eth0; tc qdisc"],
                              capture_output=True, text=True, timeout=60)
        assert said.returncode == 0, said.stderr
        assert said.stdout.splitlines()[0] == host
        assert f"inet {made.address(host)}/24" in said.stdout
        assert "qdisc tbf" in said.stdout and "rate 800Mbit" in said.stdout
    stranger = subprocess.run([str(made.launcher), "-x", "elsewhere", "true"], capture_output=True, text=True,
                              timeout=60)
    assert stranger.returncode == 255 and "no host elsewhere" in stranger.stderr

    again = namespace_cluster.up(made.name, 1, 1)  # a stale cluster of the same name is removed first
    assert namespace_cluster.namespaces_of(made.name) == [f"{made.name}-0"]
    assert sorted(namespace_cluster.links_of(made.name)) == [f"{made.name}-0", f"{made.name}-br"]

    namespace_cluster.cut(made.name, again.hosts[0])
    assert re.search(rf"{again.hosts[0]} +\S+ +link cut", namespace_cluster.status(made.name))
    namespace_cluster.heal(made.name, again.hosts[0])
    assert re.search(rf"{again.hosts[0]} +\S+ +link up", namespace_cluster.status(made.name))

    result = mpiparallel("cluster", "down", "--name", made.name)
    assert result.returncode == 0, result.stderr
    assert not namespace_cluster.namespaces_of(made.name) and not namespace_cluster.links_of(made.name)
    assert not Path(made.folder).exists()


def test_cluster_commands_say_in_one_line_what_the_machine_lacks(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="needs root"):
        namespace_cluster.up("mpt", 2, 2)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "ip" else f"/usr/bin/{tool}")
    with pytest.raises(ConfigError, match="needs the `ip` command"):
        namespace_cluster.up("mpt", 2, 2)
    with pytest.raises(ConfigError, match="cluster name"):
        namespace_cluster.up("Not-a-name!", 2, 2)
    refused = subprocess.CompletedProcess([], 1, "", "mount --make-shared /run/netns failed: Operation not permitted")
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: refused)
    with pytest.raises(ConfigError, match="does not permit `ip netns add mpt-0`.*need root and a kernel or container"):
        namespace_cluster._run("ip", "netns", "add", "mpt-0")


def test_a_free_subnet_overlaps_nothing_in_use():
    taken = [namespace_cluster.ipaddress.ip_network(n) for n in ("10.0.0.0/9", "10.128.0.0/10", "192.0.2.0/24")]
    picked = namespace_cluster.pick_subnet("mpiparallel", taken)
    assert picked.prefixlen == 24 and not any(picked.overlaps(network) for network in taken)


# -- bad hostfiles: one error before anything starts ------------------------------------------------------------

@pytest.mark.parametrize("text, args, fragment", [
    ("localhost:2\nno-such-host-of-ours.invalid:2\n", ["-n", "2"], "unknown host: no-such-host-of-ours.invalid"),
    ("localhost:2\n", ["-n", "3"], "more ranks than --hostfile"),
    ("localhost:two\n", ["-n", "2"], "is not `host` or `host:slots`"),
    ("# nothing\n", ["-n", "2"], "names no host"),
])
def test_a_bad_hostfile_is_one_error_before_any_rank_starts(tmp_path, text, args, fragment):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    result = mpiparallel("bench", "all_reduce", *args, "--hostfile", str(hostfile), timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert output.count("Error") == 1 and fragment in output, output
    assert "Traceback" not in output


def test_a_cluster_hostfile_refuses_more_ranks_than_slots_and_a_host_that_is_down(cluster):
    made = cluster(nodes=2, ranks_per_node=1)
    result = mpiparallel("bench", "all_reduce", "-n", "3", "--hostfile", str(made.hostfile), timeout=120)
    assert result.returncode == 2 and "-n 3 asks for more ranks than" in result.stderr, result.stderr
    subprocess.run(["ip", "netns", "del", made.hosts[1]], check=True)
    result = mpiparallel("bench", "all_reduce", "--hostfile", str(made.hostfile), timeout=120)
    assert result.returncode == 2 and f"unknown host: {made.hosts[1]}" in result.stderr, result.stderr


# -- running on two hosts ------------------------------------------------------------------------------------------

TRAIN = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "8", "--steps", "1",
         "--dtype", "float64", "--vocab-size", "256"]
ACROSS = re.compile(r"(\w+) (\d+\.\d+) MB \(formula (\d+\.\d+) MB, ratio (\S+)\)")


def test_train_across_two_hosts_sees_two_real_nodes_and_sends_dp_bytes_over_the_link_as_the_formula_says(
        cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2)
    before = {host: namespace_cluster.link_bytes(host) for host in made.hosts}
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the same text again and again. " * 400)
    result = mpiparallel("train", "-n", "4", "--hostfile", str(made.hostfile), *TRAIN, "--dp", "2", "--tp", "2",
                         "--show-mesh", "--data", str(corpus), "--log-json", str(tmp_path / "log.jsonl"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nodes: 2 nodes of 2, 2 ranks (MPI's shared-memory nodes)" in result.stdout
    assert "inside a node: tp; across nodes: dp" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank") and " across nodes: " in line]
    assert len(lines) == 4
    for line in lines:
        axes = {axis: (float(counted), ratio) for axis, counted, _, ratio in ACROSS.findall(line)}
        assert axes["tp"] == (0.0, "1.0000") and axes["dp"][0] > 0 and axes["dp"][1] == "1.0000", line
    record = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    dp_across = record["inter_node_bytes"]["dp"]
    assert dp_across > 0 and record["inter_node_bytes"]["tp"] == 0
    for host in made.hosts:  # two ranks per host sent that much each, over its own link
        assert namespace_cluster.link_bytes(host) - before[host] >= 2 * dp_across


def test_hybrid_sharding_with_a_shard_group_per_host_sends_only_the_replicas_all_reduce_across(cluster, tmp_path):
    """`--zero 3 --dp-shard 2` on 2 hosts of 2: the shard groups stay inside the hosts (0 bytes across, as their
    formula says), the replicas' all-reduce of each shard is all that crosses — equal to its formula, and to what
    the veth counters saw at least."""
    made = cluster(nodes=2, ranks_per_node=2)
    before = {host: namespace_cluster.link_bytes(host) for host in made.hosts}
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the same text again and again. " * 400)
    result = mpiparallel("train", "-n", "4", "--hostfile", str(made.hostfile), *TRAIN, "--zero", "3", "--dp-shard",
                         "2", "--show-mesh", "--data", str(corpus), "--log-json", str(tmp_path / "log.jsonl"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "inside a node: dp_shard; across nodes: dp, dp_replicate" in result.stdout, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank") and " across nodes: " in line]
    assert len(lines) == 4, result.stdout
    for line in lines:
        axes = {axis: (float(counted), ratio) for axis, counted, _, ratio in ACROSS.findall(line)}
        assert axes["dp_shard"] == (0.0, "1.0000") and axes["dp_replicate"][1] == "1.0000", line
        assert axes["dp_replicate"][0] > 0, line
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    across = sum(record["inter_node_bytes"]["dp_replicate"] for record in records)
    assert all(record["inter_node_bytes"]["dp_shard"] == 0 for record in records)
    for host in made.hosts:  # each host's two ranks sent that much each over its link, and received as much
        assert namespace_cluster.link_bytes(host) - before[host] >= 2 * across


def test_tp_across_hosts_is_warned_about_and_its_bytes_across_equal_the_formula(cluster, tmp_path):
    made = cluster(nodes=4, ranks_per_node=1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the same text again and again. " * 400)
    result = mpiparallel("train", "--hostfile", str(made.hostfile), *TRAIN, "--dp", "2", "--tp", "2", "--show-mesh",
                         "--data", str(corpus))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nodes: 4 nodes of 1, 1, 1, 1 ranks (MPI's shared-memory nodes)" in result.stdout
    assert "inside a node: no axis; across nodes: tp, dp" in result.stdout
    assert "warning: tensor-parallel groups of 2 ranks span nodes" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank") and " across nodes: " in line]
    assert len(lines) == 4
    for line in lines:
        axes = {axis: (float(counted), ratio) for axis, counted, _, ratio in ACROSS.findall(line)}
        assert all(counted > 0 and ratio == "1.0000" for counted, ratio in axes.values()), line


def test_verify_on_two_hosts_finds_every_algorithm_right_across_real_nodes(cluster):
    made = cluster(nodes=2, ranks_per_node=2)
    result = mpiparallel("verify", "-n", "4", "--hostfile", str(made.hostfile), "--max-count", "300", "-d", "float64",
                         "--collective", "all_reduce", "--collective", "reduce_scatter")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 nodes of 2, 2 ranks (MPI's shared-memory nodes)" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if " hierarchical " in line]
    assert {row[0] for row in rows} == {"all_reduce", "reduce_scatter"} and all(row[-1] == "0" for row in rows)


COMMON = {"n_layer": 2, "n_head": 4, "n_embd": 32, "seq_len": 16, "batch_size": 4, "steps": 3, "dtype": "float64",
          "grad_clip": 0.5, "weight_decay": 0.1, "vocab_size": 257, "lr": 1e-2}


def test_a_two_host_mesh_dp_across_tp_inside_trains_the_serial_models_numbers(cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2)
    (tmp_path / "serial").mkdir()
    reference = serial_training(COMMON, tmp_path / "serial")
    configs = [{"dp": 2, "tp": 2}, {"dp": 2, "tp": 2, "sp": True, "zero": 1}]
    results = parallel_training(4, COMMON, configs, reference, mpiexec_options=made.mpiexec_options())
    for result in results:
        assert_equals_serial(result, COMMON["steps"], 1e-9)


def test_the_ledgers_inter_node_bytes_equal_the_formulas_between_real_hosts(cluster):
    made = cluster(nodes=2, ranks_per_node=2)
    algorithms = ["ring", "hierarchical", "recursive_doubling", "recursive_halving", "rabenseifner"]
    results = run_on_ranks(4, topology_checks.ledger_against_formulas, timeout=300,
                           mpiexec_options=made.mpiexec_options(), algorithms=algorithms, block=2048)
    for rank, result in enumerate(results):
        assert result["nodes"] == [0, 0, 1, 1]
        for row in result["world"] + result["half"]:
            assert row["equal"] and row["input_kept"], (rank, row)
            if row["formula"] is not None:
                assert row["inter_node"] == pytest.approx(row["formula"]), (rank, row)
    assert {r["world"][1]["inter_node"] for r in results} == {2 * 1 / 2 * 4 * 2048 * 8 / 2}


# -- faults ----------------------------------------------------------------------------------------------------------

class Job:
    """`mpiparallel train` on a cluster, in the background, its output collected line by line."""

    def __init__(self, made: namespace_cluster.Cluster, tmp_path: Path, env: dict[str, str] | None = None) -> None:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("the same text again and again. " * 400)
        command = [sys.executable, "-m", "mpiparallel", "train", "-n", "4", "--hostfile", str(made.hostfile),
                   "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "8",
                   "--steps", "1000000", "--dp", "2", "--tp", "2", "--data", str(corpus), "--log-json",
                   str(tmp_path / "log.jsonl")]
        self.log = tmp_path / "log.jsonl"
        self.process = start_job(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, **(env or {})})  # waits bounded below; killed after the test
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.process.stdout.readline, "")))
        self.reader.start()

    def wait_for_steps(self, steps: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not (self.log.exists() and len(self.log.read_text().splitlines()) >= steps):
            assert self.process.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "the job never trained " + "".join(self.lines)
            time.sleep(0.1)

    def seconds_to_end(self, since: float, bound: float) -> float:
        """Seconds from `since` (a time.monotonic()) until the job ended; past `bound` seconds from `since` it is
        killed (its process group) and the test fails."""
        try:
            self.process.wait(timeout=max(since + bound - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            pytest.fail(f"the job did not end within {bound} s:\n{''.join(self.lines)[-3000:]}")
        finally:
            self.reader.join(timeout=30)
        return time.monotonic() - since

    def output(self) -> str:
        return "".join(self.lines)


def test_killing_a_host_mid_run_ends_every_rank_within_30_s_with_one_line_naming_it_and_its_ranks(cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2)
    job = Job(made, tmp_path)
    job.wait_for_steps(3)
    since = time.monotonic()
    result = mpiparallel("cluster", "kill", made.hosts[1], "--name", made.name, timeout=60)
    assert result.returncode == 0, result.stderr
    seconds = job.seconds_to_end(since, 30)
    output = job.output()
    assert job.process.returncode == ExitCode.LOST_HOST, output
    lost = [line for line in output.splitlines() if "lost" in line or "unreachable" in line]
    assert lost == [f"mpiparallel: host {made.hosts[1]} (ranks 2, 3) was lost: every process on it ended at once; "
                    f"mpiexec ended the other ranks"], output
    assert "assert" not in output and "Traceback" not in output and "failed" not in output, output
    assert_no_processes_on(made)
    print(f"killed host: the job ended {seconds:.1f} s later")


def test_cutting_a_hosts_link_mid_run_ends_the_job_within_the_heartbeat_bound_naming_the_host(cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2)
    timeout = 4.0
    job = Job(made, tmp_path, env={multi_host.TIMEOUT_VARIABLE: str(timeout)})
    job.wait_for_steps(3)
    since = time.monotonic()
    result = mpiparallel("cluster", "cut", made.hosts[1], "--name", made.name, timeout=60)
    assert result.returncode == 0, result.stderr
    bound = timeout + multi_host.ENDING_GRACE_S + multi_host.HEARTBEAT_INTERVAL_S
    seconds = job.seconds_to_end(since, bound + 30)  # the slack: a loaded machine; the printed figure is the measure
    output = job.output()
    assert job.process.returncode == ExitCode.UNREACHABLE_HOST, output
    lost = [line for line in output.splitlines() if line.startswith("mpiparallel:")]
    assert len(lost) == 1 and lost[0].startswith(f"mpiparallel: host {made.hosts[1]} (ranks 2, 3) is unreachable: "
                                                 f"no heartbeat for "), output
    assert "Traceback" not in output, output
    # every rank is alive (a cut link stops no process): each wrote what it waits in, under the host's line
    assert lost[0] + "\n  flight records of 4 of 4 ranks in " in output, output
    assert_no_processes_on(made)
    print(f"cut link: the job ended {seconds:.1f} s later (bound {bound:.1f} s on an idle machine)")


# -- the benchmark script ------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("cluster")  # root and namespaces; the script makes and removes clusters of its own
def test_the_cluster_benchmark_prints_predictions_beside_measurements_and_takes_its_clusters_down(tmp_path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_cluster.py"
    report_path = tmp_path / "report.json"
    process = subprocess.Popen([sys.executable, str(script), "--part", "collectives", "--sizes", "64K", "--rounds",
                                "1", "--link-rate", "2gbit", "--json", str(report_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        name = f"b{process.pid:x}0"  # the script's cluster, named after its PID
        left = namespace_cluster.namespaces_of(name) + namespace_cluster.links_of(name)
        namespace_cluster.down(name)
    assert process.returncode == 0, output
    assert not left, left
    rows = json.loads(report_path.read_text())["collectives"]["rows"]
    assert {row["collective"] for row in rows} == {"all_reduce", "reduce_scatter", "all_gather"}
    for row in rows:
        assert "hierarchical" in row["measured_us"] and set(row["predicted_us"]) == set(row["measured_us"])
        fastest = min(row["measured_us"], key=row["measured_us"].get)
        printed = re.search(rf"^{row['collective']} .* auto {row['auto']} +fastest {fastest} +auto/best (\S+)$",
                            output, re.MULTILINE)
        assert printed, output
        assert float(printed.group(1)) == pytest.approx(
            row["measured_us"][fastest] / row["measured_us"][row["auto"]], abs=0.006)


# -- hostfiles, heartbeats and lost hosts, without root ------------------------------------------------------------

def test_a_hostfile_reads_hosts_and_slots_and_skips_comments(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the machines\nnode-a:4\n\nnode-b   # one slot\nnode-c:2\n")
    assert multi_host.read_hostfile(hostfile) == [multi_host.Host("node-a", 4), multi_host.Host("node-b", 1),
                                                  multi_host.Host("node-c", 2)]


def test_a_rank_that_stops_beating_makes_its_host_unreachable_and_the_others_are_not_named():
    heard: list[tuple[str, float]] = []
    monitor = multi_host.HeartbeatMonitor("127.0.0.1", 2.0,
                                          lambda host, seconds: heard.append((host, seconds)) or True)
    monitor.start()
    beating = multi_host.start_heartbeat(0, {multi_host.HEARTBEAT: monitor.target})  # this host, throughout
    assert beating is not None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        for _ in range(4):  # a host that beats for a while, then falls silent
            other.sendto(b"silent-host 1 4242", ("127.0.0.1", int(monitor.target.rsplit(":", 1)[1])))
            time.sleep(multi_host.HEARTBEAT_INTERVAL_S)
    monitor.join(timeout=30)
    beating.kill()
    beating.wait(timeout=5)
    assert [host for host, _ in heard] == ["silent-host"]
    assert heard[0][1] > 2.0


def test_a_host_whose_ranks_said_farewell_is_done_not_lost_and_the_heartbeats_say_which_ranks_a_host_ran():
    """Where ranks cannot register in the parent's folder (srun on other machines), their farewell datagram is all
    that tells a host that finished from one that died; a host one of whose ranks said nothing is still lost."""
    heard: list[str] = []
    monitor = multi_host.HeartbeatMonitor("127.0.0.1", 2.0, lambda host, seconds: heard.append(host) or False)
    monitor.start()
    target = {multi_host.HEARTBEAT: monitor.target}
    port = int(monitor.target.rsplit(":", 1)[1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        for _ in range(3):
            for rank in (0, 1):
                other.sendto(f"done-host {rank} 42".encode(), ("127.0.0.1", port))
            other.sendto(b"half-host 2 43", ("127.0.0.1", port))
            other.sendto(b"half-host 3 44", ("127.0.0.1", port))
            time.sleep(multi_host.HEARTBEAT_INTERVAL_S)
    for rank in (0, 1):
        multi_host.say_farewell(rank, {**target, "SLURMD_NODENAME": "done-host"})
    multi_host.say_farewell(2, {**target, "SLURMD_NODENAME": "half-host"})
    time.sleep(4.0)
    monitor.stop()
    monitor.join(timeout=10)
    assert heard == ["half-host"]
    assert monitor.ranks_heard("half-host") == (2, 3) and monitor.ranks_heard("done-host") == (0, 1)


def test_a_host_whose_launcher_shell_never_noted_its_end_was_lost_with_its_ranks(tmp_path):
    for pid, rank, host in ((101, 0, "h-0"), (102, 1, "h-0"), (103, 2, "h-1"), (104, 3, "h-1")):
        (tmp_path / str(pid)).write_text(f"{rank} ")
        (tmp_path / f"{pid}{multi_host.RANK_HOST_SUFFIX}").write_text(host)
    (tmp_path / f"{multi_host.HOST_NOTE_PREFIX}h-0").write_text("ended 1\n")
    (tmp_path / f"{multi_host.HOST_NOTE_PREFIX}h-1").write_text(f"running {ended_pid()}\n")  # its shell is gone
    ranks = {pid: (rank, "") for pid, rank in ((101, 0), (102, 1), (103, 2), (104, 3))}
    lost = multi_host.killed_hosts(tmp_path, ranks)
    assert lost == [multi_host.LostHost("h-1", (2, 3), (103, 104), "killed")]
    assert lost[0].message() == ("mpiparallel: host h-1 (ranks 2, 3) was lost: every process on it ended at once; "
                                 "mpiexec ended the other ranks")
    assert multi_host.killed_hosts(tmp_path, ranks, ended_by_us={"h-1"}) == []


def ended_pid() -> int:
    """The PID of a process that has ended and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait(timeout=30)
    return child.pid


def test_under_open_mpi_a_job_that_ended_with_status_0_around_its_survivors_lost_the_host_that_died_first(tmp_path):
    """Open MPI 5.0's mpirun exits with 0 when its runtime ends a job that lost a host, and every host's note then
    reads as killed (`launch._killed_hosts`): the job finished only if every rank off the silent hosts ended with
    0; otherwise the host lost is that of the first rank to end without a word."""
    gone = ended_pid()
    for host in ("h-0", "h-1"):
        (tmp_path / f"{multi_host.HOST_NOTE_PREFIX}{host}").write_text(f"running {gone}\n")

    def job(endings: dict[int, str]) -> None:
        for pid, ending in endings.items():
            rank = pid - 101
            (tmp_path / str(pid)).write_text(f"{rank} {ending}")
            (tmp_path / f"{pid}{multi_host.RANK_HOST_SUFFIX}").write_text(f"h-{rank // 2}")

    order = [[(2, 103)], [(3, 104)], [(0, 101)], [(1, 102)]]  # the second host's ranks ended first
    job({101: "ended", 102: "ended", 103: "", 104: ""})  # the survivors went on in place and finished
    assert launch._killed_hosts(tmp_path, set(), 0, order) == []
    job({101: "ended 143", 102: "ended 143", 103: "", 104: ""})  # ended around them (a signal's stop)
    assert [host.host for host in launch._killed_hosts(tmp_path, set(), 0, order)] == ["h-1"]
    job({101: "", 102: "", 103: "", 104: ""})  # ended at once: nobody said a word
    assert [host.host for host in launch._killed_hosts(tmp_path, set(), 0, order)] == ["h-1"]
    assert [host.host for host in launch._killed_hosts(tmp_path, set(), 0, order[2:] + order[:2])] == ["h-0"]
    assert len(launch._killed_hosts(tmp_path, set(), 1, order)) == 2  # hydra's non-zero status: the notes decide


def test_a_host_whose_ranks_all_ended_on_their_own_may_fall_silent(tmp_path):
    for pid, rank, host, ending in ((101, 0, "h-0", ""), (102, 1, "h-0", ""), (103, 2, "h-1", "ended"),
                                    (104, 3, "h-1", "ended")):
        (tmp_path / str(pid)).write_text(f"{rank} {ending}")
        (tmp_path / f"{pid}{multi_host.RANK_HOST_SUFFIX}").write_text(host)
    ranks = {101: (0, ""), 102: (1, ""), 103: (2, "ended"), 104: (3, "ended")}
    assert multi_host.ended_on_their_own("h-1", tmp_path, ranks)  # done: rank 0 may still be saving
    assert not multi_host.ended_on_their_own("h-0", tmp_path, ranks)
    assert not multi_host.ended_on_their_own("h-2", tmp_path, ranks)  # no rank of it ever registered


def rank_processes(host: str) -> list[int]:
    """The PIDs of the training ranks on `host` (not hydra's proxy nor the launcher's shell)."""
    found = []
    for pid in namespace_cluster.processes_in(host):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if command[1:4] == [b"-m", b"mpiparallel", b"train"]:
            found.append(pid)
    return found


def test_a_single_killed_rank_on_a_cluster_is_named_as_a_rank_not_a_host(cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2)
    job = Job(made, tmp_path)
    job.wait_for_steps(3)
    victim = rank_processes(made.hosts[1])[0]
    since = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    job.seconds_to_end(since, 30)
    output = job.output()
    lost = [line for line in output.splitlines() if "lost" in line or "unreachable" in line]
    assert len(lost) == 1 and re.match(rf"mpiparallel: rank [23] \(pid {victim}\) was lost: ", lost[0]), output
    assert "assert" not in output and "Traceback" not in output, output
    assert_no_processes_on(made)


def test_a_stopped_rank_on_a_cluster_is_named_by_the_stall_watchdog_before_the_heartbeats_miss_it(cluster, tmp_path):
    """SIGSTOP stops the rank's heartbeat thread too: with a stall timeout (3 s) under the heartbeats' (10 s), the
    stall watchdog ends the job first, naming the rank, and its line alone is printed."""
    made = cluster(nodes=2, ranks_per_node=2)
    job = Job(made, tmp_path, env={"MPIPARALLEL_STALL_TIMEOUT": "3"})
    job.wait_for_steps(3)
    victim = rank_processes(made.hosts[1])[0]
    since = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    job.seconds_to_end(since, 30)
    output = job.output()
    assert job.process.returncode == ExitCode.STALL, output
    named = [line for line in output.splitlines() if "lost" in line or "unreachable" in line or "stalled" in line]
    assert len(named) == 1 and re.match(r"mpiparallel: stalled: rank [23] \(stopped: SIGSTOP or a debugger\) has not "
                                        r"finished step \d+ ", named[0]), output
    assert "assert" not in output and "Traceback" not in output, output
    assert_no_processes_on(made)


def test_ctrl_c_ends_a_cluster_job_without_naming_a_lost_host(cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2)
    job = Job(made, tmp_path)
    job.wait_for_steps(3)
    since = time.monotonic()
    os.killpg(job.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    job.seconds_to_end(since, 30)
    output = job.output()
    assert job.process.returncode == ExitCode.INTERRUPTED, output
    assert not [line for line in output.splitlines() if "was lost" in line or "unreachable" in line], output
    assert_no_processes_on(made)
