"""One rank of a `mpi_harness.run_on_ranks` job: run the target, write its result, abort the job on error."""

import importlib
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpiparallel.process import keep_freed_memory, limit_blas_threads  # noqa: E402

# as `mpiparallel train` sets up its ranks (before NumPy loads BLAS): a rank's share of the cores for BLAS threads,
# else every rank spins one thread per core and they wait for each other at every product
limit_blas_threads(None)
keep_freed_memory()

from mpi4py import MPI  # noqa: E402


def run(job: dict) -> object:
    """Call the job's function with its arguments, or each of its named calls in turn ({name: result})."""
    if "calls" in job:
        return {name: run(each) for name, each in job["calls"].items()}
    module_name, function_name = job["target"].split(":")
    return getattr(importlib.import_module(module_name), function_name)(**job["arguments"])


def main() -> None:
    results_dir, job = sys.argv[1], json.loads(sys.argv[2])
    rank = MPI.COMM_WORLD.Get_rank()
    record_path = Path(results_dir) / f"rank{rank}.json"
    try:
        record = {"result": run(job)}
    except BaseException:
        record_path.write_text(json.dumps({"error": traceback.format_exc()}))
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)
    record_path.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
