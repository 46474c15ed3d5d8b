"""How an entry script runs its job: one line and exit code 2 for a configuration, data or
checkpoint problem, 1 for a run stopped by its guards, never a traceback for either."""
from __future__ import annotations

import sys
from typing import Callable, Optional


def run_entry(prog: str, job: Callable, argv: Optional[list[str]] = None) -> int:
    from ..checkpoint import CheckpointError
    from ..optim.builder import NonFiniteParametersError
    from ..platform.distributed import destroy_distributed
    from .trainer import TrainingAborted

    try:
        job(argv)
    except (ValueError, CheckpointError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (TrainingAborted, NonFiniteParametersError) as exc:
        print(f"{prog}: stopped: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        destroy_distributed()
    return 0
