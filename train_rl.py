#!/usr/bin/env python
"""The RL stage of the Composer recipe, synchronous, on the shared training loop.

    python train_rl.py --load runs/tiny/sft --save runs/tiny/rl --train-iters 40 --group-size 8
    torchrun --nproc-per-node 2 train_rl.py --load ... --save ...

See `python train_rl.py --help`, `megatron_composer/rl/trainer.py` and the README's RL section.
"""
import sys

from megatron_composer.rl.async_rl.failures import TrainerDied
from megatron_composer.rl.train import train_rl
from megatron_composer.training.entry import run_entry


def main(argv=None) -> int:
    """Run; a configuration, data or checkpoint problem prints one line and exits 2 (1 for a run
    stopped by its guards), without a traceback. With --async-rl, a dead trainer rank ends the job
    with one line (what died, the last complete checkpoint, the command that resumes) and exit 1."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run_entry("train_rl.py", train_rl, argv)
    except TrainerDied as died:
        print(died.line([sys.executable, sys.argv[0]], argv), file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
