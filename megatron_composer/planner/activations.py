"""Activation memory of one micro-batch on one GPU: an estimate from shapes.

What the forward saves for backward, per token, is counted tensor by tensor
for the layers `models.build_model` makes (megatron-core's local MLA spec
with our attention and grouped experts), and checked against the peak of
live tensor storages of a real forward + backward of the tiny model
(`tests/test_plan.py` allows 20%; measured on CPU: 0.4-2.5% above the peak
without recompute and with full recompute, 7-13% above with selective
recompute, whose working set the plan counts generously). Per layer, with T tokens on the rank
(micro-batch x sequence / CP), `a` bytes per activation element:

* attention: the layer input and each RMSNorm's input, normalized copy and
  output (3 h, plus an fp32 1/rms per token), the q / kv latents through
  their norms (3 q_lora, kv_lora + rope + 2 kv_lora), query, key, zero-padded
  value, output (4 x heads x (qk + rope)) and the fp32 log-sum-exp of the
  flash kernel, the output projection's input (heads x v);
* dense SwiGLU MLP and shared expert: fc1's output and the three ffn-sized
  products (5 ffn; 3 ffn on CUDA, where megatron-core fuses bias-SwiGLU);
* MoE: the router's fp32 scores and probabilities and its index tensors,
  then per routed token (T x top-k) the permuted input and the experts' 5 ffn,
  and, in the local spec under HSDP, the stacked expert weights the grouped
  GEMM saves (local experts x 3 x hidden x ffn, per MoE layer: FSDP2 gathers
  each expert's weights into its own tensor, which the experts stack; under
  DDP they are rows of one packed tensor, saved as a view, and Transformer
  Engine's grouped GEMM saves none);
* under CP: the gathered KV latents, K and the padded V for the whole
  sequence (each rank up-projects K/V for all tokens; `attention.cp`).

The peak is reached in backward: everything saved, the logits of every head
(alive until backward ends), and the largest backward working set: the
output layer's weight gradients (three [vocab, hidden] tensors with MTP,
whose two uses of the weight autograd sums) or one MoE layer's (its
recomputed activations under recompute, the stacked expert-weight gradient,
the routed tokens' gradients; the EP all-to-all buffers are listed apart), plus FSDP2's
reduce-scatter input under HSDP. Not modeled: allocator fragmentation and
kernel workspaces (`reserved` in the plan), uneven expert routing (tokens
are assumed balanced over EP ranks), packed-document attention.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..config.model import ModelConfig
from ..config.training import RecomputeConfig

CPU_LOSS_CHUNK_ELEMENTS = 1 << 17  # training.losses.CHUNK_ELEMENTS
CUDA_LOSS_CHUNK_ELEMENTS = 1 << 26  # training.losses.CUDA_CHUNK_ELEMENTS
LOSS_CHUNKS_LIVE = 3  # fp32 temporaries of one chunk of the chunked losses


@dataclass(frozen=True)
class ActivationSetup:
    """What the activation estimate depends on besides the architecture."""

    micro_batch_size: int
    seq_length: int
    cp: int = 1
    ep: int = 1
    bf16: bool = True  # activation elements: 2 bytes, else 4
    sharding: str = "hsdp"
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    device: str = "cuda"  # "cuda" | "cpu": which fusions megatron-core turns on (`models.builder.cuda_fusions`)
    transformer_impl: str = "local"
    moe_dispatch_precision: str = "bf16"

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank."""
        return self.micro_batch_size * self.seq_length // self.cp

    @property
    def a(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def weight_grad_bytes(self) -> int:
        """Bytes per element of a weight gradient as autograd makes it (the compute dtype)."""
        return 2 if self.bf16 else 4

    def recomputes(self, module: str) -> bool:
        r = self.recompute
        return r.recompute_granularity == "selective" and module in (r.recompute_modules or ("core_attn",))


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one layer saves for backward in one micro-batch, by part."""

    attention: int
    kv_latents: int  # CP: the gathered latents of the whole sequence
    mlp: int  # dense MLP, or router + routed experts + shared expert
    stacked_expert_weights: int

    @property
    def total(self) -> int:
        return self.attention + self.kv_latents + self.mlp + self.stacked_expert_weights


def _attention_bytes(c: ModelConfig, x: ActivationSetup) -> tuple[int, int]:
    """(attention bytes saved, gathered KV latents) of one layer."""
    T, a, h, H = x.tokens, x.a, c.hidden_size, c.num_attention_heads
    dq, kv, r = c.qk_head_dim + c.qk_pos_emb_head_dim, c.kv_lora_rank, c.qk_pos_emb_head_dim
    norms = 2 + (1 if c.q_lora_rank else 0) + 1  # input, pre-MLP, q and kv latent RMSNorms
    per_token = 6 * h + (3 * c.q_lora_rank if c.q_lora_rank else 0) + (kv + r) + 2 * kv
    stats = 4 * norms + 4 * H  # fp32 1/rms per norm, fp32 log-sum-exp per head
    rope = 16 * (x.seq_length // x.cp) * r  # four fp32 cos/sin caches [s, 1, 1, rope], per position
    full = x.micro_batch_size * x.seq_length  # K and V cover the whole sequence on every CP rank
    q_and_out = (2 if not x.recomputes("core_attn") else 1) * T * H * dq
    if x.recomputes("core_attn"):  # the checkpoint keeps q, k, v as they enter core attention
        kv_saved = full * H * (dq + c.v_head_dim)
    elif x.recomputes("mla_up_proj"):  # the expanded query and key are freed and recomputed
        q_and_out, kv_saved = T * H * dq, full * H * dq
    else:
        kv_saved = 2 * full * H * dq
    attn = T * per_token * a + T * stats + rope + (q_and_out + kv_saved + T * H * c.v_head_dim) * a
    latents = full * (kv + r) * a if x.cp > 1 else 0
    return attn, latents


def _swiglu_bytes(ffn: int, tokens: int, x: ActivationSetup) -> int:
    return tokens * (3 if x.device == "cuda" else 5) * ffn * x.a


def _moe_bytes(c: ModelConfig, x: ActivationSetup) -> tuple[int, int]:
    """(router + routed + shared bytes, stacked expert weights) of one MoE layer."""
    T, a, h, k, E = x.tokens, x.a, c.hidden_size, c.moe_router_topk, c.num_experts
    groups = c.moe_router_num_groups or 0
    group_topk = c.moe_router_group_topk or 0
    router = T * (E * 10 + k * 20 + 4 + (groups * (k // max(group_topk, 1)) * 8 + group_topk * 8 if groups else 0))
    routed = T * k * ((h + 5 * c.moe_ffn_hidden_size) * a + 4)
    shared = 0
    if c.moe_shared_expert_intermediate_size and not x.recomputes("shared_experts"):
        shared = _swiglu_bytes(c.moe_shared_expert_intermediate_size, T, x)
    stacked = 0
    if x.transformer_impl == "local" and x.sharding == "hsdp":  # moe.grouped: packed under DDP
        stacked = (E // x.ep) * 3 * h * c.moe_ffn_hidden_size * a
    if x.recomputes("moe"):
        return 0, 0
    return router + routed + shared, stacked


def layer_activations(c: ModelConfig, x: ActivationSetup, moe: bool, recompute: bool = True) -> LayerActivations:
    """What one decoder (or MTP transformer) layer saves, with this setup's selective recompute
    (`recompute=False`: none); full recompute is applied by `activation_plan`."""
    if not recompute:
        x = dataclasses.replace(x, recompute=RecomputeConfig())
    attn, latents = _attention_bytes(c, x)
    if moe:
        mlp, stacked = _moe_bytes(c, x)
    else:
        mlp, stacked = (0 if x.recomputes("mlp") else _swiglu_bytes(c.ffn_hidden_size, x.tokens, x)), 0
    return LayerActivations(attn, latents, mlp, stacked)


@dataclass(frozen=True)
class ActivationPlan:
    """Peak activation-side bytes of one GPU in one micro-batch, by category."""

    activations: int  # saved for backward by all layers and the glue around them
    kv_latent_all_gather: int  # CP: gathered latents kept for backward, plus one layer's in flight
    logits_and_loss: int  # the logits of every head (alive until backward ends)
    moe_dispatch_buffers: int  # one EP all-to-all's send + receive buffers
    transient: int  # the largest short-lived working set (module docstring)
    dense_layer: LayerActivations
    moe_layer: Optional[LayerActivations]

    @property
    def total(self) -> int:
        return (self.activations + self.kv_latent_all_gather + self.logits_and_loss + self.moe_dispatch_buffers
                + self.transient)


def _full_recompute(c: ModelConfig, r: RecomputeConfig) -> tuple[int, int, int, bool]:
    """Full recompute: (decoder layers recomputed, checkpoint inputs kept, layers recomputed at once,
    whether the MTP layers are recomputed: megatron-core does so for `uniform` only)."""
    if r.recompute_granularity != "full":
        return 0, 0, 0, False
    n = r.recompute_num_layers or 1
    if r.recompute_method == "uniform":
        return c.num_layers, -(-c.num_layers // n), n, True
    return min(n, c.num_layers), min(n, c.num_layers), 1, False


def _glue_bytes(c: ModelConfig, x: ActivationSetup, mtp_recomputed: bool) -> int:
    """Saved outside the transformer layers: ids, final norms, MTP's input norms and projection
    (its checkpoint's inputs when recomputed), the output layer's input, labels and loss statistics."""
    T, a, h, d = x.tokens, x.a, c.hidden_size, c.mtp_num_layers
    final_norms = (1 + d) * (2 * h * a + 4) if not mtp_recomputed else 2 * h * a + 4
    mtp_glue = d * ((h * a + 16) if mtp_recomputed else (6 * h * a + 16))
    return T * (8 + final_norms + mtp_glue + (1 + d) * h * a + 8 + 8 + 4 * (1 + d))


def _dispatch_bytes(c: ModelConfig, x: ActivationSetup) -> int:
    """One EP all-to-all's send and receive buffers (the permuted tokens are not saved, the sorted
    received copy is, in `activations`): combine in the compute dtype; an MXFP8 dispatch sends
    1 + 1/32 bytes per element but the receiver also dequantizes, so its peak is not lower."""
    if x.ep == 1 or not c.num_moe_layers:
        return 0
    routed = x.tokens * c.moe_router_topk * c.hidden_size
    dispatch = routed * (2 * (1 + 1 / 32) + x.a) if x.moe_dispatch_precision == "mxfp8" else 2 * routed * x.a
    return int(max(dispatch, 2 * routed * x.a))


def activation_plan(c: ModelConfig, x: ActivationSetup) -> ActivationPlan:
    """Estimate the activation-side peak of one micro-batch (module docstring)."""
    T, a, h, V, d = x.tokens, x.a, c.hidden_size, c.vocab_size, c.mtp_num_layers
    dense = layer_activations(c, x, moe=False)
    moe = layer_activations(c, x, moe=True) if c.num_moe_layers else None
    layers = [dense] * c.first_k_dense_layers + [moe] * c.num_moe_layers
    mtp_layer = moe or dense
    recomputed, inputs, at_once, mtp_recomputed = _full_recompute(c, x.recompute)
    kept = layers[recomputed:] + ([] if mtp_recomputed else [mtp_layer] * d)
    saved = sum(l.total - l.kv_latents for l in kept) + inputs * T * h * a + _glue_bytes(c, x, mtp_recomputed)
    # plus one layer's worth in backward: the latent gradient the reduce-scatter sends (or, under
    # full recompute, the recomputed layer's gather)
    latents = sum(l.kv_latents for l in kept) + mtp_layer.kv_latents
    chunk = CUDA_LOSS_CHUNK_ELEMENTS if x.device == "cuda" else CPU_LOSS_CHUNK_ELEMENTS
    loss_chunks = LOSS_CHUNKS_LIVE * min(chunk, T * V) * 4
    head = (1 if d == 0 else 3) * V * h * x.weight_grad_bytes + (1 + d) * T * h * a
    if x.sharding == "hsdp":
        head += V * h * 4  # FSDP2's fp32 reduce-scatter input of the output layer
    layer = _layer_backward_bytes(c, x, moe is not None)
    if recomputed:
        layer += at_once * max(l.total - l.kv_latents for l in layers + [mtp_layer] * d)
    elif x.recompute.recompute_granularity == "selective":
        layer += _recomputed_module_bytes(c, x, moe is not None)
    return ActivationPlan(
        activations=saved, kv_latent_all_gather=latents, logits_and_loss=(1 + d) * T * V * a,
        moe_dispatch_buffers=_dispatch_bytes(c, x), transient=max(head, loss_chunks, layer),
        dense_layer=dense, moe_layer=moe)


def _recomputed_module_bytes(c: ModelConfig, x: ActivationSetup, moe: bool) -> int:
    """Selective recompute: the activations of the largest recomputed module, which exist
    again while its backward runs (modules are recomputed one at a time)."""
    whole = layer_activations(c, x, moe, recompute=False).total
    extra = 0
    for module in x.recompute.recompute_modules or ("core_attn",):
        alone = dataclasses.replace(x, recompute=RecomputeConfig("selective", recompute_modules=(module,)))
        extra = max(extra, whole - layer_activations(c, alone, moe).total)
    return extra


def _layer_backward_bytes(c: ModelConfig, x: ActivationSetup, moe: bool) -> int:
    """The largest working set of one layer's backward beyond its saved tensors: weight
    gradients as autograd makes them (stacked for the grouped experts) and the gradients
    of the routed tokens; under HSDP also FSDP2's fp32 reduce-scatter input."""
    T, a, h = x.tokens, x.a, c.hidden_size
    if not moe:
        weights = 3 * h * c.ffn_hidden_size
        tokens = T * (3 * c.ffn_hidden_size + h) * a
    else:
        weights = (c.num_experts // x.ep) * 3 * h * c.moe_ffn_hidden_size
        tokens = T * c.moe_router_topk * (3 * c.moe_ffn_hidden_size + h) * a
    fsdp = weights * 4 if x.sharding == "hsdp" else 0
    return weights * x.weight_grad_bytes + tokens + fsdp
