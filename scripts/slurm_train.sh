#!/bin/bash
# Train GPT-2 with mpiparallel on a Slurm cluster: one rank per GPU, the site's MPI, srun as the launcher.
#
#   sbatch scripts/slurm_train.sh                       # 2 nodes × 4 GPUs: dp 2 × tp 4 (tp inside a node)
#   sbatch --nodes 4 scripts/slurm_train.sh --pp 2      # extra flags go to `mpiparallel train`
#
# Prerequisites, once, in the environment the job activates (docs/clusters.md, "On a real cluster"): mpi4py built
# against the site MPI (env MPICC=$(which mpicc) pip install --no-binary=mpi4py mpi4py), then pip install -e
# ".[gpu]" — not the `mpich` wheel, which knows neither the interconnect nor Slurm.
#
# Layout: ranks are laid out innermost tp, cp, dp, pp (rank = ((pp·dp + dp_i)·cp + cp_i)·tp + tp_i), and srun
# numbers ranks node by node, so keep tp × cp ≤ GPUs per node: the chattiest axes then stay on NVLink.
#
# What to look for in mpiparallel-<job>.out (docs/clusters.md, "On a real cluster"):
#   - the --show-mesh table: a node column (MPI's shared-memory nodes) and "inside a node: tp; across nodes: dp"
#     (no "warning: tensor-parallel groups ... span nodes" line);
#   - at the end, each rank's bytes per axis beside the formula, then "rank r across nodes: tp 0.000 MB ... |
#     dp X MB (formula X MB, ratio 1.0000)": tp sends nothing across nodes, dp's gradient all-reduce does.
#     With --tp 2 on 4-GPU nodes each dp group has k = 2 ranks per node, and where algo="auto" picks the
#     hierarchical all-reduce, dp's bytes across nodes fall to 2(N−1)/N·S/k per rank (N nodes).
# Calibrate once per allocation size so that "auto" knows both tiers (α, β inside and across nodes):
#   srun mpiparallel bench --calibrate
#SBATCH --job-name=mpiparallel
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=mpiparallel-%j.out

set -euo pipefail

# module load cuda mpi                 # the site's modules providing CUDA and the MPI mpi4py was built against
# source ~/venvs/mpiparallel/bin/activate

export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}   # BLAS threads per rank: its share of the cores
GPUS_PER_NODE=${SLURM_GPUS_PER_NODE:-4}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}                # "a100:4" -> "4"
CHECKPOINTS=${CHECKPOINTS:-$PWD/checkpoints-$SLURM_JOB_NAME}

# each rank takes GPU (local rank mod GPU count), so one rank per GPU needs --ntasks-per-node = GPUs per node;
# --resume makes a requeued job continue from the newest complete checkpoint
srun --cpu-bind=cores mpiparallel train --device gpu --show-mesh \
    --tp "$GPUS_PER_NODE" --sp --zero 1 \
    --n-layer 12 --n-embd 768 --n-head 12 --seq-len 1024 --batch-size 64 --microbatches 4 \
    --dtype float32 --steps 5000 --lr 6e-4 --warmup-steps 200 --lr-schedule cosine --grad-clip 1 \
    --eval-every 250 --checkpoint-dir "$CHECKPOINTS" --checkpoint-every 500 --resume \
    --log-json "train-$SLURM_JOB_ID.jsonl" "$@"
