"""`mpiparallel cluster`: hosts made of network namespaces on this machine (`mpiparallel.jobs.namespace_cluster`). No
MPI ranks; it needs root."""

from __future__ import annotations

import click

from ..jobs.namespace_cluster import DEFAULT_NAME

name_option = click.option("--name", default=DEFAULT_NAME, show_default=True,
                           help="The cluster's name: every namespace, link and file it makes carries it.")


@click.group()
def cluster() -> None:
    """A cluster on one machine: hosts made of network namespaces, a hostfile to launch on them, and faults.

    \b
    Example:
      mpiparallel cluster up --nodes 2 --ranks-per-node 2 --link-rate 800mbit
      mpiparallel train -n 4 --dp 2 --tp 2 --hostfile /run/mpiparallel-clusters/mpiparallel/hostfile
      mpiparallel cluster down
    """


@cluster.command()
@click.option("--nodes", type=click.IntRange(1, 100), default=2, show_default=True, help="Hosts to make.")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=2, show_default=True,
              help="Slots per host in the hostfile.")
@click.option("--link-rate", default=None, metavar="RATE",
              help="Shape every host's outgoing link to this rate with tc tbf (tc's units: 800mbit, 1gbit, 50mbps).")
@click.option("--scheduler", type=click.Choice(["none", "slurm"]), default="none", show_default=True,
              help="slurm: also start a Slurm of the cluster's own (munged, slurmctld, one slurmd per host) and "
                   "print the SLURM_CONF that points srun, sbatch and sinfo at it. Needs Debian's slurm-wlm, munge "
                   "and libpmix-dev.")
@name_option
def up(nodes: int, ranks_per_node: int, link_rate: str | None, scheduler: str, name: str) -> None:
    """Make NODES hosts (network namespaces with their own address and host name on one bridge), write a hostfile
    and a launcher script, and print how to use them. A cluster of the same name is removed first.

    \b
    Example, a Slurm cluster:
      mpiparallel cluster up --nodes 2 --ranks-per-node 2 --scheduler slurm
      export SLURM_CONF=/run/mpiparallel-clusters/mpiparallel/slurm/slurm.conf
      srun -N 2 -n 4 --mpi=pmi2 mpiparallel train --dp 2 --tp 2 --steps 3 --show-mesh
      mpiparallel cluster down
    """
    from ..jobs import namespace_cluster

    made = namespace_cluster.up(name, nodes, ranks_per_node, link_rate, scheduler)
    click.echo(namespace_cluster.usage(made))


@cluster.command()
@name_option
def status(name: str) -> None:
    """Print the hosts, their addresses, whether their links are up or cut, and their processes (and, with a
    Slurm, its view of the nodes and its queue)."""
    from ..jobs import namespace_cluster

    click.echo(namespace_cluster.status(name))


@cluster.command()
@name_option
def down(name: str) -> None:
    """Remove everything the cluster made: its processes, namespaces, bridge, links and files."""
    from ..jobs import namespace_cluster

    namespace_cluster.check_machine()
    removed = namespace_cluster.down(name)
    click.echo(f"cluster {name}: removed {', '.join(removed)}" if removed else f"cluster {name}: nothing to remove")


@cluster.command()
@click.argument("node")
@name_option
def kill(node: str, name: str) -> None:
    """End every process on host NODE at once (SIGKILL), as if the machine died."""
    from ..jobs import namespace_cluster

    click.echo(f"{node}: killed {namespace_cluster.kill(name, node)} processes")


@cluster.command()
@click.argument("node")
@name_option
def cut(node: str, name: str) -> None:
    """Take host NODE's link down: its processes live on, but no packet reaches it or leaves it."""
    from ..jobs import namespace_cluster

    namespace_cluster.cut(name, node)
    click.echo(f"{node}: link down")


@cluster.command()
@click.argument("node")
@name_option
def heal(node: str, name: str) -> None:
    """Bring host NODE's link back up."""
    from ..jobs import namespace_cluster

    namespace_cluster.heal(name, node)
    click.echo(f"{node}: link up")
