"""A Slurm of the cluster's own on its namespace hosts: `mpiparallel cluster up --scheduler slurm`.

Users meet clusters through Slurm: `sbatch` a script, `srun` the ranks. This module puts a real Slurm (Debian's
`slurm-wlm`, no emulation) on the hosts `namespace_cluster` makes, so that jobs start the way they start on a
site's cluster, and every daemon, file and port is the cluster's own:

    root namespace:  munged  --socket NAME/slurm/munge.socket      (one credential service; a socket path is
                                                                     reachable from every namespace)
                     slurmctld  host name NAME-ctl, on the bridge's address, port P (a free one)
    namespace NAME-i: slurmd -N NAME-i  (its own network stack: the default slurmd port is free in each)

All of it is written under the cluster's folder (NAME/slurm: slurm.conf, cgroup.conf, the munge key, state,
spool and logs), and every daemon's command line names that folder, which is how `down` finds exactly them.

What the recipe needs, measured on Debian 12 (Slurm 22.05):

- `SlurmctldHost=NAME-ctl(ADDRESS)` and `NodeAddr=` per node: names resolve without touching /etc/hosts;
  slurmctld runs under `unshare --uts` with the host name NAME-ctl, as it checks its own name.
- `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`, and `CgroupPlugin=cgroup/v1` in cgroup.conf:
  `ip netns exec` remounts /sys, which hides the cgroup mounts, and slurmd dies on the cgroup plugins otherwise.
- Per-node `SlurmdSpoolDir=…/%n` and `TmpFS=…/%n`: the hosts share one file system, and PMIx's per-step folder
  under TmpFS collides between nodes otherwise.
- `SlurmdParameters=config_overrides`: a node has as many CPUs as `--ranks-per-node` says, whatever this machine
  has, so `srun -N 2 -n 4` is placed two per node as on a real cluster.
- `ReturnToService=2`: a node that was down (a `cluster kill`) is used again once its slurmd registers.

Debian's packages install their own daemons but do not start them in a container (policy-rc.d); nothing here
uses /etc/slurm or /etc/munge.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from .namespace_cluster import Cluster

PACKAGES = "slurm-wlm munge libpmix-dev"
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol")
START_TIMEOUT_S = 30.0
SLURMD_PORT = 6818
SLURMD_TIMEOUT_S = 30
"""How long a node may stay silent before slurmctld declares it DOWN (Slurm's default 300 s; a crashed host is
noticed no sooner, and srun waits for that)."""


CRED_EXPIRE_S = 10
"""A job step credential's lifetime, which is also how long a requeued job waits before it may start again (Slurm's
default 120 s; a requeue here resumes ~12 s after the job stopped)."""


def folder(cluster: Cluster) -> Path:
    return Path(cluster.folder) / "slurm"


def conf_path(cluster: Cluster) -> Path:
    return folder(cluster) / "slurm.conf"


def controller_name(cluster: Cluster) -> str:
    return f"{cluster.name}-ctl"


def environment(cluster: Cluster) -> dict[str, str]:
    """The variables Slurm's commands need to talk to this cluster's Slurm (on top of the caller's)."""
    return {**os.environ, "SLURM_CONF": str(conf_path(cluster))}


def check_packages() -> None:
    """One line naming what to install when a Slurm or munge command is missing."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if missing:
        raise ConfigError(f"--scheduler slurm needs {', '.join(missing)}, which this machine lacks: install "
                          f"Debian's {PACKAGES} (apt-get install {PACKAGES})")


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def free_port(address: str) -> int:
    """A TCP port nothing in the root namespace listens on now (the kernel picks it)."""
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def slurm_conf(cluster: Cluster, controller_port: int) -> str:
    """slurm.conf for this cluster: one partition named after it holding every host."""
    base = folder(cluster)
    nodes = "\n".join(f"NodeName={host} NodeAddr={cluster.address(host)} CPUs={cluster.ranks_per_node} "
                      f"State=UNKNOWN" for host in cluster.hosts)
    return f"""# mpiparallel cluster {cluster.name}: its own Slurm (mpiparallel/jobs/slurm_cluster.py)
ClusterName={cluster.name}
SlurmctldHost={controller_name(cluster)}({cluster.bridge_address})
SlurmctldPort={controller_port}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={base / 'munge.socket'},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={base / 'state'}
SlurmdSpoolDir={base / 'spool'}/%n
TmpFS={base / 'tmp'}/%n
SlurmctldPidFile={base / 'slurmctld.pid'}
SlurmdPidFile={base / 'spool'}/%n/slurmd.pid
SlurmctldLogFile={base / 'slurmctld.log'}
SlurmdLogFile={base / 'spool'}/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT_S}
MailProg=/bin/true
TaskProlog={base / 'task_prolog.sh'}
{nodes}
PartitionName={cluster.name} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


TASK_PROLOG = """#!/bin/sh
# Run by slurmd before each task; every `export NAME=VALUE` line it prints is set in the task's environment.
# MPICH's UCX sees that the namespace hosts share one kernel and would move bytes between them through memory:
# TCP over the host's own link makes them cross it, as between real machines (unless the user chose otherwise).
[ -n "$UCX_TLS" ] || echo "export UCX_TLS=tcp,self"
[ -n "$UCX_NET_DEVICES" ] || echo "export UCX_NET_DEVICES=eth0"
"""


SOCKET_PATH_LIMIT = 107
"""The longest path a Unix socket may have (sun_path, 108 bytes with its NUL). slurmd names each job step's socket
SPOOL/NODE_JOB.STEP; past the limit every task launch fails with srun's 'Unspecified error' (measured)."""


def check_folder_length(cluster: Cluster) -> None:
    """One clear error where the cluster's folder is too long a path for Slurm's step sockets."""
    longest = max(len(f"{folder(cluster) / 'spool' / host / host}_4294967294.4294967294") for host in cluster.hosts)
    if longest > SOCKET_PATH_LIMIT:
        raise ConfigError(f"--scheduler slurm: the cluster's folder {cluster.folder} is too long a path for Slurm's "
                          f"step sockets ({longest} characters of at most {SOCKET_PATH_LIMIT}): set "
                          f"MPIPARALLEL_CLUSTERS to a shorter folder (the default, /run/mpiparallel-clusters, fits)")


def start(cluster: Cluster) -> None:
    """Write the configuration, start munged, slurmctld and one slurmd per host, and wait until every node is
    idle (one error with the logs' last lines otherwise)."""
    check_packages()
    check_folder_length(cluster)
    base = folder(cluster)
    for sub in ("state", *(f"spool/{host}" for host in cluster.hosts), *(f"tmp/{host}" for host in cluster.hosts)):
        (base / sub).mkdir(parents=True, exist_ok=True)
    base.chmod(0o700)  # munged refuses a key or socket in a folder others may write to
    conf_path(cluster).write_text(slurm_conf(cluster, free_port(cluster.bridge_address)))
    (base / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    (base / "task_prolog.sh").write_text(TASK_PROLOG)
    (base / "task_prolog.sh").chmod(0o755)
    _start_munge(base)
    _daemon([*_uts("root", controller_name(cluster)), _tool("slurmctld"), "-D", "-f", str(conf_path(cluster))],
            base / "slurmctld.out")
    for host in cluster.hosts:
        _daemon([*_uts(host, host), _tool("slurmd"), "-D", "-N", host, "-f", str(conf_path(cluster))],
                base / "spool" / host / "slurmd.out")
    _wait_until_idle(cluster)


def _uts(namespace: str, host_name: str) -> list[str]:
    """The command prefix that runs a daemon in `namespace` ("root": this one) under its own host name."""
    prefix = [] if namespace == "root" else ["ip", "netns", "exec", namespace]
    return [*prefix, "unshare", "--uts", "sh", "-c", f'hostname {host_name} && exec "$@"', "sh"]


def _daemon(command: list[str], output: Path) -> None:
    """Start a daemon in the foreground of its own session (so that it outlives `cluster up`)."""
    with open(output, "ab") as log:
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)


def _start_munge(base: Path) -> None:
    key = base / "munge.key"
    subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}", "--force"], check=True,
                   capture_output=True)
    key.chmod(0o600)
    _daemon([_tool("munged"), "--foreground", "--force", f"--socket={base / 'munge.socket'}", f"--key-file={key}",
             f"--pid-file={base / 'munged.pid'}", f"--log-file={base / 'munged.log'}",
             f"--seed-file={base / 'munged.seed'}"], base / "munged.out")
    _wait_for(lambda: (base / "munge.socket").exists(), "munged made no socket", base / "munged.log")


def _wait_for(ready: Callable[[], bool], failure: str, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            said = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
            raise ConfigError(f"Slurm did not start: {failure} within {timeout_s:.0f} s"
                              + (f"; {log} ends: " + " | ".join(said) if said else ""))
        time.sleep(0.1)


def node_states(cluster: Cluster) -> dict[str, str]:
    """Slurm's state of each node (idle, alloc, down*, …); empty when the controller does not answer."""
    said = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], capture_output=True, text=True,
                          env=environment(cluster), timeout=30)
    if said.returncode != 0:
        return {}
    return dict(line.split(None, 1) for line in said.stdout.splitlines() if line.strip())


def _wait_until_idle(cluster: Cluster) -> None:
    _wait_for(lambda: all(node_states(cluster).get(host) == "idle" for host in cluster.hosts),
              "not every node became idle", folder(cluster) / "slurmctld.log")


def own_processes(cluster_folder: str | Path) -> list[int]:
    """The processes whose command line names the cluster's Slurm folder: its munged, slurmctld and slurmds
    (and the `unshare` around them while they start). Nothing else names it."""
    mark = f"{Path(cluster_folder) / 'slurm'}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return [pid for pid in found if pid != os.getpid()]


def stop(cluster_folder: str | Path, deadline_s: float = 10.0) -> int:
    """End every daemon of the cluster's Slurm: SIGTERM (slurmctld saves its state), then SIGKILL for any left
    after `deadline_s`. Returns how many there were."""
    found = own_processes(cluster_folder)
    for number in (signal.SIGTERM, signal.SIGKILL):
        for pid in own_processes(cluster_folder):
            try:
                os.kill(pid, number)
            except ProcessLookupError:
                pass
        give_up = time.monotonic() + deadline_s
        while (left := own_processes(cluster_folder)) and time.monotonic() < give_up:
            time.sleep(0.05)
        if not left:
            break
    return len(found)


def status_lines(cluster: Cluster) -> list[str]:
    """What `cluster status` adds: Slurm's view of each node, and the jobs in its queue."""
    states = node_states(cluster)
    if not states:
        return [f"slurm: the controller does not answer (its log: {folder(cluster) / 'slurmctld.log'})"]
    lines = [f"slurm ({conf_path(cluster)}): " + ", ".join(f"{host} {states.get(host, 'unknown')}"
                                                           for host in cluster.hosts)]
    queue = subprocess.run(["squeue", "--noheader", "--format=%i %j %T %D %R"], capture_output=True, text=True,
                           env=environment(cluster), timeout=30).stdout.splitlines()
    lines += [f"  job {line}" for line in queue] or ["  no jobs"]
    return lines


def usage_lines(cluster: Cluster) -> list[str]:
    """What `up` adds: how to point Slurm's commands at this cluster and launch on it."""
    ranks = cluster.nodes * cluster.ranks_per_node
    return [
        f"slurm: controller {controller_name(cluster)} on {cluster.bridge_address}, partition {cluster.name}, "
        f"{cluster.nodes} nodes of {cluster.ranks_per_node} CPUs",
        "use it:",
        f"  export SLURM_CONF={conf_path(cluster)}",
        f"  srun -N {cluster.nodes} -n {ranks} --mpi=pmi2 mpiparallel train --dp {ranks} --show-mesh   # MPICH",
        f"  MPI=pmi2 sbatch -N {cluster.nodes} --ntasks-per-node {cluster.ranks_per_node} scripts/slurm_train.sh "
        f"--n-layer 4 --n-embd 128 --n-head 4",
    ]
