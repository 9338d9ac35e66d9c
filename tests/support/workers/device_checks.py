"""GPU code paths on the CuPy test double (tests/support/fake_cupy.py): staging, synchronization, training."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
from fake_cupy import TRAFFIC, CheckedIntracomm, DeviceArray, install
from mpi4py import MPI

import collectives as C
from workers import collective_checks
from workers.byte_data import byte_corpus
from workers.errors import relative_error, worst


def collectives_on_device(cuda_aware: bool, sizes: list[int]) -> dict:
    """Every collective × algorithm on pretend device arrays vs native MPI, through a communicator that notices
    device buffers handed to MPI with device work still queued. Returns failures and what the double counted."""
    os.environ["MPIPARALLEL_CUDA_AWARE"] = "1" if cuda_aware else "0"
    install()
    world = C.Communicator(CheckedIntracomm(MPI.COMM_WORLD))
    collective_checks.C.world = lambda: world  # the shared checks take their communicator from here
    TRAFFIC.reset()
    failures = collective_checks.check_against_native(sizes=sizes, dtypes=["float32", "int64", "bfloat16"],
                                                      ops=["sum", "max"], backend="fake")
    counted = asdict(TRAFFIC)
    return {"failures": failures, "traffic": counted, "staged": _staged_bytes_of_one_ring(world),
            "detector_fires": _unsynchronized_send_is_noticed(world)}


def _unsynchronized_send_is_noticed(world: C.Communicator) -> dict[str, bool]:
    """The double's own check can fail: a device buffer handed to MPI right after a device operation is counted,
    by a point-to-point call, by a native collective, and on a communicator split from the checked one."""
    fake = install()
    split = world.comm.Split(0, world.rank)
    return {"Send": _noticed(fake, world.comm), "Allreduce": _noticed_in_allreduce(fake, world.comm),
            "Split Send": _noticed(fake, split)}


def _noticed(fake, comm: MPI.Intracomm) -> bool:
    y = fake.asarray(np.ones(4)) + 1  # queued device work, no synchronize
    before = TRAFFIC.unsynchronized_mpi_calls
    if comm.Get_size() == 1:
        return True
    if comm.Get_rank() == 0:
        comm.Send([y, MPI.BYTE], 1, 7)
        return TRAFFIC.unsynchronized_mpi_calls == before + 1
    if comm.Get_rank() == 1:
        out = fake.empty(4)
        fake.cuda.get_current_stream().synchronize()
        comm.Recv([out, MPI.BYTE], 0, 7)
    return TRAFFIC.unsynchronized_mpi_calls == before


def _noticed_in_allreduce(fake, comm: MPI.Intracomm) -> bool:
    y = fake.asarray(np.ones(4)) + 1
    out = fake.empty(4)
    before = TRAFFIC.unsynchronized_mpi_calls
    comm.Allreduce([y, MPI.DOUBLE], [out, MPI.DOUBLE])
    return TRAFFIC.unsynchronized_mpi_calls == before + 1


def _staged_bytes_of_one_ring(world: C.Communicator) -> dict:
    """Bytes copied each way during one ring all-reduce, next to the bytes its ledger says it sent/received."""
    fake = install()
    x = fake.asarray(np.arange(1000, dtype=np.float64))
    world.ledger.reset()
    TRAFFIC.reset()
    result = C.all_reduce(x, world, algo="ring")
    return {"to_host": TRAFFIC.to_host, "to_device": TRAFFIC.to_device,
            "sent": world.ledger.total_sent(), "received": world.ledger.total_received(),
            "result_on_device": type(result).__name__ == "DeviceArray",
            "correct": bool(np.array_equal(result.get(), np.arange(1000) * world.size))}


def training_on_device(runs: list[dict], steps: int) -> list[dict]:
    """Train each configuration on the CPU and on the pretend GPU; return both runs' losses and final weights'
    largest relative difference (rank 0; the other ranks return None)."""
    from mpiparallel import train

    install()
    results = []
    for options in runs:
        mesh = options.pop("mesh")
        base = train.TrainSettings.from_options(**{"n_layer": 2, "n_head": 2, "n_embd": 16, "seq_len": 16,
                                                   "batch_size": 4, "steps": steps, "dtype": "float64", "lr": 1e-2,
                                                   **mesh, **options})
        cpu, gpu = _train(train, base), _train(train, base.with_options(device="gpu"))
        if gpu is not None:
            results.append({"options": {**options, "mesh": mesh}, "cpu_losses": cpu[0], "gpu_losses": gpu[0],
                            "weights_max_relative_difference": _max_relative_difference(cpu[1], gpu[1]),
                            "weights_on_device_saved": sorted(gpu[1]) == sorted(cpu[1])})
    return results  # filled on rank 0 only


def _train(train, settings) -> tuple[list[float], dict] | None:
    """Run `train.run` with a JSON log and --save into a directory shared by the ranks; rank 0 reads both."""
    world = MPI.COMM_WORLD
    directory = world.bcast(tempfile.mkdtemp(prefix="device-check-") if world.rank == 0 else None)
    log, saved = Path(directory) / "log.jsonl", Path(directory) / "model"
    train.run(settings.with_options(log_json=str(log), save=str(saved)))
    if world.rank != 0:
        return None
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    from mpiparallel.checkpoints import hugging_face

    _, tensors, _ = hugging_face.load_pretrained(str(saved))
    return losses, tensors


def _max_relative_difference(a: dict, b: dict) -> float:
    return worst(relative_error(b[k], a[k]) for k in a)


PRECISION_MODES = {
    "float64": {"dtype": "float64"},
    "float32": {"dtype": "float32"},
    "bfloat16 compute": {"dtype": "float32", "compute_dtype": "bfloat16"},
    "float16 compute": {"dtype": "float32", "compute_dtype": "float16"},
    "bfloat16 compute, bfloat16 gradients": {"dtype": "float32", "compute_dtype": "bfloat16",
                                             "grad_dtype": "bfloat16"},
    "fp8 blockwise, bfloat16 moments": {"dtype": "float32", "compute_dtype": "bfloat16", "fp8": "blockwise",
                                        "exp_avg_dtype": "bfloat16"},
}
"""Every precision mode the trainer runs (DESIGN.md, Precision)."""


def kernel_calls_in_training(families: list[str], meshes: list[dict]) -> list[dict]:
    """Train one AdamW step on the CuPy double for every precision mode × family × mesh, recording each fused
    kernel call: its kernel, the dtype name of every input (None for a Python scalar) and of every output array
    passed. Returns the distinct calls with the modes that made them (rank 0; every rank records its own)."""
    from models import kernels
    from mpiparallel import train

    install()
    calls: dict[tuple, set[str]] = {}
    original = kernels.FusedKernel.__call__
    mode = [""]

    def recording(kernel: kernels.FusedKernel, **arrays) -> dict:
        key = (kernel.name, tuple(_dtype_name(arrays[name]) for name in kernel.input_names),
               tuple(_dtype_name(arrays[name]) for name in kernel.output_names if name in arrays))
        calls.setdefault(key, set()).add(mode[0])
        return original(kernel, **arrays)

    kernels.FusedKernel.__call__ = recording
    try:
        for family in families:
            for mesh in meshes:
                for name, precision in PRECISION_MODES.items():
                    mode[0] = f"{family} {name} {mesh}"
                    train.run(train.TrainSettings.from_options(
                        arch=family, n_layer=2, n_head=2, n_embd=16, seq_len=16, batch_size=4, steps=1,
                        optimizer="adamw", vocab_size=256, device="gpu", data=byte_corpus(), **mesh, **precision))
    finally:
        kernels.FusedKernel.__call__ = original
    everyone = MPI.COMM_WORLD.gather(calls)
    if MPI.COMM_WORLD.rank != 0:
        return []
    merged: dict[tuple, set[str]] = {}
    for rank_calls in everyone:
        for key, modes in rank_calls.items():
            merged.setdefault(key, set()).update(modes)
    return [{"kernel": k, "inputs": list(i), "outputs": list(o), "modes": sorted(m)}
            for (k, i, o), m in sorted(merged.items(), key=lambda item: str(item[0]))]


def _dtype_name(value) -> str | None:
    """An array argument's dtype name; None for a Python (or NumPy) scalar, which CuPy types by its parameter."""
    return value.dtype.name if isinstance(value, DeviceArray) else None
