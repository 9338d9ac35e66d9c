"""collectives/nccl.py: the NCCL adapter computes what our collectives compute, with the calls NCCL expects.

Without a GPU the adapter runs against tests/support/fake_nccl.py, a double of `cupy.cuda.nccl` over MPI on NumPy
arrays that also logs every call; with CuPy, a GPU and NCCL the same checks run against the real library.
One launch per rank count runs every check (module-scoped fixture), because starting ranks is the slow part.
"""

from __future__ import annotations

import json

import pytest
from mpi_harness import run_on_ranks
from workers import nccl_checks

from collectives import nccl

COUNTS = [0, 1, 7, 1001]  # 7 and 1001 divide by none of 2, 3, 4
NCCL_REASON = nccl.nccl_unavailable_reason()


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"{n}ranks")
def report(request):
    """Per-rank reports of one run of every check through the test double, on 1 to 4 ranks."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.delenv(nccl.MULTI_RANK_GPU, raising=False)
    try:
        return request.param, run_on_ranks(request.param, nccl_checks.check_against_ours, timeout=120,
                                           counts=COUNTS)
    finally:
        monkeypatch.undo()


def test_every_wrapped_collective_dtype_op_and_count_equals_our_collectives(report):
    """all_reduce (also out=x), reduce_scatter, reduce and broadcast at both ends, all_gather, all_to_all(v),
    sendrecv, for every NCCL type and op, counts 0, 1 and not divisible by n, plus 3-d and strided inputs;
    each NCCL call had the expected name, count, datatype and op constant, and waited for the stream."""
    ranks, results = report
    for rank, result in enumerate(results):
        assert not result["failures"], f"rank {rank} of {ranks}: {len(result['failures'])} failures, " \
                                       f"first: {result['failures'][:5]}"


def test_every_call_is_queued_on_the_current_stream(report):
    _, results = report
    assert all(result["streams"] == [0x5EED] for result in results)


def test_rank_0_makes_the_unique_id_and_every_rank_builds_its_communicator_from_it(report):
    ranks, results = report
    assert [result["unique_ids_made"] for result in results] == [1] + [0] * (ranks - 1)


def test_unique_id_as_a_tuple_old_nccl_without_avg_and_nonblocking_calls(report):
    _, results = report
    for result in results:
        others = result["others"]
        assert others["tuple_id"]["has_avg"] and others["tuple_id"]["version"] == "2.30.4"
        assert not others["nccl_2_8"]["has_avg"] and others["nccl_2_8"]["version"] == "2.8.4"
        assert others["nonblocking"]["syncs"] == 0


def test_ranks_sharing_a_gpu_get_nccl_multi_rank_gpu_enable(report):
    ranks, results = report
    for result in results:
        assert result["shares"] is (ranks > 1)
        assert result["multi_rank_gpu"] == ("1" if ranks > 1 else None)


def test_bad_arguments_raise_value_errors_naming_the_cause(report):
    ranks, results = report
    errors = results[0]["errors"]
    for dtype in ("int16", "bool", "complex"):
        assert "NCCL cannot reduce" in errors[dtype] and "float16" in errors[dtype], errors[dtype]
    assert "median" in errors["op"] and "sum, prod, max, min, avg" in errors["op"]
    assert "divisible" in errors["not_divisible"] or ranks == 1  # on one rank everything divides
    assert "at least one axis" in errors["zero_dimensional"]
    assert "dtype" in errors["out_dtype"]
    assert "root" in errors["root"]
    assert "send_counts" in errors["send_counts"]


def test_ranks_on_different_gpus_leave_the_variable_alone(monkeypatch):
    monkeypatch.delenv(nccl.MULTI_RANK_GPU, raising=False)
    for result in run_on_ranks(2, nccl_checks.multi_rank_setting, timeout=60, devices="distinct"):
        assert result == {"multi_rank_gpu": None, "shares": False}


def test_ranks_sharing_a_gpu_under_an_nccl_before_2_30_get_one_clear_error_on_every_rank():
    for message in run_on_ranks(2, nccl_checks.an_old_nccl_on_a_shared_gpu, timeout=60):
        assert "ranks share a GPU, which NCCL 2.23.4 refuses" in message and ">= 2.30" in message, message


def test_a_multi_rank_setting_the_user_made_is_kept():
    results = run_on_ranks(2, nccl_checks.multi_rank_setting, timeout=60, env={nccl.MULTI_RANK_GPU: "0"},
                           devices="shared")
    assert all(result == {"multi_rank_gpu": "0", "shares": True} for result in results)


def test_several_ranks_on_one_gpu_are_refused_before_nccl_2_30_only(monkeypatch):
    """The tests' skip reason: ranks beyond the GPU count share one, which NCCL 2.28 refuses and 2.30 allows."""
    class Binding:
        version = 22809

        def get_version(self) -> int:
            return self.version

    binding = Binding()
    monkeypatch.setattr(nccl, "nccl_unavailable_reason", lambda: None)
    monkeypatch.setattr(nccl, "cupy_nccl", lambda: binding)
    monkeypatch.setattr(nccl, "_gpu_count", lambda: 1)
    assert nccl.several_ranks_unavailable_reason(1) is None
    assert "2 ranks on 1 GPU(s) share a GPU, which NCCL 2.28.9 refuses" in nccl.several_ranks_unavailable_reason(2)
    binding.version = 23000
    assert nccl.several_ranks_unavailable_reason(4) is None


def test_version_codes_read_both_ways():
    assert nccl.format_version(2804) == "2.8.4"
    assert nccl.format_version(22304) == "2.23.4"


@pytest.mark.gpu
@pytest.mark.skipif(NCCL_REASON is not None, reason=f"needs CuPy, a GPU and NCCL: {NCCL_REASON}")
@pytest.mark.parametrize("ranks", [1, 2])
def test_real_nccl_on_cupy_arrays_equals_our_collectives(ranks):
    reason = nccl.several_ranks_unavailable_reason(ranks)
    if reason is not None:  # one GPU and an NCCL before 2.30: NcclComm's refusal is tested on the doubles above
        pytest.skip(reason)
    results = run_on_ranks(ranks, nccl_checks.check_against_ours, timeout=300, env={nccl.MULTI_RANK_GPU: "1"},
                           counts=COUNTS, backend="cupy")
    for rank, result in enumerate(results):
        assert not result["failures"], f"rank {rank}: {result['failures'][:5]}"


# -- verify and bench with NCCL replaced by the double -------------------------------------------------------

def table_rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines() if line.strip() and not line.startswith("#")]


def test_verify_against_nccl_prints_the_table_and_finds_no_wrong_element(monkeypatch):
    """Three ranks: NCCL's float average multiplies by 1/3 first, which the inputs keep exact."""
    monkeypatch.delenv(nccl.MULTI_RANK_GPU, raising=False)
    report = run_on_ranks(3, nccl_checks.verify_against_the_double, timeout=120, max_count=20)[0]
    assert report["status"] == 0, report["output"]
    output = report["output"]
    assert "# reference: NCCL 2.30.4 through cupy.cuda.nccl; ranks share a GPU: NCCL_MULTI_RANK_GPU_ENABLE=1" \
        in output
    rows = table_rows(output)
    assert len(rows) > 100 and {row[-1] for row in rows} == {"0"}
    assert {row[0] for row in rows} == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_allv",
                                        "broadcast", "reduce"}
    assert "all OK" in output
    assert "bfloat16" in {row[2] for row in rows}  # NCCL ≥ 2.10 reduces bfloat16, and the double does


def test_verify_against_an_nccl_without_bfloat16_says_so_once_and_checks_the_rest(monkeypatch):
    monkeypatch.delenv(nccl.MULTI_RANK_GPU, raising=False)
    report = run_on_ranks(2, nccl_checks.verify_against_the_double, timeout=120, max_count=7, version=20903)[0]
    assert report["status"] == 0, report["output"]
    output = report["output"]
    # a CuPy or NCCL older than bfloat16 has no NCCL_BFLOAT16: one line says so, no row runs it
    assert "# bfloat16: not checked: this NCCL binding has no NCCL_BFLOAT16" in output
    assert "bfloat16" not in {row[2] for row in table_rows(output)} and "all OK" in output


def test_bench_compare_nccl_adds_nccls_bandwidth_and_the_ratio(tmp_path):
    collectives = ["all_reduce", "reduce_scatter", "all_gather", "alltoall", "broadcast", "reduce", "sendrecv"]
    runs = run_on_ranks(2, nccl_checks.bench_against_the_double, timeout=120, collectives=collectives,
                        json_dir=str(tmp_path), options={"minbytes": 8, "maxbytes": 1024, "iters": 2,
                                                         "warmup_iters": 1, "op": "avg", "root": 1})[0]
    for name, run in runs.items():
        output = run["output"]
        header = [line for line in output.splitlines() if line.startswith("#") and "#wrong" in line]
        assert header[0].split()[1:] == ["size", "count", "type", "redop", "root"] + \
            ["time", "algbw", "busbw", "#wrong", "nccl-bw", "vs-nccl"] * 2 + ["algo"], name
        rows = table_rows(output)
        assert run["status"] == len(rows) == 8 and all(len(row) == 18 for row in rows), output
        assert all(float(row[10]) > 0 and row[8] == row[14] == "0" for row in rows), output
        assert "# nccl-bw: busbw of NCCL 2.30.4" in output and "# Avg bus bandwidth of NCCL :" in output
        assert "# vs-nccl, geometric mean  :" in output and "# Out of bounds values : 0 OK" in output
        document = json.loads((tmp_path / f"{name}.json").read_text())
        assert document["compare"] == "nccl" and document["device"] == "cpu"
        first = document["rows"][0]["out_of_place"]
        assert first["nccl_time_us"] > 0 and first["vs_nccl"] == pytest.approx(first["nccl_time_us"] / first["time_us"])


def test_the_adapters_cupy_memory_reaches_device_arrays_streams_and_devices_on_the_cupy_double():
    """`cupy_memory()` itself runs (x.data.ptr, the stream's .ptr, Device().pci_bus_id): on the CuPy double."""
    for report in run_on_ranks(2, nccl_checks.cupy_memory_on_the_cupy_double, timeout=120):
        for dtype, result in report["results"].items():
            assert result["on_device"], dtype
            assert result["values"] == [2 * i + 1 for i in range(5)], dtype
        assert report["streams"] == [report["stream_ptr"]]
        assert report["shares"]  # both ranks name the double's one GPU by the same PCI bus id
