"""Run a function on N gloo ranks from a test (real process groups, no fakes).

    def _body(rank, world_size, x):      # module-level, so it pickles
        ...
        return value                     # anything torch.save can write

    results = run_distributed(_body, 2, x)   # list indexed by rank

A failure on any rank re-raises in the test with that rank's traceback. A
rank that deadlocks (a collective its peers never join) cannot hang the test
run: after `timeout` seconds every rank still running is killed and a
RuntimeError names the limit and those ranks. The process group gets the same
timeout, so a blocked gloo collective aborts on its own too.

Ranks are forked from a forkserver that imported torch and megatron-core once
(`PRELOAD`), instead of each rank importing them again (about 5 s a rank on
2 cores). A rank starts with the caller's environment as it is at the call.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "MC_DIST_TEST_TIMEOUT"
# imported once by the forkserver; every rank is a fork of it (an import that fails is skipped there)
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron_composer.training.trainer"]
multiprocessing.set_forkserver_preload(PRELOAD)


def resolve_timeout(timeout: float | None) -> float:
    """Seconds a `run_distributed` call may take: `timeout` if given, else
    $MC_DIST_TEST_TIMEOUT if set (a slow machine raises every call's limit at
    once), else DEFAULT_TIMEOUT_S."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None or raw == "":
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. 300") from None
    if not timeout > 0:
        raise ValueError(f"run_distributed timeout {timeout} must be a positive number of seconds, e.g. 120")
    return float(timeout)


def _worker(rank, world_size, outdir, timeout_s, environ, fn, args, kwargs):
    os.environ.clear()
    os.environ.update(environ)  # the forkserver's environment is the one it started with
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
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args, **kwargs)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join_until(ctx, deadline: float) -> list[int]:
    """Join the spawned ranks until they all exit (returns []) or `deadline`
    (time.monotonic) passes; then kill the ranks still running and return them.
    A rank that fails makes `ctx.join` kill the others and raise."""
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            alive = [rank for rank, proc in enumerate(ctx.processes) if proc.is_alive()]
            for rank in alive:
                ctx.processes[rank].kill()
            for rank in alive:
                ctx.processes[rank].join()
            return alive
    return []


def run_distributed(fn, world_size: int, *args, timeout: float | None = None, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` spawned gloo ranks.

    Args:
        fn: a module-level function (it is pickled into each rank).
        world_size: number of ranks.
        *args, **kwargs: passed to fn (a keyword named `timeout` is taken by
            this function; pass such a value positionally).
        timeout: seconds for the whole call, rank start-up included (see
            `resolve_timeout`; default 120, or $MC_DIST_TEST_TIMEOUT); also the
            process group's collective timeout.
    Returns:
        list of fn's return values, indexed by rank.
    Raises:
        RuntimeError: a rank failed (with its traceback) or the call ran past
            `timeout` (naming the ranks that had not finished, which are killed).
    """
    timeout_s = resolve_timeout(timeout)
    with tempfile.TemporaryDirectory() as outdir:
        deadline = time.monotonic() + timeout_s
        ctx = mp.start_processes(
            _worker,
            args=(world_size, outdir, timeout_s, dict(os.environ), fn, args, kwargs),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        errors, unfinished = [], []
        try:
            unfinished = _join_until(ctx, deadline)
        except Exception as exc:  # a rank died; collect every rank's report
            errors.append(str(exc))
        if unfinished:
            errors.insert(0, (
                f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) timed out after "
                f"{timeout_s:g} s: ranks {unfinished} had not finished and were killed; find the collective "
                f"they wait in, or raise the limit with timeout= or {TIMEOUT_ENV}=<seconds>"
            ))
        results = []
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pt")
            if not os.path.exists(path):
                if rank not in unfinished:
                    errors.append(f"rank {rank} wrote no result")
                continue
            try:
                report = torch.load(path, weights_only=False)
            except Exception:  # noqa: BLE001 - a rank killed while writing its report
                if rank not in unfinished:
                    raise
                continue
            if not report["ok"]:
                errors.append(f"rank {rank} failed:\n{report['error']}")
            results.append(report.get("result"))
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
