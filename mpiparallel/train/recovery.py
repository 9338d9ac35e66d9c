"""In-place recovery: when a rank dies, the survivors go on with the same processes — no relaunch, and no
checkpoint read where every piece of the state has a surviving copy (`train --elastic` under an MPI with ULFM:
Open MPI started with `--with-ft ulfm`, which `train -n N --elastic` does itself).

    a rank dies
     │  its peers' next MPI call fails (PROC_FAILED); they revoke every communicator they hold
     │  (`collectives.faults`), so every other survivor's call fails too (REVOKED)            1 detect, revoke
     ▼
    the step's ranks: Agree(1) at the step's commit point, Agree(0) from a failure           2 agree
     │  all 1: the step is applied on every rank; anything else: applied on none
     ▼
    every survivor, spares too: Shrink → the survivors' world                                 3 shrink
     ▼
    the mesh for the ranks left, by --elastic's rule (the same tp·cp·pp with a dp that
    divides the global batch, else the planner's); ranks beyond it wait as spares             4 re-mesh
     ▼
    every tensor from the survivors' memory (`checkpoints.survivors`) when each element
    has a surviving copy, else from the newest checkpoint, resharded                         5 refill
     ▼
    the loop goes on from the first step not applied                                         6 redo

Why a step is applied everywhere or nowhere. Before the optimizer touches anything, every rank of the step calls
MPI_Comm_agree with 1 (`commit`, from `Trainer.step`, after the gradients, the clip and the loss are summed: the
step's last communication that decides the update). A rank that saw a failure calls it with 0 instead, once per
step (`recover`). The agreement is itself fault tolerant and uniform: every survivor gets the same answer. All 1 →
each rank updates (a local computation, then ZeRO's after-update gathers); otherwise no rank has changed a
parameter, a moment, the loss scale or an expert bias, and the step is redone on the new mesh from the state
before it. A failure after the agreement (in the gathers, the validation, a checkpoint's save) finds the step
applied on every survivor: they go on from the step after it, and a checkpoint the failure cut short is saved
again. The state handed to the new mesh is the last applied one: the survivors' arrays after the update (ZeRO's
shards, not the gathered copies a cut gather leaves stale), their optimizer step count and loss scale as of it.

A spare (a survivor beyond the new mesh: 3 ranks left when dp must divide a global batch of 4) holds nothing and
waits in a barrier with the others; a later failure wakes it, and the next mesh may take it in.

Cost on the healthy path: one MPI_Comm_agree per step (measured in docs/clusters.md). A recovery: the shrink, one
small all-gather (who is left, the step applied, the optimizer's scalars), the refill's bytes (none for a dp run
that shrinks dp: every survivor is a whole replica), and building the model on the new mesh.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from collectives import Communicator, faults
from collectives.faults import FT_VARIABLE, PeerFailure, fault_tolerant

from ..checkpoints import sharded
from ..checkpoints.sharded import MOMENT_KEYS, TrainingCheckpoint
from ..checkpoints.survivors import SurvivorMemory
from ..errors import ConfigError, ElasticGaveUp
from ..mesh import Coordinates, MeshShape, coordinates_of, rank_of
from ..text import plural
from .settings import TrainSettings
from .state import load_model_state, load_optimizer_state

MeshRule = Callable[[int, TrainSettings], "dict[str, Any] | str"]
"""--elastic's rule for the survivors: (ranks left, the run's settings) → the mesh options for them (dp, tp, pp,
cp, ep, microbatches, dp_shard and world_size: the ranks it uses), or a str saying why there is none."""

def recovery_for(settings: TrainSettings, world: Communicator, rule: MeshRule | None) -> InPlace | None:
    """In-place recovery when --elastic asks for it and the MPI can (None otherwise: a lost rank ends the job, and
    a self-launching parent relaunches it); --elastic-mode in-place without ULFM is one clear error."""
    elastic = settings.elastic
    if not elastic.elastic or elastic.elastic_mode == "relaunch" or rule is None:
        return None
    if not fault_tolerant():
        if elastic.elastic_mode == "in-place":
            raise ConfigError(f"--elastic-mode in-place needs an MPI with ULFM fault tolerance: Open MPI started "
                              f"with --with-ft ulfm (train -n N does it itself; {FT_VARIABLE}=1 under srun). This "
                              f"job runs {MPI.Get_library_version().splitlines()[0].strip(chr(0))[:40]} without it")
        return None
    return InPlace(world, settings, rule)


MESH_OPTIONS = ("dp", "tp", "pp", "cp", "ep", "microbatches", "dp_shard")
"""The mesh options --elastic's rule chooses (and the restart event reports)."""


@dataclass(frozen=True)
class Survivor:
    """What each survivor tells the others after the shrink (one all-gather)."""

    original: int                     # its rank in the job's first world
    expected: list[str]               # the state's tensor names (a spare, holding none, may know fewer)
    applied: int | None               # the steps its state has applied (None: a spare holds no state)
    scalars: dict[str, Any] | None    # the optimizer's and loss scaler's, as of those steps
    pid: int
    place: Coordinates | None         # its coordinates in the mesh it ran on (None: a spare)


@dataclass
class Outcome:
    """What a recovery did: for the log line and the restart event."""

    lost: list[int]          # the original ranks lost
    step: int                # steps applied: the loop goes on from this one
    mesh: dict[str, Any]     # the new mesh's words (`checkpoints.upkeep.mesh_words`)
    refill: str              # "memory" or "checkpoint" ("none": a checkpoint-less start from step 0)
    refill_bytes: int        # bytes this rank received to refill its pieces (summed over ranks in the event)
    seconds: float           # from the failure seen to the new mesh ready
    spare: int               # survivors left waiting
    pids: dict[int, int]     # each survivor's process id, by original rank (the same processes go on)


class InPlace:
    """The recovery protocol's state on this rank: the survivors' world (`survivors`, spares included), the
    step's world (`active`, None on a spare), each survivor's original rank, the steps applied."""

    failures = (PeerFailure, MPI.Exception)

    def __init__(self, world: Communicator, settings: TrainSettings, rule: MeshRule) -> None:
        self.survivors = self.active = world
        self.settings, self.rule = settings, rule
        self.original = list(range(world.size))  # original rank of each survivor
        self.applied = 0  # steps applied (as of the last agreement that said all 1)
        self.agreed = False  # whether this rank already took part in the current step's agreement
        self.recoveries = 0

    # -- 2 agree -------------------------------------------------------------------------------------------------

    def commit(self, step: int) -> None:
        """The step's commit point (`Trainer.commit`): returns when every rank of the step got here; raises
        PeerFailure (on every survivor alike) when one did not."""
        self.agreed = True
        try:
            whole = self.active.comm.Agree(1)
        except MPI.Exception as error:
            faults.raise_if_peer_failed(error, "the step's agreement")
            raise
        if not whole:
            faults.revoke_all()
            raise PeerFailure("a rank of the step saw a failed peer", MPI.ERR_PROC_FAILED)
        self.applied, self.agreed = step + 1, False

    def _agree_on_the_failure(self) -> None:
        """A rank that saw the failure before the commit point takes part in the step's agreement with 0."""
        if self.active is None or self.agreed:
            return
        try:
            self.active.comm.Agree(0)
        except MPI.Exception:
            pass  # the failure itself (MPI_ERR_PROC_FAILED): every rank of the step learns it the same way

    # -- 3 shrink, 4 re-mesh, 5 refill -----------------------------------------------------------------------------

    def recover(self, error: BaseException, held: list[tuple[sharded.Piece, Any]], scalars: dict[str, Any] | None,
                expected: list[str], build: Callable[[TrainSettings, Communicator, Any], Any]) -> tuple[Any, Outcome]:
        """After `error` (a failed peer): agree, shrink, choose the mesh, build this rank's part of it with `build`
        (settings, world, the state to fill it from) and fill it. `held`/`scalars`: this rank's pieces of the last
        applied state and the optimizer's and loss scaler's scalars (none on a spare); `expected`: the names of
        every tensor of the state (a survivor must hold each). Returns what `build` made (None on a spare, which
        then waits: `wait_as_spare`) and the outcome."""
        if isinstance(error, MPI.Exception) and error.Get_error_class() not in faults.failure_classes():
            raise error
        started = time.perf_counter()
        _recovered.append(True)
        faults.revoke_all()  # 1: so that every survivor, whatever it waits in, learns of it
        self._agree_on_the_failure()  # 2
        old_shape, place = self._place()
        survivors = self.survivors.shrink()  # 3
        known = [Survivor(*entry) for entry in survivors.allgather_objects(
            (self.original[self.survivors.rank], expected, self.applied if scalars is not None else None, scalars,
             os.getpid(), place))]
        lost = sorted(set(self.original) - {survivor.original for survivor in known})
        self.survivors, self.original = survivors, [survivor.original for survivor in known]
        ranks = self._remesh(lost, [survivor.place for survivor in known], old_shape)  # 4
        memory = SurvivorMemory(survivors, held)  # 5
        source = _state_source(memory, known, self.settings)
        built = build(self.settings, self.active, source) if self.active is not None else source.serve()
        self.applied = source.first_step  # 6: the loop goes on from here
        refill_bytes = sum(survivors.allgather_objects(memory.received_bytes))
        mesh = {"world_size": ranks, **{axis: getattr(self.settings.mesh, axis) for axis in MESH_OPTIONS}}
        return built, Outcome(lost, source.first_step, mesh, source.kind, refill_bytes, time.perf_counter() - started,
                              survivors.size - ranks, {survivor.original: survivor.pid for survivor in known})

    def _remesh(self, lost: list[int], places: list[Coordinates | None], old_shape: MeshShape | None) -> int:
        """The survivors' mesh by --elastic's rule (giving up where there is none): this rank's settings and step
        world for it (`active`: None on a spare); returns its rank count."""
        self.recoveries += 1
        if self.recoveries > self.settings.elastic.max_restarts:
            self._give_up(self.survivors, lost, f"--max-restarts {self.settings.elastic.max_restarts} used up")
        chosen = self.rule(self.survivors.size, self.settings)
        if isinstance(chosen, str):
            self._give_up(self.survivors, lost, chosen)
        ranks = chosen.pop("world_size")
        self.settings = self.settings.with_options(**chosen)
        key = _places_in_new_mesh(places, old_shape, chosen)[self.survivors.rank]
        world = self.survivors.split(0 if key < ranks else 1, key, label="world")
        self.active, self.agreed = (world if key < ranks else None), False
        return ranks

    def _place(self) -> tuple[MeshShape | None, Coordinates | None]:
        """The shape of the mesh this rank ran on and its coordinates there (None, None on a spare)."""
        if self.active is None:
            return None, None
        layout = self.settings.mesh
        shape = MeshShape(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                          dp_shard=layout.dp_shard).resolve(self.active.size)
        return shape, coordinates_of(self.active.rank, shape)

    def wait_as_spare(self) -> bool:
        """A spare's wait: True when the run ended (the others' `release_spares`), False when a failure woke it
        (then `recover` with nothing held)."""
        try:
            self.survivors.barrier()
        except self.failures as error:
            if isinstance(error, MPI.Exception) and error.Get_error_class() not in faults.failure_classes():
                raise
            return False
        return True

    def release_spares(self) -> None:
        """At the end of the run, every rank of the step meets the spares in their barrier (no spare: nothing)."""
        if self.survivors.size == self.active.size:
            return
        try:
            self.survivors.barrier()
        except self.failures:
            pass  # a spare lost after the last step: the run is complete all the same

    def _give_up(self, survivors: Communicator, lost: list[int], why: str) -> None:
        if survivors.rank == 0:
            print(f"mpiparallel: elastic: lost {_ranks_words(lost)}; {why}: giving up", file=sys.stderr, flush=True)
        raise ElasticGaveUp(why)  # every survivor ends with its status (`leave_if_recovered`)


_recovered: list[bool] = []
"""Set once this process took part in a recovery (`leave_if_recovered`)."""


def leave_if_recovered(status: int) -> None:
    """End a process that recovered in place now, with `status`, its output flushed, without MPI_Finalize: with a
    lost process in the job, Open MPI 5.0's finalize may wait for it forever (seen every time after a loss during a
    checkpoint's save; the job's launcher then never ends). Under ULFM, mpirun takes such an end as a normal one
    (measured: exit status 0 when every survivor ends with 0). Called by the one exit path
    (`jobs.launch.run_guarded`), once the rank has told the self-launching parent how it ended."""
    if not _recovered:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _ranks_words(ranks: list[int]) -> str:
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))}"


def describe(outcome: Outcome) -> str:
    """The log line of a recovery."""
    from ..checkpoints.upkeep import mesh_words

    spare = f", {plural(outcome.spare, 'rank')} spare" if outcome.spare else ""
    source = {"memory": f"the survivors' memory ({outcome.refill_bytes / 1e6:.3g} MB moved, no checkpoint read)",
              "checkpoint": f"the checkpoint of step {outcome.step} (a piece of the state had no surviving copy)",
              "none": "step 0 (no piece of the state survived and there is no checkpoint yet)"}[outcome.refill]
    return (f"elastic: lost {_ranks_words(outcome.lost)}; recovered in place in {outcome.seconds:.2f} s on "
            f"{mesh_words(outcome.mesh)}{spare}, refilled from {source}; going on from step {outcome.step + 1}")


def restart_event(outcome: Outcome) -> dict[str, Any]:
    """The --log-json record of a recovery (the relaunch's, with "mode" saying which); "step": the steps applied
    when the rank was lost, from which the run goes on (a checkpoint's step where the refill read one)."""
    return {"event": "restart", "mode": "in-place", "step": outcome.step, "lost": [{"rank": rank} for rank in
            outcome.lost], "mesh": outcome.mesh, "refill": outcome.refill, "refill_bytes": outcome.refill_bytes,
            "seconds": round(outcome.seconds, 4), "pids": outcome.pids}


def _places_in_new_mesh(places: list[Coordinates | None], old: MeshShape | None, new: dict[str, Any]) -> list[int]:
    """Each survivor's rank in the new world (its ranks from 0 up; those past the mesh are spares). Where the
    model axes are kept, a whole replica of the old mesh (every rank of one dp coordinate alive) keeps its tp, cp
    and pp places in a dp slot of its own, so that each of its ranks already holds what it needs (the refill moves
    nothing for it); the other survivors fill the places left, in rank order."""
    keys: list[int | None] = [None] * len(places)
    if old is not None and all(getattr(old, axis) == new[axis] for axis in ("tp", "cp", "pp")):
        shape = MeshShape(dp=new["dp"], tp=new["tp"], pp=new["pp"], cp=new["cp"]).resolve(
            new["dp"] * new["tp"] * new["pp"] * new["cp"])
        members: dict[int, list[int]] = {}
        for survivor, place in enumerate(places):
            if place is not None:
                members.setdefault(place.dp, []).append(survivor)
        whole = [dp for dp in sorted(members) if len(members[dp]) == old.tp * old.cp * old.pp]
        for slot, dp in enumerate(whole[:new["dp"]]):
            for survivor in members[dp]:
                place = places[survivor]
                keys[survivor] = rank_of(Coordinates(pp=place.pp, dp=slot, cp=place.cp, tp=place.tp), shape)
    free = iter(sorted(set(range(len(places))) - {key for key in keys if key is not None}))
    return [key if key is not None else next(free) for key in keys]


# -- where the new mesh's state comes from -------------------------------------------------------------------------

class FromSurvivors:
    """The last applied state, from the survivors' memory: the model's pieces before the data-parallel engines
    take them over, the moments after (each a fill, collective over the survivors), the scalars from any rank."""

    kind = "memory"

    def __init__(self, memory: SurvivorMemory, steps: int, scalars: dict[str, Any]) -> None:
        self.memory, self.first_step, self.scalars = memory, steps, scalars

    def bind(self, mesh: Any, data_identity: dict[str, Any]) -> None:
        """The survivors' arrays need no mesh to be found."""

    def load_model(self, model: Any) -> None:
        held = sharded.parameter_pieces(model.params.values(), model.axis_ranks())
        self.memory.fill(held + sharded.expert_bias_pieces(model.expert_biases))
        for param in model.params.values():  # mixed precision: the working copy is the filled master, rounded
            if param.master is not None:
                param.data[...] = param.master

    def load_optimizer(self, trainer: Any) -> None:
        optimizer, held = trainer.optimizer, []
        state = dict(self.scalars["optimizer"])
        pieces, ranks = trainer.engine.optimizer_parameters(), trainer.model.axis_ranks()
        for key in MOMENT_KEYS:
            if hasattr(optimizer, key):
                state[key] = getattr(optimizer, key)
                held += sharded.parameter_pieces(pieces, ranks, state[key], prefix=f"{key}/")
        self.memory.fill(held)
        optimizer.load_state_dict(state)
        if self.scalars["loss_scaler"]:
            trainer.scaler.load_state_dict(self.scalars["loss_scaler"])

    def serve(self) -> None:
        """A spare's part: it needs nothing, and serves what it holds (both fills)."""
        self.memory.fill([])
        self.memory.fill([])


class FromCheckpoint:
    """The newest complete checkpoint (a piece had no surviving copy), read in place onto the new mesh; before
    the first one, nothing: the run starts again from step 0."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self.kind = "checkpoint" if path is not None else "none"
        self.first_step = TrainingCheckpoint(path).step if path is not None else 0
        self.mesh: Any = None
        self.data_identity: dict[str, Any] = {}

    def bind(self, mesh: Any, data_identity: dict[str, Any]) -> None:
        """The new mesh (its ranks share the checks of the files) and the data the checkpoint must match."""
        self.mesh, self.data_identity = mesh, data_identity

    def load_model(self, model: Any) -> None:
        if self.path is not None:
            self.saved = load_model_state(str(self.path), model, self.mesh, self.data_identity)

    def load_optimizer(self, trainer: Any) -> None:
        if self.path is not None:
            load_optimizer_state(trainer, self.saved)

    def serve(self) -> None:
        """A spare reads nothing."""


def _state_source(memory: SurvivorMemory, known: list[Survivor], settings: TrainSettings
                  ) -> FromSurvivors | FromCheckpoint:
    """From the survivors where every piece of every tensor survived, else from the newest checkpoint (the same
    answer on every rank: it is decided from all-gathered facts)."""
    expected = {name for survivor in known for name in survivor.expected}
    holders = [survivor for survivor in known if survivor.applied is not None]
    if holders and memory.complete and expected <= set(memory.boxes_of):
        return FromSurvivors(memory, holders[0].applied, holders[0].scalars)
    return FromCheckpoint(sharded.latest_training_checkpoint(settings.output.checkpoint_dir)
                          if settings.output.checkpoint_dir else None)
