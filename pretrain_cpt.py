#!/usr/bin/env python
"""Composer continued pretraining, long-context extension and SFT.

    python pretrain_cpt.py --stage cpt-32k --model-preset tiny --train-iters 30 --save ckpt
    torchrun --nproc-per-node 8 pretrain_cpt.py --stage cpt-256k --context-parallel-size 2 ...

See `python pretrain_cpt.py --help` and the README for every flag.
"""
import sys

from megatron_composer.training.pretrain import pretrain
from megatron_composer.training.entry import run_entry


def main(argv=None) -> int:
    """Run; a configuration, data or checkpoint problem prints one line and exits 2 (1 for a run
    stopped by its guards), without a traceback."""
    return run_entry("pretrain_cpt.py", pretrain, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
