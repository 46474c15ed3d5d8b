#!/usr/bin/env bash
# Stage 3 at tiny scale: SFT on chat-formatted coding tasks, loss on
# assistant tokens only. Data: synthetic conversations built from the stdlib
# (complete a function from its signature and docstring, ...). Starts from
# the cpt-32k checkpoint when it exists (weights only: --finetune).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/tiny}
LOAD=()
[ -f "$OUT/cpt_32k/latest_checkpointed_iteration.txt" ] && LOAD=(--load "$OUT/cpt_32k" --finetune)

$PY pretrain_cpt.py \
    --stage sft \
    --model-preset tiny \
    --micro-batch-size 4 \
    --train-iters ${TRAIN_ITERS:-20} \
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 \
    --log-interval 5 \
    --save "$OUT/sft" \
    "${LOAD[@]}" "$@"
