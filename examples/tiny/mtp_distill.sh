#!/usr/bin/env bash
# The MTP head trained on a frozen trunk: the cpt-32k checkpoint's trunk stays
# fixed (--mtp-freeze-trunk) and only the MTP layer learns, either by
# self-distillation toward the main head (Composer) or by cross-entropy on
# the token two ahead (DeepSeek-V3). Both start from the same weights
# (--finetune: weights only, fresh optimizer and iteration count), so
# benchmarks/mtp_decode.py compares the two objectives on one trunk.
#
#     bash examples/tiny/mtp_distill.sh self-distill    # -> runs/tiny/mtp_self-distill
#     bash examples/tiny/mtp_distill.sh ce              # -> runs/tiny/mtp_ce
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/tiny}
KIND=${1:?usage: mtp_distill.sh self-distill|ce [pretrain_cpt.py flags...]}
shift
case "$KIND" in
    self-distill|ce) ;;
    *) echo "mtp_distill.sh: loss kind '$KIND'; use self-distill or ce" >&2; exit 2 ;;
esac
if [ ! -f "$OUT/cpt_32k/latest_checkpointed_iteration.txt" ]; then
    echo "mtp_distill.sh: no trunk at $OUT/cpt_32k; run examples/tiny/cpt_32k.sh (make demo-cpt) first" >&2
    exit 2
fi

$PY pretrain_cpt.py \
    --stage cpt-32k \
    --model-preset tiny \
    --load "$OUT/cpt_32k" --finetune \
    --mtp-freeze-trunk --mtp-loss "$KIND" \
    --micro-batch-size 4 \
    --global-batch-size 8 \
    --train-iters ${TRAIN_ITERS:-150} \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 \
    --log-interval 10 \
    --save "$OUT/mtp_$KIND" --save-interval ${TRAIN_ITERS:-150} \
    "$@"
