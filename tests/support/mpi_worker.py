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


def main() -> None:
    results_dir, target, arguments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rank = MPI.COMM_WORLD.Get_rank()
    record_path = Path(results_dir) / f"rank{rank}.json"
    module_name, function_name = target.split(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
        record = {"result": function(**arguments)}
    except BaseException:
        record_path.write_text(json.dumps({"error": traceback.format_exc()}))
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)
    record_path.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
