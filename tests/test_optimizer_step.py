"""One optimizer update's own cost: host syncs, gradient-buffer zeroing, the AdamW kernel.

The host syncs are counted by a `TorchFunctionMode` that sees every call that
makes the host wait for the device on a GPU (`.item()`, `.tolist()`, `.cpu()`,
`bool(tensor)`, ...), with the model's forward and backward left out: what is
counted is the trainer's and the optimizer's part of `Trainer.update`.
"""
import contextlib
import math
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.test_trainer import UnevenDataset
from tests.trainers import make_trainer

# Tensor methods that copy device values to the host (a device sync on CUDA)
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "nonzero"}


class HostReads(TorchFunctionMode):
    """Records the name of every host read while `paused` is 0; a `.to()` / `.copy_()` onto the CPU
    from another device counts too. Reads of the tensors `host_resident()` lists (ids of tensors
    that live on the host on a GPU too) are not device syncs and are not counted."""

    def __init__(self, host_resident=lambda: set()):
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0
        self.host_resident = host_resident

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            name = getattr(func, "__name__", "")
            if name in HOST_READS and not (args and id(args[0]) in self.host_resident()):
                self.reads.append(name)
            elif name in ("to", "copy_") and _onto_host(name, args, out):
                self.reads.append(name)
        return out


def _onto_host(name, args, out) -> bool:
    src = args[1] if name == "copy_" else args[0]
    dst = args[0] if name == "copy_" else out
    return all(torch.is_tensor(t) for t in (src, dst)) and src.device.type != "cpu" and dst.device.type == "cpu"


def _cpu_step_counters(tr) -> set[int]:
    """torch's non-fused AdamW keeps each parameter's step counter on the host, on a GPU too, and
    reads it with `.item()`."""
    return {id(st["step"]) for o in tr.optimizer.optimizers if not o.defaults.get("fused")
            for st in o.state.values() if "step" in st}


def _count_update(tr, counter: HostReads, model_part=contextlib.nullcontext):
    """Run one training step under `counter`, the model's forward and backward paused (and run
    inside `model_part()`)."""
    forward_backward = tr.forward_backward

    def paused(*args):
        counter.paused += 1
        try:
            with model_part():
                return forward_backward(*args)
        finally:
            counter.paused -= 1

    tr.forward_backward = paused
    batches = tr.micro_batches(tr.state.consumed_samples)
    try:
        with counter:
            return tr.train_step(batches)
    finally:
        tr.forward_backward = forward_backward


def test_an_update_makes_two_host_syncs_and_zeroes_the_gradient_buffer_once():
    """The gradient norm, then the logged values read with the finite-weights flag: two host syncs
    in the trainer and optimizer per update, the first update (megatron's bucket bookkeeping) and
    a skipped one included; the DDP gradient buffer is zeroed once per update."""
    tr = make_trainer(UnevenDataset(), micro_batch_size=1, global_batch_size=4)
    zeroed = []
    zero_grad_buffer = tr.model.module.zero_grad_buffer
    tr.model.module.zero_grad_buffer = lambda: zeroed.append(1) or zero_grad_buffer()
    poison = torch.zeros(())
    tr.model.params[3].register_hook(lambda g: g + poison)
    for step in range(3):
        poison.fill_(math.nan if step == 2 else 0.0)
        counter = HostReads(lambda: _cpu_step_counters(tr))
        result = _count_update(tr, counter)
        assert result.skipped == (step == 2)
        assert len(counter.reads) <= 2, (step, counter.reads)
        assert len(zeroed) == step + 1


def test_an_unread_non_finite_update_is_caught_by_the_next_step():
    """A caller that steps without reading the finite-weights flag (`check_finite`) still never
    applies an update on top of non-finite weights: the next step reads the flag with its norm.
    --adam-eps 0 makes the embedding rows of absent tokens 0/0 = NaN."""
    from megatron_composer.optim.builder import NonFiniteParametersError

    tr = make_trainer(UnevenDataset(n=4), adam_eps=0.0)
    opt = tr.optimizer
    batches = [b.to(tr.device) for b in tr.micro_batches(0)]
    shifts = [tr.shift_for(b) for b in batches]
    denominators = tr.global_counts(batches, shifts).clamp(min=1.0).float()
    tr.model.zero_grad()
    for batch, shift in zip(batches, shifts):
        tr.forward_backward(batch, shift, denominators)
    tr.model.finalize_grads()
    opt.set_lr(0)
    applied, _, _ = opt.step()
    assert applied and any("embedding" in n for n in opt.non_finite_parameters())
    before = [p.detach().clone() for p in opt.opt_params]
    with pytest.raises(NonFiniteParametersError, match=r"non-finite \(\d+ tensors on this rank, first .*embedding"):
        opt.step()
    for a, b in zip(before, opt.opt_params):  # nothing applied
        torch.testing.assert_close(b.detach(), a, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------- the AdamW kernel
def test_adamw_is_fused_where_torch_has_the_kernel(monkeypatch):
    """CUDA gets torch's fused AdamW; a device without a fused kernel gets foreach, decided by
    the parameters' device when the optimizer is built (here CPU, with and without a kernel)."""
    from megatron_composer.optim import builder

    assert builder.adamw_implementation("cuda") == {"fused": True}
    monkeypatch.setattr(builder, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    assert builder.adamw_implementation("cpu") == {"foreach": True}
    for optimizer in ("adam", "muon"):
        tr = make_trainer(UnevenDataset(n=4), optimizer=optimizer)
        adamw = [o for o in tr.optimizer.optimizers if isinstance(o, torch.optim.AdamW)]
        assert len(adamw) == 1 and adamw[0].defaults["foreach"] and not adamw[0].defaults["fused"]
    monkeypatch.setattr(builder, "_get_fused_kernels_supported_devices", lambda: ["cuda", "cpu"])
    tr = make_trainer(UnevenDataset(n=4))
    assert tr.optimizer.optimizers[0].defaults["fused"]
    assert not tr.step().skipped


def test_fused_adamw_equals_foreach_on_cpu():
    """torch's fused CPU kernel and its foreach implementation: the same AdamW (decoupled weight
    decay on one group, none on the other) up to rounding, over several steps."""
    if "cpu" not in torch.utils._foreach_utils._get_fused_kernels_supported_devices():
        pytest.skip(f"torch {torch.__version__} has no fused CPU AdamW")
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (3, 16, 8)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(6)]
    out = {}
    for kind in ("fused", "foreach"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:],
                                 "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, **{kind: True})
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.clone()
            opt.step()
        out[kind] = [p.detach() for p in params]
    for a, b, p0 in zip(out["fused"], out["foreach"], start):
        assert not torch.equal(a, p0)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_an_update_on_cuda_makes_two_device_syncs_with_fused_adamw():
    """On a GPU: the AdamW kernel is the fused one, and CUDA itself (`set_sync_debug_mode`)
    reports at most two synchronizing calls in an update's trainer and optimizer part, the
    same as the host reads counted."""
    tr = make_trainer(UnevenDataset(), micro_batch_size=1, global_batch_size=4)
    assert tr.device.type == "cuda" and tr.optimizer.optimizers[0].defaults["fused"]

    @contextlib.contextmanager
    def sync_debug(mode):
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(1 - mode)

    for step in range(2):
        counter = HostReads(lambda: _cpu_step_counters(tr))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sync_debug(1):
                _count_update(tr, counter, model_part=lambda: sync_debug(0))
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        assert len(counter.reads) <= 2 and len(syncs) <= 2, (step, counter.reads, syncs)
