"""Save and load checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, reshardable.

Save of iteration N under ROOT (`save_checkpoint`):
 1. refuse, writing nothing, if a model tensor holds NaN/Inf on any rank;
 2. rank 0 makes ROOT/iter_N.tmp (clearing debris of an earlier attempt);
 3. DCP writes every rank's shards into it (each file fsynced), each rank
    its `rng_rank{r}.pt` (`rng.py`: CPU, CUDA and RNG-tracker states), rank 0
    `meta.json`, and the tokenizer model into ROOT once (`tracker.copy_tokenizer`);
 4. each rank checksums the files it wrote; rank 0 writes the manifest;
 5. rank 0 publishes: fsync the dir; move an existing iter_N (a re-save) to
    iter_N.old; rename iter_N.tmp to iter_N; fsync ROOT; replace the tracker
    (fsynced); remove iter_N.old.
A failure in any step on any rank is gathered, so every rank raises the
same error instead of the others waiting in a collective forever; failures
in 2-5 remove the `.tmp` and raise CheckpointSaveError. The tracker never
names an iteration without a complete copy: during 5 readers fall back to
iter_N.old (`tracker.readable_iteration_dir`).

Load (`load_checkpoint`): tracker -> complete dir -> checksums (ranks
split the files) -> DCP load into this rank's layout -> rng states (a state
saved on another kind of device is noted in meta["rng_note"]). Every
failure is one CheckpointError naming the path and the likely fix; DCP's
own CheckpointException is a BaseException, so it is caught by name.

`tensor_specs` / `load_tensors` read chosen model tensors of one iteration
dir without building a model (conversion, in-flight weight updates).

Start-up helpers for the trainer: `guard_save_dir` (no other run's checkpoint
in --save, `guard.py`), `check_save_dir` (writable, enough free space),
`remove_stale_tmp` (debris of killed saves).
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .guard import check_save_target
from .integrity import (
    MANIFEST,
    checksum_files,
    checksummed_files,
    files_for_rank,
    read_manifest,
    verify_files,
    write_manifest,
)
from .rng import restore_rng_state, rng_state
from .state import (
    first_nonfinite,
    load_model_state_dict,
    load_optimizer_state_dict,
    model_state_dict,
    optimizer_state_dict,
    optimizer_template,
)
from .tracker import (
    DCP_METADATA,
    META,
    OLD_SUFFIX,
    TMP_SUFFIX,
    CheckpointError,
    CheckpointSaveError,
    complete_iterations,
    copy_tokenizer,
    fsync_dir,
    fsync_file,
    iteration_dir,
    latest_iteration,
    locate_checkpoint,
    read_meta,
    remove_stale_local,
    restore_or_drop_old,
    tracked_iteration_dir,
    write_file_atomic,
    write_tracker,
)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _agreed(step: Callable[[], object], rank0_only: bool = False) -> list:
    """Run `step` on every rank (or rank 0) and gather the outcome: raises the first
    failure as CheckpointError on every rank, else returns each rank's result."""
    result, error = None, None
    if not rank0_only or _rank() == 0:
        try:
            result = step()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = _describe(exc)
    outcomes = [(error, result)]
    if _world() > 1:
        outcomes = [None] * _world()
        dist.all_gather_object(outcomes, (error, result))
    for rank, (err, _) in enumerate(outcomes):
        if err is not None:
            raise CheckpointError(err if _world() == 1 else f"rank {rank}: {err}")
    return [r for _, r in outcomes]


@contextmanager
def _single_process_quiet():
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
        yield


def _dcp_reason(exc: BaseException) -> str:
    """The useful lines of a DCP failure: each distinct inner error, with its ranks."""
    if not isinstance(exc, CheckpointException):
        return _describe(exc)
    by_text: dict[str, list[int]] = {}
    for rank, failure in sorted(exc.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        by_text.setdefault(_describe(inner), []).append(rank)
    if len(by_text) == 1 and _world() == 1:
        return next(iter(by_text))
    return "; ".join(f"rank {','.join(map(str, ranks))}: {text}" for text, ranks in by_text.items())


# ---------------------------------------------------------------- save
def _previous(root: str) -> str:
    try:
        it = latest_iteration(root)
    except CheckpointError:
        it = None
    return iteration_dir(root, it) if it is not None else "no earlier checkpoint"


def _fresh_dir(root: str, tmp: str) -> None:
    os.makedirs(root, exist_ok=True)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)


def _write_rng(tmp: str) -> None:
    path = os.path.join(tmp, f"rng_rank{_rank()}.pt")
    torch.save(rng_state(), path)
    fsync_file(path)


def _write_meta(tmp: str, meta: dict, iteration: int, has_optimizer: bool) -> None:
    meta = dict(meta, iteration=iteration, has_optimizer=has_optimizer)
    text = json.dumps(meta, indent=2, sort_keys=True, default=str)
    write_file_atomic(os.path.join(tmp, META), text.encode())


def _write_extra(tmp: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        if os.path.basename(name) != name or name in (META, MANIFEST) or name.startswith(("__", "rng_rank", ".")):
            raise CheckpointError(f"extra checkpoint file name {name!r} is not a plain name of its own")
        write_file_atomic(os.path.join(tmp, name), data)


def read_extra_file(load_dir: str, name: str, iteration: Optional[int] = None) -> Optional[bytes]:
    """The bytes of an `extra_files` entry of a checkpoint (a root: its tracked iteration, or an
    iter_XXXXXXX dir), None when absent."""
    path = os.path.join(locate_checkpoint(load_dir, iteration).dir, name)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def _own_files(tmp: str, rank: int) -> list[str]:
    """Files this rank wrote: its DCP shards (`__{rank}_*`) and rng file."""
    mine = (f"__{rank}_", f"rng_rank{rank}.pt")
    return [n for n in checksummed_files(tmp) if n.startswith(mine[0]) or n == mine[1]]


def _write_checksums(tmp: str) -> None:
    """Each rank hashes what it wrote (still in its page cache); rank 0 the rest, then the manifest."""
    entries: dict[str, dict] = {}
    for part in _agreed(lambda: checksum_files(tmp, _own_files(tmp, _rank()))):
        entries.update(part)

    def finish():
        rest = [n for n in checksummed_files(tmp) if n not in entries]
        entries.update(checksum_files(tmp, rest))
        write_manifest(tmp, entries)

    _agreed(finish, rank0_only=True)


def _publish(root: str, iteration: int, tmp: str) -> None:
    """Rank 0: move the finished `tmp` into place and point the tracker at it (steps in module doc)."""
    final = iteration_dir(root, iteration)
    old = final + OLD_SUFFIX
    fsync_dir(tmp)
    restore_or_drop_old(root, iteration)  # an earlier re-save of N that was killed half-way
    if os.path.exists(final):
        os.rename(final, old)
        fsync_dir(root)
    os.rename(tmp, final)
    fsync_dir(root)
    write_tracker(root, iteration)
    if os.path.exists(old):
        shutil.rmtree(old)


def _refuse_nonfinite(model_state: dict, root: str, iteration: int) -> None:
    def check():
        name = first_nonfinite(model_state)
        if name is not None:
            raise CheckpointError(
                f"refusing to save iteration {iteration} to {root}: model tensor {name} holds NaN or Inf. "
                f"Nothing was written; {_previous(root)} stays the latest. Resume from it, e.g. with a "
                "lower --lr or after skipping the data that diverged")
    _agreed(check)


def save_checkpoint(root: str, iteration: int, model, optimizer, meta: dict,
                    extra_files: Optional[dict[str, bytes]] = None, tokenizer_model: Optional[str] = None) -> str:
    """Write a checkpoint for `iteration` and then mark it latest (collective). Returns its dir.

    `extra_files` ({file name: bytes}, rank 0's): written into the iteration directory before it is
    checksummed and published, so they exist exactly when the checkpoint does (RL: the buffer of
    completed groups). `tokenizer_model`: the tokenizer's model file, copied to ROOT/tokenizer.model
    before the first iteration that needs it is published (`tracker.checkpoint_tokenizer` finds it).

    Raises CheckpointError (nothing written) when a model tensor is not
    finite, CheckpointSaveError when writing fails (the previous checkpoint
    is kept and the partial `.tmp` removed).
    """
    tmp = iteration_dir(root, iteration) + TMP_SUFFIX
    model_state = model_state_dict(model)
    _refuse_nonfinite(model_state, root, iteration)
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer_state_dict(model, optimizer)
    try:
        _agreed(lambda: _fresh_dir(root, tmp), rank0_only=True)
        try:
            with _single_process_quiet():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        except (Exception, CheckpointException) as exc:  # DCP has told every rank already
            raise CheckpointError(_dcp_reason(exc)) from None
        _agreed(lambda: _write_rng(tmp))
        _agreed(lambda: _write_meta(tmp, meta, iteration, optimizer is not None), rank0_only=True)
        _agreed(lambda: _write_extra(tmp, extra_files or {}), rank0_only=True)
        if tokenizer_model:
            _agreed(lambda: copy_tokenizer(root, tokenizer_model), rank0_only=True)
        _write_checksums(tmp)
        _agreed(lambda: _publish(root, iteration, tmp), rank0_only=True)
    except CheckpointError as exc:
        _agreed(lambda: shutil.rmtree(tmp, ignore_errors=True), rank0_only=True)
        raise CheckpointSaveError(
            f"could not save iteration {iteration} to {tmp}: {exc}. {_previous(root)} is kept as the latest "
            f"checkpoint; free space or fix permissions under {root}, or save elsewhere with --save"
        ) from None
    return iteration_dir(root, iteration)


# ---------------------------------------------------------------- load
def _verify(path: str) -> None:
    def step():
        manifest = read_manifest(path)
        if manifest is None:
            if _rank() == 0:
                warnings.warn(f"{path} has no {MANIFEST} (written before checksums); loading it unverified")
            return
        verify_files(path, manifest, files_for_rank(sorted(manifest), _rank(), _world()))
    _agreed(step)


def _load_fix(root: str, iteration: int, reason: str) -> str:
    lowered = reason.lower()
    if "size mismatch" in lowered or "missing key" in lowered:
        return ("the model built from the current flags differs from the saved one (its architecture is "
                "model_config in meta.json); launch with matching model flags")
    others = [i for i in complete_iterations(root) if i != iteration]
    earlier = (f"resume from another complete iteration ({others}) by writing its number into the tracker"
               if others else "no other complete iteration is left to resume from")
    return f"the checkpoint is damaged or incomplete; restore it from a copy, or {earlier}"


def _dcp_load(root: str, iteration: int, path: str, state: dict) -> None:
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises anything from any rank
        reason = _dcp_reason(exc)
        fix = _load_fix(root, iteration, reason)
        raise CheckpointError(f"could not read checkpoint {path}: {reason}; {fix}") from None


def _stored_keys(path: str) -> set:
    try:
        return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises anything
        raise CheckpointError(f"cannot read {os.path.join(path, DCP_METADATA)} ({_describe(exc)}); the checkpoint "
                              "is damaged: restore it from a copy or resume from another iteration") from None


def tensor_specs(it_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of the model tensors stored in one iteration dir (no data is read)."""
    try:
        metadata = dcp.FileSystemReader(it_dir).read_metadata()
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises anything
        raise CheckpointError(f"cannot read {os.path.join(it_dir, DCP_METADATA)} ({_describe(exc)}); the "
                              "checkpoint is damaged: restore it from a copy") from None
    prefix = "model."  # save_checkpoint stores {"model": {...}}
    return {key[len(prefix):]: (tuple(md.size), md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)}


def load_tensors(it_dir: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Read the named model tensors (only those; `tensor_specs` says what is there) of one iteration dir."""
    state = {"model": {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=it_dir)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises anything
        raise CheckpointError(f"could not read {len(specs)} tensor(s) from {it_dir}: {_dcp_reason(exc)}; the "
                              "checkpoint is damaged or incomplete: restore it from a copy") from None
    return state["model"]


def _load_rng(path: str) -> Optional[str]:
    """Restore this rank's random state; a note if part of it could not be (`rng.restore_rng_state`)."""
    file = os.path.join(path, f"rng_rank{_rank()}.pt")
    if not os.path.exists(file):
        return None  # more ranks than at save time: the new ranks keep their seeded state
    try:
        saved = torch.load(file, weights_only=True)
        note = restore_rng_state(saved)
        return f"{file}: {note}" if note else None
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything
        raise CheckpointError(
            f"rng file {file} is unreadable ({_describe(exc)}); restore it, or delete it to resume with "
            "freshly seeded random state (then not bit-exact with an uninterrupted run)") from None


def load_checkpoint(root: str, model, optimizer=None, iteration: Optional[int] = None,
                    allow_missing: tuple[str, ...] = (), verify: bool = True) -> dict:
    """Load model (and optimizer) state in place (collective); return the checkpoint's meta.

    `allow_missing`: name prefixes of model tensors that may be absent from
    the checkpoint and keep their fresh initialization (e.g. ("mtp.",) when
    MTP modules are added to a checkpoint trained without them); optimizer
    state is then not loaded (meta["optimizer_skipped"]). `verify`: check the
    files against their checksums first (reads the checkpoint once more).
    """
    iteration, path = tracked_iteration_dir(root, iteration)
    meta = read_meta(root, iteration)
    if verify:
        _verify(path)
    stored = _stored_keys(path)  # read first: DCP logs whole tracebacks for an unreadable .metadata
    state = {"model": model_state_dict(model)}
    if allow_missing:
        skipped = [k for k in state["model"] if f"model.{k}" not in stored and k.startswith(allow_missing)]
        for k in skipped:
            del state["model"][k]
        if skipped and optimizer is not None:
            optimizer = None  # fresh modules need fresh optimizer state for everything
            meta = dict(meta, optimizer_skipped=True)
    load_optim = optimizer is not None and meta.get("has_optimizer", False)
    if load_optim:
        state["optimizer"] = optimizer_template(model, optimizer)
    _dcp_load(root, iteration, path, state)
    load_model_state_dict(model, state["model"], allow_missing)
    if load_optim:
        load_optimizer_state_dict(model, optimizer, state["optimizer"])
    note = _agreed(lambda: _load_rng(path))[_rank()]
    if note:
        warnings.warn(note)
        meta = dict(meta, rng_note=note)
    return meta


# ---------------------------------------------------------------- start-up
def remove_stale_tmp(root: str) -> list[str]:
    """Remove debris of interrupted saves under `root` (collective; rank 0 does the work).

    Returns the removed paths on every rank (`tracker.remove_stale_local`).
    """
    return _agreed(lambda: remove_stale_local(root), rank0_only=True)[0]


def guard_save_dir(save: Optional[str], load: Optional[str], overwrite_save: bool = False) -> Optional[str]:
    """Refuse a `--save` that holds another run's checkpoint, or move it aside with `overwrite_save`
    (`guard.check_save_target`; collective: rank 0 decides and moves, every rank raises the same error
    and returns where the old run went, None when nothing moved)."""
    return _agreed(lambda: check_save_target(save, load, overwrite_save), rank0_only=True)[0]


def check_save_dir(root: str, expected_bytes: int) -> None:
    """Fail early unless `root` can take a checkpoint of `expected_bytes` (not a collective).

    Creates `root` if needed, writes and removes a probe file, and compares
    the filesystem's free space with `expected_bytes`
    (`state.expected_checkpoint_bytes`).
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--save {root} is a file; choose a directory")
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".write_probe.{os.getpid()}.{_rank()}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"--save {root} is not writable ({_describe(exc)}); fix its permissions or "
                              "choose another directory") from None
    free = shutil.disk_usage(root).free
    if free < expected_bytes:
        raise CheckpointError(
            f"--save {root} has {free} bytes ({free / 2**30:.2f} GiB) free but one checkpoint needs about "
            f"{expected_bytes} bytes ({expected_bytes / 2**30:.2f} GiB); free space or choose another directory")
