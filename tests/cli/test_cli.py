"""The `mpiparallel` command line, run as users run it: in subprocesses, on 1 to 3 ranks, each with a timeout.

A hang must fail the test, not stall it: every command runs in its own process group, killed at its timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import textwrap
import time
from pathlib import Path

import click
import pytest
from mpi_harness import run_with_timeout

from collectives import backend, nccl
from mpiparallel.commands.cli import ByteSize
from mpiparallel.errors import ExitCode
from mpiparallel.jobs.launch import launched_by_mpi, relaunch_command

PROGRAM = [sys.executable, "-m", "mpiparallel"]
OTHER_COLLECTIVES = ("reduce_scatter", "all_gather", "alltoall", "broadcast", "reduce", "sendrecv")


def mpiexec() -> str:
    beside_python = Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec") or "mpiexec"


def clean_environment(tmp_path: Path) -> dict[str, str]:
    """This environment without any launcher's variables (pytest itself might run under one), and with a
    calibration file of its own, so a user's stored cost model cannot change what algo=auto picks."""
    launcher = ("PMI_", "OMPI_", "PMIX_", "SLURM_", "MPIPARALLEL_")
    environment = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    environment.update(PYTHONUNBUFFERED="1", MPIPARALLEL_CALIBRATION=str(tmp_path / "calibration.json"))
    return environment


@pytest.fixture
def run(tmp_path):
    """run(*args, timeout=...) -> (exit status, stdout, stderr, seconds); kills the whole job on timeout."""

    def run_command(*command: str, timeout: float) -> tuple[int, str, str, float]:
        start = time.monotonic()
        finished = run_with_timeout(list(command), timeout, env=clean_environment(tmp_path), cwd=tmp_path)
        return finished.returncode, finished.stdout, finished.stderr, time.monotonic() - start

    return run_command


def table_rows(output: str) -> list[list[str]]:
    """The data rows of a bench table: every line that is not a '#' comment, split into cells."""
    return [line.split() for line in output.splitlines() if line.strip() and not line.startswith("#")]


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' bus bandwidth / algorithm bandwidth (its PERFORMANCE.md), written out here independently."""
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if collective in ("reduce_scatter", "all_gather", "alltoall"):
        return (ranks - 1) / ranks
    return 1.0


def rounding(cell: str) -> float:
    """The most that printing moved a number: half a unit of the cell's last decimal."""
    return 0.5 * 10.0 ** -len(cell.partition(".")[2])


LEFT_CELLS = 5  # size, count, type, redop, root; then time, algbw, busbw, #wrong (+ 2 with --compare) per mode


def assert_printed_bandwidths_follow_nccl_tests(row: list[str], factor: float, mode_cells: int = 4) -> None:
    """algbw = size / time and busbw = algbw × factor in both modes of a printed row, within print rounding
    (size in bytes, time in µs, bandwidths in GB/s = bytes/ns)."""
    size = int(row[0])
    for first in (LEFT_CELLS, LEFT_CELLS + mode_cells):
        time_cell, algbw_cell, busbw_cell = row[first:first + 3]
        time_us, algbw, busbw = float(time_cell), float(algbw_cell), float(busbw_cell)
        assert time_us > rounding(time_cell), row
        slowest, fastest = time_us + rounding(time_cell), time_us - rounding(time_cell)
        slack = rounding(algbw_cell) + 1e-9
        assert size / (slowest * 1e3) - slack <= algbw <= size / (fastest * 1e3) + slack, row
        assert abs(busbw - factor * algbw) <= rounding(busbw_cell) + factor * rounding(algbw_cell) + 1e-9, row


def assert_json_bandwidths_follow_nccl_tests(document: dict, factor: float) -> None:
    """The same relations at full precision, in --json's rows."""
    assert document["rows"]
    for row in document["rows"]:
        for mode in ("out_of_place", "in_place"):
            measured = row[mode]
            assert measured["algbw"] == pytest.approx(row["size"] / (measured["time_us"] * 1e3), rel=1e-12)
            assert measured["busbw"] == pytest.approx(measured["algbw"] * factor, rel=1e-12)


# -- help and pure helpers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("subcommand", [[], ["bench"], ["verify"]])
def test_every_command_has_help(run, subcommand):
    status, out, err, _ = run(*PROGRAM, *subcommand, "--help", timeout=30)
    assert status == 0, err
    assert out.startswith("Usage: mpiparallel")
    if subcommand:
        assert "-n, --np N" in out
    else:
        commands = out.partition("\nCommands:\n")[2].split()
        assert {"bench", "generate", "train", "verify"} <= set(commands)


def test_console_script_help_and_cli_import_do_not_start_mpi(run):
    status, out, _, _ = run(sys.executable, "-c",
                            "import sys, mpiparallel.commands.cli; print('mpi4py' in sys.modules)", timeout=30)
    assert (status, out.strip()) == (0, "False")
    script = shutil.which("mpiparallel", path=str(Path(sys.executable).parent)) or shutil.which("mpiparallel")
    if script is None:
        pytest.skip("no mpiparallel console script on PATH or beside the interpreter: pip install -e .")
    status, out, _, _ = run(script, "--help", timeout=30)
    assert status == 0 and "bench" in out and "verify" in out


@pytest.mark.parametrize("text, expected", [("8", 8), ("64K", 64 << 10), ("1M", 1 << 20), ("2g", 2 << 30),
                                            ("16KB", 16 << 10)])
def test_byte_sizes_read_k_m_g_as_powers_of_1024(text, expected):
    assert ByteSize().convert(text, None, None) == expected


def test_byte_size_rejects_words():
    with pytest.raises(click.BadParameter):
        ByteSize().convert("lots", None, None)


@pytest.mark.parametrize("environment, under_mpi", [
    ({}, False),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}, True),
    ({"PMIX_RANK": "3"}, True),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, False),  # a batch script, not an srun step
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4"}, True),
])
def test_launcher_detection_reads_the_launchers_variables(environment, under_mpi):
    assert launched_by_mpi(environment) is under_mpi


def test_relaunch_runs_this_interpreter_with_the_same_arguments():
    command = relaunch_command("/opt/mpi/bin/mpiexec", 4, ["bench", "all_reduce", "-n", "4"])
    assert command == ["/opt/mpi/bin/mpiexec", "-n", "4", sys.executable, "-m", "mpiparallel",
                       "bench", "all_reduce", "-n", "4"]


# -- bench --------------------------------------------------------------------------------------------------

def test_bench_all_reduce_prints_the_nccl_tests_table_and_json(run, tmp_path):
    json_path = tmp_path / "bench.json"
    status, out, err, _ = run(*PROGRAM, "bench", "all_reduce", "-n", "2", "-b", "8", "-e", "64K", "--iters", "3",
                              "-w", "1", "--json", str(json_path), timeout=60)
    assert status == 0, out + err
    header = [line for line in out.splitlines() if line.startswith("#") and "busbw" in line]
    assert len(header) == 1
    assert header[0].split()[1:] == ["size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                                     "#wrong", "time", "algbw", "busbw", "#wrong", "algo"]
    assert re.search(r"out-of-place\s+in-place", out)
    rows = table_rows(out)
    assert [int(row[0]) for row in rows] == [8 << k for k in range(14)]  # 8 B to 64 KiB, factor 2
    for size, count, dtype, redop, root, *timed, _algo in rows:
        assert (int(count), dtype, redop, root) == (int(size) // 4, "float", "sum", "-1")
        time_us, algbw, busbw = (float(cell) for cell in timed[:3])
        assert time_us > 0 and busbw == pytest.approx(algbw, abs=0.01)  # 2(n-1)/n = 1 on two ranks
        assert timed[3] == timed[7] == "0"  # #wrong, out-of-place and in-place
        assert_printed_bandwidths_follow_nccl_tests([size, count, dtype, redop, root, *timed], 1.0)
    assert "# Out of bounds values : 0 OK" in out
    assert re.search(r"# Avg bus bandwidth\s+: [0-9.e+-]+", out)

    document = json.loads(json_path.read_text())
    assert (document["collective"], document["ranks"], document["datatype"], document["op"]) == \
        ("all_reduce", 2, "float", "sum")
    assert document["mpi_library"] and document["wrong"] == 0
    assert [row["size"] for row in document["rows"]] == [8 << k for k in range(14)]
    assert all(row["out_of_place"]["wrong"] == row["in_place"]["wrong"] == 0 for row in document["rows"])
    assert_json_bandwidths_follow_nccl_tests(document, 1.0)


def test_bench_compare_mpi_adds_the_libraries_bandwidth_and_the_ratio(run, tmp_path):
    json_path = tmp_path / "bench.json"
    status, out, err, _ = run(*PROGRAM, "bench", "all_reduce", "-n", "2", "-e", "4K", "--iters", "2", "-w", "1",
                              "--compare", "mpi", "--algo", "ring", "--json", str(json_path), timeout=60)
    assert status == 0, out + err
    assert "mpi-bw" in out and "vs-mpi" in out
    rows = table_rows(out)
    assert len(rows) == 10 and all(len(row) == 18 for row in rows)
    assert all(row[-1] == "ring" for row in rows)  # the forced algo
    for row in rows:
        assert_printed_bandwidths_follow_nccl_tests(row, 1.0, mode_cells=6)
        for first in (LEFT_CELLS, LEFT_CELLS + 6):  # vs-mpi = MPI's time / ours, so mpi-bw × vs-mpi = busbw
            busbw, mpi_bw, vs_mpi = row[first + 2], row[first + 4], row[first + 5]
            slack = (rounding(busbw) + rounding(mpi_bw) * (float(vs_mpi) + rounding(vs_mpi))
                     + float(mpi_bw) * rounding(vs_mpi) + 1e-9)
            assert abs(float(mpi_bw) * float(vs_mpi) - float(busbw)) <= slack, row
    assert "# Avg bus bandwidth of MPI" in out

    document = json.loads(json_path.read_text())
    assert_json_bandwidths_follow_nccl_tests(document, 1.0)
    for row in document["rows"]:
        for mode in ("out_of_place", "in_place"):
            measured = row[mode]
            assert measured["vs_mpi"] == pytest.approx(measured["mpi_time_us"] / measured["time_us"], rel=1e-12)
            assert measured["mpi_busbw"] == pytest.approx(row["size"] / (measured["mpi_time_us"] * 1e3), rel=1e-12)


@pytest.mark.parametrize("collective, options", [
    ("reduce_scatter", ["-o", "max"]),
    ("all_gather", ["-d", "double"]),
    ("alltoall", ["-d", "int64"]),
    ("broadcast", ["--root", "1", "-d", "half"]),
    ("reduce", ["--root", "1", "-o", "avg"]),
    ("sendrecv", ["-d", "int32"]),
])
def test_bench_every_collective_checks_out_on_two_ranks(run, tmp_path, collective, options):
    json_path = tmp_path / "bench.json"
    status, out, err, _ = run(*PROGRAM, "bench", collective, "-n", "2", "-b", "8", "-e", "4K", "--iters", "2",
                              "-w", "1", *options, "--json", str(json_path), timeout=60)
    assert status == 0, out + err
    assert "# Out of bounds values : 0 OK" in out
    assert len(table_rows(out)) == 10
    for row in table_rows(out):
        assert_printed_bandwidths_follow_nccl_tests(row, bus_factor(collective, 2))
    assert_json_bandwidths_follow_nccl_tests(json.loads(json_path.read_text()), bus_factor(collective, 2))


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_bench_busbw_is_algbw_times_the_nccl_tests_factor_on_three_ranks(run, tmp_path, collective):
    """On 3 ranks the factors differ: 4/3 for all_reduce, 2/3 for reduce_scatter (both 1 or 1/2 on 2 ranks)."""
    json_path = tmp_path / "bench.json"
    status, out, err, _ = run(*PROGRAM, "bench", collective, "-n", "3", "-b", "3K", "-e", "48K", "--iters", "2",
                              "-w", "1", "--json", str(json_path), timeout=60)
    assert status == 0, out + err
    rows = table_rows(out)
    assert [int(row[0]) for row in rows] == [3072 << k for k in range(5)]
    for row in rows:
        assert_printed_bandwidths_follow_nccl_tests(row, bus_factor(collective, 3))
    document = json.loads(json_path.read_text())
    assert document["ranks"] == 3
    assert_json_bandwidths_follow_nccl_tests(document, bus_factor(collective, 3))


def test_bench_all_reduce_in_bfloat16_checks_out_and_names_the_type_as_nccl_tests_does(run, tmp_path):
    """bfloat16 on 3 ranks: nccl-tests' type name, exact results, auto's round-once pairwise algorithm, and the
    MPI column from algo="mpi" (MPI has no bfloat16 datatype for straight mpi4py calls)."""
    json_path = tmp_path / "bench.json"
    status, out, err, _ = run(*PROGRAM, "bench", "all_reduce", "-n", "3", "-d", "bfloat16", "-b", "6", "-e", "96K",
                              "--iters", "2", "-w", "1", "--compare", "mpi", "--json", str(json_path), timeout=90)
    assert status == 0, out + err
    assert "# Out of bounds values : 0 OK" in out
    rows = table_rows(out)
    assert len(rows) == 15 and {row[2] for row in rows} == {"bfloat16"} and {row[-1] for row in rows} == {"pairwise"}
    assert all(int(row[1]) == int(row[0]) // 2 for row in rows)  # 2 bytes per element
    assert json.loads(json_path.read_text())["datatype"] == "bfloat16"


def test_verify_in_bfloat16_on_three_ranks_finds_no_wrong_element(run):
    status, out, err, _ = run(*PROGRAM, "verify", "-n", "3", "-d", "bfloat16", "--max-count", "1000", timeout=120)
    assert status == 0, out + err
    rows = table_rows(out)
    assert {row[2] for row in rows} == {"bfloat16"} and {row[-1] for row in rows} == {"0"}
    assert {"ring", "pairwise", "hierarchical", "rabenseifner"} <= {row[1] for row in rows if row[0] == "all_reduce"}
    assert "all OK" in out


def test_bench_sizes_follow_nccl_tests_for_gathers(run):
    """all_gather's size is the gathered output; its count is one rank's block."""
    status, out, err, _ = run(*PROGRAM, "bench", "all_gather", "-n", "2", "-b", "4K", "-e", "4K", "-d", "double",
                              "--iters", "1", "-w", "0", timeout=60)
    assert status == 0, out + err
    assert table_rows(out)[0][:2] == ["4096", "256"]


# -- verify -------------------------------------------------------------------------------------------------

def test_verify_against_mpi_finds_no_wrong_element(run):
    status, out, err, _ = run(*PROGRAM, "verify", "--against", "mpi", "-n", "2", "--max-count", "1000",
                              timeout=120)
    assert status == 0, out + err
    rows = table_rows(out)
    assert len(rows) > 100
    assert {row[-1] for row in rows} == {"0"}
    assert {row[0] for row in rows} == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_allv",
                                        "broadcast", "reduce"}
    assert "all OK" in out


def test_bench_and_verify_report_a_broken_algorithm(run, tmp_path):
    """A ring all-gather that corrupts one element must show up as wrong and fail both commands."""
    script = tmp_path / "broken.py"
    script.write_text(textwrap.dedent("""
        import collectives
        from mpiparallel.commands import bench, verify

        ring = collectives.ALGORITHMS["all_gather"]["ring"]

        def corrupted_ring(x, out, rank, size):
            yield from ring(x, out, rank, size)
            if len(out) > 3:
                out[3] += 1

        collectives.ALGORITHMS["all_gather"]["ring"] = corrupted_ring
        bench_status = bench.run(bench.BenchSettings("all_gather", minbytes=64, maxbytes=256, iters=1,
                                                     warmup_iters=0, algo="ring"))
        verify_status = verify.run(verify.VerifySettings(max_count=40, collectives=("all_gather",),
                                                         datatypes=("int32",)))
        from mpi4py import MPI
        from pathlib import Path
        # one file per rank: printed lines of two ranks can interleave
        Path(__file__).with_name(f"status{MPI.COMM_WORLD.Get_rank()}").write_text(f"{bench_status} {verify_status}")
    """))
    status, out, err, _ = run(mpiexec(), "-n", "2", sys.executable, str(script), timeout=60)
    assert status == 0, out + err
    assert "Out of bounds values : 12 FAILED" in out  # one element per rank, 2 ranks x 2 modes x 3 sizes
    assert re.search(r"all_gather\s+ring\s+int32.*FAILED at count", out)
    failed = f"{ExitCode.CHECK_FAILED} {ExitCode.CHECK_FAILED}"  # a check that failed, not a crash's 1
    assert [(tmp_path / f"status{rank}").read_text() for rank in range(2)] == [failed, failed]


# -- errors -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("launcher, arguments, message", [
    ([], ["bench", "all_reduce", "-n", "2", "--algo", "nonsense"], "no algorithm 'nonsense'"),
    ([], ["bench", "all_reduce", "-n", "2", "-d", "badtype"], "'badtype' is not one of"),
    (["-n", "2"], ["bench", "all_reduce", "-n", "3"], "-n 3 asks for 3 ranks"),
    (["-n", "2"], ["bench", "broadcast", "--root", "2"], "--root 2 is not a rank"),
])
def test_a_bad_argument_is_reported_once_and_fails_every_rank(run, launcher, arguments, message):
    command = [mpiexec(), *launcher, *PROGRAM] if launcher else PROGRAM
    status, out, err, seconds = run(*command, *arguments, timeout=60)
    assert status != 0
    assert (out + err).count(message) == 1, out + err
    assert (out + err).count("Error:") == 1 and "Traceback" not in out + err
    assert seconds < 30


def test_an_exception_on_one_rank_aborts_the_whole_job_quickly(run, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        from mpiparallel.jobs.launch import run_guarded

        def body():
            if MPI.COMM_WORLD.Get_rank() == 1:
                raise RuntimeError("rank-local failure on purpose")
            MPI.COMM_WORLD.Barrier()  # without MPI_Abort the other ranks would wait here forever

        run_guarded(body)
    """))
    status, out, err, seconds = run(mpiexec(), "-n", "3", sys.executable, str(script), timeout=30)
    assert status != 0
    assert (out + err).count("rank 1 failed: RuntimeError: rank-local failure on purpose") == 1
    assert "Traceback" not in out + err
    assert seconds < 15


# -- GPU buffers and NCCL -------------------------------------------------------------------------------------

GPU_REASON = backend.gpu_unavailable_reason()
NCCL_REASON = nccl.nccl_unavailable_reason()


@pytest.mark.skipif(NCCL_REASON is None, reason="this machine has a GPU with NCCL: the commands would run")
@pytest.mark.parametrize("launcher, arguments, reason", [
    ([], ["verify", "--against", "nccl", "-n", "2"], NCCL_REASON),
    (["-n", "2"], ["verify", "--against", "mpi", "--device", "gpu"], GPU_REASON),
    ([], ["bench", "all_reduce", "--compare", "nccl", "-n", "2"], NCCL_REASON),
    ([], ["bench", "all_reduce", "--device", "gpu", "-n", "2"], GPU_REASON),
])
def test_gpu_commands_without_a_usable_gpu_stop_with_one_message_naming_the_reason(run, launcher, arguments,
                                                                                    reason):
    if reason is None:
        pytest.skip("this machine has a GPU: only the NCCL commands would fail")
    command = [mpiexec(), *launcher, *PROGRAM] if launcher else PROGRAM
    status, out, err, seconds = run(*command, *arguments, timeout=60)
    assert status != 0
    assert (out + err).count(reason) == 1, out + err
    assert [line.startswith("Error:") for line in (out + err).splitlines()] == [True], out + err
    assert "Traceback" not in out + err and seconds < 30


@pytest.mark.parametrize("arguments", [["verify", "--against", "nccl", "--device", "cpu"],
                                       ["bench", "all_reduce", "--compare", "nccl", "--device", "cpu"]])
def test_nccl_on_cpu_buffers_is_a_usage_error(run, arguments):
    status, out, err, _ = run(*PROGRAM, *arguments, "-n", "2", timeout=30)
    assert status == 2
    assert (out + err).count("GPU buffers") == 1 and "Traceback" not in out + err


def skip_unless_nccl_runs_on(ranks: int) -> None:
    """One GPU and an NCCL before 2.30 (an H200 image's 2.28.9): several ranks cannot share it, and the command's
    own refusal of that is tested on the doubles (test_nccl.py)."""
    reason = nccl.several_ranks_unavailable_reason(ranks)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.skipif(NCCL_REASON is not None, reason=f"needs CuPy, a GPU and NCCL: {NCCL_REASON}")
@pytest.mark.parametrize("ranks", ["2", "4"])
def test_verify_against_nccl_on_gpu_finds_no_wrong_element(run, monkeypatch, ranks):
    skip_unless_nccl_runs_on(int(ranks))
    monkeypatch.setenv(nccl.MULTI_RANK_GPU, "1")  # several ranks on one GPU need it (NCCL >= 2.30)
    status, out, err, _ = run(*PROGRAM, "verify", "--against", "nccl", "-n", ranks, "--max-count", "1000",
                              timeout=600)
    assert status == 0, out + err
    assert "# reference: NCCL" in out and "# device: gpu" in out and "all OK" in out
    assert {row[-1] for row in table_rows(out)} == {"0"}


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"needs CuPy and a GPU: {GPU_REASON}")
def test_verify_against_mpi_on_gpu_buffers_finds_no_wrong_element(run):
    status, out, err, _ = run(*PROGRAM, "verify", "--against", "mpi", "--device", "gpu", "-n", "2",
                              "--max-count", "1000", timeout=600)
    assert status == 0, out + err
    assert "# device: gpu" in out and "all OK" in out


@pytest.mark.gpu
@pytest.mark.skipif(NCCL_REASON is not None, reason=f"needs CuPy, a GPU and NCCL: {NCCL_REASON}")
def test_bench_compare_nccl_on_gpu_prints_the_table(run, monkeypatch):
    skip_unless_nccl_runs_on(2)
    monkeypatch.setenv(nccl.MULTI_RANK_GPU, "1")
    status, out, err, _ = run(*PROGRAM, "bench", "all_reduce", "--compare", "nccl", "--device", "gpu", "-n", "2",
                              "-e", "1M", "--iters", "5", "-w", "2", timeout=300)
    assert status == 0, out + err
    rows = table_rows(out)
    assert len(rows) == 18 and all(len(row) == 18 for row in rows)
    assert "nccl-bw" in out and "vs-nccl" in out and "# Out of bounds values : 0 OK" in out
