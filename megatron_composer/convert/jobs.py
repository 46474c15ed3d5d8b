"""Conversion at scale: independent jobs, run in parallel, resumable after a kill.

A 1T-parameter checkpoint is ~600 GB in and ~2 TB out; one process reading
it tensor by tensor takes hours, and a kill near the end must not cost them
again. So both directions split the work into jobs that share nothing:

* hf -> mcore: one job per input safetensors shard, writing the megatron
  tensors whose first HF part lies in that shard as a DCP "part"
  (`dcp_io.save_lazily`, files of at most `max_file_bytes`); `merge_parts`
  then joins the parts' metadata into one checkpoint;
* mcore -> hf: one job per output shard.

A job holds one input shard's tensors (read one at a time) and one output
file, so memory is about `workers x max_file_bytes`. `run_jobs` runs them in
`workers` spawned processes (fork is unsafe once torch's OpenMP pool has
run) with a byte-counting progress bar.

`ResumableOutput` is the output directory while it is built: `SAVE.partial/`
holding the finished files plus `.convert/` (the plan's fingerprint, one
marker per finished job, a lock). A rerun of the same command with the same
inputs skips the finished jobs; a different plan starts over. Only a
complete output is renamed to SAVE, so SAVE never holds a partial
conversion.
"""
from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import pickle
import queue
import shutil
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from .config import ConversionError

WORK = ".convert"
PARTIAL_SUFFIX = ".partial"
_progress: Optional[object] = None  # a worker's queue of byte counts for the parent's bar


def _log(msg: str) -> None:
    print(f"[convert] {msg}", file=sys.stderr, flush=True)


def file_fingerprint(paths: Sequence[str]) -> dict:
    """name -> [size, mtime_ns] of each file: a changed input invalidates a partial output."""
    out = {}
    for path in paths:
        st = os.stat(path)
        out[os.path.basename(path)] = [st.st_size, st.st_mtime_ns]
    return out


class ResumableOutput:
    """SAVE.partial/ while a conversion builds it; see the module docstring.

    Args:
        final: the output directory (SAVE).
        plan: everything that determines the output (inputs' fingerprints, options); a
            partial output of another plan is discarded.
        overwrite: replace an existing non-empty SAVE at the end.
    """

    def __init__(self, final: str, plan: dict, overwrite: bool):
        self.final = os.path.abspath(final)
        self.path = self.final + PARTIAL_SUFFIX
        self.plan = json.loads(json.dumps(plan, default=str))
        self.overwrite = overwrite
        self._lock = None

    @property
    def work(self) -> str:
        return os.path.join(self.path, WORK)

    def __enter__(self) -> "ResumableOutput":
        if os.path.exists(self.final) and (not os.path.isdir(self.final) or os.listdir(self.final)) \
                and not self.overwrite:
            raise ConversionError(f"--save {self.final} exists and is not empty; choose a new directory "
                                  "or pass --overwrite")
        os.makedirs(self.work, exist_ok=True)
        self._lock = open(os.path.join(self.work, "lock"), "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConversionError(f"another conversion is writing {self.path}; wait for it or stop it") from None
        plan_file = os.path.join(self.work, "plan.json")
        if os.path.exists(plan_file):
            with open(plan_file) as f:
                previous = json.load(f)
            if previous == self.plan:
                _log(f"resuming {self.path}: {len(self.finished())} job(s) already done")
                return self
            _log(f"{self.path} holds a conversion of other inputs or options; starting over")
            for name in os.listdir(self.path):
                if name != WORK:
                    _remove(os.path.join(self.path, name))
            for name in os.listdir(self.work):
                if name != "lock":
                    _remove(os.path.join(self.work, name))
        with open(plan_file + ".tmp", "w") as f:
            json.dump(self.plan, f, indent=1, sort_keys=True)
        os.replace(plan_file + ".tmp", plan_file)
        os.makedirs(os.path.join(self.work, "done"), exist_ok=True)
        return self

    def __exit__(self, kind, exc, tb):
        if self._lock is not None:
            self._lock.close()
        if kind is not None:
            _log(f"stopped ({kind.__name__}); finished jobs are kept in {self.path}: rerun the same "
                 "command to resume")

    def finished(self) -> dict[str, object]:
        """job name -> its recorded result, for the jobs already done."""
        done = os.path.join(self.work, "done")
        out = {}
        for name in os.listdir(done) if os.path.isdir(done) else ():
            if name.endswith(".json"):
                with open(os.path.join(done, name)) as f:
                    out[name[:-5]] = json.load(f)
        return out

    def mark_done(self, job: str, result) -> None:
        path = os.path.join(self.work, "done", f"{job}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def publish(self) -> None:
        """Drop the bookkeeping and rename the finished output to SAVE."""
        self._lock.close()
        self._lock = None
        shutil.rmtree(self.work)
        if os.path.exists(self.final):
            old = f"{self.final}.old-{os.getpid()}"
            os.replace(self.final, old)
            os.replace(self.path, self.final)
            shutil.rmtree(old)
        else:
            os.replace(self.path, self.final)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def report_bytes(nbytes: int) -> None:
    """Progress from inside a job (a worker process or the parent)."""
    if _progress is not None:
        _progress.put(nbytes)


def _init_worker(progress, threads: int) -> None:
    global _progress
    _progress = progress
    torch.set_num_threads(threads)


def run_jobs(jobs: dict[str, tuple], fn: Callable, out: ResumableOutput, workers: int, bar) -> dict:
    """Run `fn(*args)` for every job not finished yet; record and return every job's result.

    Args:
        jobs: name -> args (picklable: they travel to spawned workers).
        fn: a module-level function; it calls `report_bytes` as it goes.
        bar: a tqdm bar counting bytes.
    """
    global _progress
    results = out.finished()
    todo = [name for name in jobs if name not in results]
    for name in results:
        if name in jobs and isinstance(results[name], dict):
            bar.update(results[name].get("bytes", 0))
    if not todo:
        return results
    if workers <= 1:
        _progress = _Direct(bar)
        try:
            for name in todo:
                results[name] = fn(*jobs[name])
                out.mark_done(name, results[name])
        finally:
            _progress = None
        return results
    context = multiprocessing.get_context("spawn")
    progress = context.Queue()
    threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                             initargs=(progress, threads)) as pool:
        pending = {pool.submit(fn, *jobs[name]): name for name in todo}
        while pending:
            finished, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            _drain(progress, bar)
            for future in finished:
                name = pending.pop(future)
                results[name] = future.result()  # a worker's exception stops the run here
                out.mark_done(name, results[name])
        _drain(progress, bar)
    return results


class _Direct:
    """The progress feed of jobs run in this process: straight into the bar."""

    def __init__(self, bar):
        self.put = bar.update


def _drain(source, bar) -> None:
    while True:
        try:
            bar.update(source.get_nowait())
        except (queue.Empty, EOFError, OSError):
            return


def merge_parts(parts: Sequence[str], it_dir: str) -> None:
    """Join DCP checkpoints `parts` (directories, disjoint tensors) into one at `it_dir`.

    Each part's data files move to `it_dir` as `__{p}_{k}.distcp` (part p, file k)
    and the union of the parts' metadata, pointing at the new names, becomes
    `it_dir/.metadata`. Idempotent: a merge cut short is finished by a rerun (the
    parts' `.metadata` files stay where they are until the bookkeeping goes).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    os.makedirs(it_dir, exist_ok=True)
    merged: Optional[Metadata] = None
    for p, part in enumerate(parts):
        with open(os.path.join(part, ".metadata"), "rb") as f:
            md: Metadata = pickle.load(f)
        renamed = {}
        for name in sorted({info.relative_path for info in md.storage_data.values()}):
            new = f"__{p}_{name.rsplit('_', 1)[-1]}" if name.startswith("__") else f"__{p}_{name}"
            renamed[name] = new
            if os.path.exists(os.path.join(part, name)):
                os.replace(os.path.join(part, name), os.path.join(it_dir, new))
            elif not os.path.exists(os.path.join(it_dir, new)):
                raise ConversionError(f"{part}/{name} is missing and was not moved to {it_dir}; remove "
                                      f"{os.path.dirname(os.path.dirname(part))} and convert again")
        storage = {index: replace(info, relative_path=renamed[info.relative_path])
                   for index, info in md.storage_data.items()}
        overlap = merged is not None and set(md.state_dict_metadata) & set(merged.state_dict_metadata)
        if overlap:
            raise ConversionError(f"internal: DCP parts both hold {sorted(overlap)[:3]}")
        if merged is None:
            merged = Metadata(state_dict_metadata=dict(md.state_dict_metadata),
                              planner_data=dict(md.planner_data or {}), storage_data=storage,
                              storage_meta=None, version=md.version)
        else:
            merged.state_dict_metadata.update(md.state_dict_metadata)
            merged.planner_data.update(md.planner_data or {})
            merged.storage_data.update(storage)
    if merged is None:
        raise ConversionError("internal: no DCP part to merge")
    tmp = os.path.join(it_dir, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(merged, f)
    os.replace(tmp, os.path.join(it_dir, ".metadata"))
