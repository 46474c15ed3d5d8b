"""Routed-expert names under both transformer implementations store, load and convert alike.

megatron-core's SequentialMLP (the local spec) names local expert i's
weights `X.experts.local_experts.{i}.linear_fc1.weight`; TEGroupedMLP (the
TE spec) names the same [out, in] tensor `X.experts.linear_fc1.weight{i}`.
Transformer Engine is not needed here: the TE-named model is the local tiny
model's tensors under TEGroupedMLP's documented names (`_te_name`).
"""
import re
from types import SimpleNamespace

import pytest
import torch

from megatron_composer import checkpoint as ck
from megatron_composer.checkpoint import state
from megatron_composer.config import get_preset
from megatron_composer.convert import tensor_maps

TINY = get_preset("tiny")


def _te_name(name: str) -> str:
    """TEGroupedMLP's name for a SequentialMLP expert parameter: the index moves onto the tensor name."""
    m = re.fullmatch(r"(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))", name)
    return f"{m[1]}{m[3]}{m[2]}" if m else name


class _Named(torch.nn.Module):
    """Parameters and buffers under exactly the given dotted names, with a GPT-like `config`."""

    def __init__(self, params: dict, buffers: dict, num_moe_experts: int):
        super().__init__()
        self.config = SimpleNamespace(num_moe_experts=num_moe_experts)
        for tensors, register in ((params, "register_parameter"), (buffers, "register_buffer")):
            for name, t in tensors.items():
                *path, leaf = name.split(".")
                module = self
                for part in path:
                    if not hasattr(module, part):
                        module.add_module(part, torch.nn.Module())
                    module = getattr(module, part)
                value = torch.nn.Parameter(t.detach().clone()) if register == "register_parameter" else t.clone()
                getattr(module, register)(leaf, value)


def _renamed(model, rename) -> _Named:
    params = dict(model.named_parameters())
    tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return _Named({rename(k): v for k, v in tensors.items() if k in params},
                  {rename(k): v for k, v in tensors.items() if k not in params}, model.config.num_moe_experts)


@pytest.fixture(scope="module")
def tiny():
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    layout = ParallelLayout(world_size=init_distributed().world_size)
    initialize_parallel(layout, seed=1234)
    return build_model(TINY, layout)


def test_expert_param_parts_reads_both_namings():
    prefix = "mtp.layers.0.transformer_layer.mlp.experts."
    assert state.expert_param_parts(prefix + "local_experts.12.linear_fc1.weight") == (prefix, 12, "linear_fc1.weight")
    assert state.expert_param_parts(prefix + "linear_fc1.weight12") == (prefix, 12, "linear_fc1.weight")
    assert state.expert_param_parts(prefix + "linear_fc2.bias3") == (prefix, 3, "linear_fc2.bias")
    for other in ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", "decoder.layers.1.mlp.router.weight",
                  "decoder.layers.1.mlp.experts.weight1", "decoder.layers.0.mlp.linear_fc1.weight",
                  "decoder.layers.1.mlp.experts.linear_fc1._extra_state"):
        assert state.expert_param_parts(other) is None, other
    assert state.expert_global_name(prefix + "linear_fc2.weight3", offset=4) == prefix + "7.linear_fc2.weight"


def test_te_names_store_like_local_names(tiny):
    te = _renamed(tiny, _te_name)
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight7" in dict(te.named_parameters())
    local, grouped = state.model_state_dict(tiny), state.model_state_dict(te)
    assert "decoder.layers.1.mlp.experts.7.linear_fc1.weight" in local
    assert local.keys() == grouped.keys()
    assert all(torch.equal(local[k], grouped[k]) for k in local)
    assert ck.expected_checkpoint_bytes(te) == ck.expected_checkpoint_bytes(tiny)


def _half_experts(rename) -> _Named:
    """EP rank 1 of 2 of an 8-expert layer: local experts 0..3 (global 4..7) and a router."""
    params = {"decoder.layers.1.mlp.router.weight": torch.randn(8, 6)}
    for i in range(4):
        params[f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc1.weight"] = torch.full((10, 6), float(i))
        params[f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc2.weight"] = torch.full((6, 5), float(i))
    return _Named({rename(k): v for k, v in params.items()}, {}, num_moe_experts=8)


def test_te_names_store_like_local_names_under_expert_parallelism(monkeypatch):
    monkeypatch.setattr(state, "_expert_parallel", lambda: (2, 1))
    expected = {"decoder.layers.1.mlp.router.weight"}
    expected |= {f"decoder.layers.1.mlp.experts.{e}.linear_fc{k}.weight" for e in range(4, 8) for k in (1, 2)}
    stored = [state.model_state_dict(_half_experts(rename)) for rename in (lambda n: n, _te_name)]
    for names in stored:
        assert set(names) == expected
        assert torch.equal(names["decoder.layers.1.mlp.experts.6.linear_fc1.weight"], torch.full((10, 6), 2.0))
    # Each of the 2 EP ranks holds 4 experts x (10*6 + 6*5) fp32; the router is replicated.
    want = 4 * (8 * 6 + 2 * 4 * (10 * 6 + 6 * 5))
    assert ck.expected_checkpoint_bytes(_half_experts(_te_name)) == want
    assert ck.expected_checkpoint_bytes(_half_experts(lambda n: n)) == want


def _step_adamw(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def _zeroed(model):
    with torch.no_grad():
        for t in model.state_dict().values():
            if torch.is_tensor(t) and t.is_floating_point():
                t.zero_()


def test_te_checkpoint_loads_into_a_local_model_and_back(tiny, tmp_path):
    torch.manual_seed(0)
    te = _renamed(tiny, _te_name)
    te_opt = _step_adamw(te)
    saved = {k: v.clone() for k, v in state.model_state_dict(te).items()}
    ck.save_checkpoint(str(tmp_path / "te"), 1, te, te_opt, {})

    _zeroed(tiny)
    local_opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3)
    ck.load_checkpoint(str(tmp_path / "te"), tiny, local_opt)
    loaded = state.model_state_dict(tiny)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    te_names, local_names = state.param_global_names(te), state.param_global_names(tiny)
    by_name = {te_names[p]: te_opt.state[p] for p in te.parameters()}
    for p in tiny.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(local_opt.state[p][key], by_name[local_names[p]][key]), local_names[p]

    ck.save_checkpoint(str(tmp_path / "local"), 1, tiny, None, {})
    _zeroed(te)
    ck.load_checkpoint(str(tmp_path / "local"), te)
    te_state = dict(te.state_dict())
    for k, v in tiny.state_dict().items():
        if not k.endswith("_extra_state"):
            assert torch.equal(te_state[_te_name(k)], v), k


def test_both_namings_map_to_the_same_hf_tensors(tiny):
    maps = {m.mcore: m for m in tensor_maps(TINY) if m.mcore is not None}
    hf = []
    for model in (tiny, _renamed(tiny, _te_name)):
        stored = state.model_state_dict(model)
        assert set(stored) == set(maps)
        assert all(tuple(stored[name].shape) == maps[name].mcore_shape for name in stored)
        hf.append({name: maps[name].hf for name in stored})
    assert hf[0] == hf[1]
    assert hf[1]["decoder.layers.1.mlp.experts.7.linear_fc1.weight"] == (
        "model.layers.1.mlp.experts.7.gate_proj.weight", "model.layers.1.mlp.experts.7.up_proj.weight")
