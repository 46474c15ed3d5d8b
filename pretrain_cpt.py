#!/usr/bin/env python
"""Composer continued pretraining, long-context extension and SFT.

    python pretrain_cpt.py --stage cpt-32k --model-preset tiny --train-iters 30 --save ckpt
    torchrun --nproc-per-node 8 pretrain_cpt.py --stage cpt-256k --context-parallel-size 2 ...

See `python pretrain_cpt.py --help` and the README for every flag.
"""
import sys

from megatron_composer.platform.distributed import destroy_distributed
from megatron_composer.training.pretrain import pretrain


def main(argv=None):
    try:
        pretrain(argv)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
