"""The planner is arithmetic: it imports and runs where mpi4py cannot load an MPI library (a laptop planning a
cluster run). Each test runs in a fresh interpreter whose `import mpi4py` fails, as it does without MPI."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_MPI = "import sys; sys.modules['mpi4py'] = None  # any import of mpi4py now raises ModuleNotFoundError\n"


def _run_without_mpi(program: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_MPI + program], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_plan_runs_without_mpi4py():
    result = _run_without_mpi(
        "from mpiparallel.commands.cli import main\n"
        "try:\n"
        "    main(['plan', '--params', '7e9', '--gpus', '64', '--batch-size', '512', '--tp', '8'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        "assert 'mpi4py.MPI' not in sys.modules\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "throughput" in result.stdout and "tokens/s" in result.stdout


def test_the_planner_and_the_cost_model_import_without_mpi4py():
    result = _run_without_mpi(
        "import mpiparallel.planner, collectives, collectives.cost_model, models.transformer\n"
        "from collectives.cost_model import CostModel\n"
        "print(collectives.cost_model.predict(CostModel(), 'all_reduce', 'ring', 2**20, 8))\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout) > 0


def test_mpi_loads_on_first_use_and_then_is_mpi4pys_own():
    from mpi4py import MPI as real

    from collectives.mpi import MPI
    assert MPI.SUM is real.SUM and MPI.Comm is real.Comm
    assert "SUM" in vars(MPI)  # kept: the next read does not go through __getattr__
    assert isinstance(real.COMM_WORLD, MPI.Comm)


def test_using_mpi_without_mpi4py_fails_at_the_use_saying_so():
    result = _run_without_mpi("from collectives import world\nworld()\n")
    assert result.returncode != 0 and "mpi4py" in result.stderr.splitlines()[-1]
