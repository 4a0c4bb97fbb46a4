#!/bin/bash
# meshtron on a SLURM cluster: one torchrun agent per node, meeting at a c10d rendezvous on the first
# node; each agent starts one rank per GPU. See docs/launching.md.
#
#   sbatch examples/slurm.sh                                  # configs/llama3-70b.toml on 32 nodes of 8
#   CONFIG=configs/mixtral-8x7b.toml sbatch --nodes=16 examples/slurm.sh --training.steps=2000
#
# Arguments after the script go to `meshtron train` as config overrides. Run it from the repository
# (or set CONFIG to an absolute path), with meshtron installed in the Python that `python` finds.
#SBATCH --job-name=meshtron
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; the agent starts the ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

CONFIG=${CONFIG:-configs/llama3-70b.toml}
# On a filesystem every node sees: each rank writes its part of every checkpoint there.
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MAX_RESTARTS=${MAX_RESTARTS:-3}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-200}
RDZV_PORT=${RDZV_PORT:-29500}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

# CPU threads per rank: the node's CPUs shared out among its ranks.
THREADS=$(( ${SLURM_CPUS_PER_TASK:-$NPROC_PER_NODE} / NPROC_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}
# A fresh store for every rendezvous round, so ranks restarted on different nodes meet again
# (docs/launching.md, "Restarts across machines").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

echo "meshtron: ${SLURM_JOB_NUM_NODES} nodes x ${NPROC_PER_NODE} ranks, rendezvous at ${HEAD_NODE}:${RDZV_PORT}, run dir ${RUN_DIR}"

# checkpoint.resume=true: every rank resumes from the newest intact checkpoint after a restart, also on
# nodes whose agent did not count the failure (and a fresh run dir simply starts at step 0).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  python -m torch.distributed.run \
    --nnodes="$SLURM_JOB_NUM_NODES" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${HEAD_NODE}:${RDZV_PORT}" \
    --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts="$MAX_RESTARTS" \
    -m meshtron train \
      --config "$CONFIG" \
      --run.dir="$RUN_DIR" \
      --checkpoint.every="$CHECKPOINT_EVERY" \
      --checkpoint.resume=true \
      "$@"
