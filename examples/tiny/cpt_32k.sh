#!/usr/bin/env bash
# Stage 1 of the recipe at tiny scale: continued pretraining "at 32K" on code.
# The tiny preset divides every stage length by 64, so 32K becomes 512.
# Data: the Python standard library of this interpreter, tokenized on first
# use into data/ (a 4096-piece BPE tokenizer + Megatron .bin/.idx files).
# Runs in a few minutes on a 2-core CPU; the lm loss falls from ~8.3 (ln 4096).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/tiny}

$PY pretrain_cpt.py \
    --stage cpt-32k \
    --model-preset tiny \
    --micro-batch-size 4 \
    --global-batch-size 8 \
    --train-iters ${TRAIN_ITERS:-60} \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 \
    --log-interval 5 \
    --eval-interval 30 --eval-iters 2 \
    --save "$OUT/cpt_32k" --save-interval 30 \
    --tensorboard-dir "$OUT/tensorboard" \
    "$@"
