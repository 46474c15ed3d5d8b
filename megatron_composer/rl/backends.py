"""Where RL's rollouts come from: the `RolloutBackend` interface and its registry.

A backend is token ids in, token ids out:

    generate(prompts, params)   one `inference.Completion` per prompt: generated ids, the sampler's
                                per-token log-probs (at the sampling temperature), the policy version
                                of every token, and the routed experts where the backend records them
    generate_n(prompt, p, n)    n samples of one prompt, sample i seeded p.seed + i
    update_weights(source, v)   new weights (a state dict, a weight-sync update, or None for weights
                                shared in process: `shares_weights`), tagged with version v
    metrics()                   what the backend measured since the last call (weight-push seconds, ...)
    pause() / resume()          hold new scheduling around an in-flight update (sequences in flight
                                keep their cache and continue on the new weights after `resume`)

Every backend returns the sampled tokens' log-probs over the full vocabulary
at the sampling temperature, what the trainer computes too (top-p / top-k
truncation is refused in RL: `policy_losses.check_rl_sampling`).
`capabilities` says what else a backend returns, so the RL loop checks its
flags once at start-up (router replay needs routed experts).

Registered here: `engine` (our engine in this process, sharing the trainer's
weights: laptops, tests, the exactness reference) and `http` (a server of
ours, vLLM or SGLang behind `inference.HTTPRolloutClient`); `vllm_backend`
registers `vllm` (vLLM's server, started by the run or given by URL, weights
pushed after every step) and `sglang_backend` `sglang` (SGLang servers given by
URL, the same). The async services add a Ray actor's handle
(`async_rl.services.RayBackend`). A backend driven some other way is one more
`@register_backend` class; nothing outside the backends branches on which
one runs.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..inference import SamplingParams
from ..inference.params import Completion
from .registry import Registry


@dataclasses.dataclass(frozen=True)
class BackendCapabilities:
    routed_experts: bool  # returns the experts every token was routed to (router replay, R3)
    policy_versions: bool  # tags every generated token with the weights version that produced it


class RolloutBackend:
    """The interface (module docstring). Subclasses implement `generate` and `update_weights`."""

    name = "abstract"
    capabilities = BackendCapabilities(routed_experts=False, policy_versions=False)
    shares_weights = False  # True: serves the trainer's own weight tensors (update_weights(None, v))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        raise NotImplementedError

    def generate_n(self, prompt: list[int], params: SamplingParams, n: int) -> list[Completion]:
        """`n` samples of `prompt`, sample i seeded `params.seed + i` (vLLM's rule for its `n`); here as
        `n` concurrent requests, which a batching backend serves in one batch."""
        import concurrent.futures
        import dataclasses

        seeds = [None if params.seed is None else (params.seed + i) % 2 ** 63 for i in range(n)]
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda s: self.generate([prompt], dataclasses.replace(params, seed=s))[0], seeds))

    def metrics(self) -> dict:
        """What the backend measured since the last call, for the step's metrics (none here)."""
        return {}

    def update_weights(self, source, version: Optional[int] = None) -> int:
        raise NotImplementedError

    def pause(self) -> None:
        """Stop scheduling new decode steps until `resume` (no-op where the backend swaps atomically)."""

    def resume(self) -> None:
        """Resume after `pause`."""

    def start(self) -> None:
        """Begin serving concurrent callers (threads); `stop` ends it. No-op for remote backends."""

    def stop(self) -> None:
        pass

    def close(self) -> None:
        self.stop()


BACKENDS = Registry("rollout backend", set_name=True)
register_backend = BACKENDS.register  # class decorator: `@register_backend("name")`
get_backend = BACKENDS.get_entry


@register_backend("engine")
class EngineBackend(RolloutBackend):
    """Our `inference.Engine` in this process. Colocated with the trainer it shares the model object, so
    `update_weights(None, version)` only moves the version on; a state dict or a delta is swapped in
    between two decode steps."""

    capabilities = BackendCapabilities(routed_experts=True, policy_versions=True)
    shares_weights = True

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def update_weights(self, source, version=None):
        return self.engine.update_weights(source, version=version)

    def pause(self):
        self.engine.pause()

    def resume(self):
        self.engine.resume()

    def start(self):
        self.engine.start()

    def stop(self):
        self.engine.stop()


@register_backend("http")
class HTTPBackend(RolloutBackend):
    """An OpenAI-compatible server (ours, vLLM or SGLang) through `inference.HTTPRolloutClient`. Our server
    returns routed experts and per-token versions; what vLLM and SGLang return is the client's docstring."""

    def __init__(self, url: str, *, max_concurrency: int = 16, client=None):
        from ..inference.client import HTTPRolloutClient

        self.client = client or HTTPRolloutClient(url, max_concurrency=max_concurrency)
        ours = self.client.flavor == "megatron-composer"
        self.capabilities = BackendCapabilities(routed_experts=ours, policy_versions=ours)

    @property
    def flavor(self) -> str:
        return self.client.flavor

    def generate(self, prompts, params):
        return self.client.generate(prompts, params)

    def update_weights(self, source, version=None):
        return self.client.update_weights(source, version=version)

    def close(self):
        self.client.close()


def check_backend(backend: RolloutBackend, *, router_replay: bool) -> None:
    """Refuse RL settings the backend cannot serve (ValueError naming the fix)."""
    if router_replay and not backend.capabilities.routed_experts:
        raise ValueError(f"router replay needs the routed experts of every token; the {backend.name} backend "
                         f"does not return them; use --no-router-replay or a backend that does (engine, our server)")
