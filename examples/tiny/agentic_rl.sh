#!/usr/bin/env bash
# Agentic RL at tiny scale: scripted expert trajectories -> SFT -> RL in the sandboxed coding environment.
#
# 1. SFT data: expert trajectories of every write-file training task (3306) through the real tools
#    (python -m megatron_composer.rl.sft_trajectories), plus 38 set-constant / fix-bug ones.
# 2. SFT in three passes (from the cpt-32k checkpoint when it exists): the tool format is learned in the
#    first, copying the file name and content from the instruction emerges in the second and is
#    finished in the third (all tasks; about 90% of held-out write-file tasks solved).
# 3. RL (train_rl.py --env agentic-coding) on write-file tasks: multi-turn episodes in bubblewrap
#    sandboxes, verified by the tasks' pristine tests; the held-out solved fraction (greedy, 192 tasks)
#    is measured before the first step, every 15 steps and at the end. Writes
#    $OUT/agentic_rl_seed$SEED/reward_curve.png.
# About 70 minutes on a 2-core CPU (trajectories ~8, SFT ~40, RL ~20). SEED=... varies the RL run;
# SFT_ITERS_1/2/3 and RL_ITERS the lengths (RL_ITERS=0 stops after SFT). The steps already done (data, SFT checkpoints) are skipped.
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

if [ ! -f "$DATA/all.jsonl" ]; then
    $PY -m megatron_composer.rl.sft_trajectories --families write-file --workers 16 \
        --output "$DATA/write_file.jsonl"
    $PY -m megatron_composer.rl.sft_trajectories --families set-constant,fix-bug --count 19 \
        --output "$DATA/other.jsonl"
    $PY -m megatron_composer.rl.sft_trajectories --families write-file --split eval --count 32 \
        --output "$DATA/valid.jsonl"
    # passes 1 and 2 see the first 1200 write-file tasks (files are in task order), pass 3 all of them
    head -n 1200 "$DATA/write_file.jsonl" | cat - "$DATA/other.jsonl" > "$DATA/train.jsonl"
    cat "$DATA/write_file.jsonl" "$DATA/other.jsonl" > "$DATA/all.jsonl.tmp" && mv "$DATA/all.jsonl.tmp" "$DATA/all.jsonl"
fi

# SFT in three passes, each restarting the schedule (about 1 s per step on 2 cores).
sft() {  # sft NAME DATA ITERS LR MIN_LR LOAD...
    local name=$1 data=$2 iters=$3 lr=$4 min_lr=$5
    shift 5
    [ -f "$OUT/$name/latest_checkpointed_iteration.txt" ] && return 0
    $PY pretrain_cpt.py \
        --stage sft --model-preset tiny \
        --data-path "$data" --valid-data-path "$DATA/valid.jsonl" \
        --tokenizer-model "$TOKENIZER" --data-cache-dir "$CACHE" \
        --seq-length 512 --micro-batch-size 8 \
        --train-iters "$iters" --lr "$lr" --min-lr "$min_lr" --lr-warmup-iters 10 \
        --log-interval 50 --eval-interval 200 --eval-iters 2 \
        --save "$OUT/$name" "$@"
}
FIRST=()
[ -f "$OUT/cpt_32k/latest_checkpointed_iteration.txt" ] && FIRST=(--load "$OUT/cpt_32k" --finetune)
sft agent_sft_pass1 "$DATA/train.jsonl" ${SFT_ITERS_1:-300} 2e-3 2e-4 "${FIRST[@]}"
sft agent_sft_pass2 "$DATA/train.jsonl" ${SFT_ITERS_2:-800} 3e-3 3e-4 --load "$OUT/agent_sft_pass1" --finetune
sft agent_sft_model "$DATA/all.jsonl" ${SFT_ITERS_3:-1000} 2e-3 2e-4 --load "$OUT/agent_sft_pass2" --finetune

# RL_ITERS=0: stop at the SFT checkpoint (the benchmarks/ scripts start from it)
[ "${RL_ITERS:-30}" = 0 ] && { echo "SFT checkpoint: $OUT/agent_sft_model (RL_ITERS=0: no RL)"; exit 0; }
$PY train_rl.py \
    --env agentic-coding --task-families write-file \
    --load "$OUT/agent_sft_model" \
    --save "$OUT/agentic_rl${SEED:+_seed$SEED}" \
    --seed "$SEED" \
    --tokenizer-model "$TOKENIZER" --data-cache-dir "$CACHE" \
    --model-preset tiny --seq-length 512 --rl-micro-batch-tokens 4096 \
    --train-iters ${RL_ITERS:-30} \
    --prompts-per-step 8 --group-size 8 --max-new-tokens 64 --max-turns 3 --temperature 1.0 \
    --lr ${RL_LR:-3e-4} --min-lr ${RL_LR:-3e-4} --lr-warmup-iters 0 \
    --reward correctness=1.0,all_pass=1.0,tool_misuse=0.1 \
    --eval-tasks ${EVAL_TASKS:-192} --eval-interval 15 \
    --log-interval 1 \
    --tensorboard-dir "$OUT/tensorboard_agentic_rl" \
    "$@"
