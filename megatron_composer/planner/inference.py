"""Memory and decode time of one rollout engine (`inference.Engine`) on one GPU.

What an asynchronous RL inference worker allocates (`rl.async_rl.services.build_engine`):

* start-up: megatron-core initializes the model on the current device in
  fp32 (4 bytes per parameter), then the worker casts it to bf16 tensor by
  tensor, so its start-up peak is the fp32 model (exact);
* running: the bf16 weights (exact); the latent KV cache (exact), allocated
  whole at the first request: per layer (trunk, and the MTP layers when the
  model has them) and cache slot (`--rollout-batch-size`), max_model_len + 1
  positions (+ 1: a speculative draft of the last token) of
  kv_lora_rank + qk_pos_emb_head_dim values (MLA caches the compressed
  latent and the shared RoPE key, not per-head K and V); the largest working
  set of one engine step (estimate): decoding every slot at full length, one
  layer's gathered latents [slots, L, kv_lora + rope] and its fp32 scores,
  masked scores and probabilities plus the probabilities in the cache dtype
  [slots, heads, L] (`runner.ModelRunner._attend`), or a prefill chunk's
  [heads, chunk, L] of the same; and the fp32 logits and log-probs of the
  slots' rows; `reserved` for the CUDA context and fragmentation.

With `gpus_per_worker` G > 1 the routed experts are split over the worker's
G GPUs and each GPU caches and attends for its 1 / G of the slots: a layout
the engine does not run (it holds whole weights per process) but that the
planner can size. G = 1 is what `train_rl.py --async-rl` runs.

Decode time (estimate): one engine step over B running sequences reads the
weights its tokens touch (every dense weight; of each MoE layer's E experts
the E (1 - (1 - k/E)^B) that B tokens routed to top-k reach on average) and
the cached latents of the B sequences, and computes 2 x active parameters
plus the absorbed attention per token; it takes the longer of bytes / HBM
bandwidth and FLOPs / (peak x MFU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config.model import ModelConfig, count_parameters, parameter_inventory

GiB = 1 << 30
RESERVED_BYTES = 5 * GiB  # CUDA context, allocator fragmentation (as the trainer plan's --reserved-gib)
PREFILL_CHUNK = 256  # inference.Engine's default prefill_chunk_size
CACHE_BYTES = 2  # bf16 on CUDA (`build_engine`)


@dataclass(frozen=True)
class EngineShape:
    """What the engine's memory depends on besides the architecture."""

    max_model_len: int  # the longest prompt + completion (`--seq-length`)
    max_batch_size: int  # cache slots (`--rollout-batch-size`)
    gpus_per_worker: int = 1
    reserved_bytes: int = RESERVED_BYTES

    @property
    def slots_per_gpu(self) -> int:
        return -(-self.max_batch_size // self.gpus_per_worker)


def kv_cache_bytes(c: ModelConfig, slots: int, max_model_len: int, bytes_per_value: int = CACHE_BYTES) -> int:
    """The engine's latent cache: (layers + MTP layers) x slots x (max_model_len + 1) x (kv_lora_rank +
    qk_pos_emb_head_dim) values."""
    width = c.kv_lora_rank + c.qk_pos_emb_head_dim
    return (c.num_layers + c.mtp_num_layers) * slots * (max_model_len + 1) * width * bytes_per_value


def weight_elements(c: ModelConfig, gpus_per_worker: int = 1) -> int:
    """Parameters on one GPU of a worker: every dense weight, 1 / G of the routed experts."""
    inventory = parameter_inventory(c)
    dense = sum(p.numel for p in inventory if not p.expert)
    experts = sum(p.numel for p in inventory if p.expert)
    return dense + -(-experts // gpus_per_worker)


def _working_set(c: ModelConfig, x: EngineShape) -> int:
    """The largest transient of one engine step on one GPU (module docstring)."""
    B, L, H = x.slots_per_gpu, x.max_model_len + 1, c.num_attention_heads
    width = c.kv_lora_rank + c.qk_pos_emb_head_dim
    decode = B * L * width * CACHE_BYTES + B * H * L * (3 * 4 + CACHE_BYTES)
    prefill = PREFILL_CHUNK * H * L * (3 * 4 + CACHE_BYTES)
    rows = B + PREFILL_CHUNK
    logits = 2 * rows * c.vocab_size * 4
    return max(decode, prefill) + logits


def engine_memory(c: ModelConfig, x: EngineShape) -> dict:
    """Bytes on one GPU of an inference worker by category; "total" is the running peak,
    "startup" the fp32 model megatron-core builds first (module docstring)."""
    weights = weight_elements(c, x.gpus_per_worker)
    memory = {"weights": weights * CACHE_BYTES,
              "kv_cache": kv_cache_bytes(c, x.slots_per_gpu, x.max_model_len),
              "working_set": _working_set(c, x), "reserved": x.reserved_bytes}
    memory["total"] = sum(memory.values())
    memory["startup"] = weights * 4 + x.reserved_bytes
    return memory


def peak_bytes(memory: dict) -> int:
    return max(memory["total"], memory["startup"])


def largest_batch_that_fits(c: ModelConfig, x: EngineShape, capacity: int) -> int:
    """The most cache slots (`--rollout-batch-size`) with which the engine fits `capacity`, 0 if none."""
    import dataclasses

    lo, hi = 0, x.max_batch_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak_bytes(engine_memory(c, dataclasses.replace(x, max_batch_size=mid))) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_inference_worker_fits(c: ModelConfig, x: EngineShape, capacity: int, model_name: str = "the model") -> dict:
    """The engine's memory (`engine_memory`) when it fits a GPU of `capacity` bytes; else ValueError with
    the planner's numbers and what would fit."""
    memory = engine_memory(c, x)
    need = peak_bytes(memory)
    if need <= capacity:
        return memory
    g = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    holds = "holds the whole model" if x.gpus_per_worker == 1 else f"holds 1/{x.gpus_per_worker} of the experts"
    parts = (f"bf16 weights {g(memory['weights'])} ({memory['weights'] // CACHE_BYTES / 1e9:.2f}B parameters; "
             f"built in fp32 first: {g(memory['startup'] - x.reserved_bytes)}), latent KV cache "
             f"{g(memory['kv_cache'])} ({x.slots_per_gpu} slots x {x.max_model_len + 1} tokens), engine step "
             f"{g(memory['working_set'])}, reserved {g(x.reserved_bytes)}")
    slots = largest_batch_that_fits(c, x, capacity)
    if slots:
        fix = f"use --rollout-batch-size {slots} or less, or a shorter --seq-length"
    else:
        most = (capacity - x.reserved_bytes) // 4 * x.gpus_per_worker / 1e9
        fix = (f"the weights alone do not fit: an inference worker on this GPU builds at most about {most:.1f}B "
               f"parameters (fp32 first); use a smaller model")
    raise ValueError(f"an inference worker {holds} of {model_name} on one GPU: it needs {g(need)} but the GPU "
                     f"has {g(capacity)}: {parts}; {fix} (tools/plan.py --stage rl plans the layout)")


def check_local_inference_worker(model_config: dict, max_model_len: int, max_batch_size: int) -> None:
    """`check_inference_worker_fits` against the memory of this process's GPU (none: nothing to check)."""
    import torch

    from ..config import model_config_from_dict

    if torch.cuda.is_available():
        capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        check_inference_worker_fits(model_config_from_dict(model_config), EngineShape(max_model_len, max_batch_size),
                                    capacity)


def _experts_touched(c: ModelConfig, tokens: int) -> float:
    """Expected routed experts of one MoE layer that `tokens` tokens reach (each picks top-k of E)."""
    E, k = c.num_experts, c.moe_router_topk
    return E * (1 - (1 - k / E) ** tokens)


def decode_step_seconds(c: ModelConfig, batch: int, context: int, *, hbm_gbps: float, tflops: float,
                        mfu: float, gpus_per_worker: int = 1) -> float:
    """One decode step of `batch` sequences at `context` cached tokens each on one GPU, which holds 1 / G
    of the routed experts (module docstring)."""
    inventory = parameter_inventory(c)
    dense = sum(p.numel for p in inventory if not p.expert)
    moe_layers = c.num_moe_layers + (c.mtp_num_layers if c.num_moe_layers else 0)
    expert = 3 * c.hidden_size * c.moe_ffn_hidden_size
    touched = moe_layers * _experts_touched(c, batch * gpus_per_worker) * expert / gpus_per_worker if moe_layers else 0
    width = c.kv_lora_rank + c.qk_pos_emb_head_dim
    layers = c.num_layers + c.mtp_num_layers
    read = (dense + touched) * CACHE_BYTES + batch * context * layers * width * CACHE_BYTES
    counts = count_parameters(c)
    attention = 2 * c.num_attention_heads * context * (width + c.kv_lora_rank) * layers
    flops = batch * (2 * (counts.active + counts.mtp_active) + attention)
    return max(read / (hbm_gbps * 1e9), flops / (tflops * 1e12 * mfu))


def prefill_seconds(c: ModelConfig, tokens: int, *, tflops: float, mfu: float) -> float:
    """Prompt tokens through the trunk (compute-bound), causal attention over half the prompt on average."""
    counts = count_parameters(c)
    width = c.kv_lora_rank + c.qk_pos_emb_head_dim
    attention = 2 * c.num_attention_heads * (tokens / 2) * (width + c.kv_lora_rank) * c.num_layers
    return tokens * (2 * counts.active + attention) / (tflops * 1e12 * mfu)


def rollout_seconds(c: ModelConfig, *, samples: int, prompt_tokens: int, response_tokens: int, workers: int,
                    slots: int, hbm_gbps: float, tflops: float, mfu: float,
                    gpus_per_worker: int = 1) -> Optional[dict]:
    """Seconds to sample one step's `samples` on `workers` engines of `slots` each: full batches, no tool
    time, every sample at its full length; None without workers."""
    if workers < 1:
        return None
    per_worker = -(-samples // workers)
    batch = min(slots, per_worker)
    waves = -(-per_worker // batch)
    per_gpu = -(-batch // gpus_per_worker)
    context = prompt_tokens + response_tokens // 2
    decode = waves * response_tokens * decode_step_seconds(c, per_gpu, context, hbm_gbps=hbm_gbps, tflops=tflops,
                                                           mfu=mfu, gpus_per_worker=gpus_per_worker)
    prefill = prefill_seconds(c, prompt_tokens, tflops=tflops, mfu=mfu) * per_worker / gpus_per_worker
    return {"batch": batch, "waves": waves, "decode": decode, "prefill": prefill, "rollout": decode + prefill,
            "generated_tokens_per_second_per_worker": per_worker * response_tokens / (decode + prefill)}
