#!/usr/bin/env python
"""The RL stage of the Composer recipe, synchronous, on the shared training loop.

    python train_rl.py --load runs/tiny/sft --save runs/tiny/rl --train-iters 40 --group-size 8
    torchrun --nproc-per-node 2 train_rl.py --load ... --save ...

See `python train_rl.py --help`, `megatron_composer/rl/trainer.py` and the README's RL section.
"""
import sys

from megatron_composer.rl.train import train_rl
from megatron_composer.training.entry import run_entry


def main(argv=None) -> int:
    """Run; a configuration, data or checkpoint problem prints one line and exits 2 (1 for a run
    stopped by its guards), without a traceback."""
    return run_entry("train_rl.py", train_rl, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
