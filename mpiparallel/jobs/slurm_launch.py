"""Inside a Slurm allocation (an `sbatch` script, `salloc`'s shell): `-n N` starts its ranks with `srun`; a node
lost mid-run is named in one line, and `train --elastic` relaunches on the nodes left.

Launch. Where SLURM_JOB_ID is set and this process is no task of a step of several, the self-launching parent
runs `srun --ntasks N --mpi=PLUGIN --kill-on-bad-exit=1 python -m mpiparallel …` in place of mpiexec: PLUGIN is
pmix for Open MPI and pmi2 for MPICH — the interface the MPI library mpi4py loads can reach (with the other one
Open MPI gives every rank a world of 1, MPICH fails); SLURM_MPI_TYPE, srun's own variable, overrides it. `-n` more
than the allocation's tasks is one error before anything starts. MPIPARALLEL_LAUNCHER=mpiexec keeps mpiexec (a
single-task allocation whose ranks should share its node, say).

Lost nodes. Slurm notices a crashed node only when its controller's pings go unanswered for SlurmdTimeout:
measured on the namespace hosts (SlurmdTimeout=30), srun ended 41.5 s after `cluster kill` with "Node failure",
and MPICH's survivors waited in their all-reduce until then. The parent does what it does for a hostfile cluster
(`hosts.py`): each rank sends a UDP heartbeat to it every half second, and a node none of whose ranks was heard
for MPIPARALLEL_HEARTBEAT_TIMEOUT seconds (default 10) is named in one line, `host H (ranks …) is unreachable`,
exit status 6 (ExitCode.UNREACHABLE_HOST). The parent then ends the step the way srun is asked to: SIGTERM twice
within a second (srun kills every task of the step it can reach, at once: 0.03 s measured), and srun itself after
ENDING_GRACE_S (it would wait for the lost node's tasks until Slurm gives the node up). The heartbeats go to the
address this machine uses to reach the allocation's first node (its NodeAddr), so the parent may sit on a
compute node (the batch shell) or a login node (salloc). One trap: srun notices the lost node's task daemon gone
and kills the other nodes' tasks at once (--kill-on-bad-exit), so they fall silent within a heartbeat of the lost
node, and the last beat heard cannot tell which was first; a node srun reported ending the tasks of
(`nodes_whose_tasks_ended`) is passed over.

Elastic. `train --elastic` relaunches on the nodes left: `srun --nodes K --nodelist LEFT --overlap`. --overlap,
because until Slurm declares the lost node down the old step still holds the CPUs of the nodes left, and a new step
would wait for them (measured: 8 s and counting); the old step's tasks there are already dead. The allocation must
outlive the node: `salloc --no-kill` or `sbatch --no-kill` (without it Slurm revokes the whole job once it
declares the node down, and the relaunched step with it).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from ..errors import ConfigError
from ..text import plural
from . import hosts as multi_host

LAUNCHER_VARIABLE = "MPIPARALLEL_LAUNCHER"
"""`srun` (the default inside an allocation) or `mpiexec`: what `-n N` starts its ranks with."""

SECOND_SIGNAL_AFTER_S = 0.3
"""srun ends a step at once on a second SIGTERM within a second of the first (the first alone only signals)."""

_STEP_VARIABLES = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                   "SLURM_TASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS")
"""The allocation's shape as salloc/sbatch exported it: stale once a node is lost (Slurm shrinks a --no-kill
job), and srun then complains that they disagree with the job; a relaunch drops them and names its nodes."""


def expand_counts(compressed: str) -> list[int]:
    """Slurm's per-node counts, `2(x3),1` → [2, 2, 2, 1]."""
    counts = []
    for item in filter(None, compressed.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ConfigError(f"cannot read Slurm's per-node counts {compressed!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _scontrol(*words: str) -> str:
    try:
        done = subprocess.run(["scontrol", *words], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ConfigError(f"scontrol {' '.join(words)}: {error}") from None
    if done.returncode != 0:
        raise ConfigError(f"scontrol {' '.join(words)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs in: its nodes and how many tasks each may run. `relaunch`: a step after a
    loss, which names its nodes and overlaps the lost step (module docstring)."""

    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    relaunch: bool = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Allocation:
        nodes = tuple(_scontrol("show", "hostnames", environ["SLURM_JOB_NODELIST"]).split())
        counts = expand_counts(environ.get("SLURM_TASKS_PER_NODE", "")) or [1] * len(nodes)
        if len(counts) != len(nodes):
            raise ConfigError(f"SLURM_TASKS_PER_NODE {environ.get('SLURM_TASKS_PER_NODE')!r} does not give one "
                              f"count per node of {environ['SLURM_JOB_NODELIST']}")
        return cls(environ["SLURM_JOB_ID"], nodes, tuple(counts))

    @property
    def tasks(self) -> int:
        return sum(self.tasks_per_node)

    @property
    def hosts(self) -> list[multi_host.Host]:
        return [multi_host.Host(node, count) for node, count in zip(self.nodes, self.tasks_per_node, strict=True)]

    def without(self, lost: Sequence[str]) -> Allocation:
        """The nodes left after losing `lost`, for the relaunch."""
        kept = [(node, count) for node, count in zip(self.nodes, self.tasks_per_node, strict=True) if node not in lost]
        return replace(self, nodes=tuple(node for node, _ in kept), tasks_per_node=tuple(c for _, c in kept),
                       relaunch=True)

    @cached_property
    def heartbeat_address(self) -> str:
        """This machine's address on the way to the first node: where every node can send its heartbeats."""
        fields = dict(word.split("=", 1) for word in _scontrol("show", "node", "-o", self.nodes[0]).split()
                      if "=" in word)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((fields.get("NodeAddr", self.nodes[0]), 9))  # UDP: no packet is sent
            return probe.getsockname()[0]

    def check_ranks(self, ranks: int) -> None:
        if ranks > self.tasks:
            raise ConfigError(f"-n {ranks} asks for more ranks than Slurm job {self.job_id} has tasks: "
                              f"{self.tasks} on {plural(len(self.nodes), 'node')} ({','.join(self.nodes)}); ask "
                              f"salloc/sbatch for -n {ranks}, or set {LAUNCHER_VARIABLE}=mpiexec to start the ranks "
                              f"here with mpiexec")

    def command(self, ranks: int, argv: Sequence[str], open_mpi: bool,
                environ: Mapping[str, str] = os.environ) -> list[str]:
        """The srun line that starts `ranks` copies of this program with `argv`."""
        plugin = [] if environ.get("SLURM_MPI_TYPE") else [f"--mpi={'pmix' if open_mpi else 'pmi2'}"]
        where = [f"--nodes={len(self.nodes)}", f"--nodelist={','.join(self.nodes)}", "--overlap"] \
            if self.relaunch else []
        return ["srun", f"--ntasks={ranks}", *where, *plugin, "--kill-on-bad-exit=1", sys.executable, "-m",
                "mpiparallel", *argv]

    def environment(self, open_mpi: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """Variables for srun and its ranks: a relaunch drops the allocation's stale shape; Open MPI's ranks yield
        when idle where a node runs more of them than it has CPUs (see `launch.open_mpi_settings`)."""
        added = {}
        if open_mpi:
            cpus = expand_counts(environ.get("SLURM_JOB_CPUS_PER_NODE", "")) or [os.cpu_count() or 1]
            if max(self.tasks_per_node) > min(cpus):
                added["OMPI_MCA_mpi_yield_when_idle"] = "1"
            added["OMPI_MCA_btl"] = "^ofi"
        base = {name: value for name, value in environ.items() if not (self.relaunch and name in _STEP_VARIABLES)}
        return {**base, **{name: value for name, value in added.items() if name not in environ}}

    def end_step(self, srun: subprocess.Popen) -> None:
        """Have srun end every task of its step now (SIGTERM twice within a second), where the parent cannot reach
        the tasks itself (other machines); the caller kills srun after a grace."""
        for _ in range(2):
            try:
                srun.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                return
            time.sleep(SECOND_SIGNAL_AFTER_S)


_TASKS_ENDED = re.compile(r"^srun: error: (\S+): tasks? [0-9,-]+: ")


def nodes_whose_tasks_ended(srun_said: Sequence[bytes]) -> set[str]:
    """The nodes whose tasks srun reported ended (`srun: error: NODE: tasks 0-1: Killed`): srun kills the other
    tasks at once when one fails (--kill-on-bad-exit), and a node whose ranks it killed falls silent beside the lost
    one, within a heartbeat of it — its silence is no loss (the parent cannot tell the two apart by the last beat
    heard: seen, the live node was named). A node that crashed gets no such line until Slurm declares it down."""
    return {match[1] for line in srun_said if (match := _TASKS_ENDED.match(line.decode(errors="replace")))}


def current(environ: Mapping[str, str] = os.environ) -> Allocation | None:
    """The allocation `-n N` should start its ranks in: inside a Slurm job, unless MPIPARALLEL_LAUNCHER says
    mpiexec; None outside Slurm."""
    chosen = environ.get(LAUNCHER_VARIABLE, "").strip()
    if chosen not in ("", "srun", "mpiexec"):
        raise ConfigError(f"{LAUNCHER_VARIABLE}={chosen!r}: srun or mpiexec")
    inside = bool(environ.get("SLURM_JOB_ID") and environ.get("SLURM_JOB_NODELIST"))
    if chosen == "srun" and not inside:
        raise ConfigError(f"{LAUNCHER_VARIABLE}=srun needs a Slurm allocation (salloc, sbatch): SLURM_JOB_ID and "
                          f"SLURM_JOB_NODELIST are not set")
    if chosen == "mpiexec" or not inside:
        return None
    return Allocation.from_environment(environ)
