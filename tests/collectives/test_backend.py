"""Array backend: the CUDA-aware switch and GPU collectives (skipped cleanly without CuPy and a GPU)."""

from __future__ import annotations

import pytest
from mpi_harness import run_on_ranks
from workers import collective_checks

from collectives import backend


def test_cuda_aware_override_is_validated(monkeypatch):
    for value, expected in (("1", True), ("0", False)):
        backend.cuda_aware_mpi.cache_clear()
        monkeypatch.setenv("MPIPARALLEL_CUDA_AWARE", value)
        assert backend.cuda_aware_mpi() is expected
    backend.cuda_aware_mpi.cache_clear()
    monkeypatch.setenv("MPIPARALLEL_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        backend.cuda_aware_mpi()
    backend.cuda_aware_mpi.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and an NVIDIA GPU (pip install -e '.[gpu]')")
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_collectives_on_cupy_arrays_match_native_mpi(ranks):
    results = run_on_ranks(ranks, collective_checks.check_against_native, sizes=[0, 1, 7, 1000, 100_003],
                           backend="cupy")
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: {failures[:5]}"
