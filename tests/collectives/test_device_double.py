"""The GPU code paths on the CuPy test double (tests/support/fake_cupy.py), so they are exercised without a GPU.

The double is NumPy memory posing as device memory: it refuses host/device mixing as CuPy does, counts the
bytes moved each way, and notices device buffers handed to MPI while device work is still queued. These tests
check the backend's promises — stage through host memory when MPI is not CUDA-aware (exactly the bytes sent
and received), synchronize before MPI sees a device buffer when it is — and that training on "GPU" arrays
gives the CPU's losses and weights. What only a real GPU can show (CuPy itself, CUDA kernels, NCCL, speed)
is in the GPU-only tests, which skip here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_cupy import FAKE, TRAFFIC, install
from mpi_harness import mpiexec_path, run_on_ranks, run_with_timeout
from workers import data_parallel_checks, device_checks, tensor_parallel_checks
from workers.errors import worst

from collectives import backend


def test_the_double_refuses_mixing_host_and_device_arrays_like_cupy():
    device = FAKE.asarray(np.arange(4.0))
    with pytest.raises(TypeError, match="host"):
        device + np.ones(4)
    with pytest.raises(TypeError, match="host"):
        device[...] = np.zeros(4)
    with pytest.raises(TypeError, match="host"):
        FAKE.concatenate(np.ones(2), device)
    with pytest.raises(TypeError, match="host"):  # inside a sequence too, as CuPy checks
        FAKE.concatenate([device, np.ones(2)])
    with pytest.raises(TypeError, match="host"):  # NumPy's functions dispatch to CuPy's, which refuse host arrays
        np.dot(np.ones(4), device)
    with pytest.raises(TypeError, match="host"):
        np.concatenate([device, np.ones(2)])
    assert type(device * 2 + FAKE.ones(4)).__name__ == "DeviceArray"
    assert type(np.concatenate([device, device])).__name__ == "DeviceArray"


def test_once_installed_numpy_refuses_to_convert_device_arrays_implicitly(monkeypatch):
    monkeypatch.setattr(np, "asarray", np.asarray)
    monkeypatch.setattr(np, "array", np.array)
    monkeypatch.setattr(backend, "_cupy", backend._cupy)
    monkeypatch.setattr(backend.HostStaging, "possible", backend.HostStaging.possible)
    monkeypatch.setitem(sys.modules, "cupyx", sys.modules.get("cupyx"))
    fake = install()
    device = fake.asarray(np.arange(4.0))
    for convert in (np.asarray, np.array):
        with pytest.raises(TypeError, match="implicit conversion"):
            convert(device)
        with pytest.raises(TypeError, match="implicit conversion"):
            convert([device, device])
    TRAFFIC.reset()
    assert backend.to_host(device).tolist() == [0.0, 1.0, 2.0, 3.0] and TRAFFIC.to_host == 32  # counted
    assert np.asarray([1.0, 2.0]).tolist() == [1.0, 2.0]  # host values convert as before
    backend.cuda_aware_mpi.cache_clear()


def test_the_double_counts_transfers_and_queued_work():
    TRAFFIC.reset()
    device = FAKE.asarray(np.arange(8.0))
    assert TRAFFIC.to_device == 64 and TRAFFIC.queued > 0
    host = (device * 3).get()
    assert TRAFFIC.to_host == 64 and TRAFFIC.queued == 0  # get() blocks, as CuPy's does
    assert isinstance(host, np.ndarray) and host.tolist() == [3.0 * i for i in range(8)]


NATIVE_COLLECTIVES = {"Allreduce", "Reduce_scatter_block", "Allgather", "Alltoallv", "Bcast", "Reduce"}
"""What collectives.native calls: the references every hand-written algorithm is compared with."""


@pytest.mark.parametrize("cuda_aware", [False, True], ids=["host-staging", "cuda-aware"])
def test_collectives_on_device_arrays_stage_or_synchronize(cuda_aware):
    results = run_on_ranks(3, device_checks.collectives_on_device, timeout=240, cuda_aware=cuda_aware,
                           sizes=[0, 1, 7, 1000])
    for rank, result in enumerate(results):
        assert not result["failures"], f"rank {rank}: {result['failures'][:5]}"
        assert result["detector_fires"] == {"Send": True, "Allreduce": True, "Split Send": True}, \
            "the double did not notice an unsynchronized device buffer handed to MPI"
        traffic, ring = result["traffic"], result["staged"]
        assert NATIVE_COLLECTIVES <= set(traffic["mpi_calls"]), \
            f"the native references bypassed the checked communicator: saw only {sorted(traffic['mpi_calls'])}"
        assert ring["correct"] and ring["result_on_device"]
        if cuda_aware:  # device pointers straight to MPI, each after the stream was drained
            assert traffic["device_buffers_given_to_mpi"] > 0
            assert traffic["unsynchronized_mpi_calls"] == 0
            assert ring["to_host"] == ring["to_device"] == 0
        else:  # MPI never sees device memory; the ring copies exactly what it sends and receives
            assert traffic["device_buffers_given_to_mpi"] == 0
            assert ring["to_host"] == ring["sent"] > 0
            assert ring["to_device"] == ring["received"] > 0


@pytest.mark.parametrize("cuda_aware, runs", [
    ("0", [{"mesh": {"dp": 2}}, {"mesh": {"dp": 2}, "zero": 3}, {"mesh": {"tp": 2}, "sp": True}]),
    ("1", [{"mesh": {"dp": 2}, "zero": 2, "microbatches": 2}]),
], ids=["host-staging", "cuda-aware"])
def test_training_on_device_arrays_equals_cpu_training(cuda_aware, runs):
    results = run_on_ranks(2, device_checks.training_on_device, timeout=300, steps=2, runs=runs,
                           env={"MPIPARALLEL_CUDA_AWARE": cuda_aware})[0]
    assert len(results) == len(runs)
    for result in results:
        what = result["options"]
        np.testing.assert_allclose(result["gpu_losses"], result["cpu_losses"], rtol=1e-9, err_msg=str(what))
        assert result["weights_on_device_saved"], what
        assert result["weights_max_relative_difference"] <= 1e-9, what


def test_mixed_precision_training_runs_on_the_strict_double_and_follows_the_cpu():
    """bfloat16 Llama and float16 GPT-2 (loss scaling) on the strict double, which refuses what CuPy refuses:
    the steps run, and their losses follow the CPU run's (the same roundings in another order: the first step is
    the same number, later ones differ in the fourth digit at most; AdamW's normalized updates make the weights
    incomparable where gradients are near zero, so they are not compared)."""
    runs = [{"mesh": {"dp": 2}, "arch": "llama", "dtype": "float32", "compute_dtype": "bfloat16"},
            {"mesh": {"tp": 2}, "arch": "gpt2", "dtype": "float32", "compute_dtype": "float16"}]
    results = run_on_ranks(2, device_checks.training_on_device, timeout=300, steps=3, runs=runs,
                           env={"MPIPARALLEL_CUDA_AWARE": "0"})[0]
    assert len(results) == 2
    for result in results:
        assert result["gpu_losses"][0] == result["cpu_losses"][0], result["options"]
        np.testing.assert_allclose(result["gpu_losses"], result["cpu_losses"], rtol=1e-4, err_msg=str(result))


def test_parallel_equals_serial_workers_run_on_device_arrays():
    """The equivalence workers themselves on device arrays (scripts/gpu_check.sh runs them with real CuPy):
    ZeRO-3 data parallelism and TP+SP against the NumPy serial model."""
    fake = {"MPIPARALLEL_TEST_ARRAYS": "fake"}
    for rank, failures in enumerate(run_on_ranks(2, data_parallel_checks.check_equals_serial, env=fake,
                                                 zero=3, microbatch_count=2)):
        assert not failures, f"rank {rank}: {failures[:3]}"
    reports = run_on_ranks(2, tensor_parallel_checks.compare_training, env=fake,
                           runs=[{"tp": 2, "dp": 1, "sequence_parallel": True, "vocab_size": 61}])
    for rank, [report] in enumerate(reports):
        assert report["initial_weights_exact"] and report["checked_grads"] > 0, rank
        assert worst([report["loss_error"], report["grad_error"], report["weight_error"]]) <= 1e-9, (rank, report)


def test_training_benchmark_runs_its_gpu_path_on_device_arrays():
    root = Path(__file__).resolve().parents[2]
    program = ("import sys; sys.path[:0] = ['tests/support', 'scripts']; from fake_cupy import install; install(); "
               "import bench_train; bench_train.main(sys.argv[1:])")
    result = subprocess.run([sys.executable, "-c", program, "--device", "gpu", "--layers", "1", "--embd", "32",
                             "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1",
                             "--peak-tflops", "1"], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Fake GPU; CuPy" in result.stdout
    assert "ours :" in result.stdout and "MFU (peak 1.0 TFLOP/s): ours" in result.stdout, result.stdout
    bfloat16 = subprocess.run([sys.executable, "-c", program, "--device", "gpu", "--layers", "1", "--embd", "32",
                               "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1",
                               "--peak-tflops", "1", "--compute-dtype", "bfloat16", "--model", "llama"], cwd=root,
                              capture_output=True, text=True, timeout=120)
    assert bfloat16.returncode == 0, bfloat16.stderr[-2000:]
    assert "(bfloat16 compute)" in bfloat16.stdout and "MFU (peak 1.0 TFLOP/s): ours" in bfloat16.stdout
    # the double refuses batched bfloat16 matmul and has no cuBLAS: the attention products are left out, saying so
    assert "the batched bfloat16 (attention) products are not timed: cuBLAS" in bfloat16.stdout, bfloat16.stdout


@pytest.mark.skipif(backend.cupy_available(), reason="checks the no-GPU refusal; on a GPU the script really runs")
def test_gpu_check_script_refuses_clearly_without_a_gpu(tmp_path):
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no GPU to check" in result.stderr and result.stdout == ""


def _cli_on_fake_gpu(ranks: int, *args: str) -> subprocess.CompletedProcess:
    """`mpiparallel ARGS` on `ranks` ranks with the CuPy double installed in every rank (killed on a hang)."""
    root = Path(__file__).resolve().parents[2]
    program = ("import sys; sys.path.insert(0, 'tests/support'); from fake_cupy import install; install(); "
               "from mpiparallel.commands.cli import main; main(sys.argv[1:])")
    return run_with_timeout([mpiexec_path(), "-n", str(ranks), sys.executable, "-c", program, *args], 180,
                       merge_output=True, cwd=root)


def test_verify_and_bench_run_their_gpu_paths_on_device_arrays():
    verify = _cli_on_fake_gpu(2, "verify", "--against", "mpi", "--device", "gpu", "--max-count", "100",
                              "-d", "float32", "-d", "int64", "-d", "bfloat16")
    assert verify.returncode == 0, verify.stdout[-3000:]
    assert "host staging" in verify.stdout and "all OK" in verify.stdout
    bench = _cli_on_fake_gpu(2, "bench", "all_reduce", "--device", "gpu", "--compare", "mpi", "-e", "64K")
    assert bench.returncode == 0, bench.stdout[-3000:]
    assert "# Out of bounds values : 0 OK" in bench.stdout
    bench = _cli_on_fake_gpu(2, "bench", "reduce_scatter", "--device", "gpu", "--compare", "mpi", "-e", "64K",
                             "-d", "bfloat16", "-o", "avg")
    assert bench.returncode == 0, bench.stdout[-3000:]
    assert "# Out of bounds values : 0 OK" in bench.stdout and "bfloat16" in bench.stdout


# -- the double refuses what CuPy refuses (each check below fails if the double's matching strictness goes) ----

def test_host_device_copies_take_exactly_the_arrays_dtype_shape_and_contiguity_as_in_cupy():
    device = FAKE.asarray(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="cannot be set"):
        device.set(np.zeros((2, 3), np.float64))
    with pytest.raises(ValueError, match="Shape mismatch"):
        device.set(np.zeros(6, np.float32))
    with pytest.raises(RuntimeError, match="non-contiguous"):
        FAKE.asarray(np.zeros((3, 4), np.float32))[:, ::2].set(np.zeros((3, 2), np.float32))
    with pytest.raises(TypeError, match="cannot be obtained"):
        device.get(out=np.empty((2, 3), np.float64))
    with pytest.raises(ValueError, match="Shape mismatch"):
        device.get(out=np.empty((3, 2), np.float32))
    with pytest.raises(TypeError, match="Only numpy.ndarray"):
        device.set(FAKE.zeros((2, 3), np.float32))


def test_a_kernel_placeholder_takes_one_dtype_and_a_fixed_type_a_safe_cast_as_in_cupy():
    scale = FAKE.ElementwiseKernel("T x, T w, float32 eps", "T y", "y = x * w + eps", "scale")
    x32 = FAKE.asarray(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="Type is mismatched. w bfloat16 float32 T"):
        scale(x32, x32.astype(backend.BFLOAT16), 1.0)
    with pytest.raises(TypeError, match="Type is mismatched. eps float64 float32"):
        scale(x32, x32, FAKE.asarray(np.ones(4)))
    with pytest.raises(TypeError, match="Type is mismatched. y float64 float32 T"):
        scale(x32, x32, 1.0, FAKE.zeros(4))
    result = scale(x32.astype(np.float16), x32.astype(np.float16), 0.5)
    assert result.dtype == np.float16 and result.get().tolist() == [1.5] * 4


def test_the_double_offers_only_cupys_names_and_keywords():
    assert FAKE.zeros(2).get().tolist() == [0.0, 0.0]
    with pytest.raises(AttributeError, match="busday_count"):  # NumPy has it, CuPy does not
        getattr(FAKE, "busday_count")  # noqa: B009 (the attribute access is what is tested)
    with pytest.raises(TypeError, match="unexpected keyword"):
        FAKE.ElementwiseKernel("T x", "T y", "y = x", "copy", fast_math=True)
    copy = FAKE.ElementwiseKernel("T x", "T y", "y = x", "copy", preamble="")
    with pytest.raises(TypeError):
        copy(FAKE.zeros(2), threads=2)


def test_bfloat16_products_stay_bfloat16_and_refuse_to_sort_as_in_cupy():
    """Seen on an H200 (CuPy 14.2): a bfloat16 matrix product is bfloat16 (ml_dtypes' NumPy product gives float32)
    and Thrust sorts no bfloat16 — the MoE router's argsort failed there and passed on the looser double."""
    a = FAKE.asarray(np.ones((3, 4), dtype=backend.BFLOAT16))
    assert (a @ a.T).dtype == FAKE.matmul(a, a.T).dtype == backend.BFLOAT16
    with pytest.raises(NotImplementedError, match="bfloat16"):
        FAKE.argsort(a, axis=1, kind="stable")
    with pytest.raises(NotImplementedError, match="bfloat16"):
        a.sort()
    assert FAKE.argsort(a.astype(np.float32), axis=1).shape == (3, 4)


def test_batched_bfloat16_products_are_refused_as_in_cupy():
    """Seen on an H200 (CuPy 14.2): matmul of bfloat16 operands with a batch dimension fails ("data type 'E' not
    understood": CuPy's integer kernels); 2-D bfloat16 and batched float32 products run."""
    batched = FAKE.asarray(np.ones((2, 3, 4), dtype=backend.BFLOAT16))
    with pytest.raises(TypeError, match="data type 'E'"):
        FAKE.matmul(batched, FAKE.swapaxes(batched, -1, -2))
    with pytest.raises(TypeError, match="data type 'E'"):
        batched @ FAKE.asarray(np.ones((4, 5), dtype=backend.BFLOAT16))
    assert (batched[0] @ batched[0].T).shape == (3, 3)
    assert FAKE.matmul(batched.astype(np.float32), FAKE.swapaxes(batched, -1, -2).astype(np.float32)).shape == (2, 3, 3)


def test_set_from_pinned_memory_is_queued_reads_the_memory_late_and_the_pool_reuses_the_block():
    memory = FAKE.cuda.alloc_pinned_memory(4 * 8)
    host = np.frombuffer(memory, np.float64, 4)
    host[...] = 1.0
    device = FAKE.zeros(4)
    device.set(host)
    host[...] = 2.0  # before the stream reached the copy: the device gets these bytes, as on a GPU
    assert device.get().tolist() == [2.0] * 4
    address = host.ctypes.data
    del memory, host
    again = np.frombuffer(FAKE.cuda.alloc_pinned_memory(4 * 8), np.float64, 4)
    assert again.ctypes.data == address  # the freed block comes back at once


def test_host_staging_waits_for_its_copies_before_their_pinned_blocks_are_reused(monkeypatch):
    """The receive-only step of a tree: receive into a staged buffer, copy it to the device, and receive the next
    block into a staged buffer of the same size. Without the wait in `finish`, the second receive lands in the
    block whose copy is still queued, and the first device array gets the second block's values."""
    monkeypatch.setattr(np, "asarray", np.asarray)
    monkeypatch.setattr(np, "array", np.array)
    monkeypatch.setattr(backend, "_cupy", backend._cupy)
    monkeypatch.setattr(backend.HostStaging, "possible", backend.HostStaging.possible)
    monkeypatch.setitem(sys.modules, "cupyx", sys.modules.get("cupyx"))
    monkeypatch.setenv("MPIPARALLEL_CUDA_AWARE", "0")
    fake = install()
    backend.cuda_aware_mpi.cache_clear()
    received = []
    for value in (1.0, 2.0):
        target = fake.zeros(8)
        staging = backend.HostStaging()
        staging.incoming(target)[...] = value  # what MPI_Recv writes
        staging.finish()
        received.append(target)
    assert [target.get().tolist() for target in received] == [[1.0] * 8, [2.0] * 8]
    backend.cuda_aware_mpi.cache_clear()
