"""What the Trainer saves and restores, on top of the `checkpoint` package.

* before any work (`check_paths`, every entry point): a `--save` holding
  another run's checkpoint is refused unless it is `--load` (resume) or
  `--overwrite-save` moves that run aside (`checkpoint.guard`);
* start-up (`prepare_save_dir`): stale `iter_*.tmp` debris of killed saves is
  removed (and logged); `--save` is checked for writability and free space
  against the expected checkpoint size, before any work is done;
* `save()`: model, optimizer (fp32 main weights included) and loop state
  under global names, and the tokenizer model into the root once
  (`CheckpointConfig.tokenizer_model`, so a checkpoint carries its tokenizer);
  a failed save keeps the previous checkpoint and stops the run by default
  (`--continue-on-save-failure` keeps training);
* `resume()`: `--load DIR` restores everything; `--finetune`, or a checkpoint
  of another stage (cpt-32k -> cpt-256k), restores weights only (fresh
  optimizer, iteration and data; MTP modules may be new); `--no-load-optim`
  keeps the fresh optimizer. A `--load` that is missing or not a checkpoint
  is an error, except the resume idiom `--save D --load D` on first launch
  (D missing or empty), which starts from scratch and says so. The CUDA and
  RNG-tracker streams of a checkpoint saved on another kind of device (CPU
  vs CUDA) keep their seeded state, with a warning.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Optional

from .. import checkpoint as ckpt


def check_paths(load, save, overwrite_save: bool = False) -> Optional[str]:
    """The checks that need no model, run before any data or model is built
    (collective under torch.distributed): `--save` holds no other run's
    checkpoint (or, with `--overwrite-save`, that run is moved aside:
    `checkpoint.guard`; returns where it went), `--save` is a writable
    directory, `--load` names a checkpoint (or is the first launch of the
    resume idiom `--save D --load D`). The free-space check against the
    checkpoint size comes later (`Checkpointer.prepare_save_dir`)."""
    moved = ckpt.guard_save_dir(save, load, overwrite_save)
    if save:
        ckpt.check_save_dir(save, 0)
    if load:
        kind = ckpt.load_target_kind(load)
        if kind != "checkpoint":
            _nothing_to_load(load, save, kind)
    return moved


def moved_message(save: str, moved: str) -> str:
    """The start-up line of a run that moved an earlier one aside (`check_paths`)."""
    return f" --overwrite-save: moved the earlier run in {save} to {moved}; training from scratch"


def _nothing_to_load(load, save, kind: str) -> bool:
    """True for the first launch of `--save D --load D`; raise for a --load
    that names no checkpoint."""
    if save is not None and os.path.realpath(load) == os.path.realpath(save):
        return True
    what = "does not exist" if kind == "missing" else "is an empty directory"
    raise ckpt.CheckpointError(
        f"--load {load} {what}: no checkpoint to load. Point --load at a directory written by "
        f"--save (it holds {ckpt.TRACKER}), or drop --load to train from scratch")


class Checkpointer:
    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg.checkpoint

    def _print(self, message: str) -> None:
        self.trainer.log.print(message)

    # ---- save ---------------------------------------------------------------
    def prepare_save_dir(self) -> None:
        t = self.trainer
        for path in ckpt.remove_stale_tmp(self.cfg.save):
            self._print(f" removed {path}: an unfinished save of an earlier run")
        # +5%: the estimate counts tensor bytes, not DCP's per-tensor framing
        needed = int(ckpt.expected_checkpoint_bytes(t.model.module, t.optimizer) * 1.05)
        ckpt.check_save_dir(self.cfg.save, needed)

    def meta(self) -> dict:
        t = self.trainer
        return dict(t.state_dict(), stage=t.cfg.stage, model_preset=t.cfg.model_preset,
                    model_config=asdict(t.model_cfg), training_config=asdict(t.cfg))

    def save(self) -> None:
        t = self.trainer
        try:
            path = ckpt.save_checkpoint(self.cfg.save, t.state.iteration, t.model.module, t.optimizer,
                                        self.meta(), extra_files=t.extra_checkpoint_files(),
                                        tokenizer_model=self.cfg.tokenizer_model)
        except ckpt.CheckpointSaveError as exc:
            if self.cfg.exit_on_save_failure:
                raise
            self._print(f"WARNING: {exc}; training continues (--continue-on-save-failure)")
            return
        self._print(f" saved checkpoint at iteration {t.state.iteration:8d} to {path}")

    # ---- load ---------------------------------------------------------------
    def _nothing_to_load(self, kind: str) -> bool:
        load = self.cfg.load
        if _nothing_to_load(load, self.cfg.save, kind):
            self._print(f" no checkpoint in --load {load} yet (it is also --save): training from scratch")
        return True

    def resume(self) -> None:
        t, load = self.trainer, self.cfg.load
        if not load:
            return
        kind = ckpt.load_target_kind(load)
        if kind != "checkpoint" and self._nothing_to_load(kind):
            return
        saved = ckpt.read_meta(load)
        saved_stage = saved.get("stage")
        next_stage = saved_stage is not None and saved_stage != t.cfg.stage
        weights_only = self.cfg.finetune or next_stage
        load_optim = not (self.cfg.no_load_optim or weights_only)
        # MTP modules may be added to a checkpoint trained without them (the
        # recipe adds MTP mid-CPT); they keep their fresh initialization.
        allow = ("mtp.",) if weights_only else ()
        meta = ckpt.load_checkpoint(load, t.model.module, t.optimizer if load_optim else None,
                                    allow_missing=allow, verify=self.cfg.verify_checkpoint)
        if load_optim and meta.get("has_optimizer") and not meta.get("optimizer_skipped"):
            t.optimizer.copy_main_to_model()
        else:
            t.optimizer.copy_model_to_main()
        if not weights_only:
            t.load_state_dict(meta)
        if self.cfg.finetune:
            reason = " (weights only: --finetune)"
        elif next_stage:
            reason = f" (weights only: stage {saved_stage} -> {t.cfg.stage})"
        else:
            reason = " (optimizer state not loaded: --no-load-optim)" if self.cfg.no_load_optim else ""
        self._print(f" loaded checkpoint from {load} at iteration {meta['iteration']}{reason}")
        if meta.get("rng_note"):
            self._print(f" WARNING: {meta['rng_note']}")
