# Sourced by the Slurm recipes of this directory: paths, the NCCL / InfiniBand environment, the
# torchrun rendezvous, resuming from the newest checkpoint and requeueing near the time limit.
# Every variable below can be set in the environment of `sbatch` instead.
#
# sbatch runs a copy of the script from its spool directory, so paths come from REPO (the
# directory sbatch was called from, by default), never from $0.

REPO=${REPO:-$PWD}
PY=${PY:-$REPO/.venv/bin/python}
TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
CKPT=${CKPT:-$REPO/checkpoints}            # stage checkpoints: base, cpt_32k, cpt_256k, sft, rl
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_PORT=${RDZV_PORT:-29500}
MAX_REQUEUES=${MAX_REQUEUES:-20}           # a job that keeps hitting its limit stops requeueing
# Slurm writes the job's own log to logs/%x-%j.out (#SBATCH --output); every rank's log goes here.
JOB_LOGS=${JOB_LOGS:-$PWD/logs/${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID:-0}}
TRACKER=latest_checkpointed_iteration.txt  # what megatron_composer.checkpoint writes last in a save
mkdir -p "$JOB_LOGS"

export PYTHONUNBUFFERED=1                  # log lines arrive in order, not at buffer flushes
# srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05): without this the one task per
# node, hence all 8 ranks and their data loading, would be bound to a single core.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
fi

# ---- NCCL over InfiniBand --------------------------------------------------------------------------
# The HCAs NCCL may use between nodes. "mlx5" takes every mlx5_* port; list the ports instead
# ("mlx5_0:1,mlx5_3:1,...") to keep one NIC per GPU as the node's PCIe topology pairs them, or
# exclude a storage NIC with "^mlx5_8". RoCE fabrics also need NCCL_IB_GID_INDEX (usually 3, the
# RoCE v2 GID) set in the environment of sbatch; InfiniBand needs none.
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
# The interface of NCCL's bootstrap and socket transport and of torchrun's c10d store: any but
# loopback and container bridges. Name it ("ib0", "eth0") where several networks reach the nodes.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
# WARN prints only NCCL's problems; INFO prints the NICs, rings and trees it chose: the first thing
# to read when all-to-all or all-gather bandwidth between nodes is low.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A failed or timed-out collective aborts the communicator and ends the process, so the job fails
# (and can be resubmitted) instead of hanging; the timeout is --distributed-timeout-minutes.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# On such a timeout each rank dumps its last collectives (the NCCL flight recorder) into the job's
# log directory: the rank that stopped is the one whose last collective the others wait in.
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$JOB_LOGS/nccl_trace_rank_}
# CUDA_DEVICE_MAX_CONNECTIONS stays at CUDA's default: 1 is only needed by megatron-core's tensor-
# parallel communication overlap (TP is 1 in these recipes), and it would put every stream's
# kernels in one hardware queue, delaying FSDP2's prefetching all-gathers behind compute.

# The first node of the allocation: the torchrun rendezvous host and the Ray head.
head_node() {
    local nodes
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    echo "${nodes[0]}"
}

# resume_flags [INIT]: sets RESUME, the --load flags of this run. The job's own newest checkpoint in
# $SAVE when there is one (a requeue or a resubmission: weights, optimizer, iteration, data position
# and RNG are restored); else INIT with --finetune (weights only: a converted checkpoint or the
# previous stage's); else none (from scratch).
resume_flags() {
    if [ -f "$SAVE/$TRACKER" ]; then
        RESUME=(--load "$SAVE")
        echo "resuming from $SAVE (iteration $(cat "$SAVE/$TRACKER"))"
    elif [ -n "${1:-}" ]; then
        RESUME=(--load "$1" --finetune)
        echo "starting from the weights of $1"
    else
        RESUME=()
        echo "starting from scratch"
    fi
}

# Near the time limit Slurm sends USR1 to this script (#SBATCH --signal=B:USR1@300). The job is
# requeued (at most MAX_REQUEUES times; #SBATCH --requeue allows it) and its step is stopped; the
# requeued job resumes from the newest checkpoint in $SAVE. The trainer has no signal-triggered
# save, so the iterations since the last --save-interval checkpoint are trained again.
on_usr1() {
    REQUEUED=1
    echo "$(date '+%F %T') USR1: the time limit is near"
    if [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then
        echo "requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}, at most $MAX_REQUEUES);" \
            "it resumes from $SAVE"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "not requeueing: $MAX_REQUEUES requeues already; resubmit to resume from $SAVE"
    fi
    if [ -n "$STEP_PID" ]; then
        kill -TERM "$STEP_PID" 2>/dev/null || true
    fi
}

# run_step COMMAND...: the job step in the background, so that bash runs the USR1 trap at once
# rather than after the step; returns the step's status (0 after a requeue, which stopped it).
run_step() {
    REQUEUED=0
    STEP_PID=
    trap on_usr1 USR1
    "$@" &
    STEP_PID=$!
    local rc=0
    wait "$STEP_PID" || rc=$?
    while kill -0 "$STEP_PID" 2>/dev/null; do  # wait was cut short by USR1: let the step stop
        rc=0
        wait "$STEP_PID" || rc=$?
    done
    trap - USR1
    if [ "$REQUEUED" = 1 ]; then
        return 0
    fi
    return "$rc"
}

# torchrun_step SCRIPT ARGS...: one torchrun per node (one Slurm task each) starting GPUS_PER_NODE
# ranks, all meeting at the c10d rendezvous on the first node. Each rank's output goes to its file
# under JOB_LOGS; local rank 0 of each node is also copied to the job's log.
torchrun_step() {
    run_step srun --kill-on-bad-exit=1 --ntasks-per-node=1 "$TORCHRUN" \
        --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
        --rdzv-backend c10d --rdzv-endpoint "$(head_node):$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \
        --max-restarts 0 --log-dir "$JOB_LOGS/torchrun" --tee 3 --local-ranks-filter 0 \
        "$@"
}
