"""A pipeline step on 2 ranks whose schedule or activation shape was broken on purpose, for the checked
point-to-point messages (`--check-collectives`; see tests/runtime/test_flight_recorder.py)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from collectives import CollectiveMismatchError, Communicator
from models.transformer import GPTConfig, Transformer
from mpiparallel.axes.pipeline_parallel import PipelineExecutor, PipelineStages
from mpiparallel.data import Microbatch
from mpiparallel.schedules import RECV_F, build_schedule

ROWS, SEQ, EMBD = 2, 8, 16


def broken_step(breakage: str, checked: bool = True) -> str:
    """One 1F1B step of a 2-layer GPT-2 on 2 stages with `breakage`: "none"; "dropped_receive" (rank 1's
    schedule loses its first RECV_F: rank 0 sends a message nobody receives); "longer_buffer" (rank 1 expects
    activations of twice the sequence: a size that differs); "short_data" (both ranks expect activations of twice
    the sequence, the model makes them of one: rank 0's send itself is wrong). Returns the CollectiveMismatchError's
    message on this rank, or "no error"; any other error propagates (the harness reports it), as does the error of
    "short_data", which only the sending rank can see (the harness aborts the job, as `train` does)."""
    comm = Communicator(MPI.COMM_WORLD, check_arguments=checked)
    comm.label = "pp"
    config = GPTConfig(vocab_size=64, n_positions=4 * SEQ, n_embd=EMBD, n_layer=2, n_head=2)
    schedule = build_schedule("1f1b", comm.size, 2)
    model = Transformer(config, dtype=np.float64).parallelize(PipelineStages(schedule, comm.rank))
    seq = 2 * SEQ if breakage == "short_data" or (breakage == "longer_buffer" and comm.rank == 1) else SEQ
    executor = PipelineExecutor(model, schedule, comm, (ROWS, seq, EMBD), np.float64)
    if breakage == "dropped_receive" and comm.rank == 1:
        first = next(index for index, action in enumerate(executor.actions) if action.kind == RECV_F)
        executor.actions = executor.actions[:first] + executor.actions[first + 1:]
    tokens = np.random.default_rng(0).integers(0, 64, (2, ROWS, SEQ + 1))
    microbatches = [Microbatch(rows[:, :-1], rows[:, 1:]) for rows in tokens]
    try:
        executor.step(microbatches, normalizer=2 * ROWS * SEQ)
    except CollectiveMismatchError as error:
        if breakage == "short_data":
            raise
        return str(error)
    return "no error"
