"""Where bench's and verify's buffers live (--device cpu|gpu), and one clean stop when some rank has no GPU.

A GPU run must start on every rank or on none: a rank that fails alone would leave the others blocked in their
first collective. `use_gpu` therefore asks every rank (one allgather of a short string) before any rank binds
its GPU (local rank mod GPU count, `collectives.backend.bind_device`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import Communicator, backend, nccl

from ..errors import ConfigError


def gpu_problem(comm: Communicator, need_nccl: bool) -> str | None:
    """Why some rank cannot run on a GPU (or NCCL), the same answer on every rank; None when all can.

    Collective: each rank asks its own machine, and all ranks then report the first problem found, so that
    every rank stops together (a rank stopping alone would leave the others waiting).
    """
    mine = nccl.nccl_unavailable_reason() if need_nccl else backend.gpu_unavailable_reason()
    reasons = comm.comm.allgather(mine)
    problems = [(rank, reason) for rank, reason in enumerate(reasons) if reason is not None]
    if not problems:
        return None
    rank, reason = problems[0]
    return reason if len(set(reasons)) == 1 else f"rank {rank}: {reason}"


def use_gpu(comm: Communicator, what: str, need_nccl: bool = False) -> int:
    """Stop every rank with one ConfigError unless all can use a GPU; then bind each to its GPU (returned)."""
    problem = gpu_problem(comm, need_nccl)
    if problem is not None:
        raise ConfigError(f"{what} needs {'NCCL on ' if need_nccl else ''}a GPU on every rank: {problem}")
    return backend.bind_device(comm.comm)


def array_module(device: str) -> Any:
    """NumPy for --device cpu, CuPy for --device gpu."""
    return np if device == "cpu" else backend.gpu_array_module()
