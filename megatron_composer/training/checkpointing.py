"""Distributed checkpoints: torch.distributed.checkpoint (DCP), atomic, reshardable.

Layout of `--save DIR` (Megatron's names for the tracker and iteration dirs):

    DIR/latest_checkpointed_iteration.txt   "120"; replaced atomically, last
    DIR/iter_0000120/                        DCP files (.metadata, __*_*.distcp)
    DIR/iter_0000120/meta.json               iteration, consumed samples, scheduler, args
    DIR/iter_0000120/rng_rank{r}.pt          per-rank RNG states

Every tensor is stored under its *global* name: an expert that lives on EP
rank r as `local_experts.{i}` is stored as `experts.{r * local + i}`, so a
checkpoint written with one expert-parallel size loads under another
(DCP reads each rank's keys from wherever they were written). Optimizer
state is keyed by the same parameter names. Replicated tensors (dense
weights under data parallelism) are written once.

Atomicity: ranks write into `iter_N.tmp`; only after every rank finished
does rank 0 rename it to `iter_N` and then replace the tracker file. A crash
at any point leaves the previous checkpoint as `latest`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state

from ..models.forward import unwrap

TRACKER = "latest_checkpointed_iteration.txt"
_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)\.(.*)$")
_GLOBAL_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(.*)$")


class CheckpointError(RuntimeError):
    pass


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _expert_offset(gpt) -> tuple[int, int]:
    cfg = gpt.config
    num_experts = cfg.num_moe_experts or 0
    ep = parallel_state.get_expert_model_parallel_world_size()
    rank = parallel_state.get_expert_model_parallel_rank()
    local = num_experts // ep if num_experts else 0
    return rank * local, local


def global_param_names(model) -> dict[str, str]:
    """Map each local parameter/buffer name to its layout-independent name."""
    gpt = unwrap(model)
    offset, _ = _expert_offset(gpt)
    names = {}
    for name in list(dict(gpt.named_parameters())) + list(dict(gpt.named_buffers())):
        m = _LOCAL_EXPERT.match(name)
        names[name] = f"{m.group(1)}{offset + int(m.group(2))}.{m.group(3)}" if m else name
    return names


def model_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's state under global names (parameters and persistent buffers)."""
    gpt = unwrap(model)
    names = global_param_names(model)
    state = {}
    for key, value in gpt.state_dict().items():
        if key.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        state[names.get(key, key)] = value
    return state


def load_model_state_dict(model, state: dict[str, torch.Tensor], allow_missing: tuple[str, ...] = ()) -> None:
    gpt = unwrap(model)
    names = global_param_names(model)
    local = {}
    for key in gpt.state_dict():
        if key.endswith("_extra_state"):
            continue
        name = names.get(key, key)
        if name not in state and name.startswith(allow_missing):
            continue
        local[key] = state[name]
    missing, unexpected = gpt.load_state_dict(local, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")
               and not names.get(k, k).startswith(allow_missing or ("\0",))]
    if missing:
        raise CheckpointError(f"checkpoint lacks model tensors: {missing[:5]}")


def optimizer_state_dict(model, optimizer) -> dict:
    """Per-parameter optimizer state keyed by global parameter name."""
    gpt = unwrap(model)
    names = global_param_names(model)
    by_param = {p: names[n] for n, p in gpt.named_parameters()}
    state = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                state[f"{by_param[p]}/{key}"] = tensor
    return state


def _optimizer_template(model, optimizer) -> dict:
    """State tensors to load into (creating state by a zero-lr dry step if empty)."""
    template = optimizer_state_dict(model, optimizer)
    if template:
        return template
    saved = [(g["lr"], g.get("weight_decay")) for g in optimizer.param_groups]
    grads = {}
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        if "weight_decay" in group:
            group["weight_decay"] = 0.0
        for p in group["params"]:
            grads[p] = p.grad
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, (lr, wd) in zip(optimizer.param_groups, saved):
        group["lr"] = lr
        if wd is not None:
            group["weight_decay"] = wd
        for p in group["params"]:
            p.grad = grads[p]
    return optimizer_state_dict(model, optimizer)


def load_optimizer_state_dict(model, optimizer, state: dict) -> None:
    gpt = unwrap(model)
    names = global_param_names(model)
    for name, p in gpt.named_parameters():
        gname = names[name]
        for key in list(optimizer.state.get(p, {})):
            value = state[f"{gname}/{key}"]
            current = optimizer.state[p][key]
            if torch.is_tensor(current):
                current.copy_(value)
            else:
                optimizer.state[p][key] = type(current)(value.item())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root: str, iteration: int, model, optimizer, meta: dict) -> str:
    """Write a checkpoint for `iteration` and then mark it latest. Returns its dir."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # debris of an interrupted save
        os.makedirs(tmp)
    _barrier()
    state = {"model": model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=tmp)
    torch.save({"torch": torch.get_rng_state()}, os.path.join(tmp, f"rng_rank{_rank()}.pt"))
    if _rank() == 0:
        meta = dict(meta, iteration=iteration, has_optimizer=optimizer is not None)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True, default=str)
    _barrier()
    if _rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _barrier()
    return final


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the tracker points to, or None when `root` has no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{path} should hold an iteration number but holds {text!r}; "
            "fix or delete it to start from an earlier checkpoint"
        )
    return int(text)


def read_meta(root: str, iteration: Optional[int] = None) -> dict:
    iteration = latest_iteration(root) if iteration is None else iteration
    path = os.path.join(iteration_dir(root, iteration), "meta.json")
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint {iteration_dir(root, iteration)} is incomplete (no meta.json); "
            f"point {os.path.join(root, TRACKER)} at a complete iteration"
        )
    with open(path) as f:
        return json.load(f)


def load_checkpoint(root: str, model, optimizer=None, iteration: Optional[int] = None,
                    allow_missing: tuple[str, ...] = ()) -> dict:
    """Load model (and optimizer) state in place; return the checkpoint's meta.

    `allow_missing`: name prefixes of model tensors that may be absent from
    the checkpoint and keep their fresh initialization (e.g. ("mtp.",) when
    MTP modules are added to a checkpoint trained without them).
    """
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(f"no checkpoint in {root} (missing {TRACKER})")
    path = iteration_dir(root, iteration)
    meta = read_meta(root, iteration)
    state = {"model": model_state_dict(model)}
    if allow_missing:
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        skipped = [k for k in state["model"] if f"model.{k}" not in stored and k.startswith(allow_missing)]
        for k in skipped:
            del state["model"][k]
        if skipped and optimizer is not None:
            optimizer = None  # fresh modules need fresh optimizer state for everything
            meta = dict(meta, optimizer_skipped=True)
    load_optim = optimizer is not None and meta.get("has_optimizer", False)
    if load_optim:
        state["optimizer"] = _optimizer_template(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as exc:  # DCP's errors do not say which checkpoint
        raise CheckpointError(
            f"could not read checkpoint {path}: {exc}. If the model architecture "
            "changed since it was written, load it with matching model flags."
        ) from exc
    load_model_state_dict(model, state["model"], allow_missing)
    if load_optim:
        load_optimizer_state_dict(model, optimizer, state["optimizer"])
    rng = os.path.join(path, f"rng_rank{_rank()}.pt")
    if os.path.exists(rng):
        torch.set_rng_state(torch.load(rng, weights_only=True)["torch"])
    return meta
