"""`train --elastic`: a run that survives the loss of ranks or hosts, on whatever is left.

The self-launching parent starts the job (`launch.run_job`) and, when it ends having lost ranks (one machine: the
ranks that died without a word; a cluster: every rank of a lost host; either: the ranks the stall watchdog found
behind, which it killed with the rest — `stall.py`), relaunches it:

1. the mesh for the survivors keeps the model axes tp·cp·pp (and ep, carved from dp) and shrinks dp to the
   largest size that fits, divides the global batch (which is kept: each DP rank takes more rows, so the loss
   curve continues as one run) and is a multiple of ep. Where the model axes no longer fit (tp·cp·pp more ranks
   than are left, or no such dp), the planner (`mpiparallel.planner`) chooses: its fastest dp·tp·pp·cp·ep and
   microbatches that fit in memory, on the most ranks left that run one (the other choices — ZeRO,
   recomputation, schedule, sp — kept). Memory per rank: the GPU's (shared round robin), or on CPU the
   machine's memory over the ranks; time: `plan --calibrate`'s measurements of this machine where saved, else
   the planner's defaults;
2. the new job resumes from the newest complete checkpoint of --checkpoint-dir (`--resume-from` its folder),
   resharded on load onto the new mesh; the steps after that checkpoint are redone. A save interrupted by the
   loss has no manifest, so the previous checkpoint is used (the line says so);
3. one line says what was lost, at which step, why the planner chose (when it did), the new mesh and the steps
   redone; --log-json gets {"event": "restart", "step", "lost", "mesh"} (and "planner" when it chose), and a job
   relaunched from step 0 (lost before the first checkpoint) appends to the log rather than rewriting it.

It gives up, with one line and a non-zero exit, when fewer than --min-ranks would be left, no mesh fits, or
--max-restarts relaunches are used up. A job that ends for any other reason (an error, a preemption, Ctrl-C)
ends the run with its status: those are not losses.

On one machine the relaunch starts ranks in the same slots (the lost rank's slot is given up). On a cluster of
`mpiparallel cluster` (`--hostfile` of `cluster up`), the relaunch starts on the hosts left: a hostfile without
the lost hosts, written in the parent's own folder, in place of the cluster's. Other hostfiles are refused (no
heartbeat tells which host was lost). Inside a Slurm allocation it is srun on the nodes left (`slurm_launch`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import click

from ..checkpoints.sharded import TrainingCheckpoint, incomplete_steps, latest_training_checkpoint
from ..checkpoints.upkeep import mesh_words
from ..errors import ExitCode
from ..text import plural
from ..train.reports import CONTINUE_LOG, PROGRESS
from . import hosts as multi_host
from . import launch, slurm_launch
from .namespace_cluster import cluster_of_hostfile
from .stall import StallWatch

AXES = ("dp", "tp", "pp", "cp", "ep")

def check_elastic(options: dict[str, Any], ranks: int | None, hostfile: Path | None) -> None:
    """What --elastic needs, checked before any rank starts."""
    if not options["checkpoint_dir"] or not options["checkpoint_every"]:
        raise click.UsageError("--elastic needs --checkpoint-dir and --checkpoint-every (it resumes the survivors "
                               "from the newest checkpoint)")
    if hostfile is not None and cluster_of_hostfile(hostfile) is None:
        raise click.UsageError("--elastic with --hostfile needs a hostfile of `mpiparallel cluster up` (whose lost "
                               "hosts the heartbeats name), or one machine (-n N)")
    if ranks is None:
        raise click.UsageError("--elastic needs -n N: the parent that relaunches the ranks is the one -n starts")
    if ranks < options["min_ranks"]:
        raise click.UsageError(f"-n {ranks} is fewer than --min-ranks {options['min_ranks']}")


@dataclass(frozen=True)
class JobMesh:
    """The mesh a job runs on: its ranks, axis sizes (`AXES`), microbatches per DP rank (None: train's default,
    pp) and, when the planner chose it, what it predicted and why the model axes could not be kept."""

    ranks: int
    axes: dict[str, int]
    microbatches: int | None = None
    planner: dict[str, Any] | None = None
    dp_shard: int | None = None  # the planner's shard group, where the run asked for hybrid sharding

    @property
    def model_parallel(self) -> int:
        return self.axes["tp"] * self.axes["cp"] * self.axes["pp"]

    def options(self) -> list[str]:
        """The train options that start a job on this mesh (appended to the command line: the last one wins)."""
        axes = [word for axis in AXES for word in (f"--{axis}", str(self.axes[axis]))]
        microbatches = ["--microbatches", str(self.microbatches)] if self.microbatches else []
        dp_shard = ["--dp-shard", str(self.dp_shard)] if self.dp_shard else []
        return ["-n", str(self.ranks), *axes, *microbatches, *dp_shard]


def survivor_dp(survivors: int, axes: dict[str, int], batch_size: int, microbatches: int,
                dp_shard: int | None = None) -> int | None:
    """The largest dp for `survivors` ranks with the model axes kept: dp·tp·cp·pp ≤ survivors, dp divides the
    global batch into DP shares that split into `microbatches`, and ep divides dp — and with hybrid sharding
    (`dp_shard`), so does the shard group: a lost node takes whole replicas with it. None if none fits."""
    model = axes["tp"] * axes["cp"] * axes["pp"]
    for dp in range(survivors // model, 0, -1):
        if batch_size % dp == 0 and (batch_size // dp) % microbatches == 0 and dp % axes["ep"] == 0 \
                and dp % (dp_shard or 1) == 0:
            return dp
    return None


def survivors_mesh(survivors: int, mesh: JobMesh, options: dict[str, Any], checkpoint: Path | None,
                   ranks_per_host: int) -> JobMesh | str:
    """The mesh for `survivors` ranks: `mesh`'s model axes with a smaller dp, else the planner's; a str says why
    there is none."""
    if survivors < options["min_ranks"]:
        return f"{plural(survivors, 'rank')} left, and --min-ranks is {options['min_ranks']}"
    dp = survivor_dp(survivors, mesh.axes, options["batch_size"], mesh.microbatches or mesh.axes["pp"],
                     options.get("dp_shard"))
    if dp is not None and dp * mesh.model_parallel >= options["min_ranks"]:
        return JobMesh(dp * mesh.model_parallel, {**mesh.axes, "dp": dp}, mesh.microbatches)
    return planned_mesh(survivors, options, checkpoint, ranks_per_host, _why_not_kept(survivors, mesh, dp, options))


def _why_not_kept(survivors: int, mesh: JobMesh, dp: int | None, options: dict[str, Any]) -> str:
    model = mesh.model_parallel
    shape = " × ".join(f"{axis} {mesh.axes[axis]}" for axis in ("tp", "cp", "pp") if mesh.axes[axis] > 1)
    if model > survivors:
        return f"{shape} needs {model} ranks, {survivors} are left"
    if dp is None:
        multiple = f" and a multiple of ep {mesh.axes['ep']}" if mesh.axes["ep"] > 1 else ""
        return (f"no dp of at most {survivors // model} beside tp·cp·pp {model} divides the global batch "
                f"{options['batch_size']} into {mesh.microbatches or mesh.axes['pp']} microbatch(es) per DP "
                f"rank{multiple}")
    beside = f" beside {shape}" if shape else ""
    return (f"dp {dp} (the largest{beside} that divides the global batch {options['batch_size']}) runs on "
            f"{plural(dp * model, 'rank')}, and --min-ranks is {options['min_ranks']}")


def run_elastic(ranks: int, argv: list[str], options: dict[str, Any], axes: dict[str, Any],
                hostfile: Path | None = None) -> NoReturn:
    """Run the job, relaunching it on the survivors after each loss; exit with the final job's status."""
    mesh = JobMesh(ranks, {**axes, "dp": axes["dp"] or ranks // (axes["tp"] * axes["cp"] * axes["pp"])},
                options["microbatches"])
    restarts = redone = 0
    extra: list[str] = []
    cluster: launch.Hosts | None = cluster_of_hostfile(hostfile) if hostfile is not None else slurm_launch.current()
    hosts = multi_host.read_hostfile(hostfile) if hostfile is not None else cluster.hosts if cluster else []
    open_mpi = launch.mpi4py_uses_open_mpi()
    placement = cluster.mpiexec_options(open_mpi) if hostfile is not None and cluster is not None else []
    in_place = recovery_mode(options, hostfile, cluster)
    with tempfile.TemporaryDirectory(prefix="mpiparallel-elastic-") as folder:
        progress = Path(folder) / "progress"
        while True:
            environ = {PROGRESS: str(progress), **({CONTINUE_LOG: "1"} if restarts else {})}
            outcome = launch.run_job(mesh.ranks, [*argv, *extra], placement, cluster, environ,
                                     StallWatch(options["stall_timeout"], options["log_json"]), in_place)
            lost = len(outcome.lost_ranks) + sum(len(host.ranks) for host in outcome.lost)
            if outcome.status in (0, ExitCode.ELASTIC_GAVE_UP) or lost == 0:  # the ranks in place gave up: final
                if outcome.status == 0 and restarts:
                    say(f"elastic: finished after {plural(restarts, 'restart')}, {plural(redone, 'step')} redone")
                raise SystemExit(outcome.status)
            reached = int(progress.read_text()) if progress.is_file() else 0
            latest = latest_training_checkpoint(options["checkpoint_dir"])
            resumed_at = TrainingCheckpoint(latest).step if latest is not None else 0
            what = _what_was_lost(outcome, reached)
            if resumed_at >= options["steps"]:  # lost after the last step's checkpoint: nothing is left to train
                say(f"elastic: {what}, after the checkpoint of the last step ({resumed_at}): the training is complete"
                    + (f"; --save did not run on every rank: `mpiparallel checkpoint export {latest} --out "
                       f"{options['save']}` writes it" if options.get("save") else ""))
                raise SystemExit(0 if not options.get("save") else outcome.status)  # the lost rank's or host's
            if restarts >= options["max_restarts"]:
                give_up(f"{what}; --max-restarts {options['max_restarts']} used up")
            if cluster is not None:
                hosts = [host for host in hosts if host.name not in {lost.host for lost in outcome.lost}]
            if isinstance(cluster, slurm_launch.Allocation):  # srun on the nodes left
                cluster = cluster.without([lost.host for lost in outcome.lost])
            chosen = survivors_mesh(mesh.ranks - lost, mesh, options, latest,
                                    max(host.slots for host in hosts) if hosts else mesh.ranks - lost)
            if isinstance(chosen, str):
                give_up(f"{what}; {chosen}")
            mesh, restarts, redone = chosen, restarts + 1, redone + reached - resumed_at
            words = {"world_size": mesh.ranks, **mesh.axes, "zero": options["zero"],
                     **({"microbatches": mesh.microbatches} if mesh.microbatches else {}),
                     **({"dp_shard": mesh.dp_shard or options["dp_shard"]} if options.get("dp_shard") else {})}
            say(f"elastic: {what}; {_planner_words(mesh)}restart {restarts}/{options['max_restarts']} on "
                f"{mesh_words(words)} (global batch {options['batch_size']} kept{_microbatch_words(mesh)}), from "
                + _resumed_words(options["checkpoint_dir"], resumed_at)
                + f": {plural(reached - resumed_at, 'step')} redone")
            _log_restart(options["log_json"], reached, outcome, words, mesh.planner)
            extra = [*mesh.options(), *(["--resume-from", str(latest)] if latest else [])]
            progress.unlink(missing_ok=True)
            if placement:  # the cluster's hosts left, in a hostfile of the parent's own
                left = Path(folder) / f"hostfile-{restarts}"
                left.write_text("".join(f"{host.name}:{host.slots}\n" for host in hosts))
                placement = cluster.mpiexec_options(open_mpi, left)


def in_place_rule(options: dict[str, Any]) -> Callable[[int, Any], dict[str, Any] | str]:
    """The same rule for the survivors of an in-place recovery (`train.recovery`): (ranks left, the run's
    settings) → the mesh options for them, with "world_size" the ranks it uses, or why there is none."""
    def choose(survivors: int, settings: Any) -> dict[str, Any] | str:
        layout = settings.mesh
        mesh = JobMesh(survivors, {"dp": layout.dp or 1, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp,
                                   "ep": layout.ep}, layout.microbatches)
        latest = latest_training_checkpoint(options["checkpoint_dir"]) if options["checkpoint_dir"] else None
        chosen = survivors_mesh(survivors, mesh, {**options, "dp_shard": layout.dp_shard if options.get("dp_shard")
                                                  else None}, latest, survivors)
        if isinstance(chosen, str):
            return chosen
        return {"world_size": chosen.ranks, **chosen.axes, "microbatches": chosen.microbatches,
                **({"dp_shard": chosen.dp_shard} if chosen.dp_shard else {})}
    return choose


def recovery_mode(options: dict[str, Any], hostfile: Path | None, cluster: Any) -> bool:
    """Whether the job recovers in place (Open MPI with ULFM, started by its own mpirun: on one machine or on the
    hosts of `mpiparallel cluster`) or by relaunch, said in one line; --elastic-mode in-place where it cannot is
    one clear error."""
    mode = options.get("elastic_mode", "auto")
    if mode == "relaunch":
        say("elastic: a lost rank is recovered by relaunch (--elastic-mode relaunch)")
        return False
    why_not = None
    if not launch.mpi4py_uses_open_mpi():
        why_not = (f"{launch.mpi_library()} has no fault tolerance (ULFM) to let the survivors go on; under Open "
                   f"MPI they recover in place")
    elif isinstance(cluster, slurm_launch.Allocation):
        why_not = ("srun starts the ranks, and Open MPI's fault tolerance runs under its own launcher (mpirun "
                   "--with-ft ulfm)")
    if why_not is None:
        say("elastic: a lost rank is recovered in place: Open MPI runs with its fault tolerance on (--with-ft ulfm)"
            + (_lost_host_words() if cluster is not None else ""))
        return True
    if mode == "in-place":
        raise click.UsageError(f"--elastic-mode in-place: {why_not}")
    say(f"elastic: a lost rank is recovered by relaunch: {why_not}")
    return False


DAEMON_LOSS = "Open MPI 5.0's runtime ends a job that lost one of its host daemons, at once or a few steps later"
"""Why a lost host is not recovered in place for good under PRRTE 3.0. Measured with `cluster kill` under
--with-ft ulfm: the survivors learn of the loss and go on in place, but PRRTE 3.0 (Open MPI 5.0.11's mpirun) ends
the job — at once ("PRTE has lost communication with a remote daemon … We cannot recover from this failure") or 1–5
steps later (after "A daemon failed to report back"), then exits with 0 (`launch._killed_hosts` tells such an end
from a finished run). PRRTE 5.0 keeps the job (`launch.KEEPS_JOBS_AFTER_LOST_DAEMONS`): a lost host is then
recovered in place like a lost rank."""


def _lost_host_words() -> str:
    """What becomes of a lost host, by what Open MPI's runtime does with a job that lost a daemon."""
    mpiexec = launch.find_mpiexec()
    if mpiexec is not None and launch.keeps_jobs_after_lost_hosts(mpiexec):
        version = ".".join(map(str, launch.prrte_version(mpiexec) or ()))
        return f"; a lost host too (its runtime, PRRTE {version}, keeps a job that lost a host's daemon)"
    return f"; after a lost host the survivors relaunch ({DAEMON_LOSS})"


def _planner_words(mesh: JobMesh) -> str:
    if mesh.planner is None:
        return ""
    chosen = mesh.planner
    return (f"{chosen['why']}, so the planner chose the mesh: its fastest layout that fits in memory on the most "
            f"ranks left ({chosen['step_s'] * 1e3:.3g} ms/step, {_megabytes(chosen['memory_bytes'])} of "
            f"{_megabytes(chosen['memory_per_rank'])} per rank, by {chosen['cost_model']}; "
            f"{plural(chosen['considered'], 'layout')} considered); ")


def _microbatch_words(mesh: JobMesh) -> str:
    count = mesh.microbatches
    return f", {count} microbatch{'es' if count > 1 else ''} per DP rank" if count else ""


def _resumed_words(directory: str, resumed_at: int) -> str:
    incomplete = incomplete_steps(directory, resumed_at)
    ignored = (f" (the checkpoint of step {', '.join(map(str, incomplete))} is incomplete, lost while saving: "
               f"ignored)") if incomplete else ""
    return (f"the checkpoint of step {resumed_at}" if resumed_at else "step 0 (no checkpoint yet)") + ignored


def _megabytes(count: float) -> str:
    return f"{count / 1e9:.3g} GB" if count >= 1e9 else f"{count / 1e6:.3g} MB"


# -- the planner's mesh ----------------------------------------------------------------------------------------

def planned_mesh(survivors: int, options: dict[str, Any], checkpoint: Path | None, ranks_per_host: int,
                 why: str) -> JobMesh | str:
    """The planner's fastest layout that fits in memory and that train runs with the run's other choices, on
    the most ranks from `survivors` down to --min-ranks that have one; a str says why there is none."""
    from .. import planner

    try:
        model = planner_model(options, checkpoint)
    except ValueError as error:
        return f"{why}, and the planner cannot model this run: {error}"
    precision = run_precision(options)
    hybrid = bool(options.get("dp_shard"))  # the planner picks the shard group; without --dp-shard, none
    choices = planner.Choices(options["batch_size"], zero=options["zero"], recompute=options["recompute"],
                              sp=options["sp"], schedule=options["schedule"], cp_attention=options["cp_attention"],
                              virtual_stages=options["virtual_stages"], dp_shard=None if hybrid else 0)
    considered = 0
    for world in range(survivors, options["min_ranks"] - 1, -1):
        cluster, cost_model = rank_cluster(world, min(ranks_per_host, world), options["device"])
        plans, count = planner.plan(model, cluster, precision, choices)
        considered += count
        runnable = [plan for plan in plans if _train_runs(plan.layout, options)]
        if runnable:
            best = runnable[0]
            return JobMesh(world, {axis: getattr(best.layout, axis) for axis in AXES}, best.layout.microbatches,
                           {"why": why, "step_s": best.step_s, "memory_bytes": best.max_memory,
                            "memory_per_rank": cluster.gpu_memory, "considered": considered, "cost_model": cost_model},
                           best.layout.shard_ranks if hybrid else None)
    worlds = plural(survivors, "rank") if survivors == options["min_ranks"] else \
        f"{options['min_ranks']} to {survivors} ranks"
    if considered == 0:
        return f"{why}, and the planner finds no layout of {worlds} for this model and global batch " \
               f"{options['batch_size']}"
    return f"{why}, and none of the planner's {plural(considered, 'layout')} of {worlds} fits in memory"


def planner_model(options: dict[str, Any], checkpoint: Path | None) -> Any:
    """The planner's model of this run: the checkpoint's model (before the first one: the options' shape, the
    vocabulary 256 when the data chooses it — it only weighs in memory). ValueError for a family the planner
    does not model."""
    from models.transformer import GPTConfig

    from .. import planner

    if checkpoint is not None:
        config = GPTConfig(**TrainingCheckpoint(checkpoint).manifest["model"])
    else:
        from ..errors import ConfigError
        from ..train.inputs import model_config
        from ..train.settings import TrainSettings

        settings = TrainSettings.from_options(**{**options, "vocab_size": options["vocab_size"] or 256})
        try:
            config = model_config(settings)
        except ConfigError as error:
            raise ValueError(str(error)) from None
    if config.arch not in ("gpt2", "llama"):
        raise ValueError(f"it models GPT-2 and llama, not {config.arch}")
    model = planner.Model(config.n_layer, config.n_embd, config.n_head, options["seq_len"], config.vocab_size,
                          config.n_positions, config.n_experts, config.moe_top_k, arch=config.arch,
                          n_kv_head=config.n_kv_head, ffn_hidden=config.ffn_hidden,
                          tie_embeddings=config.tie_embeddings)
    model.config  # noqa: B018 -- GPTConfig's checks of the shape
    return model


def run_precision(options: dict[str, Any]) -> Any:
    """Bytes per parameter and activation of this run's dtypes and optimizer (as --memory-report counts them)."""
    from ..planner.core import precision_of

    master = options["dtype"]
    precision = precision_of(options["compute_dtype"] or master, master, options["grad_dtype"] or master,
                             "bfloat16" if options["exp_avg_dtype"] == "bfloat16" else None)
    return replace(precision, optimizer=0) if options["optimizer"] == "sgd" else precision


def rank_cluster(world: int, ranks_per_host: int, device: str) -> tuple[Any, str]:
    """The planner's cluster of `world` ranks and which cost model times it: on GPU the device's preset (else the
    planner's defaults) with its memory shared by the ranks placed on it; on CPU the machine's memory over the
    ranks, timed by `plan --calibrate`'s file where there is one."""
    from .. import planner
    from ..commands.plan import DEFAULT_MACHINE

    if device == "gpu":
        name, memory, count = _gpu()
        preset = planner.preset_for_device(name)
        cluster = planner.Cluster.from_preset(preset, world, gpus_per_node=ranks_per_host) if preset else \
            planner.Cluster(gpus=world, gpus_per_node=ranks_per_host)
        share = memory / -(-world // count)  # ranks share the GPUs round robin
        return replace(cluster, gpu_memory=share), preset.name if preset else "the planner's default GPU"
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / world
    if DEFAULT_MACHINE.is_file():
        try:
            return planner.load_machine(DEFAULT_MACHINE, world, memory), str(DEFAULT_MACHINE)
        except (OSError, ValueError, KeyError):
            pass  # unreadable: the defaults below
    return planner.Cluster(gpus=world, gpu_memory=memory, gpus_per_node=ranks_per_host), "the planner's defaults"


def _gpu() -> tuple[str, float, int]:
    """Device 0's name and memory, and how many GPUs this machine has."""
    from collectives.backend import gpu_array_module

    runtime = gpu_array_module().cuda.runtime
    properties = runtime.getDeviceProperties(0)
    name = properties["name"]
    return (name.decode() if isinstance(name, bytes) else str(name)), float(properties["totalGlobalMem"]), \
        runtime.getDeviceCount()


def _train_runs(layout: Any, options: dict[str, Any]) -> bool:
    """Whether train runs `layout` with the flags the command line already holds (they cannot be taken back):
    --sp needs tp > 1 dividing each CP rank's tokens, --virtual-stages a pipeline."""
    if layout.sp != options["sp"] or options["virtual_stages"] not in (None, 1) and layout.pp == 1:
        return False
    return not layout.sp or (options["seq_len"] // layout.cp) % layout.tp == 0


def _what_was_lost(outcome: launch.JobOutcome, reached: int) -> str:
    hosts = [f"host {host.host} (ranks {', '.join(map(str, host.ranks))})" for host in outcome.lost]
    stalled = " (stalled)" if outcome.stall is not None else ""
    ranks = [f"rank {rank}{stalled}" for rank in outcome.lost_ranks]
    return f"lost {' and '.join(hosts + ranks)} after step {reached}"


def _log_restart(log_json: str | None, step: int, outcome: launch.JobOutcome, mesh: dict[str, Any],
                 planner: dict[str, Any] | None) -> None:
    if log_json is None:
        return
    stalled = {"stalled": True} if outcome.stall is not None else {}
    lost = [*({"host": host.host, "ranks": list(host.ranks)} for host in outcome.lost),
            *({"rank": rank, **stalled} for rank in outcome.lost_ranks)]
    event = {"event": "restart", "mode": "relaunch", "step": step, "lost": lost, "mesh": mesh,
             **({"planner": planner} if planner else {})}
    with open(log_json, "a", encoding="utf-8") as log:
        log.write(json.dumps(event) + "\n")


def say(text: str) -> None:
    print(f"mpiparallel: {text}", file=sys.stderr, flush=True)


def give_up(text: str) -> NoReturn:
    say(f"elastic: {text}: giving up")
    raise SystemExit(ExitCode.ELASTIC_GAVE_UP)
