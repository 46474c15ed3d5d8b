#!/usr/bin/env bash
# Stage 2 of the recipe at tiny scale: long-context extension "at 256K" (the
# tiny preset divides lengths by 64: 4096 tokens) with context parallelism.
# CP ranks (one process each) hold a zigzag share of every sequence and
# all-gather the MLA KV latents per layer; EP is folded into the same ranks.
# Starts from the cpt-32k checkpoint when it exists: a new stage loads the
# weights only (fresh optimizer, iteration 0), like --finetune.
#   CP=4 examples/tiny/cpt_256k.sh            # 4 gloo ranks on CPU
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/tiny}
CP=${CP:-2}
EP=${EP:-$CP}
LOAD=()
[ -f "$OUT/cpt_32k/latest_checkpointed_iteration.txt" ] && LOAD=(--load "$OUT/cpt_32k")

$PY -m torch.distributed.run --standalone --nproc-per-node "$CP" pretrain_cpt.py \
    --stage cpt-256k \
    --model-preset tiny \
    --context-parallel-size "$CP" \
    --expert-model-parallel-size "$EP" \
    --micro-batch-size 1 \
    --global-batch-size 2 \
    --train-iters ${TRAIN_ITERS:-10} \
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 \
    --log-interval 1 \
    --save "$OUT/cpt_256k" \
    "${LOAD[@]}" "$@"
