"""Run a function on N gloo ranks from a test (real process groups, no fakes).

    def _body(rank, world_size, x):      # module-level, so it pickles
        ...
        return value                     # anything torch.save can write

    results = run_distributed(_body, 2, x)   # list indexed by rank

A failure on any rank re-raises in the test with that rank's traceback.
"""
from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, outdir, fn, args, kwargs):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        # a file rendezvous: no TCP port to race for with other jobs on the machine
        dist.init_process_group("gloo", init_method=f"file://{outdir}/rendezvous",
                                rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args, **kwargs)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, **kwargs):
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.spawn(
            _worker,
            args=(world_size, outdir, fn, args, kwargs),
            nprocs=world_size,
            join=False,
        )
        errors = []
        try:
            while not ctx.join():
                pass
        except Exception as exc:  # a rank died; collect every rank's report
            errors.append(str(exc))
        results = []
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank} wrote no result")
                continue
            report = torch.load(path, weights_only=False)
            if not report["ok"]:
                errors.append(f"rank {rank} failed:\n{report['error']}")
            results.append(report.get("result"))
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
