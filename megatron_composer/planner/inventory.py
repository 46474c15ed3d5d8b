"""Every parameter one rank holds, from a `ModelConfig` alone (nothing is built).

`parameter_inventory(cfg, ep)` lists the parameters of one expert-parallel
rank's GPTModel exactly as `models.build_model` names and shapes them with
megatron-core 0.16.1's local spec (`decoder.layers.{i}.`, MTP's
`mtp.layers.{k}.transformer_layer.`, routed experts as
`mlp.experts.local_experts.{e}.` with e < num_experts / EP), and the FSDP2
unit each belongs to under dual-mesh HSDP (`parallel.fsdp`: one
`fully_shard` per routed-experts module, per decoder/MTP layer, and for the
embedding, the output layer and the final norm). Transformer Engine's spec
fuses some of these tensors under other names, with the same number of
elements in the same units. `tests/test_plan.py` checks names and shapes
against a built tiny model.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from ..config.model import ModelConfig


@dataclass(frozen=True)
class ParamEntry:
    """One parameter tensor of one rank."""

    name: str
    shape: tuple[int, ...]
    unit: str  # the module `fully_shard` is applied to under HSDP
    expert: bool  # a routed expert's weight (EP-split; sharded over the expert-data-parallel ranks)

    @property
    def numel(self) -> int:
        return prod(self.shape)


def _attention(c: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_head_dim + c.qk_pos_emb_head_dim
    a = prefix + "self_attention."
    out = [(prefix + "input_layernorm.weight", (h,)), (a + "linear_proj.weight", (h, heads * c.v_head_dim))]
    if c.q_lora_rank:
        out += [(a + "linear_q_down_proj.weight", (c.q_lora_rank, h)),
                (a + "linear_q_up_proj.weight", (heads * qk, c.q_lora_rank))]
    else:
        out.append((a + "linear_q_proj.weight", (heads * qk, h)))
    out += [(a + "linear_kv_down_proj.weight", (c.kv_lora_rank + c.qk_pos_emb_head_dim, h)),
            (a + "linear_kv_up_proj.weight", (heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank))]
    if c.q_lora_rank:
        out.append((a + "q_layernorm.weight", (c.q_lora_rank,)))
    out += [(a + "kv_layernorm.weight", (c.kv_lora_rank,)), (prefix + "pre_mlp_layernorm.weight", (h,))]
    return out


def _layer(c: ModelConfig, prefix: str, moe: bool, ep: int) -> list[ParamEntry]:
    """A transformer layer, in the model's order: its dense tensors in unit `prefix`,
    routed experts in unit `prefix + mlp.experts`."""
    unit, experts_unit = prefix.rstrip("."), prefix + "mlp.experts"
    h, m = c.hidden_size, prefix + "mlp."
    out = [ParamEntry(n, s, unit, False) for n, s in _attention(c, prefix)]
    if not moe:
        return out + [ParamEntry(m + "linear_fc1.weight", (2 * c.ffn_hidden_size, h), unit, False),
                      ParamEntry(m + "linear_fc2.weight", (h, c.ffn_hidden_size), unit, False)]
    out.append(ParamEntry(m + "router.weight", (c.num_experts, h), unit, False))
    f = c.moe_ffn_hidden_size
    for e in range(c.num_experts // ep):
        out += [ParamEntry(f"{m}experts.local_experts.{e}.linear_fc1.weight", (2 * f, h), experts_unit, True),
                ParamEntry(f"{m}experts.local_experts.{e}.linear_fc2.weight", (h, f), experts_unit, True)]
    s = c.moe_shared_expert_intermediate_size
    if s:
        out += [ParamEntry(m + "shared_experts.linear_fc1.weight", (2 * s, h), unit, False),
                ParamEntry(m + "shared_experts.linear_fc2.weight", (h, s), unit, False)]
    return out


@lru_cache(maxsize=16)
def parameter_inventory(c: ModelConfig, ep: int = 1) -> tuple[ParamEntry, ...]:
    """The trainable parameters of one EP rank of `build_model(c)` (local spec, TP = PP = 1).

    Raises ValueError if EP does not divide the experts.
    """
    if c.num_moe_layers and c.num_experts % ep:
        raise ValueError(f"EP={ep} does not divide the {c.num_experts} experts")
    h, v = c.hidden_size, c.vocab_size
    out = [ParamEntry("embedding.word_embeddings.weight", (v, h), "embedding", False)]
    for i in range(c.num_layers):
        out += _layer(c, f"decoder.layers.{i}.", i >= c.first_k_dense_layers, ep)
    out.append(ParamEntry("decoder.final_layernorm.weight", (h,), "decoder.final_layernorm", False))
    last_is_moe = c.num_moe_layers > 0
    for k in range(c.mtp_num_layers):
        p = f"mtp.layers.{k}."
        unit = p.rstrip(".")
        out += [ParamEntry(p + "enorm.weight", (h,), unit, False), ParamEntry(p + "hnorm.weight", (h,), unit, False),
                ParamEntry(p + "eh_proj.weight", (h, 2 * h), unit, False)]
        layer = _layer(c, p + "transformer_layer.", last_is_moe, ep)
        out += [e if e.expert else ParamEntry(e.name, e.shape, unit, False) for e in layer]
        out.append(ParamEntry(p + "final_layernorm.weight", (h,), unit, False))
    if c.untie_embeddings_and_output_weights:
        out.append(ParamEntry("output_layer.weight", (v, h), "output_layer", False))
    return tuple(out)
