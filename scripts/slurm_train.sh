#!/bin/bash
# Train GPT-2 with mpiparallel on a Slurm cluster: srun starts the ranks with the site's MPI, a signal ahead of the
# time limit saves a checkpoint and requeues the job, and the requeued job continues from it with no edit.
#
#   sbatch --gpus-per-node 4 scripts/slurm_train.sh          # 2 nodes × 4 GPUs: dp 2 × tp 4 (tp inside a node)
#   sbatch --nodes 4 --gpus-per-node 4 scripts/slurm_train.sh --pp 2      # extra flags go to `mpiparallel train`
#   sbatch scripts/slurm_train.sh --n-layer 4 --n-embd 256 --n-head 4     # no GPUs asked for: the ranks use CPUs
#
# Environment (optional): MPI=pmi2 for MPICH (the default: pmix, Open MPI's), TP (default: tasks per node),
# CHECKPOINTS (default: ./checkpoints-JOBNAME).
#
# Prerequisites, once, in the environment the job activates (docs/clusters.md, "On a real cluster"): mpi4py built
# against the site MPI (env MPICC=$(which mpicc) pip install --no-binary=mpi4py mpi4py), then pip install -e
# ".[gpu]". On the namespace cluster of `mpiparallel cluster up --scheduler slurm`, the `mpich` wheel and MPI=pmi2.
#
# Layout: ranks are laid out innermost tp, cp, dp, pp (rank = ((pp·dp + dp_i)·cp + cp_i)·tp + tp_i), and srun
# numbers ranks node by node, so keep tp × cp ≤ ranks per node: the chattiest axes then stay inside a node.
#
# Time limits and requeues (docs/clusters.md, "On Slurm"): `--signal=B:USR1@300` has Slurm signal this script 5
# minutes before the limit (give it more than a checkpoint's save takes; Slurm checks only every ~30 s). The script
# passes the signal to srun, which passes it to every rank; the ranks finish the step, save, and exit with 138
# (128 + SIGUSR1), and the script then requeues the job. The requeued job runs this same script, and --resume
# continues from the newest complete checkpoint (the first submission, finding none, starts at step 0). A TERM
# (scancel, the limit itself, `scontrol requeue` by an administrator) also saves and exits (143), without a requeue
# of the script's own: a cancelled job stays cancelled.
#
# What to look for in mpiparallel-<job>.out: the --show-mesh table (a node column, "inside a node: tp; across
# nodes: dp"), and at the end each rank's bytes per axis beside the formula, and those sent across nodes.
# Calibrate once per allocation size so that algo="auto" knows both tiers: srun mpiparallel bench --calibrate
#SBATCH --job-name=mpiparallel
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --time=01:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=mpiparallel-%j.out

set -uo pipefail

# module load cuda mpi                 # the site's modules providing CUDA and the MPI mpi4py was built against
# source ~/venvs/mpiparallel/bin/activate

if [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ "${SLURM_GPUS_ON_NODE}" != 0 ]; then
    DEVICE=gpu        # each rank takes GPU (local rank mod GPU count): one rank per GPU
else
    DEVICE=cpu
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}   # BLAS threads per rank: its share of cores
TP=${TP:-${SLURM_NTASKS_PER_NODE:-1}}
CHECKPOINTS=${CHECKPOINTS:-$PWD/checkpoints-$SLURM_JOB_NAME}
echo "slurm_train.sh: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}, device $DEVICE"

# srun in the background and `wait`: bash runs a trap only between commands, and `wait` is one it interrupts
srun --mpi="${MPI:-pmix}" mpiparallel train --device "$DEVICE" --show-mesh \
    --tp "$TP" --sp --zero 1 \
    --n-layer 12 --n-embd 768 --n-head 12 --seq-len 1024 --batch-size 64 --microbatches 4 \
    --dtype float32 --steps 5000 --lr 6e-4 --warmup-steps 200 --lr-schedule cosine --grad-clip 1 \
    --eval-every 250 --checkpoint-dir "$CHECKPOINTS" --checkpoint-every 500 --resume \
    --log-json "train-$SLURM_JOB_ID.jsonl" "$@" &
ranks=$!
trap 'echo "slurm_train.sh: SIGUSR1: the ranks save and stop"; kill -USR1 $ranks' USR1
wait $ranks
status=$?
while [ $status -gt 128 ] && kill -0 $ranks 2>/dev/null; do  # `wait` was interrupted by the trap: wait again
    wait $ranks
    status=$?
done
if [ $status -eq 138 ]; then  # the ranks saved and stopped for SIGUSR1: come back for the rest
    echo "slurm_train.sh: requeueing job $SLURM_JOB_ID to continue from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit $status
