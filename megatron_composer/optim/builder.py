"""The training loop's optimizer: one builder for AdamW and Muon + AdamW.

`build_optimizer(model, cfg)` returns a `ComposerOptimizer` that owns
everything between "gradients are reduced" and "weights are updated", so the
training step has no branches on the optimizer or the precision:

1. the global gradient norm (from the `ParallelModel`, one implementation
   for DDP and HSDP) and the non-finite skip: a NaN/Inf norm applies nothing;
2. clipping to `--clip-grad` (foreach, in place on the fp32 gradients);
3. the learning rate of the update (`set_lr(iteration)`, Megatron's
   warmup + decay schedule, applied to every param group);
4. the update: AdamW for everything, or Muon for the hidden matrices (per
   head / per expert; ShardedMuon under FSDP2) + AdamW for embeddings, output
   head, router, norms and biases. AdamW is torch's fused kernel wherever
   torch has one for the parameters' device (CUDA, and CPU in recent torch),
   else the foreach implementation (`adamw_implementation`);
5. with bf16 parameters under DDP, megatron-core's mixed-precision pattern:
   the optimizers update fp32 *main* copies of the parameters with the fp32
   gradient buffers and the bf16 model weights are copied from them (under
   HSDP the sharded parameters are the fp32 main weights themselves);
6. a check that the updated weights are finite (`NonFiniteParametersError`).

`step()` returns Megatron-LM's `(success, grad_norm, num_zeros)` (num_zeros
is not computed: None).

Host syncs: the norm is read once (the skip decision and the clip factor
need it on the host). The finite-weights flag of the update stays on the
device until `check_finite(values)` reads it in one transfer with values the
caller reads anyway (the trainer's logged losses), and raises before
anything else happens to the weights; an update whose flag nobody read is
checked with the next step's norm, before the next update is applied.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from ..checkpoint.state import load_name_keyed_optimizer_state, name_keyed_optimizer_state
from ..config.training import OptimizerConfig
from ..platform.distributed import local_device
from .param_groups import HeadGeometry, adamw_param_groups, build_muon_adamw
from .schedule import learning_rate


class NonFiniteParametersError(RuntimeError):
    """An applied update produced NaN/Inf weights."""


class ComposerOptimizer:
    """AdamW, or Muon + AdamW, over a `parallel.ParallelModel`'s trainable parameters.

    `state` and `param_groups` present the parameters by *model* parameter
    (the fp32 main copy is the extra state entry "main_param" under
    mixed precision), so checkpoints key everything by parameter name.
    """

    def __init__(self, model, cfg: OptimizerConfig, optimizers: list, opt_params: list,
                 names: list[str]):
        self.model = model
        self.cfg = cfg
        self.optimizers = optimizers
        self.model_params = model.params
        self.opt_params = opt_params  # what the optimizers update: the params, or fp32 main copies
        self.names = names
        self.mixed_precision = any(o is not m for o, m in zip(opt_params, self.model_params))
        self._to_model = {id(o): m for o, m in zip(opt_params, self.model_params)}
        self._unchecked: Optional[torch.Tensor] = None  # the last update's any-rank non-finite flag, unread

    # ---- torch.optim.Optimizer surface --------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        """Optimizer state keyed by model parameter."""
        merged = {}
        for o in self.optimizers:
            for p, s in o.state.items():
                merged[self._to_model[id(p)]] = dict(s, main_param=p) if self.mixed_precision else s
        return merged

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad()
        for p in self.opt_params:
            p.grad = None

    # ---- checkpoints (keyed by global parameter name) -----------------------
    def _names(self, names: dict) -> dict:
        """Global names of the optimizers' own parameters (main copies included)."""
        return {o: names[self._to_model[id(o)]] for o in self.opt_params}

    def sharded_state_dict(self, names: dict) -> dict:
        """{"{name}/{key}": tensor} for every state entry; `names` maps model
        parameters to their global names. Under mixed precision the fp32 main
        weight is the entry "main_param"."""
        own = self._names(names)
        out = {}
        for o in self.optimizers:
            out.update(name_keyed_optimizer_state(o, own))
        if self.mixed_precision and out:
            out.update({f"{own[p]}/main_param": p.detach() for p in self.opt_params})
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict, names: dict) -> None:
        """Copy `state` (as `sharded_state_dict` makes it) into the existing state."""
        own = self._names(names)
        for o in self.optimizers:
            load_name_keyed_optimizer_state(o, state, own)
        if self.mixed_precision:
            for p in self.opt_params:
                p.copy_(state[f"{own[p]}/main_param"])

    # ---- mixed precision ----------------------------------------------------
    @torch.no_grad()
    def copy_main_to_model(self) -> None:
        """Model weights from the fp32 main weights (after an update or a load)."""
        if self.mixed_precision:
            torch._foreach_copy_([_local(p) for p in self.model_params], [_local(p) for p in self.opt_params])

    @torch.no_grad()
    def copy_model_to_main(self) -> None:
        """fp32 main weights from the model (after loading weights without optimizer state)."""
        if self.mixed_precision:
            torch._foreach_copy_([_local(p) for p in self.opt_params], [_local(p) for p in self.model_params])

    @torch.no_grad()
    def init_state(self) -> None:
        """Create every state tensor (an update with zero gradients and zero learning
        rate and weight decay, which changes no weight) so a checkpoint can load into it."""
        saved = [(g["lr"], g.get("weight_decay")) for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        for p in self.opt_params:
            p.grad = torch.zeros_like(p)
        for o in self.optimizers:
            o.step()
        for g, (lr, wd) in zip(self.param_groups, saved):
            g["lr"] = lr
            if wd is not None:
                g["weight_decay"] = wd
        for p in self.opt_params:
            p.grad = None

    # ---- one update ---------------------------------------------------------
    def set_lr(self, iteration: int) -> float:
        """Set the scheduled learning rate of the update at 0-based `iteration`; return it."""
        c = self.cfg
        lr = learning_rate(iteration, c.lr, c.min_lr, c.lr_warmup_iters, c.lr_decay_iters, c.lr_decay_style)
        for g in self.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
        return lr

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """Clip and apply the reduced gradients unless their norm is non-finite.

        Returns (success, grad norm before clipping, None). The finite check of
        the new weights is left on the device for `check_finite`.
        """
        # the one host sync of a step here: the skip decision and the clip factor need the norm
        (norm,) = self.check_finite(self.model.grad_norm().reshape(1))
        if not math.isfinite(norm):
            return False, norm, None
        grads = self.model.grads()
        for p, g in zip(self.opt_params, grads):
            p.grad = g
        present = [g for g in grads if g is not None]
        if self.cfg.clip_grad and norm > self.cfg.clip_grad and present:
            torch._foreach_mul_(present, self.cfg.clip_grad / (norm + 1e-6))
        for o in self.optimizers:
            o.step()
        for p in self.opt_params:
            p.grad = None
        self._unchecked = self._any_rank_non_finite()
        self.copy_main_to_model()
        return True, norm, None

    def check_finite(self, values: Optional[torch.Tensor] = None) -> list[float]:
        """Read the last update's non-finite-weights flag, if not read yet, in one host
        transfer with `values` (a 1-D tensor the caller reads anyway), and raise
        `NonFiniteParametersError` naming this rank's non-finite weights if any rank has one.

        Returns `values` on the host (as floats; [] for None)."""
        flag, self._unchecked = self._unchecked, None
        parts = [] if values is None else [values.double()]
        if flag is not None:
            parts.append(flag.reshape(1))
        if not parts:
            return []
        host = torch.cat(parts).tolist()
        if flag is not None and host.pop():
            self._raise_non_finite()
        return host

    def _non_finite_flags(self) -> torch.Tensor:
        """[trainable weights] bool on their device: True where a weight holds NaN/Inf."""
        local = [_local(p) for p in self.opt_params]
        if not local:
            return torch.zeros(0, dtype=torch.bool, device=local_device())
        return ~torch.isfinite(torch.stack(torch._foreach_norm(local, 2)))

    def non_finite_parameters(self) -> list[str]:
        """Names of this rank's trainable weights that hold NaN/Inf."""
        return [self.names[i] for i in torch.nonzero(self._non_finite_flags()).flatten().tolist()]

    def _any_rank_non_finite(self) -> torch.Tensor:
        """fp64 scalar on the device: 1 if a weight on any rank holds NaN/Inf (no host sync)."""
        flag = self._non_finite_flags().any().double()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops together
        return flag

    def _raise_non_finite(self):
        bad = self.non_finite_parameters()
        where = f"{len(bad)} tensors on this rank, first {bad[0]}" if bad else "on another rank"
        raise NonFiniteParametersError(
            f"the update made weights non-finite ({where}); nothing of it is saved. "
            f"Check --lr {self.cfg.lr}, --adam-eps {self.cfg.adam_eps} (> 0) and --clip-grad "
            f"{self.cfg.clip_grad}, then resume from the last checkpoint")


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _main_params(model, mixed_precision: bool) -> list:
    if not mixed_precision:
        return list(model.params)
    return [torch.nn.Parameter(p.detach().float(), requires_grad=True) for p in model.params]


def adamw_implementation(device_type: str) -> dict:
    """torch.optim.AdamW's implementation keyword for parameters on `device_type`: the fused
    kernel (one launch per parameter group and dtype) where torch has one for that device,
    else foreach. Fused and foreach differ by rounding only (about 1 ulp per step)."""
    if device_type in _get_fused_kernels_supported_devices():
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(model, cfg: OptimizerConfig) -> ComposerOptimizer:
    """AdamW or Muon + AdamW for a `parallel.ParallelModel` (after sharding).

    Parameters held in bf16/fp16 (DDP with --bf16) get fp32 main copies.
    """
    named = dict(model.gpt.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    names = [by_id[id(p)] for p in model.params]
    mixed = any(p.dtype != torch.float32 for p in model.params)
    opt_params = _main_params(model, mixed)
    pairs = list(zip(names, opt_params))
    device_type = opt_params[0].device.type if opt_params else local_device().type
    adamw_kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, **adamw_implementation(device_type))
    if cfg.optimizer == "adam":
        optimizers = [torch.optim.AdamW(adamw_param_groups(pairs, cfg.weight_decay), **adamw_kwargs)]
    else:
        muon, adamw = build_muon_adamw(
            pairs, HeadGeometry.from_config(model.gpt.config), granularity=cfg.muon_granularity,
            muon_kwargs=dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                             nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                             adjust_lr_fn=cfg.muon_adjust_lr),
            adamw_kwargs=dict(adamw_kwargs, weight_decay=cfg.weight_decay),
        )
        optimizers = [o for o in (muon, adamw) if o is not None]
    return ComposerOptimizer(model, cfg, optimizers, opt_params, names)
