#!/bin/bash
# meshtron on a SLURM cluster with replica groups that fail and heal (fault_tolerance.enabled,
# docs/fault-tolerance.md): the job's nodes split into DP_REPLICATE groups of equal size; each group is
# its own torchrun job (its own rendezvous on its first node, its own restarts), and a torchft lighthouse
# on the first node forms each step's quorum of the live groups. A group whose rank dies restarts and
# heals from a live one over the network while the others keep training.
#
#   DP_REPLICATE=4 sbatch --nodes=32 examples/slurm_replica_groups.sh    # 4 groups of 8 nodes
#
# Arguments after the script go to `meshtron train` as config overrides; the config's parallel.dp_replicate
# is set to DP_REPLICATE. Run it from the repository, with meshtron[ft] installed (pip install torchft).
#SBATCH --job-name=meshtron-ft
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; the agent starts the ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

CONFIG=${CONFIG:-configs/llama3-70b.toml}
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
DP_REPLICATE=${DP_REPLICATE:-4}
MAX_RESTARTS=${MAX_RESTARTS:-10}     # per group: a group must be able to come back
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-1000}  # for a whole-job loss only: failures heal without them
RDZV_PORT=${RDZV_PORT:-29500}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
PER_GROUP=$(( ${#NODES[@]} / DP_REPLICATE ))
if (( PER_GROUP * DP_REPLICATE != ${#NODES[@]} )); then
  echo "meshtron: ${#NODES[@]} nodes do not split into DP_REPLICATE=${DP_REPLICATE} equal groups" >&2
  exit 2
fi

THREADS=$(( ${SLURM_CPUS_PER_TASK:-$NPROC_PER_NODE} / NPROC_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export TORCHFT_LIGHTHOUSE="http://${NODES[0]}:${LIGHTHOUSE_PORT}"

srun --nodes=1 --ntasks=1 --nodelist="${NODES[0]}" --overlap \
  torchft_lighthouse --bind "[::]:${LIGHTHOUSE_PORT}" --min_replicas 1 --join_timeout_ms 60000 &
LIGHTHOUSE=$!

echo "meshtron: ${DP_REPLICATE} replica groups of ${PER_GROUP} nodes x ${NPROC_PER_NODE} ranks, lighthouse ${TORCHFT_LIGHTHOUSE}"
GROUPS_RUNNING=()
for (( g = 0; g < DP_REPLICATE; g++ )); do
  MEMBERS=$(IFS=,; echo "${NODES[*]:$(( g * PER_GROUP )):$PER_GROUP}")
  HEAD=${NODES[$(( g * PER_GROUP ))]}
  srun --nodes="$PER_GROUP" --ntasks-per-node=1 --nodelist="$MEMBERS" \
    --export=ALL,MESHTRON_REPLICA_GROUP=$g \
    python -m torch.distributed.run \
      --nnodes="$PER_GROUP" \
      --nproc-per-node="$NPROC_PER_NODE" \
      --rdzv-backend=c10d \
      --rdzv-endpoint="${HEAD}:${RDZV_PORT}" \
      --rdzv-id="${SLURM_JOB_ID}-group-${g}" \
      --max-restarts="$MAX_RESTARTS" \
      -m meshtron train \
        --config "$CONFIG" \
        --run.dir="$RUN_DIR" \
        --parallel.dp_replicate="$DP_REPLICATE" \
        --fault_tolerance.enabled=true \
        --checkpoint.every="$CHECKPOINT_EVERY" \
        --checkpoint.resume=true \
        "$@" &
  GROUPS_RUNNING+=($!)
done

STATUS=0
for pid in "${GROUPS_RUNNING[@]}"; do
  wait "$pid" || STATUS=$?
done
kill "$LIGHTHOUSE" 2>/dev/null || true
exit "$STATUS"
