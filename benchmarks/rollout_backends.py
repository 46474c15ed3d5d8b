"""The same agentic episodes through our engine and through vLLM: episodes/s, tokens/s, prefill, pushes.

    python benchmarks/rollout_backends.py [--groups 2 --group-size 4 --max-turns 3 --max-new-tokens 32]
                                          [--load CKPT] [--vllm-python PY] [--vllm-url URL] [--pushes 3]

One model (`--load`, else the `tiny-vllm` preset freshly initialized: vLLM's
CPU MLA kernel takes only its attention sizes), the agentic coding
environment on the embedded corpus's tokenizer, and the same groups (task,
seeds, max turns, sampling) run through each backend: our engine in this
process (`EngineBackend`) and a vLLM server (`VLLMBackend`, started in vLLM's
venv unless --vllm-url). Printed per backend, one line each:

    episodes/s          episodes over the wall time of all groups (groups one after another, a
                        group's episodes at once: --episode-workers)
    gen tok/s           generated tokens (model turns) per second
    prefill tok/ep      prompt tokens sent per episode: every turn sends the whole context, which our
                        engine prefills again; vLLM's prefix cache (on GPUs; off for MLA on CPU)
                        saves the part it has cached ("cached" in the line, from its /metrics)
    push s              seconds to swap in the whole policy: our engine copies a state dict in
                        process; vLLM gets it through the worker extension (safetensors in /dev/shm)

The episodes differ between the backends after the first sampled token (two
samplers); the counts are the work each did. On 2 CPU cores our engine is
faster for this 6M-parameter model (vLLM's CPU build binds one core and pays
HTTP and scheduling per token); on a GPU, run it with --load of a real
checkpoint to see the other side.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


class Counting:
    """A backend that counts what it is asked: requests, prompt tokens sent, tokens generated."""

    def __init__(self, backend):
        self.backend, self.prompt_tokens, self.generated = backend, 0, 0
        self.name, self.capabilities = backend.name, backend.capabilities

    def _count(self, prompts, out):
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.generated += sum(len(c.token_ids) for c in out)
        return out

    def generate(self, prompts, params):
        return self._count(prompts, self.backend.generate(prompts, params))

    def generate_n(self, prompt, params, n):
        return self._count([prompt] * n, self.backend.generate_n(prompt, params, n))


def _model(args, data):
    from megatron_composer.checkpoint.state import model_state_dict
    from megatron_composer.config import get_preset
    from megatron_composer.models import build_model
    from megatron_composer.models.loading import load_checkpoint_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    init_distributed()
    if args.load:
        model, cfg = load_checkpoint_model(args.load, seq_length=args.seq_length)
    else:
        layout = ParallelLayout(world_size=1)
        initialize_parallel(layout, seed=1)
        cfg = get_preset("tiny-vllm")
        model = build_model(cfg, layout, seq_length=args.seq_length)
    model.eval()
    return model, cfg, {k: v.detach().clone() for k, v in model_state_dict(model).items()}


def _run(env, backend, args) -> tuple[float, int]:
    started = time.perf_counter()
    episodes = 0
    for g in range(args.groups):
        episodes += len({s.trajectory for s in env.run_group(backend, g, env.seeds(args.seed, g))})
    return time.perf_counter() - started, episodes


def _line(name, seconds, episodes, counted, push, extra=""):
    return (f"{name:7s} episodes/s {episodes / seconds:7.3f} | gen tok/s {counted.generated / seconds:8.1f} | "
            f"prefill tok/ep {counted.prompt_tokens / episodes:8.1f}{extra} | push s {push:.3f} | "
            f"{episodes} episodes, {counted.generated} generated tokens in {seconds:.1f} s")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", default=None, help="a checkpoint of ours (default: tiny-vllm, random)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pushes", type=int, default=3, help="weight pushes timed per backend")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--vllm-url", default=None)
    p.add_argument("--vllm-mtp", type=int, default=0)
    args = p.parse_args(argv)

    from megatron_composer.data import default_cpt_data
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.inference.engine import Engine
    from megatron_composer.rl.backends import EngineBackend
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.environments import build_environment
    from megatron_composer.rl.vllm_backend import VLLMBackend
    from megatron_composer.rl.vllm_server import VLLMConfig

    data = default_cpt_data("data", progress=False)
    tokenizer = Tokenizer(str(data.tokenizer_model))
    model, cfg, state = _model(args, data)
    rl = RLConfig.from_flat(env="agentic-coding", group_size=args.group_size, max_turns=args.max_turns,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, router_replay=False,
                            episode_workers=args.group_size)
    env = build_environment(rl, tokenizer, args.seq_length)
    print(f"{args.groups} groups x {args.group_size} episodes of {env.describe()}; model {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}, {sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters, "
          f"{torch.get_num_threads()} threads", flush=True)

    engine = Engine(model, cfg, tokenizer, max_batch_size=args.group_size, max_model_len=args.seq_length)
    ours = Counting(EngineBackend(engine))
    engine.start()
    try:
        seconds, episodes = _run(env, ours, args)
    finally:
        engine.stop()
    pushes = []
    for v in range(args.pushes):
        started = time.perf_counter()
        engine.update_weights(state, version=v + 1)
        pushes.append(time.perf_counter() - started)
    print(_line("engine", seconds, episodes, ours, sum(pushes) / len(pushes)), flush=True)

    vcfg = VLLMConfig(url=args.vllm_url, python=args.vllm_python, mtp=args.vllm_mtp)
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        started = time.perf_counter()
        backend = (VLLMBackend.connect(cfg, vcfg) if args.vllm_url else
                   VLLMBackend.launch(cfg, state, vcfg, tmp, max_model_len=args.seq_length))
        print(f"vLLM server ready in {time.perf_counter() - started:.0f} s", flush=True)
        try:
            for v in range(args.pushes):
                backend.update_weights(state, v + 1)
            push = sum(backend.push_seconds) / len(backend.push_seconds)
            hits_before = _prefix_hits(backend)
            theirs = Counting(backend)
            seconds, episodes = _run(env, theirs, args)
            cached = _prefix_hits(backend) - hits_before
            extra = f" ({cached / episodes:.1f} cached)"
            acceptance = backend.metrics().get("mtp acceptance")
            if acceptance is not None:
                extra += f", MTP acceptance {acceptance:.2f}"
            print(_line("vllm", seconds, episodes, theirs, push, extra), flush=True)
        finally:
            backend.close()


def _prefix_hits(backend) -> float:
    """Prompt tokens vLLM served from its prefix cache so far (its /metrics)."""
    text = backend.client._http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


if __name__ == "__main__":
    main()
