#!/usr/bin/env bash
# The whole Composer recipe at tiny scale on the embedded data (`make demo`), about 10 minutes on 2 CPU cores:
#
#   1. CPT at the 32K stage (tiny: 512 tokens) on the embedded standard-library code corpus
#   2. the 256K stage (tiny: 4096 tokens) with context parallelism 2 on 2 gloo ranks
#   3. MTP self-distillation: the MTP layer trained toward the main head on the frozen trunk
#   4. SFT on scripted expert agent trajectories (write-file tasks, run through the real tools)
#   5. asynchronous agentic RL on Ray: trainer, inference, environment and evaluation services,
#      weights pushed in flight as compressed deltas, sandboxed episodes verified by tests
#   6. the report: $OUT/report.md with loss, reward and MTP-acceptance plots and a summary table
#
# Every stage loads the previous one's checkpoint; each log is in $OUT/logs. Lengths: CPT_ITERS,
# LONG_ITERS, MTP_ITERS, SFT_TASKS, SFT_ITERS, RL_ITERS. A stage whose checkpoint exists is skipped
# (delete $OUT to start over).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/demo}
CACHE=${DATA_CACHE_DIR:-data}
if ! command -v bwrap >/dev/null 2>&1; then
    echo "recipe.sh: the agent's sandbox needs bubblewrap; install it (apt-get install -y bubblewrap) and rerun" >&2
    exit 2
fi
mkdir -p "$OUT/logs"
started=$(date +%s)

stage() {  # stage NAME: say what runs, time it; skipped when NAME's checkpoint exists
    local name=$1
    if [ -f "$OUT/$name/latest_checkpointed_iteration.txt" ]; then
        echo "== $name: done already ($OUT/$name)"
        return 1
    fi
    echo "== $name ($(( $(date +%s) - started )) s into the recipe)"
}

if stage cpt_32k; then
    $PY pretrain_cpt.py --stage cpt-32k --model-preset tiny --data-cache-dir "$CACHE" \
        --micro-batch-size 4 --global-batch-size 8 --train-iters ${CPT_ITERS:-40} \
        --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --log-interval 5 --eval-interval 20 --eval-iters 2 \
        --save "$OUT/cpt_32k" --save-interval ${CPT_ITERS:-40} --tensorboard-dir "$OUT/tensorboard/cpt_32k" \
        2>&1 | tee "$OUT/logs/cpt_32k.log"
fi
TOKENIZER=$CACHE/tokenizer.model

if stage cpt_256k; then
    $PY -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_cpt.py \
        --stage cpt-256k --model-preset tiny --data-cache-dir "$CACHE" \
        --context-parallel-size 2 --expert-model-parallel-size 2 \
        --micro-batch-size 1 --global-batch-size 1 --train-iters ${LONG_ITERS:-4} \
        --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 --log-interval 1 \
        --load "$OUT/cpt_32k" --save "$OUT/cpt_256k" 2>&1 | tee "$OUT/logs/cpt_256k.log"
fi

if stage mtp; then
    $PY pretrain_cpt.py --stage cpt-32k --model-preset tiny --data-cache-dir "$CACHE" \
        --load "$OUT/cpt_256k" --finetune --mtp-freeze-trunk --mtp-loss self-distill \
        --micro-batch-size 4 --global-batch-size 8 --train-iters ${MTP_ITERS:-10} \
        --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 --log-interval 5 \
        --save "$OUT/mtp" 2>&1 | tee "$OUT/logs/mtp.log"
fi

if stage sft; then
    if [ ! -f "$OUT/agent_sft/train.jsonl" ]; then
        $PY -m megatron_composer.rl.sft_trajectories --families write-file --count ${SFT_TASKS:-200} \
            --workers 16 --output "$OUT/agent_sft/train.jsonl"
        $PY -m megatron_composer.rl.sft_trajectories --families write-file --split eval --count 16 \
            --workers 16 --output "$OUT/agent_sft/valid.jsonl"
    fi
    $PY pretrain_cpt.py --stage sft --model-preset tiny --data-cache-dir "$CACHE" \
        --data-path "$OUT/agent_sft/train.jsonl" --valid-data-path "$OUT/agent_sft/valid.jsonl" \
        --tokenizer-model "$TOKENIZER" --seq-length 512 --micro-batch-size 4 \
        --train-iters ${SFT_ITERS:-120} --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 \
        --log-interval 10 --eval-interval ${SFT_ITERS:-120} --eval-iters 1 \
        --load "$OUT/mtp" --finetune --save "$OUT/sft" 2>&1 | tee "$OUT/logs/sft.log"
fi

if stage rl; then
    $PY train_rl.py --async-rl --env agentic-coding --task-families write-file \
        --load "$OUT/sft" --save "$OUT/rl" --save-interval 5 \
        --tokenizer-model "$TOKENIZER" --data-cache-dir "$CACHE" \
        --model-preset tiny --seq-length 512 --rl-micro-batch-tokens 4096 \
        --train-iters ${RL_ITERS:-12} --prompts-per-step 4 --group-size 4 \
        --max-new-tokens 48 --max-turns 2 --episode-workers 16 \
        --max-inflight-groups 8 --max-policy-lag 2 \
        --lr ${RL_LR:-5e-4} --min-lr ${RL_LR:-5e-4} --lr-warmup-iters 0 \
        --reward correctness=1.0,tool_misuse=0.2 \
        --eval-tasks 4 --eval-interval 6 --log-interval 1 \
        --tensorboard-dir "$OUT/tensorboard/rl" 2>&1 | tee "$OUT/logs/rl.log"
fi

$PY tools/recipe_report.py --run-dir "$OUT" --seconds $(( $(date +%s) - started ))
