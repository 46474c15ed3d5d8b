#!/usr/bin/env bash
# Stage 4 at tiny scale: synchronous RL on the embedded complete-function task
# (write a stdlib function's body from its signature and docstring; a sample
# is correct when the function parses). Starts from the SFT checkpoint
# (examples/tiny/sft.sh), which knows the chat format. Dr.GRPO advantages,
# router replay, k1 KL in the reward against the SFT weights. Writes
# $OUT/rl/reward_curve.png. A few minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/tiny}
[ -f "$OUT/sft/latest_checkpointed_iteration.txt" ] || { echo "run examples/tiny/sft.sh first ($OUT/sft)"; exit 2; }

$PY train_rl.py \
    --load "$OUT/sft" \
    --save "$OUT/rl${SEED:+_seed$SEED}" \
    --seed ${SEED:-1234} \
    --model-preset tiny \
    --train-iters ${TRAIN_ITERS:-40} \
    --prompts-per-step 4 --group-size 8 --max-new-tokens 48 --temperature 1.0 \
    --lr 3e-4 --min-lr 3e-4 --lr-warmup-iters 0 \
    --kl-coef 0.01 --kl-placement reward \
    --reward correctness=1.0 \
    --log-interval 1 \
    --tensorboard-dir "$OUT/tensorboard_rl" \
    "$@"
