#!/usr/bin/env bash
# The GPU check, in groups that each fit one command of a lent GPU machine (600 s there):
#
#   scripts/gpu_check.sh [REPORT_DIR [GROUP ...]]     (REPORT_DIR default: $OUT if set, else gpu-report/)
#
# GROUPs, run in the order given (default: probe):
#   probe   the environment: GPU, CuPy, CUDA, NVRTC, NCCL (and what it allows on one GPU), MPI, our packages
#   tests   the GPU test subset (`pytest -m gpu`) with the equivalence workers on CuPy arrays; PYTEST_ARGS adds
#           options (e.g. "-n 8": pytest-xdist, which the GPU image has, runs the subset on 8 workers)
#   verify  `verify --against nccl` and `verify --against mpi --device gpu`
#   bench   all_reduce and all_gather, ours against NCCL (busbw side by side)
#   train   scripts/bench_train.py against PyTorch eager (GPT-2 124M, SmolLM-135M's shape; float32, TF32, bf16)
#           and `train` on two ranks
#   gemm    scripts/measure_gemm.py: the chip's MAMF, the planner's products of the published rows, and a minute
#           of sustained load (about five minutes); its gemm.json and gemm.md go beside the report.
#           MEASURE_GEMM_ARGS passes options to it, e.g. "--mamf-budget 45 --product-budget 60 --sustained 20"
#           (about two and a half minutes) where a lease cannot spare five
#   cpu     issue 47's CPU comparison on the host's processor, one thread per process: the CPU's name and vector
#           extensions, scripts/bench_train.py --profile (GPT-2 4L/256d against the fastest PyTorch eager, by
#           category) and scripts/bench_torch_distributed.py (train -n 2 against DDP and FSDP2 over gloo); about
#           four minutes on a 2-core AMD EPYC. Worth a lease's spare minutes where the host is a CPU kind the
#           project's own machines are not (an Intel Xeon with AVX-512: the probe prints it). Needs no GPU.
#   cpu-124m  the same comparison at GPT-2 124M (T 128, B 8, four timed steps): about six minutes there
#
# What it needs, and where it comes from: the machine's own CuPy (cupy-cuda13x in the GPU image; nothing installs
# the `gpu` extra here), PyTorch for the training comparison, and MPI. The GPU image has mpi4py but no MPI library:
# bring the wheels (scripts/gpu_wheels.sh downloads mpich and our pure dependencies into .whl/, which git ignores,
# for the image's Python) and send them with the run; every group installs whatever of them does not import yet
# into the interpreter's own prefix (`pip install --no-index`: `--target` would drop the mpich wheel's lib/).
#
# STEP_TIMEOUT=SECONDS ends any one step that runs longer (it then fails with exit 124, and the next step runs), so a
# step that hangs cannot spend the whole lease.
#
# Output: REPORT_DIR/report.md (each step's status and the lines that matter), REPORT_DIR/report.json (the same as
# data), REPORT_DIR/logs.tar.gz (every step's full log and JSON files) — three files, so the whole report comes
# back from a device run's $OUT (the gemm group adds gemm.json, which `plan --gemm-measured` reads, and gemm.md).
# Every step runs even if an earlier one fails; exit 0 iff every step passed.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPORT=$(realpath -m "${1:-${OUT:-$ROOT/gpu-report}}")  # a relative REPORT_DIR is relative to where you are
cd "$ROOT"
shift $(( $# > 0 ? 1 : 0 ))
GROUPS_WANTED=${*:-probe}
PYTHON=${PYTHON:-python3}
LOGS=$(mktemp -d)
mkdir -p "$REPORT"
SUMMARY="$REPORT/report.md"
STEPS="$LOGS/steps.jsonl"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
FAILED=0

NEEDS_GPU=0
for group in $GROUPS_WANTED; do
    case $group in
    probe|tests|verify|bench|train|gemm) NEEDS_GPU=1 ;;
    cpu|cpu-124m) ;;
    *) echo "gpu_check: unknown group '$group' (probe, tests, verify, bench, train, gemm, cpu, cpu-124m)" >&2; exit 2 ;;
    esac
done

# Our dependencies and MPI, from the carried wheels where the image lacks them.
missing=$("$PYTHON" - <<'EOF'
import importlib
wanted = {"mpi4py": "mpi4py", "click": "click", "safetensors": "safetensors", "ml_dtypes": "ml_dtypes",
          "tokenizers": "tokenizers", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
missing = []
for module, package in wanted.items():
    try:
        importlib.import_module(module)
    except Exception:
        missing.append(package)
try:
    from mpi4py import MPI  # noqa: F401  (the image's mpi4py imports, but finds no MPI library)
except Exception:
    missing.append("mpich")
print(" ".join(missing))
EOF
)
if [ -n "$missing" ]; then
    if ! ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: missing $missing and no wheels in .whl/ (run scripts/gpu_wheels.sh here, carry .whl)" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --find-links "$ROOT/.whl" $missing >&2 || exit 2
fi
# The MPI the check runs on is MPICH from the carried wheel, the launcher the project and its tests are built for:
# an image whose mpi4py loads another MPI (seen on an H200, 2026-11-28: Debian's Open MPI 4.1.6, whose mpiexec
# refuses root) gets the mpich and mpi4py wheels installed over it (mpi4py 4 loads the libmpi of its own prefix
# first, and the wheel's mpiexec lands beside the interpreter, ahead of the system one on PATH).
mpi_library() { "$PYTHON" -c "from mpi4py import MPI; print(MPI.Get_library_version().split()[0])" 2>/dev/null; }
if [ "$(mpi_library)" != MPICH ] && ls "$ROOT"/.whl/mpich-*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --force-reinstall --find-links "$ROOT/.whl" \
        mpich mpi4py >&2 || exit 2
fi
export PATH="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')"):$PATH"
if [ "$(mpi_library)" = Open ] && [ "$(id -u)" = 0 ]; then  # no MPICH wheel: Open MPI as root, oversubscribed
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
        PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMPI_MCA_mpi_yield_when_idle=1
fi
if ! "$PYTHON" -c "from mpi4py import MPI" 2>"$LOGS/mpi.err"; then
    echo "gpu_check: mpi4py finds no MPI library even after installing the mpich wheel: $(tail -1 "$LOGS/mpi.err")" >&2
    exit 2
fi
NCCL_RANKS=""
if [ $NEEDS_GPU = 1 ]; then  # (the cpu groups run anywhere)
    reason=$("$PYTHON" -c "from collectives import backend; print(backend.gpu_unavailable_reason() or '')" 2>&1)
    if [ -n "$reason" ]; then
        echo "gpu_check: no GPU to check: $reason" >&2
        exit 2
    fi
    # NCCL allows several ranks on one GPU from 2.30 on, with NCCL_MULTI_RANK_GPU_ENABLE=1 ("Duplicate GPU" before).
    NCCL_CODE=$("$PYTHON" -c "from cupy.cuda import nccl; print(nccl.get_version())" 2>/dev/null || echo 0)
    GPUS=$("$PYTHON" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())")
    if [ "$NCCL_CODE" -ge 23000 ] || [ "$GPUS" -ge 4 ]; then NCCL_RANKS="2 4"
    elif [ "$GPUS" -ge 2 ]; then NCCL_RANKS="2"; fi
fi
export NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1}

# step NAME GREP_PATTERN COMMAND...: run COMMAND, keep its log, put its status and matching lines in the report.
step() {
    local name=$1 pattern=$2
    shift 2
    local log="$LOGS/$name.log" started=$SECONDS status verdict
    echo "== $name: $*"
    timeout "${STEP_TIMEOUT:-0}" "$@" >"$log" 2>&1  # 0: no limit; a step past STEP_TIMEOUT seconds fails (124)
    status=$?
    if [ $status -eq 0 ]; then verdict=passed; else verdict="FAILED (exit $status)"; FAILED=1; fi
    {
        echo "## $name — $verdict, $((SECONDS - started)) s"
        echo
        echo '```'
        echo "\$ $*"
        grep -a -E "$pattern" "$log" | tail -n 40
        echo '```'
        echo
    } >>"$SUMMARY"
    "$PYTHON" - "$name" "$status" "$((SECONDS - started))" "$log" "$pattern" "$*" >>"$STEPS" <<'EOF'
import json, re, sys
name, status, seconds, log, pattern, command = sys.argv[1:]
lines = [line for line in open(log, errors="replace").read().splitlines() if re.search(pattern, line)]
print(json.dumps({"step": name, "command": command, "status": int(status), "seconds": int(seconds),
                  "lines": lines[-40:]}))
EOF
    echo "   $verdict ($((SECONDS - started)) s)"
}

# note TEXT: a line in the report for something the check cannot run here, and why.
note() {
    echo "- $*" >>"$SUMMARY"
    "$PYTHON" -c "import json, sys; print(json.dumps({'note': sys.argv[1]}))" "$*" >>"$STEPS"
}

# The host's processor: its name and the vector extensions that decide the CPU comparison (issue 47).
HOST_CPU='import sys; sys.path.insert(0, "scripts"); import profile_step as p
print(f"host CPU: {p.cpu_name()}, {p.os.cpu_count()} logical CPUs; {p.cpu_extensions()}")'
CPU_LINES='host CPU|^CPU|^torch|agrees|ours *:|torch *:|ratio|ahead|^matmul|^attention|^GELU|^LayerNorm|^cross|^bias|^embedding|^optimizer|^zeroing|^the rest|^step|BLAS|would run|DDP|FSDP|tokens/s'

echo "# mpiparallel GPU check ($GROUPS_WANTED), $(date -u '+%Y-%m-%d %H:%M UTC')" >"$SUMMARY"
echo >>"$SUMMARY"

for group in $GROUPS_WANTED; do
    case $group in
    probe)
        step host-cpu 'host CPU' "$PYTHON" -c "$HOST_CPU"
        step probe 'GPU|CuPy|CUDA|NVRTC|NCCL|MPI|ranks|torch|staging|aware' "$PYTHON" - <<'EOF'
import subprocess
import cupy
from mpi4py import MPI
from collectives import backend, nccl
name = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                      capture_output=True, text=True).stdout.strip()
print(f"GPU: {name} ({cupy.cuda.runtime.getDeviceCount()} visible)")
print(f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
      f"NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}")
reason = nccl.nccl_unavailable_reason()
if reason:
    print(f"NCCL: unavailable ({reason})")
else:
    code = nccl.cupy_nccl().get_version()
    several = code >= 23000
    print(f"NCCL {nccl.format_version(code)}: several ranks on one GPU "
          f"{'allowed (NCCL_MULTI_RANK_GPU_ENABLE=1)' if several else 'refused (needs NCCL >= 2.30)'}; "
          f"with one GPU this check runs NCCL on {'2 and 4 ranks' if several else 'no multi-rank job'}")
print(f"MPI: {MPI.Get_library_version().splitlines()[0]}")
print(f"device buffers reach MPI by: {backend.transfer_path()}")
try:
    import torch
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, sees GPU: {torch.cuda.is_available()}")
except ImportError:
    print("torch: not installed (the train group's comparison needs it)")
EOF
        ;;
    tests)
        step tests-on-gpu 'passed|failed|error|skipped|PASSED|FAILED|ERROR|SKIPPED' \
            env MPIPARALLEL_TEST_ARRAYS=cupy "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider -m gpu -x \
            --timeout 500 ${PYTEST_ARGS:-} tests
        ;;
    verify)
        if [ -n "$NCCL_RANKS" ]; then
            for n in $NCCL_RANKS; do
                step "verify-nccl-$n" 'wrong|rows|OK|FAILED|Error|reference' \
                    "$PYTHON" -m mpiparallel verify --against nccl -n "$n"
            done
        else
            note "verify --against nccl on several ranks: not run — NCCL $NCCL_CODE on $GPUS GPU(s) refuses two ranks on one GPU (needs NCCL >= 2.30)"
        fi
        step verify-mpi-gpu-2 'wrong|rows|OK|FAILED|Error|staging|CUDA-aware' \
            "$PYTHON" -m mpiparallel verify --against mpi --device gpu -n 2
        ;;
    bench)
        if [ -n "$NCCL_RANKS" ]; then
            for n in $NCCL_RANKS; do
                step "bench-all-reduce-nccl-$n" '^#|^ +[0-9]' \
                    "$PYTHON" -m mpiparallel bench all_reduce --device gpu --compare nccl -n "$n" -b 8 -e 256M -f 4 \
                    --json "$LOGS/bench-all-reduce-nccl-$n.json"
            done
        else
            note "bench --compare nccl: not run — NCCL $NCCL_CODE on $GPUS GPU(s) refuses two ranks on one GPU"
        fi
        step bench-all-reduce-ours-2 '^#|^ +[0-9]' \
            "$PYTHON" -m mpiparallel bench all_reduce --device gpu -n 2 -b 8 -e 64M -f 4
        ;;
    train)
        TRAIN='GPT-2|Llama|ours|torch|ratio|MFU|difference'
        for precision in "--dtype float32" "--tf32" "--compute-dtype bfloat16"; do
            tag=${precision//[- ]/}
            step "train-gpt2-124m-$tag" "$TRAIN" "$PYTHON" scripts/bench_train.py --device gpu --preset gpt2-124m \
                --batch 8 --steps 10 --warmup 2 $precision
            step "train-smollm-135m-$tag" "$TRAIN" "$PYTHON" scripts/bench_train.py --device gpu \
                --preset smollm-135m --batch 8 --steps 10 --warmup 2 $precision
        done
        step train-cli-dp2-zero3 'GPT-2|GPU|step|saved|Error' \
            "$PYTHON" -m mpiparallel train --device gpu -n 2 --zero 3 --steps 20 --n-layer 4 --n-embd 256 \
            --n-head 4 --seq-len 256 --batch-size 8 --log-json "$LOGS/train-cli-dp2-zero3.jsonl"
        ;;
    gemm)
        step gemm-measure 'device|MAMF|products|sustained|wrote|rror' \
            "$PYTHON" scripts/measure_gemm.py --out "$REPORT" ${MEASURE_GEMM_ARGS:-}
        ;;
    cpu)
        step host-cpu 'host CPU' "$PYTHON" -c "$HOST_CPU"
        step cpu-train-gpt2 "$CPU_LINES" "$PYTHON" scripts/bench_train.py --device cpu --model gpt2 --profile
        step cpu-ddp-fsdp2 "$CPU_LINES" "$PYTHON" scripts/bench_torch_distributed.py --kind both --repeats 1
        ;;
    cpu-124m)
        step host-cpu 'host CPU' "$PYTHON" -c "$HOST_CPU"
        step cpu-train-gpt2-124m "$CPU_LINES" "$PYTHON" scripts/bench_train.py --device cpu --preset gpt2-124m \
            --seq 128 --batch 8 --steps 4 --warmup 1
        ;;
    esac
done

"$PYTHON" - "$STEPS" "$REPORT/report.json" "$GROUPS_WANTED" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
json.dump({"groups": sys.argv[3].split(), "steps": [r for r in records if "step" in r],
           "notes": [r["note"] for r in records if "note" in r]}, open(sys.argv[2], "w"), indent=1)
EOF
tar -czf "$REPORT/logs.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
echo "report: $SUMMARY"
exit $FAILED
