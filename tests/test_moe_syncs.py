"""Host syncs of one MoE layer (tiny preset, forward + backward), and the sync-free dispatcher's exactness.

On CPU no op waits for a device, so `_count_syncs` counts the points where
the same code on CUDA would make the host wait for the GPU:

- reads of a tensor's values on the host: `item`, `tolist`, `numpy`, `cpu`,
  `bool`/`int`/`float`/`index` of a tensor (torch-function level);
- a `.to()` of a host tensor (below) onto the device without `non_blocking`
  (on CUDA a blocking copy waits for the whole stream);
- aten ops whose output shape or value depends on the data (torch's tags
  `dynamic_output_shape` / `data_dependent_output`: `masked_select`,
  `nonzero`, `_local_scalar_dense`, ...), `repeat_interleave` without
  `output_size` (dispatch level, so the backward is seen too);
- event and stream waits (`Event.synchronize`, `Stream.synchronize`,
  `torch.cuda.synchronize`), which the CPU shims turn into no-ops.

Host tensors. On CPU every tensor is a host tensor; the counter treats them
all as device tensors except those marked as host ones. At EP > 1 megatron's dispatcher copies the split sizes and per-expert counts
to the host with a non-blocking copy at its `cuda_dtoh_point` and then waits
on that copy's event once; reads of those host copies (and of the chunk-sort
indices megatron builds on the host) are host work, not syncs, so the counter
is told which tensors they are (`host`), and what an op computes from host
tensors only is a host tensor too.
"""
import contextlib
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_composer.config import get_preset
from tests.distributed import run_distributed

TINY = get_preset("tiny")

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_SYNC_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def _source() -> str:
    """file:line of the innermost megatron / megatron_composer frame."""
    for frame in reversed(traceback.extract_stack()):
        for package in ("megatron_composer", "megatron"):
            if f"/{package}/" in frame.filename and not frame.filename.endswith("platform/cpu.py"):
                return f"{package}{frame.filename.rsplit('/' + package, 1)[1]}:{frame.lineno}"
    return "?"


class _Syncs:
    def __init__(self):
        self.found: list[str] = []  # "op at file:line"
        self.host: set[int] = set()  # storages that live on the host on CUDA
        self.depth = 0  # inside a counted read (its aten ops are not counted again)

    def device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.host

    def add(self, op: str) -> None:
        self.found.append(f"{op} at {_source()}")

    @property
    def ops(self) -> list[str]:
        return [f.split(" at ")[0] for f in self.found]

    def mark_host(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self.host.add(t.untyped_storage().data_ptr())


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, syncs: _Syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = None
        if self.syncs.depth:
            pass
        elif func in _READS and self.syncs.device(args[0]):
            name = func.__name__
        elif func is torch.Tensor.to and not self.syncs.device(args[0]):
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and not non_blocking:
                name = "blocking host-to-device .to()"
        if name is None:
            return func(*args, **kwargs)
        self.syncs.add(name)
        self.syncs.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.syncs.depth -= 1


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, syncs: _Syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        syncs = (any(tag in func.tags for tag in _SYNC_TAGS) or func is torch.ops.aten.equal.default)
        if func is torch.ops.aten.repeat_interleave.Tensor:
            syncs = kwargs.get("output_size") is None
        if syncs and not self.syncs.depth and self.syncs.device(args[0]):
            self.syncs.add(f"aten.{func.overloadpacket.__name__}")
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if inputs and not any(self.syncs.device(t) for t in inputs):  # computed from host tensors only
            for t in tree_flatten(out)[0]:
                self.syncs.mark_host(t)
        return out


@contextlib.contextmanager
def _count_syncs(monkeypatch, layer=None):
    """Yield the record (`_Syncs`) of the block's syncs; see the module docstring. With a MoE
    `layer`, its dispatcher's host-side chunk-sort indices count as host tensors."""
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_composer.platform import cpu

    syncs = _Syncs()

    def wait(name):
        return lambda *args, **kwargs: syncs.add(name)

    monkeypatch.setattr(cpu._NoEvent, "synchronize", wait("Event.synchronize"))
    monkeypatch.setattr(cpu._NoStream, "synchronize", wait("Stream.synchronize"))
    monkeypatch.setattr(torch.cuda, "synchronize", wait("torch.cuda.synchronize"))
    # megatron's non-blocking copies to the host at its dtoh point: the results are host tensors
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def copy_to_host(tensor, *args, **kwargs):
        syncs.depth += 1
        try:
            out = to_host(tensor, *args, **kwargs)
        finally:
            syncs.depth -= 1
        syncs.mark_host(out)
        return out

    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", copy_to_host)
    dispatcher = getattr(layer, "token_dispatcher", None)
    for name in ("sort_input_by_local_experts", "restore_output_by_local_experts"):
        if dispatcher is not None and not dispatcher.config.moe_permute_fusion:  # built on "cpu"
            syncs.mark_host(getattr(dispatcher, name))
    try:
        with _FunctionLevel(syncs), _DispatchLevel(syncs):
            yield syncs
    finally:
        monkeypatch.undo()


def _setup(ep=1):
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    initialize_parallel(ParallelLayout(world_size=env.world_size, ep=ep), seed=1234)


def _moe_layer(dtype=torch.float32, grouped_experts=True, **overrides):
    """The tiny preset's MoE layer as the model builds it (its last decoder layer's MLP)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_composer.models import transformer_config
    from megatron_composer.models.builder import composer_block_spec

    tconfig = transformer_config(TINY, params_dtype=dtype, **overrides)
    spec = composer_block_spec(tconfig, grouped_experts=grouped_experts).layer_specs[-1].submodules.mlp
    return build_module(spec, config=tconfig)


def _inputs(seq=24, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, 1, TINY.hidden_size, generator=g).to(dtype).requires_grad_()
    return x, torch.randn(seq, 1, TINY.hidden_size, generator=g).to(dtype)


def _forward_backward(layer, x, grad):
    """The syncs (`_Syncs`) of the layer's forward and of its backward."""
    with pytest.MonkeyPatch.context() as monkeypatch, _count_syncs(monkeypatch, layer) as forward:
        out, _ = layer(x)
    with pytest.MonkeyPatch.context() as monkeypatch, _count_syncs(monkeypatch, layer) as backward:
        out.backward(grad)
    return forward, backward


# ------------------------------------------------------------------ EP = 1
def test_moe_layer_makes_no_host_sync_at_ep1():
    _setup()
    forward, backward = _forward_backward(_moe_layer(), *_inputs())
    assert forward.found == [] and backward.found == [], (forward.found, backward.found)


def test_the_counter_sees_megatron_s_dispatcher_syncs():
    """The counter is not blind: megatron's own dispatcher at EP=1 waits three times."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    _setup()
    layer = _moe_layer()
    megatron = MoELayer(layer.config, layer.submodules)
    megatron.load_state_dict(layer.state_dict())
    forward, backward = _forward_backward(megatron, *_inputs())
    assert sorted(forward.ops) == ["Event.synchronize", "aten.masked_select", "aten.masked_select"], forward.found
    assert backward.found == []


def test_megatron_sequential_mlp_experts_sync_once_for_their_splits():
    _setup()
    forward, backward = _forward_backward(_moe_layer(grouped_experts=False), *_inputs())
    assert forward.ops == ["tolist"] and backward.found == [], (forward.found, backward.found)


# ------------------------------------------------------------------ exactness
def _random_routing(tokens, experts, topk, seed):
    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(tokens, experts, generator=g).topk(topk, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)
    probs = torch.rand(tokens, experts, generator=g) * routing_map
    return routing_map, probs


@pytest.mark.parametrize("tokens,experts,topk", [(13, 8, 2), (1, 4, 4), (40, 16, 1)])
def test_permute_by_expert_equals_megatron_permute(tokens, experts, topk):
    from megatron.core.transformer.moe.moe_utils import permute

    from megatron_composer.moe import permute_by_expert

    routing_map, probs = _random_routing(tokens, experts, topk, seed=tokens)
    hidden = torch.randn(tokens, 6, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (permute, permute_by_expert):
        h, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
        out, out_probs, index = fn(h, routing_map, probs=p, num_out_tokens=tokens * topk)
        g = torch.Generator().manual_seed(2)
        (out * torch.randn(out.shape, generator=g)).sum().add((out_probs * torch.randn(
            out_probs.shape, generator=g)).sum()).backward()
        results.append((out, out_probs, index, h.grad, p.grad))
    for name, ours, megatron in zip(("tokens", "probs", "index", "grad tokens", "grad probs"), *results):
        assert torch.equal(ours, megatron), name


@pytest.mark.parametrize("grouped_experts", [True, False])
def test_device_counts_layer_equals_megatron_moe_layer_bit_for_bit(grouped_experts):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_composer.moe import DeviceCountsMoELayer

    _setup()
    ours = _moe_layer(grouped_experts=grouped_experts)
    assert type(ours) is DeviceCountsMoELayer
    megatron = MoELayer(ours.config, ours.submodules)
    megatron.load_state_dict(ours.state_dict())
    results = []
    for layer in (megatron, ours):
        x, grad = _inputs(seq=17, seed=3)
        out, _ = layer(x)
        out.backward(grad)
        results.append((out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (ref_out, ref_dx, ref_grads), (out, dx, grads) = results
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


# ------------------------------------------------------------------ EP > 1
def _ep_body(rank, world):
    _setup(ep=world)
    forward, backward = _forward_backward(_moe_layer(), *_inputs(seq=12, seed=rank))
    return forward.found, backward.found


def test_moe_layer_syncs_once_per_forward_at_ep2():
    """At EP > 1 the split sizes reach the host once per layer, for NCCL's all_to_all_single."""
    results = run_distributed(_ep_body, 2)
    for forward, backward in results:
        assert [f.split(" at ")[0] for f in forward] == ["Event.synchronize"], forward
        assert backward == [], backward


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("fusion", [False, True], ids=["unfused", "fused-swiglu"])
def test_moe_layer_makes_no_host_sync_on_cuda(monkeypatch, fusion):
    """The real thing: torch's sync debug mode raises on any synchronizing CUDA call
    (blocking copies, item, nonzero, ...), and event waits are counted, over a bf16
    forward + backward of the MoE layer at a training size."""
    _setup()
    layer = _moe_layer(torch.bfloat16, bias_activation_fusion=fusion).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1, TINY.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    for _ in range(2):  # compile the jit-fused functions, create cuBLAS handles
        layer(x)[0].backward(grad)
    torch.cuda.synchronize()
    waits = []
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: waits.append(self))
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = layer(x)
        out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert waits == []
