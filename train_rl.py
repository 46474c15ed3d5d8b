#!/usr/bin/env python
"""The RL stage of the Composer recipe, synchronous, on the shared training loop.

    python train_rl.py --load runs/tiny/sft --save runs/tiny/rl --train-iters 40 --group-size 8
    torchrun --nproc-per-node 2 train_rl.py --load ... --save ...

See `python train_rl.py --help`, `megatron_composer/rl/trainer.py` and the README's RL section.
"""
import sys

from megatron_composer.platform.distributed import destroy_distributed
from megatron_composer.rl.train import train_rl


def main(argv=None) -> int:
    """Run; a configuration, data or checkpoint problem prints one line and exits 2 (1 for a run
    stopped by its guards), without a traceback."""
    from megatron_composer.checkpoint import CheckpointError
    from megatron_composer.optim.builder import NonFiniteParametersError
    from megatron_composer.training.trainer import TrainingAborted

    try:
        train_rl(argv)
    except (ValueError, CheckpointError) as exc:
        print(f"train_rl.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (TrainingAborted, NonFiniteParametersError) as exc:
        print(f"train_rl.py: stopped: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
