#!/usr/bin/env python
"""Composer continued pretraining, long-context extension and SFT.

    python pretrain_cpt.py --stage cpt-32k --model-preset tiny --train-iters 30 --save ckpt
    torchrun --nproc-per-node 8 pretrain_cpt.py --stage cpt-256k --context-parallel-size 2 ...

See `python pretrain_cpt.py --help` and the README for every flag.
"""
import sys

from megatron_composer.platform.distributed import destroy_distributed
from megatron_composer.training.pretrain import pretrain


def main(argv=None) -> int:
    """Run; a configuration, data or checkpoint problem prints one line and exits 2 (1 for a run
    stopped by its guards), without a traceback."""
    from megatron_composer.checkpoint import CheckpointError
    from megatron_composer.optim.builder import NonFiniteParametersError
    from megatron_composer.training.trainer import TrainingAborted

    try:
        pretrain(argv)
    except (ValueError, CheckpointError) as exc:
        print(f"pretrain_cpt.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (TrainingAborted, NonFiniteParametersError) as exc:
        print(f"pretrain_cpt.py: stopped: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
