"""A cluster on one machine: hosts made of Linux network namespaces, a bridge between them, shaped links.

`mpiparallel cluster up --nodes N --ranks-per-node K` makes N hosts, each a network namespace with its own
network stack, its own address on one private /24 and its own host name, joined by one bridge as a switch:

    root namespace:  bridge NAME-br (ADDRESS.1) ── veth NAME-0 ─┬─ namespace NAME-0: eth0 ADDRESS.10, host NAME-0
                                                 ── veth NAME-1 ─┴─ namespace NAME-1: eth0 ADDRESS.11, host NAME-1 …

Every object it makes carries the cluster's name (bridge NAME-br, namespaces and veths NAME-i, the state folder
NAME under `state_root()`), so `down` removes exactly those and `up` first removes a stale cluster of the same
name. The /24 is picked so that it overlaps no address or route the machine already has. The namespaces have no
default route: their traffic stays between themselves and the bridge (where mpiexec listens).

Launching. MPICH's mpiexec (hydra) starts one proxy per host through a remote shell, then the proxy starts the
ranks. `up` writes an MPICH hostfile (`host:slots` per line) and a launcher script; hydra runs it as it would
ssh:

    mpiexec -launcher ssh -launcher-exec NAME/launcher.sh -f NAME/hostfile -localhost ADDRESS.1 -n 4 python …

The script drops ssh's options and runs the command in the host's namespace under its own host name
(`ip netns exec HOST unshare --uts sh -c "hostname HOST; …"`). Open MPI's mpirun (PRRTE) starts one daemon per
host the same way, the script as its ssh agent (`mpiexec_options(open_mpi=True)`):

    mpirun --host NAME-0:2,NAME-1:2 --map-by slot --prtemca plm_ssh_agent NAME/launcher.sh
           --prtemca plm_ssh_no_tree_spawn 1 --prtemca oob_tcp_if_include ADDRESS.0/24
           --mca btl_tcp_if_include ADDRESS.0/24 -n 4 python …

(PRRTE reads no `host:slots` hostfile, hence --host; every daemon is started from mpirun's side, not from one
another's namespace; the daemons and ranks talk over the cluster's /24 only, where the bridge is mpirun's
address.) MPI then sees real nodes: `COMM_TYPE_SHARED`
groups the ranks of one namespace, and the bytes between hosts cross the veths. One caution, measured: MPICH's
network module (UCX) recognises that all namespaces run on one kernel and by default moves bytes between hosts
by cross-memory attach (`process_vm_readv`), so a 16 MiB all-reduce across two shaped hosts sent 25 KB over the
link. The script therefore sets UCX_TLS=tcp,self and UCX_NET_DEVICES=eth0: between hosts, only TCP over the
host's own link (inside a host MPICH still uses shared memory).

Faults. `kill NODE` ends every process in the host's namespace at once (a machine that died); `cut NODE` takes
the bridge side of its veth down (a cable pulled: the processes live on, no packet passes) and `heal NODE` up
again. `--link-rate RATE` shapes every host's outgoing link with `tc qdisc … tbf rate RATE` (netem, for delays,
is not in every kernel; tbf is).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError
from . import slurm_cluster
from .hosts import read_hostfile

DEFAULT_NAME = "mpiparallel"
STATE_VARIABLE = "MPIPARALLEL_CLUSTERS"
"""The folder holding one folder per cluster (state, hostfile, launcher). Default /run/mpiparallel-clusters, where
/run is a tmpfs: a reboot, which removes the namespaces too, removes it."""

NAME_PATTERN = re.compile(r"[a-z][a-z0-9]{0,10}")
"""Cluster names: the bridge NAME-br and the veths NAME-i (i < 100) must fit Linux's 15-character interface names."""

MAX_NODES = 100
FIRST_HOST = 10
"""Host i gets address .(10 + i) of the /24; the bridge .1."""

BURST = "64kb"
"""tbf's bucket: at least one rate-second's 1/HZ worth of bytes for the rates asked here, and a few packets."""


class ClusterError(ConfigError):
    """Something the machine or the arguments do not allow: printed as one line, exit status 2."""


@dataclass(frozen=True)
class Cluster:
    """What `up` made, as written to NAME/cluster.json."""

    name: str
    subnet: str
    nodes: int
    ranks_per_node: int
    link_rate: str | None
    folder: str
    scheduler: str = "none"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    @property
    def hosts(self) -> list[str]:
        return [host_name(self.name, i) for i in range(self.nodes)]

    @property
    def bridge_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[1])

    def address(self, host: str) -> str:
        return str(ipaddress.ip_network(self.subnet)[FIRST_HOST + self.hosts.index(host)])

    @property
    def hostfile(self) -> Path:
        return Path(self.folder) / "hostfile"

    @property
    def launcher(self) -> Path:
        return Path(self.folder) / "launcher.sh"

    def mpiexec_options(self, open_mpi: bool = False, hostfile: Path | None = None) -> list[str]:
        """The options that make mpiexec start ranks on these hosts (those of `hostfile`, default the cluster's
        own: a relaunch names the hosts left): MPICH's hydra, or with `open_mpi` Open MPI's mpirun."""
        hostfile = hostfile or self.hostfile
        if not open_mpi:
            return ["-launcher", "ssh", "-launcher-exec", str(self.launcher), "-f", str(hostfile),
                    "-localhost", self.bridge_address]
        hosts = ",".join(f"{host.name}:{host.slots}" for host in read_hostfile(hostfile))
        return ["--host", hosts, "--map-by", "slot", "--prtemca", "plm_ssh_agent", str(self.launcher),
                "--prtemca", "plm_ssh_no_tree_spawn", "1", "--prtemca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet]


def host_name(cluster: str, index: int) -> str:
    """The host name, namespace name and bridge-side veth name of host `index`."""
    return f"{cluster}-{index}"


def state_root() -> Path:
    return Path(os.environ.get(STATE_VARIABLE) or "/run/mpiparallel-clusters")


def _read_state(folder: Path) -> Cluster | None:
    try:
        return Cluster(**json.loads((folder / "cluster.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def load(name: str) -> Cluster | None:
    """The cluster `name` as `up` recorded it, or None if there is none."""
    return _read_state(state_root() / name)


def cluster_of_hostfile(path: Path) -> Cluster | None:
    """The cluster whose `up` wrote this hostfile, or None for any other hostfile."""
    cluster = _read_state(path.resolve().parent)
    return cluster if cluster is not None and cluster.hostfile.resolve() == path.resolve() else None


# -- checks ---------------------------------------------------------------------------------------------------

def check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise ClusterError(f"cluster name {name!r}: use 1 to 11 lower-case letters and digits, starting with a "
                           f"letter (its bridge {name}-br and links {name}-N must fit Linux's 15-character "
                           f"interface names)")


def check_machine(shaping: bool = False) -> None:
    """One clear error when this machine cannot make namespace hosts."""
    if os.geteuid() != 0:
        raise ClusterError("mpiparallel cluster makes network namespaces and links, which needs root: run it as "
                           "root (sudo mpiparallel cluster ...)")
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), *((("tc", "iproute2"),) if shaping else ())):
        if shutil.which(tool) is None:
            raise ClusterError(f"mpiparallel cluster needs the `{tool}` command, which is not on PATH: install "
                               f"{package}")


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    finished = subprocess.run(command, capture_output=True, text=True)
    if check and finished.returncode != 0:
        said = (finished.stderr or finished.stdout).strip()
        if "Operation not permitted" in said or "Permission denied" in said:
            raise ClusterError(f"this machine does not permit `{' '.join(command)}`: {said} (network namespaces "
                               f"need root and a kernel or container that allows them)")
        raise ClusterError(f"`{' '.join(command)}` failed: {said}")
    return finished


# -- the address range -----------------------------------------------------------------------------------------

def addresses_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the root namespace has an address in or a route to (the default route excluded)."""
    interfaces = json.loads(_run("ip", "-j", "-4", "addr", "show").stdout or "[]")
    used = [ipaddress.ip_interface(f"{address['local']}/{address['prefixlen']}").network
            for interface in interfaces for address in interface.get("addr_info", []) if "local" in address]
    for route in json.loads(_run("ip", "-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        if route.get("dst", "default") != "default":
            used.append(ipaddress.ip_network(route["dst"], strict=False))
    return used


def pick_subnet(name: str, used: Sequence[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that overlaps none of `used`: the first free one from a start hashed from the name
    (so that two clusters of different names usually differ without having to look)."""
    start = zlib.crc32(name.encode()) % (1 << 16)
    for step in range(1 << 16):
        index = (start + step) % (1 << 16)
        candidate = ipaddress.ip_network(f"10.{index >> 8}.{index & 255}.0/24")
        if not any(candidate.overlaps(network) for network in used):
            return candidate
    raise ClusterError("no free /24 left in 10.0.0.0/8 on this machine")


# -- up, down and the rest --------------------------------------------------------------------------------------

SCHEDULERS = ("none", "slurm")


def up(name: str, nodes: int, ranks_per_node: int, link_rate: str | None = None, scheduler: str = "none") -> Cluster:
    """Make the cluster (removing a stale one of the same name first) and write its hostfile and launcher; with
    `scheduler="slurm"` start a Slurm of its own on the hosts (`slurm_cluster`)."""
    check_name(name)
    if not 1 <= nodes <= MAX_NODES:
        raise ClusterError(f"--nodes {nodes}: between 1 and {MAX_NODES}")
    if ranks_per_node < 1:
        raise ClusterError(f"--ranks-per-node {ranks_per_node}: at least 1")
    if scheduler not in SCHEDULERS:
        raise ClusterError(f"--scheduler {scheduler}: one of {', '.join(SCHEDULERS)}")
    check_machine(shaping=link_rate is not None)
    if scheduler == "slurm":
        slurm_cluster.check_packages()
    down(name)
    folder = state_root() / name
    cluster = Cluster(name, str(pick_subnet(name, addresses_in_use())), nodes, ranks_per_node, link_rate, str(folder),
                      scheduler)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cluster.json").write_text(json.dumps(asdict(cluster), indent=2) + "\n")  # first: `down` finds it
    try:
        _make_network(cluster)
        if scheduler == "slurm":
            slurm_cluster.start(cluster)
    except BaseException:
        down(name)
        raise
    cluster.hostfile.write_text("".join(f"{host}:{ranks_per_node}\n" for host in cluster.hosts))
    cluster.launcher.write_text(launcher_script(cluster))
    cluster.launcher.chmod(0o755)
    return cluster


def _make_network(cluster: Cluster) -> None:
    prefix = ipaddress.ip_network(cluster.subnet).prefixlen
    _run("ip", "link", "add", cluster.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{cluster.bridge_address}/{prefix}", "dev", cluster.bridge)
    _run("ip", "link", "set", cluster.bridge, "up")
    for host in cluster.hosts:
        _run("ip", "netns", "add", host)
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", host)
        _run("ip", "link", "set", host, "master", cluster.bridge, "up")
        _run("ip", "-n", host, "addr", "add", f"{cluster.address(host)}/{prefix}", "dev", "eth0")
        _run("ip", "-n", host, "link", "set", "eth0", "up")
        _run("ip", "-n", host, "link", "set", "lo", "up")
        if cluster.link_rate is not None:
            _run("ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                 cluster.link_rate, "burst", BURST, "latency", "20ms")


def launcher_script(cluster: Cluster) -> str:
    """The script hydra runs in place of ssh: `SCRIPT [ssh options] HOST COMMAND…`.

    COMMAND (hydra's proxy) runs under `sh` in the host's namespace, as a remote shell would run it. When the
    self-launching parent asks for it (MPIPARALLEL_RANK_PIDS), the shell around the proxy notes the host as
    running and, when the proxy ends, as ended: a host still noted as running after the job is one whose every
    process died at once (`mpiparallel.jobs.hosts`)."""
    hosts = "|".join(cluster.hosts)
    return f"""#!/bin/sh
# mpiparallel cluster {cluster.name}: hydra's remote shell for hosts {cluster.hosts[0]}..{cluster.hosts[-1]}.
# Drop ssh's options (those of one letter that take a value take the next word too).
while [ $# -gt 0 ]; do
    case "$1" in
        -[BbcDEeFIiJLlmOopQRSWw]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
shift
case "$host" in
    {hosts}) ;;
    *) echo "mpiparallel cluster {cluster.name}: no host $host (hosts: {' '.join(cluster.hosts)})" >&2; exit 255 ;;
esac
note=""
[ -n "$MPIPARALLEL_RANK_PIDS" ] && note="$MPIPARALLEL_RANK_PIDS/host-$host"
exec ip netns exec "$host" unshare --uts sh -c "
hostname $host
export UCX_TLS=tcp,self UCX_NET_DEVICES=eth0
[ -n '$note' ] && echo running \\$\\$ > '$note'
$*
status=\\$?
[ -n '$note' ] && echo ended \\$status > '$note'
exit \\$status"
"""


def namespaces_of(name: str) -> list[str]:
    """The namespaces of cluster `name` that exist (NAME-i), whatever its state folder says."""
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    pattern = re.compile(re.escape(name) + r"-\d+")
    return [line.split()[0] for line in listed if line.split() and pattern.fullmatch(line.split()[0])]


def links_of(name: str) -> list[str]:
    """The interfaces of cluster `name` in the root namespace (its bridge and veths)."""
    listed = _run("ip", "-o", "link", "show", check=False).stdout.splitlines()
    found = [line.split(":")[1].strip().split("@")[0] for line in listed if line.count(":") >= 2]
    pattern = re.compile(re.escape(name) + r"-(\d+|br)")
    return [link for link in found if pattern.fullmatch(link)]


def down(name: str) -> list[str]:
    """Remove everything cluster `name` made: its processes, namespaces, links and folder. Returns what it removed."""
    check_name(name)
    removed = []
    folder = state_root() / name
    if (daemons := slurm_cluster.stop(folder)):
        removed.append(f"{daemons} Slurm daemons")
    for namespace in namespaces_of(name):
        end_processes(namespace)
        _run("ip", "netns", "del", namespace, check=False)
        removed.append(f"namespace {namespace}")
    for link in links_of(name):  # the veths went with their namespaces; the bridge and any stray remain
        _run("ip", "link", "del", link, check=False)
        removed.append(f"link {link}")
    if folder.is_dir():
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"folder {folder}")
    return removed


def processes_in(namespace: str) -> list[int]:
    return [int(pid) for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split()]


def end_processes(namespace: str, deadline_s: float = 10.0) -> int:
    """SIGKILL every process in `namespace` until none is left (a dying proxy may fork no more, but look again).
    Returns how many were killed."""
    killed: set[int] = set()
    give_up = time.monotonic() + deadline_s
    while (pids := processes_in(namespace)) and time.monotonic() < give_up:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return len(killed)


def _require(name: str) -> Cluster:
    check_name(name)
    cluster = load(name)
    if cluster is None or not namespaces_of(name):
        raise ClusterError(f"there is no cluster {name!r} (mpiparallel cluster up --name {name} ...)")
    return cluster


def _require_host(name: str, node: str) -> Cluster:
    cluster = _require(name)
    if node not in cluster.hosts:
        raise ClusterError(f"cluster {name!r} has no host {node!r}; its hosts: {', '.join(cluster.hosts)}")
    return cluster


def kill(name: str, node: str) -> int:
    """End every process on host `node` at once, as if the machine died. Returns how many there were."""
    check_machine()
    _require_host(name, node)
    return end_processes(node)


def cut(name: str, node: str) -> None:
    """Take the link of host `node` down at the bridge: its processes live on, no packet passes."""
    check_machine()
    _require_host(name, node)
    _run("ip", "link", "set", node, "down")


def heal(name: str, node: str) -> None:
    check_machine()
    _require_host(name, node)
    _run("ip", "link", "set", node, "up")


def link_bytes(node: str) -> int:
    """Bytes through a host's veth since it was made, both directions (its bridge-side end carries its name):
    what really crossed the host's link, headers included, to compare with the ledgers' inter-node bytes."""
    statistics = Path(f"/sys/class/net/{node}/statistics")
    return sum(int((statistics / name).read_text()) for name in ("rx_bytes", "tx_bytes"))


def link_is_up(node: str) -> bool:
    """Whether the bridge side of host `node`'s link is up (not cut)."""
    flags = re.search(r"<([^>]*)>", _run("ip", "-o", "link", "show", node, check=False).stdout)
    return flags is not None and "UP" in flags.group(1).split(",")


def status(name: str) -> str:
    """What `cluster status` prints: the hosts, their addresses, links and processes, and how to launch."""
    cluster = _require(name)
    lines = [f"cluster {cluster.name}: {cluster.nodes} hosts of {cluster.ranks_per_node} slots on {cluster.subnet}, "
             f"bridge {cluster.bridge} {cluster.bridge_address}, links "
             f"{'shaped to ' + cluster.link_rate if cluster.link_rate else 'unshaped'}"]
    present = set(namespaces_of(name))
    for host in cluster.hosts:
        if host not in present:
            lines.append(f"  {host:<16} missing")
            continue
        link = "up" if link_is_up(host) else "cut"
        lines.append(f"  {host:<16} {cluster.address(host):<15} link {link:<4} {len(processes_in(host))} processes")
    if cluster.scheduler == "slurm":
        lines += slurm_cluster.status_lines(cluster)
    lines.append(f"hostfile {cluster.hostfile}")
    lines.append(f"launcher {cluster.launcher}")
    return "\n".join(lines)


def usage(cluster: Cluster) -> str:
    """What `up` prints: where the files are and how to use them."""
    ranks = cluster.nodes * cluster.ranks_per_node
    return "\n".join([
        f"cluster {cluster.name}: {cluster.nodes} hosts ({', '.join(cluster.hosts)}) of {cluster.ranks_per_node} "
        f"slots on {cluster.subnet}, bridge {cluster.bridge} {cluster.bridge_address}"
        + (f", links shaped to {cluster.link_rate}" if cluster.link_rate else ""),
        f"hostfile {cluster.hostfile}",
        f"launcher {cluster.launcher}",
        "run on it:",
        f"  mpiparallel train -n {ranks} --hostfile {cluster.hostfile} --show-mesh",
        f"  mpiexec {' '.join(cluster.mpiexec_options())} -n {ranks} python -m mpiparallel ...",
        *(slurm_cluster.usage_lines(cluster) if cluster.scheduler == "slurm" else []),
        f"take it down: mpiparallel cluster down --name {cluster.name}",
    ])
