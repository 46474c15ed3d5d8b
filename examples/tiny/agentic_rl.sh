#!/usr/bin/env bash
# Agentic RL at tiny scale: scripted expert trajectories -> SFT -> RL in the sandboxed coding environment.
#
# 1. SFT data: expert trajectories of the coding task families through the real tools
#    (python -m megatron_composer.rl.sft_trajectories), mostly the simplest family, write-file.
# 2. SFT on them (loss on the assistant turns), from the cpt-32k checkpoint when it exists.
# 3. RL (train_rl.py --env agentic-coding) on write-file tasks: multi-turn episodes in bubblewrap
#    sandboxes, verified by the tasks' pristine tests; the held-out solved fraction (greedy) is
#    measured before the first step and at the end. Writes $OUT/agentic_rl/reward_curve.png.
# About 35 minutes on a 2-core CPU (SFT ~18, RL ~12). SEED=... varies the RL run; SFT_ITERS_1/2 and
# RL_ITERS the lengths. The steps already done (data, SFT checkpoints) are kept and skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/tiny}
DATA="$OUT/agent_sft"
SEED=${SEED:-1234}
CACHE=${DATA_CACHE_DIR:-data}
# the embedded corpus's tokenizer (built on first use, as every tiny example does)
$PY -c "from megatron_composer.data import default_cpt_data as d; d('$CACHE', progress=False)"
TOKENIZER=${TOKENIZER:-$CACHE/tokenizer.model}

if [ ! -f "$DATA/train.jsonl" ]; then
    $PY -m megatron_composer.rl.sft_trajectories --families write-file --count ${SFT_TASKS:-1200} \
        --output "$DATA/write_file.jsonl"
    $PY -m megatron_composer.rl.sft_trajectories --families set-constant,fix-bug --count 19 \
        --output "$DATA/other.jsonl"
    cat "$DATA/write_file.jsonl" "$DATA/other.jsonl" > "$DATA/train.jsonl"
    $PY -m megatron_composer.rl.sft_trajectories --families write-file --split eval --count 32 \
        --output "$DATA/valid.jsonl"
fi

# SFT in two passes over the same data (the second restarts the schedule at a higher rate): the
# tool format is learned in the first, copying the file name and content from the instruction
# emerges in the second. About 1 s per step on 2 cores.
sft() {  # sft NAME ITERS LR MIN_LR LOAD...
    local name=$1 iters=$2 lr=$3 min_lr=$4
    shift 4
    [ -f "$OUT/$name/latest_checkpointed_iteration.txt" ] && return 0
    $PY pretrain_cpt.py \
        --stage sft --model-preset tiny \
        --data-path "$DATA/train.jsonl" --valid-data-path "$DATA/valid.jsonl" \
        --tokenizer-model "$TOKENIZER" --data-cache-dir "$CACHE" \
        --seq-length 512 --micro-batch-size 8 \
        --train-iters "$iters" --lr "$lr" --min-lr "$min_lr" --lr-warmup-iters 10 \
        --log-interval 50 --eval-interval 200 --eval-iters 2 \
        --save "$OUT/$name" "$@"
}
FIRST=()
[ -f "$OUT/cpt_32k/latest_checkpointed_iteration.txt" ] && FIRST=(--load "$OUT/cpt_32k" --finetune)
sft agent_sft_pass1 ${SFT_ITERS_1:-300} 2e-3 2e-4 "${FIRST[@]}"
sft agent_sft_model ${SFT_ITERS_2:-800} 3e-3 3e-4 --load "$OUT/agent_sft_pass1" --finetune

$PY train_rl.py \
    --env agentic-coding --task-families write-file \
    --load "$OUT/agent_sft_model" \
    --save "$OUT/agentic_rl${SEED:+_seed$SEED}" \
    --seed "$SEED" \
    --tokenizer-model "$TOKENIZER" --data-cache-dir "$CACHE" \
    --model-preset tiny --seq-length 512 --rl-micro-batch-tokens 4096 \
    --train-iters ${RL_ITERS:-30} \
    --prompts-per-step 8 --group-size 8 --max-new-tokens 64 --max-turns 3 --temperature 1.0 \
    --lr ${RL_LR:-5e-4} --min-lr ${RL_LR:-5e-4} --lr-warmup-iters 0 \
    --reward correctness=1.0,all_pass=1.0,tool_misuse=0.1 \
    --eval-tasks ${EVAL_TASKS:-96} \
    --log-interval 1 \
    --tensorboard-dir "$OUT/tensorboard_agentic_rl" \
    "$@"
