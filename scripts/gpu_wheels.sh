#!/usr/bin/env bash
# Download, into .whl/ (ignored by git), the wheels scripts/gpu_check.sh installs on the GPU image where it lacks
# them: the mpich wheel (the image's mpi4py finds no MPI library without it) and our pure dependencies, for the
# image's Python (3.12, x86-64 manylinux). Send .whl with the run (the device tool's `carry`); about 20 MB.
#
#   scripts/gpu_wheels.sh [PYTHON_VERSION]      (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
platforms=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl \
    mpich mpi4py click safetensors ml_dtypes tokenizers pytest pytest-timeout iniconfig pluggy packaging
ls -la .whl
