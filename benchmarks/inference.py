"""Decode tokens/s of our inference engine against transformers' `generate()`.

    python benchmarks/inference.py [--prompt-len 32] [--new-tokens 64] [--repeats 5] [--batch-sizes 1 16] [--threads N]

Both run in this one process on the same model: a random transformers
`DeepseekV3ForCausalLM` the size of our `tiny` preset (hidden 128, 4 layers,
4 heads, q LoRA 64, kv LoRA 32, qk nope 32 / rope 16, v 32, 8 routed experts
top-2 plus 1 shared, first layer dense, vocab 4096), saved with
`save_pretrained` and converted with `convert.hf_to_mcore`, then loaded with
`Engine.from_checkpoint`; the same fp32 weights on both sides.

* baseline: transformers' `model.generate(do_sample=False, use_cache=True)`
  (its DynamicCache of per-head keys and values, SDPA attention), with no
  EOS id so that every sequence runs to exactly `--new-tokens`.
* ours: `Engine.generate` with `SamplingParams(temperature=0)` (greedy over
  the MLA latent cache, continuous batching of the batch's requests).

The same prompts go to both. Timings are interleaved (one generation of
each in turn, `--repeats` times) and medians are reported, so load from other
jobs on a shared machine hits both alike. "tokens/s" counts generated tokens
over the whole call (prefill included); "decode tokens/s" removes the
prefill by subtracting the median time of a 1-token generation of the same
prompts. The ratio is ours / transformers; "cpu" is the same ratio of
process CPU time (less sensitive than wall-clock time to other jobs on a
shared machine). It also prints the fraction of
greedy tokens on which the two agree (the models are the same, so they differ
only where fp32 reassociation flips a near-tie) and the KV-cache bytes per
token: our latents, per-head K and V expanded, and what transformers'
DynamicCache actually holds after a forward (transformers' DeepSeek-V3 caches
the same latents, [c_kv | k_pe], and re-expands per-head keys and values
over the whole context with `kv_b_proj` at every step; ours attends in the
latent space with the absorbed up-projection).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

TINY_HF = dict(
    vocab_size=4096, hidden_size=128, intermediate_size=384, moe_intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
    first_k_dense_replace=1, max_position_embeddings=4096, initializer_range=0.1,
    num_nextn_predict_layers=0, tie_word_embeddings=False,
)


def build_models(workdir: str, max_model_len: int, max_batch_size: int):
    """(transformers model, our Engine) on the same random weights (see the module docstring)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from megatron_composer.convert import hf_to_mcore
    from megatron_composer.inference.engine import Engine

    torch.manual_seed(0)
    config = DeepseekV3Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              attn_implementation="sdpa", **TINY_HF)
    hf = DeepseekV3ForCausalLM(config).eval()
    hf.generation_config.eos_token_id = None  # every sequence runs to max_new_tokens
    hf.generation_config.pad_token_id = 0
    hf_dir, ours_dir = os.path.join(workdir, "hf"), os.path.join(workdir, "mc")
    hf.save_pretrained(hf_dir)
    hf_to_mcore(hf_dir, ours_dir, progress=False)
    engine = Engine.from_checkpoint(ours_dir, device="cpu", dtype=torch.float32,
                                    max_model_len=max_model_len, max_batch_size=max_batch_size)
    return hf, engine


def hf_generate(hf, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, use_cache=True)
    return out[:, prompts.shape[1]:].tolist()


def ours_generate(engine, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    from megatron_composer.inference import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    return [c.token_ids for c in engine.generate(prompts.tolist(), params)]


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions with equal tokens, fraction of each sequence's tokens before the
    first difference, averaged over sequences)."""
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    total = sum(len(s) for s in a)
    prefixes = []
    for sa, sb in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), len(sa))
        prefixes.append(n / len(sa))
    return same / total, statistics.mean(prefixes)


def hf_cache_bytes_per_token(hf, prompt: torch.Tensor) -> int:
    """Bytes transformers' DynamicCache holds per token after a forward over `prompt` [1, s]."""
    with torch.no_grad():
        cache = hf(prompt, use_cache=True).cache
    total = 0
    for layer in cache.layers:
        total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total // prompt.shape[1]


def timed(fn, *args) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_batch(hf, engine, prompts, new_tokens: int, repeats: int) -> dict:
    """{side: {"wall" | "cpu": (median seconds of `new_tokens`, of 1-token generations)}}, interleaved."""
    runs = {name: {"full": [], "single": []} for name in ("hf", "ours")}
    fns = {"hf": hf_generate, "ours": ours_generate}
    model = {"hf": hf, "ours": engine}
    for name in fns:  # warm-up (first-call allocations, the engine's cache)
        fns[name](model[name], prompts, new_tokens)
    for _ in range(repeats):
        for name, run in runs.items():
            run["full"].append(timed(fns[name], model[name], prompts, new_tokens))
            run["single"].append(timed(fns[name], model[name], prompts, 1))
    return {name: {clock: tuple(statistics.median(t[i] for t in run[kind]) for kind in ("full", "single"))
                   for i, clock in enumerate(("wall", "cpu"))} for name, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens {args.new_tokens}: decode tokens/s needs at least 2; use e.g. 64")

    with tempfile.TemporaryDirectory() as workdir:
        hf, engine = build_models(workdir, args.prompt_len + args.new_tokens + 1, max(args.batch_sizes))
    g = torch.Generator().manual_seed(1)
    vocab = TINY_HF["vocab_size"]
    print(f"tiny-sized DeepSeek-V3, fp32 on CPU, {torch.get_num_threads()} threads; prompt {args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens, median of {args.repeats} interleaved runs")
    print("baseline: transformers generate(do_sample=False, use_cache=True), same weights, same prompts")
    for batch in args.batch_sizes:
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=g)
        same, prefix = greedy_agreement(hf_generate(hf, prompts, args.new_tokens),
                                        ours_generate(engine, prompts, args.new_tokens))
        t = bench_batch(hf, engine, prompts, args.new_tokens, args.repeats)
        rate = {k: batch * args.new_tokens / v["wall"][0] for k, v in t.items()}
        decode = {k: batch * (args.new_tokens - 1) / (v["wall"][0] - v["wall"][1]) for k, v in t.items()}
        cpu = t["hf"]["cpu"][0] / t["ours"]["cpu"][0]
        cpu_decode = (t["hf"]["cpu"][0] - t["hf"]["cpu"][1]) / (t["ours"]["cpu"][0] - t["ours"]["cpu"][1])
        print(f"batch {batch:2d}: tokens/s ours {rate['ours']:7.1f}  transformers {rate['hf']:7.1f}  "
              f"ratio {rate['ours'] / rate['hf']:.2f}x (cpu {cpu:.2f}x) | decode tokens/s ours "
              f"{decode['ours']:7.1f}  transformers {decode['hf']:7.1f}  ratio {decode['ours'] / decode['hf']:.2f}x "
              f"(cpu {cpu_decode:.2f}x) | greedy tokens equal {same:.3f} (agreeing prefix {prefix:.3f})")
    kv = engine.kv_cache_bytes_per_token()
    hf_kv = hf_cache_bytes_per_token(hf, torch.randint(0, vocab, (1, args.prompt_len), generator=g))
    print(f"KV cache bytes per token (4 layers, fp32): ours latent {kv['latent']}, per-head K+V expanded "
          f"{kv['expanded']} ({kv['expanded'] / kv['latent']:.2f}x), transformers DynamicCache {hf_kv} "
          f"({hf_kv / kv['latent']:.2f}x ours)")


if __name__ == "__main__":
    main()
