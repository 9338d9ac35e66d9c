#!/usr/bin/env bash
# The GPU check in one command: the test suite on CuPy, our collectives verified against NCCL and against MPI on
# device buffers, the collectives benchmark against NCCL, and training speed against PyTorch on the same GPU.
#
#   scripts/gpu_check.sh [REPORT_DIR [GROUP ...]]     (default: the repository's gpu-report/, every group)
#
# GROUPs: tests, verify, bench, train — to split the check over several shorter runs (each appends to the report).
#
# Needs: an NVIDIA GPU, CuPy with NCCL (`pip install -e ".[gpu]"`), MPI (the `mpich` wheel will do: it is not
# CUDA-aware, so device buffers go through pinned host staging, which the report names), and PyTorch with CUDA for
# the training comparison (skipped, and said so, without it). Several ranks share a one-GPU machine; NCCL allows
# that from 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, which this script sets.
#
# Every step runs even if an earlier one fails; REPORT_DIR/report.md lists each step's exit status and the lines
# that matter, REPORT_DIR/*.log hold the full output. The script exits 0 iff every step passed.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPORT=$(realpath -m "${1:-$ROOT/gpu-report}")  # a relative REPORT_DIR is relative to where you are
cd "$ROOT"
shift $(( $# > 0 ? 1 : 0 ))
GROUPS_WANTED=${*:-tests verify bench train}
PYTHON=${PYTHON:-python3}
mkdir -p "$REPORT"
SUMMARY="$REPORT/report.md"
export NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1}
export PYTHONUNBUFFERED=1
FAILED=0

reason=$("$PYTHON" -c "from collectives import backend; print(backend.gpu_unavailable_reason() or '')" 2>&1)
if [ -n "$reason" ]; then
    echo "gpu_check: no GPU to check: $reason" >&2
    exit 2
fi

wanted() { [[ " $GROUPS_WANTED " == *" $1 "* ]]; }

# step NAME GREP_PATTERN COMMAND...: run COMMAND, keep its log, put its status and matching lines in the summary.
step() {
    local name=$1 pattern=$2
    shift 2
    local log="$REPORT/$name.log" started=$SECONDS status
    echo "== $name: $*"
    "$@" >"$log" 2>&1
    status=$?
    if [ $status -eq 0 ]; then verdict=passed; else verdict="FAILED (exit $status)"; FAILED=1; fi
    {
        echo "## $name — $verdict, $((SECONDS - started)) s"
        echo
        echo '```'
        echo "\$ $*"
        grep -E "$pattern" "$log" | tail -n 40
        echo '```'
        echo
    } >>"$SUMMARY"
    echo "   $verdict ($((SECONDS - started)) s, log: $log)"
}

{
    echo "# mpiparallel GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PYTHON" - <<'EOF'
import cupy
from mpi4py import MPI
from collectives import backend
try:
    from cupy.cuda import nccl
    nccl_version = nccl.get_version()
except Exception as error:
    nccl_version = f"unavailable ({error})"
print(f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, NCCL {nccl_version}")
print(f"MPI: {MPI.Get_library_version().splitlines()[0]}")
print(f"device buffers reach MPI by: {backend.transfer_path()}")
EOF
    echo '```'
    echo
} >>"$SUMMARY" 2>&1

RESULTS='passed|failed|error|skipped|PASSED|FAILED|ERROR|SKIPPED'
if wanted tests; then
    step tests-on-gpu "$RESULTS" \
        env MPIPARALLEL_TEST_ARRAYS=cupy "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider
fi
if wanted verify; then
    for n in 2 4; do
        step "verify-nccl-$n" 'wrong|rows|OK|FAILED|Error' \
            "$PYTHON" -m mpiparallel verify --against nccl -n "$n"
    done
    step verify-mpi-gpu-2 'wrong|rows|OK|FAILED|Error|staging|CUDA-aware' \
        "$PYTHON" -m mpiparallel verify --against mpi --device gpu -n 2
fi
if wanted bench; then
    for n in 2 4; do
        step "bench-all-reduce-nccl-$n" '^#|^ +[0-9]' \
            "$PYTHON" -m mpiparallel bench all_reduce --device gpu --compare nccl -n "$n" -b 8 -e 256M -f 4 \
            --json "$REPORT/bench-all-reduce-nccl-$n.json"
    done
    step bench-all-gather-nccl-2 '^#|^ +[0-9]' \
        "$PYTHON" -m mpiparallel bench all_gather --device gpu --compare nccl -n 2 -b 8 -e 256M -f 4
fi
if wanted train; then
    TRAIN='GPT-2|ours|torch|ratio|MFU|difference'
    step train-gpt2-124m-fp32 "$TRAIN" \
        "$PYTHON" scripts/bench_train.py --device gpu --preset gpt2-124m --batch 8 --steps 10 --warmup 2
    step train-gpt2-124m-fp32-qblock256 "$TRAIN" \
        "$PYTHON" scripts/bench_train.py --device gpu --preset gpt2-124m --batch 8 --steps 10 --warmup 2 \
        --query-block 256
    step train-gpt2-124m-tf32 "$TRAIN" \
        "$PYTHON" scripts/bench_train.py --device gpu --preset gpt2-124m --batch 8 --steps 10 --warmup 2 --tf32
    step train-cli-dp2-zero3 'GPT-2|GPU|step|saved|Error' \
        "$PYTHON" -m mpiparallel train --device gpu -n 2 --zero 3 --steps 20 --n-layer 4 --n-embd 256 --n-head 4 \
        --seq-len 256 --batch-size 8 --log-json "$REPORT/train-cli-dp2-zero3.jsonl"
fi

echo "report: $SUMMARY"
exit $FAILED
