"""Muon vs AdamW assignment and splits on megatron-core 0.16.1 GPTModel (MLA + MoE + MTP) names.

The names and shapes below are those of `build_model(get_preset("tiny"))`
(4 heads, qk 32, rope 16, v 32, q_lora 64, kv_lora 32, hidden 128), plus
the TE variants (TEGroupedMLP experts, fused layer-norm weights, biases).
"""
import pytest
import torch

from megatron_composer.optim.muon import Muon
from megatron_composer.optim.param_groups import (
    HeadGeometry,
    build_muon_adamw,
    muon_param_groups,
    muon_split,
    split_muon_adamw,
)

GEOMETRY = HeadGeometry(num_heads=4, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32)

ATTN = {
    "self_attention.linear_proj.weight": ((128, 128), {"cols": 4}),
    "self_attention.linear_q_down_proj.weight": ((64, 128), None),
    "self_attention.linear_q_up_proj.weight": ((192, 64), {"rows": 4}),
    "self_attention.linear_kv_down_proj.weight": ((48, 128), None),
    "self_attention.linear_kv_up_proj.weight": ((256, 32), {"rows": 8}),
    "self_attention.q_layernorm.weight": ((64,), "adamw"),
    "self_attention.kv_layernorm.weight": ((32,), "adamw"),
    "input_layernorm.weight": ((128,), "adamw"),
    "pre_mlp_layernorm.weight": ((128,), "adamw"),
}
DENSE_MLP = {
    "mlp.linear_fc1.weight": ((768, 128), {"rows": 2}),
    "mlp.linear_fc2.weight": ((128, 384), None),
}
MOE = {
    "mlp.router.weight": ((8, 128), "adamw"),
    "mlp.experts.local_experts.0.linear_fc1.weight": ((192, 128), {"rows": 2}),
    "mlp.experts.local_experts.0.linear_fc2.weight": ((128, 96), None),
    "mlp.experts.local_experts.7.linear_fc1.weight": ((192, 128), {"rows": 2}),
    "mlp.experts.local_experts.7.linear_fc2.weight": ((128, 96), None),
    "mlp.shared_experts.linear_fc1.weight": ((192, 128), {"rows": 2}),
    "mlp.shared_experts.linear_fc2.weight": ((128, 96), None),
}
TOP = {
    "embedding.word_embeddings.weight": ((4096, 128), "adamw"),
    "decoder.final_layernorm.weight": ((128,), "adamw"),
    "mtp.layers.0.enorm.weight": ((128,), "adamw"),
    "mtp.layers.0.hnorm.weight": ((128,), "adamw"),
    "mtp.layers.0.eh_proj.weight": ((128, 256), None),
    "mtp.layers.0.final_layernorm.weight": ((128,), "adamw"),
    "output_layer.weight": ((4096, 128), "adamw"),
}
TE_VARIANTS = {
    "decoder.layers.2.mlp.experts.linear_fc1.weight0": ((192, 128), {"rows": 2}),
    "decoder.layers.2.mlp.experts.linear_fc1.weight7": ((192, 128), {"rows": 2}),
    "decoder.layers.2.mlp.experts.linear_fc2.weight3": ((128, 96), None),
    "decoder.layers.2.self_attention.linear_q_up_proj.layer_norm_weight": ((64,), "adamw"),
    "decoder.layers.2.mlp.linear_fc1.layer_norm_bias": ((128,), "adamw"),
    "decoder.layers.2.self_attention.linear_proj.bias": ((128,), "adamw"),
    "decoder.layers.2.mlp.router.expert_bias": ((8,), "adamw"),
}


def model_table() -> dict:
    table = {}
    for prefix, parts in [
        ("decoder.layers.0.", (ATTN, DENSE_MLP)),
        ("decoder.layers.1.", (ATTN, MOE)),
        ("mtp.layers.0.transformer_layer.", (ATTN, MOE)),
    ]:
        for part in parts:
            table.update({prefix + k: v for k, v in part.items()})
    table.update(TOP)
    table.update(TE_VARIANTS)
    return table


@pytest.mark.parametrize("name", sorted(model_table()))
def test_head_granularity_assignment(name):
    shape, want = model_table()[name]
    kind, split = muon_split(name, shape, GEOMETRY, "head")
    assert (kind, split) == (("adamw", None) if want == "adamw" else ("muon", want))


def test_matrix_granularity_keeps_every_matrix_whole():
    for name, (shape, want) in model_table().items():
        kind, split = muon_split(name, shape, GEOMETRY, "matrix")
        assert kind == ("adamw" if want == "adamw" else "muon") and split is None, name


def test_q_proj_without_lora_and_unequal_k_v_heads():
    g = HeadGeometry(num_heads=3, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
    assert muon_split("decoder.layers.0.self_attention.linear_q_proj.weight", (36, 20), g) == ("muon", {"rows": 3})
    assert muon_split("decoder.layers.0.self_attention.linear_kv_up_proj.weight", (42, 10), g) == (
        "muon", {"rows": [8, 6, 8, 6, 8, 6]})
    assert muon_split("decoder.layers.0.self_attention.linear_proj.weight", (20, 18), g) == ("muon", {"cols": 3})
    assert muon_split("decoder.layers.0.mlp.linear_fc1.weight", (30, 20), g, gated_linear_unit=False) == ("muon", None)


def test_errors_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"linear_q_up_proj.weight has shape \(190, 64\).*HeadGeometry"):
        muon_split("decoder.layers.0.self_attention.linear_q_up_proj.weight", (190, 64), GEOMETRY)
    with pytest.raises(ValueError, match="legacy GroupedMLP.*TEGroupedMLP"):
        muon_split("decoder.layers.1.mlp.experts.weight1", (128, 8 * 192), GEOMETRY)
    with pytest.raises(ValueError, match="granularity"):
        muon_split("output_layer.weight", (10, 4), GEOMETRY, "expert")


def _named_params():
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, (shape, _) in model_table().items():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        if name.endswith("expert_bias"):
            p.requires_grad_(False)  # megatron-core keeps it as a buffer updated by the balancer
        out.append((name, p))
    return out


def test_split_and_build_the_two_optimizers():
    named = _named_params()
    muon_params, adamw_params = split_muon_adamw(named, GEOMETRY)
    assert {mp.name for mp in muon_params} | {n for n, _ in adamw_params} == {
        n for n, p in named if p.requires_grad}
    assert not {mp.name for mp in muon_params} & {n for n, _ in adamw_params}
    groups = muon_param_groups(muon_params)
    assert sorted(map(repr, (g["split"] for g in groups))) == sorted(
        map(repr, [None, {"cols": 4}, {"rows": 4}, {"rows": 8}, {"rows": 2}]))

    muon, adamw = build_muon_adamw(
        named, GEOMETRY, muon_kwargs=dict(lr=0.02, adjust_lr_fn="match_rms_adamw"),
        adamw_kwargs=dict(lr=1e-3, weight_decay=0.1))
    assert type(muon) is Muon and isinstance(adamw, torch.optim.AdamW)
    decay, no_decay = adamw.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    before = {n: p.detach().clone() for n, p in named}
    for _, p in named:
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    muon.step()
    adamw.step()
    changed = {n for n, p in named if not torch.equal(p, before[n])}
    assert changed == {n for n, p in named if p.requires_grad}


def test_per_head_groups_equal_muon_on_separate_head_params():
    """What build_muon_adamw sets up for q_up is Muon on each head as its own matrix."""
    name = "decoder.layers.0.self_attention.linear_q_up_proj.weight"
    q_up = torch.nn.Parameter(torch.randn(192, 64))
    heads = [torch.nn.Parameter(h.clone()) for h in q_up.detach().split(48)]
    muon, _ = build_muon_adamw([(name, q_up)], GEOMETRY, muon_kwargs=dict(lr=0.05))
    ref = Muon(heads, lr=0.05)
    for _ in range(2):
        g = torch.randn(192, 64)
        q_up.grad = g
        for h, gh in zip(heads, g.split(48)):
            h.grad = gh.clone()
        muon.step()
        ref.step()
    assert torch.equal(q_up.detach(), torch.cat([h.detach() for h in heads]))
