"""Ranks on several hosts: the hostfile, the launch line, and what was lost when a host dies or drops off the network.

Hostfile. `--hostfile FILE` (on every command that takes `-n`) names the hosts in MPICH's format, `host[:slots]`
per line (`#` starts a comment). It is checked before any rank starts: every host must be known (a host of the
cluster when the file is one `mpiparallel cluster up` wrote, else a name the resolver knows) and `-n` may not
exceed the slots; `-n` left out means one rank per slot. A cluster's hostfile launches through its launcher
(`mpiparallel.jobs.namespace_cluster`), any other through `mpiexec -f FILE`.

Lost hosts. Two ways a host goes, and how the self-launching parent tells (on a cluster of `mpiparallel cluster`,
where every process is on this machine):

- Killed (every process on it ended at once, like a machine that died). The cluster's launcher wraps the host's
  hydra proxy in a shell that notes the host as `running` in the RANK_PIDS folder and as `ended STATUS` when the
  proxy ends, however it ends (hydra ending the job included). A host still noted `running` once mpiexec has
  ended is one whose shell died with the rest: that host was lost. Hydra's own account of it (four lines of
  `assert (!closed) failed`) is replaced by one line naming the host and its ranks.
- Cut off (its link down: its processes live on, but no packet passes). MPI over TCP then waits as long as TCP
  retransmits (minutes): no rank fails, nothing ends. So every rank sends a heartbeat, a UDP datagram of a few
  bytes every HEARTBEAT_INTERVAL_S from a small process of its own that never touches MPI (`start_heartbeat`),
  to the parent (at the bridge address); a host none of whose ranks was heard for the timeout
  (MPIPARALLEL_HEARTBEAT_TIMEOUT, default DEFAULT_TIMEOUT_S) is unreachable. The parent then says so in one line,
  ends the ranks and proxies of every host (it knows their PIDs) and mpiexec, and exits: the job ends at most the
  timeout plus ENDING_GRACE_S after the cut (plus up to one interval). The heartbeat costs each rank's host two
  wake-ups a second; a step is not measurably slower (docs/clusters.md measures it).

`LostHost` is the structured account (host, ranks, PIDs, cause) that the one line prints and a supervisor can
act on: which host to leave out, which ranks to replace.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

HEARTBEAT = "MPIPARALLEL_HEARTBEAT"
"""Set by the self-launching parent on a cluster: `ADDRESS:PORT` where each rank sends its heartbeats."""

TIMEOUT_VARIABLE = "MPIPARALLEL_HEARTBEAT_TIMEOUT"
HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_TIMEOUT_S = 10.0
"""Twenty missed heartbeats: a rank starved of CPU for 10 s on a loaded machine is not mistaken for a cut."""
ENDING_GRACE_S = 3.0
"""How long the parent lets mpiexec and the ranks end by themselves before it ends them (SIGKILL)."""

HOST_NOTE_PREFIX = "host-"
"""In the RANK_PIDS folder: `host-NAME`, written by the cluster launcher's shell around the host's proxy."""
RANK_HOST_SUFFIX = ".host"
"""In the RANK_PIDS folder: `PID.host`, holding the host name of the rank with that PID."""


# -- the hostfile ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def read_hostfile(path: Path) -> list[Host]:
    """The hosts of an MPICH hostfile (`host[:slots]` per line; slots default 1), or one clear error."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"--hostfile {path}: cannot read it ({error.strerror})") from None
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        name, _, slots = entry.partition(":")
        if not name or " " in entry or (slots and not slots.isdigit()) or slots == "0":
            raise ConfigError(f"--hostfile {path}, line {number}: {line.strip()!r} is not `host` or `host:slots` "
                              f"(slots a positive whole number)")
        hosts.append(Host(name, int(slots) if slots else 1))
    if not hosts:
        raise ConfigError(f"--hostfile {path} names no host")
    return hosts


def check_hosts(path: Path, hosts: Sequence[Host], ranks: int, known: Callable[[str], bool], kind: str) -> None:
    """One clear error for a host that `known` rejects or for more ranks than slots."""
    unknown = [host.name for host in hosts if not known(host.name)]
    if unknown:
        raise ConfigError(f"--hostfile {path} names {'an unknown host' if len(unknown) == 1 else 'unknown hosts'}: "
                          f"{', '.join(unknown)} ({kind})")
    slots = sum(host.slots for host in hosts)
    if ranks > slots:
        listed = ", ".join(f"{host.name}:{host.slots}" for host in hosts)
        raise ConfigError(f"-n {ranks} asks for more ranks than --hostfile {path} has slots: {slots} ({listed}); "
                          f"lower -n or add slots")


def resolvable(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


# -- heartbeats -----------------------------------------------------------------------------------------------

_BEATING = """
import ctypes, os, socket, sys, time
address, port, message, rank_pid, interval = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), \
    int(sys.argv[4]), float(sys.argv[5])
try:
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: ended with the rank, not up to a beat later
except (OSError, AttributeError):
    pass
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
    while os.getppid() == rank_pid:
        try:
            sender.sendto(message, (address, port))
        except OSError:
            pass
        time.sleep(interval)
"""
"""The heartbeat process: beats while the rank that started it lives, and is killed by the kernel when the rank
ends (a job's hosts show no process of it once its ranks are gone); the parent check covers a rank that ended
before the request."""


def start_heartbeat(rank: int, environ: Mapping[str, str] = os.environ) -> subprocess.Popen | None:
    """On a rank: send `HOST RANK PID` to the parent every HEARTBEAT_INTERVAL_S, if the parent asked for
    heartbeats. From a small process of its own, not a thread: a rank stuck inside MPI holding Python's lock (MPICH
    spinning in MPI_Init, Open MPI's survivors of a lost peer, both seen) would starve a thread, and its live host
    would fall silent beside the dead one — which of the two the parent named was then a matter of milliseconds.
    The heartbeat says that the host and the rank's process are there; whether the rank makes progress is the
    stall watchdog's question (`stall.py`)."""
    target = environ.get(HEARTBEAT)
    if not target:
        return None
    address, _, port = target.rpartition(":")
    beating = [sys.executable, "-S", "-I", "-c", _BEATING, address, port, _beat(rank, environ), str(os.getpid()),
               str(HEARTBEAT_INTERVAL_S)]
    # holding no pipe of the rank's, so that the rank's end shows at once to whatever reads its output
    return subprocess.Popen(beating, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _beat(rank: int, environ: Mapping[str, str], said: str = "") -> str:
    """A heartbeat's words, `HOST RANK PID`, and `ended` in a farewell (`HeartbeatMonitor.run` reads them)."""
    return f"{this_host(environ)} {rank} {os.getpid()} {said}".rstrip()


def say_farewell(rank: int, environ: Mapping[str, str] = os.environ) -> None:
    """On a rank that ends through `run_guarded`: tell the parent, so that the silence that follows is not taken
    for a lost host (where the rank could not register in the parent's folder: another machine). Sent twice: a
    datagram may be lost."""
    target = environ.get(HEARTBEAT)
    if not target:
        return
    address, _, port = target.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        for _ in range(2):
            try:
                sender.sendto(_beat(rank, environ, "ended").encode(), (address, int(port)))
            except OSError:
                return


def heartbeat_timeout(environ: Mapping[str, str] = os.environ) -> float:
    value = environ.get(TIMEOUT_VARIABLE, "").strip()
    try:
        timeout = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ConfigError(f"{TIMEOUT_VARIABLE} takes seconds, got {value!r}") from None
    if timeout < 4 * HEARTBEAT_INTERVAL_S:
        raise ConfigError(f"{TIMEOUT_VARIABLE}={value}: at least {4 * HEARTBEAT_INTERVAL_S} s (four heartbeats)")
    return timeout


class HeartbeatMonitor(threading.Thread):
    """In the parent: receives the ranks' heartbeats and calls `unreachable(host, seconds)` for a host none of
    whose ranks was heard for `timeout` seconds (a host counts once one of its ranks was heard; one whose every rank
    heard said farewell, `say_farewell`, is done, not lost). The call returns True when it ended the job (the
    monitor stops), False when the silence was expected (the host's ranks ended on their own): the host is then no
    longer watched."""

    def __init__(self, address: str, timeout: float, unreachable: Callable[[str, float], bool]) -> None:
        super().__init__(name="mpiparallel-heartbeats", daemon=True)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((address, 0))
        self.socket.settimeout(HEARTBEAT_INTERVAL_S)
        self.target = f"{address}:{self.socket.getsockname()[1]}"
        self.timeout, self.unreachable = timeout, unreachable
        self.last_heard: dict[str, float] = {}
        self.heard: dict[str, set[int]] = {}  # host -> the ranks heard from it
        self.ended: dict[str, set[int]] = {}  # host -> its ranks that said they ended
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                host, rank, *said = self.socket.recv(256).decode().split()[:4]
                self.last_heard[host] = time.monotonic()
                self.heard.setdefault(host, set()).add(int(rank))
                if said[1:] == ["ended"]:
                    self.ended.setdefault(host, set()).add(int(rank))
            except (OSError, ValueError, UnicodeError):
                pass
            now = time.monotonic()
            silent = [(now - heard, host) for host, heard in self.last_heard.items()
                      if now - heard > self.timeout and not self.heard[host] <= self.ended.get(host, set())]
            if silent and not self.stopped.is_set():
                seconds, host = max(silent)
                if self.unreachable(host, seconds):
                    self.stopped.set()
                else:
                    del self.last_heard[host]
        self.socket.close()

    def stop(self) -> None:
        self.stopped.set()

    def ranks_heard(self, host: str) -> tuple[int, ...]:
        """The ranks whose heartbeats came from `host`."""
        return tuple(sorted(self.heard.get(host, ())))


# -- what was lost ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LostHost:
    """A host the job lost: its name, the world ranks that ran there and their PIDs, and why ("killed": every
    process on it ended at once; "unreachable": not heard for `silent_s` seconds)."""

    host: str
    ranks: tuple[int, ...]
    pids: tuple[int, ...]
    cause: str
    silent_s: float = 0.0

    def message(self) -> str:
        ranks = f"rank{'s' if len(self.ranks) != 1 else ''} {', '.join(map(str, self.ranks)) or '?'}"
        if self.cause == "unreachable":
            return (f"mpiparallel: host {self.host} ({ranks}) is unreachable: no heartbeat for "
                    f"{self.silent_s:.0f} s (its link is down or it stopped); ended every rank")
        return f"mpiparallel: host {self.host} ({ranks}) was lost: every process on it ended at once; " \
               f"mpiexec ended the other ranks"


def rank_hosts(pids: Path) -> dict[int, str]:
    """PID -> host name of every rank that said where it runs."""
    hosts = {}
    for entry in pids.glob(f"*{RANK_HOST_SUFFIX}"):
        pid = entry.name.removesuffix(RANK_HOST_SUFFIX)
        if pid.isdigit():
            hosts[int(pid)] = entry.read_text().strip()
    return hosts


def ended_on_their_own(host: str, pids: Path, ranks: Mapping[int, tuple[int, str]]) -> bool:
    """Whether every rank that registered from `host` has said how it ended (`ranks`: PID -> (rank, ending)):
    then its heartbeats stopped because its ranks are done, while others may still be finishing (saving, say)."""
    on_host = [pid for pid, name in rank_hosts(pids).items() if name == host]
    return bool(on_host) and all(ranks.get(pid, (0, ""))[1] for pid in on_host)


def this_host(environ: Mapping[str, str] = os.environ) -> str:
    """This host's name as the job knows it: Slurm's node name under srun (a host name may be longer, a domain
    added), else the host name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def note_rank_host(folder: Path) -> None:
    """On a rank: write PID.host with this host's name (the parent groups ranks by host with it)."""
    (folder / f"{os.getpid()}{RANK_HOST_SUFFIX}").write_text(this_host())


def host_notes(pids: Path) -> dict[str, list[str]]:
    """host -> the words of its note (`running PID` or `ended STATUS`) written by the cluster launcher's shell."""
    return {entry.name.removeprefix(HOST_NOTE_PREFIX): entry.read_text().split()
            for entry in pids.glob(f"{HOST_NOTE_PREFIX}*")}


def lost_host(host: str, cause: str, pids: Path, ranks: Mapping[int, tuple[int, str]], silent_s: float = 0.0
              ) -> LostHost:
    """The LostHost of `host`, its ranks read from the registrations (`ranks`: PID -> (rank, ending))."""
    on_host = sorted((ranks[pid][0], pid) for pid, name in rank_hosts(pids).items() if name == host and pid in ranks)
    return LostHost(host, tuple(rank for rank, _ in on_host), tuple(pid for _, pid in on_host), cause, silent_s)


def killed_hosts(pids: Path, ranks: Mapping[int, tuple[int, str]], ended_by_us: Set[str] = frozenset()
                 ) -> list[LostHost]:
    """The hosts whose launcher shell never noted its proxy's end, other than those the parent ended itself
    (`ended_by_us`): every process on them died at once."""
    return [lost_host(host, "killed", pids, ranks) for host, note in sorted(host_notes(pids).items())
            if note[:1] == ["running"] and host not in ended_by_us]


def end_processes(pids: Sequence[int], marker: str) -> None:
    """SIGKILL each of `pids` and their descendants (found through /proc) that are still this job's processes:
    those whose environment holds `marker` (a PID may have been reused since it was registered)."""
    below = [child for parent in pids for child in descendants(parent)]
    for pid in [*pids, *below]:
        if not _environment_holds(pid, marker):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _environment_holds(pid: int, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, …)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found
