"""Planted in the ranks of an `--elastic` test (this folder on PYTHONPATH): one rank of the first job kills itself
by SIGKILL — no word to anyone, as a lost node — at a place the test names, so the loss lands where the test
needs it on a quiet machine and a loaded one alike.

PLANTED_LOSS="RANK save STEP": rank RANK dies while step STEP's checkpoint is written (its shard file in place,
the manifest not yet); "RANK after STEP COUNT": at its COUNT-th collective after step STEP's checkpoint was saved
(STEP 0: from the start). "RANK at STEP PHASE": as the rank enters PHASE of step STEP (the phases the ranks
report to the stall watchdog, `train.progress`: forward, gradients, optimizer, gather, checkpoint, …).
PLANTED_LOSS_DONE: a file made just before dying, so that the relaunched jobs run on.
"""

import os
import signal

_PLAN = os.environ.get("PLANTED_LOSS", "").split()
_DONE = os.environ.get("PLANTED_LOSS_DONE", "")


def _die() -> None:
    open(_DONE, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


def _plant_in_save(step: int) -> None:
    from mpiparallel.checkpoints import sharded

    write = sharded.write_rank_file

    def write_then_die(folder, rank, held):
        shards = write(folder, rank, held)
        if folder.name == f"step-{step:08d}":
            _die()
        return shards

    sharded.write_rank_file = write_then_die


def _plant_after_save(step: int, count: int) -> None:
    from collectives.communicator import Communicator
    from mpiparallel.checkpoints import sharded

    counted = [0]
    armed = [step == 0]
    save = sharded.save

    def save_then_arm(directory, saved_step, *args, **kwargs):
        folder = save(directory, saved_step, *args, **kwargs)
        armed[0] = armed[0] or saved_step == step
        return folder

    def counting(original):
        def replacement(self, *args, **kwargs):
            counted[0] += armed[0]
            if counted[0] == count:
                _die()
            return original(self, *args, **kwargs)
        return replacement

    sharded.save = save_then_arm
    Communicator.run = counting(Communicator.run)
    Communicator.start = counting(Communicator.start)


def _plant_at_phase(step: int, phase: str) -> None:
    from mpiparallel.train import progress

    for reports in (progress.ProgressReports, progress.NoProgressReports):
        def at(self, at_step, at_phase, detail="", original=reports.at):
            if (at_step, at_phase) == (step, phase):
                _die()
            return original(self, at_step, at_phase, detail)

        reports.at = at


_RANK = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))  # MPICH's launcher, Open MPI's

if _PLAN and _RANK == _PLAN[0] and not os.path.exists(_DONE):
    if _PLAN[1] == "save":
        _plant_in_save(int(_PLAN[2]))
    elif _PLAN[1] == "at":
        _plant_at_phase(int(_PLAN[2]), _PLAN[3])
    else:
        _plant_after_save(int(_PLAN[2]), int(_PLAN[3]))
