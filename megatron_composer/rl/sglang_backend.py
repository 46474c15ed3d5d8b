"""The `sglang` rollout backend: RL's samples from SGLang servers a user runs.

    backend = SGLangBackend.connect(model_cfg, SGLangConfig(url="http://a:30000,http://b:30000"))
    backend.generate(prompts, params)      # token ids in and out, per-token log-probs and versions
    backend.generate_n(prompt, params, n)  # n samples of one prompt in one batched request
    backend.update_weights(state, v)       # {checkpoint name: tensor} -> every server, tagged version v
    backend.close()

Requests go to SGLang's native `/generate` as token ids (`input_ids`; the
server runs with `--skip-tokenizer-init`), with `return_logprob` (the
sampled tokens' log-probs, at the sampling temperature: SGLang's default,
`SGLANG_RETURN_ORIGINAL_LOGPROB` unset; greedy gives them at T = 1) and,
with router replay, `return_routed_experts` (base64 int32 [tokens, MoE
layers, topk]; the shape is checked against the model). Sample i of
`generate_n` is seeded `seed + i` (`sampling_seed`), as our groups are.
Prompts are spread over the servers of `--sglang-url URL[,URL...]`.

Weights after every step go to every server, under Hugging Face DeepSeek-V3
names (`convert.hf_state_dict`), tagged `weight_version`:

    --sglang-weight-transport tensor   POST /update_weights_from_tensor: the named tensors pickled with
                                       torch's multiprocessing reductions (SGLang's
                                       MultiprocessingSerializer, one payload per tensor-parallel rank);
                                       the storage travels through shared memory, so the server runs on
                                       this host
    --sglang-weight-transport disk     POST /update_weights_from_disk: a Hugging Face directory the
                                       converter writes (`--sglang-weight-dir`, a path the server reads)

Both ask SGLang to flush its prefix cache (the tensor route's `flush_cache`;
the disk route flushes on success). As with vLLM, a push waits for the
requests in flight and holds new ones until it is done (`vllm_backend._Gate`),
so every token a request returns carries the version pushed before it; a
server that reports another `weight_version` (someone else pushed) fails the
request rather than mixing versions.

Routed experts: a probe request at start-up asks for them; a server started
without `--enable-return-routed-experts` returns none, and the trainer turns
router replay off, says so, and reports `router replay` 0. A server that
returned them at the probe and then does not fails the request (never a mix
of replayed and unreplayed samples).

The run does not start SGLang itself, and the asynchronous loop does not
drive it (`--async-rl` is refused with this backend).
"""
from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import io
import itertools
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..inference.params import Completion, SamplingParams
from .backends import BackendCapabilities, RolloutBackend, register_backend

WEIGHT_TRANSPORTS = ("tensor", "disk")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SGLangConfig:
    """The `--sglang-*` flags."""

    url: Optional[str] = None  # URL[,URL...]: running SGLang servers (python -m sglang.launch_server ...)
    weight_transport: str = "tensor"  # tensor: /update_weights_from_tensor; disk: /update_weights_from_disk
    weight_dir: Optional[str] = None  # disk: where the HF directory is written (default: a temporary one)
    dtype: Optional[str] = None  # pushed weights; default: bfloat16 when the trainer trains in bf16, else float32

    def __post_init__(self):
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"--sglang-weight-transport {self.weight_transport!r}; use one of "
                             f"{', '.join(WEIGHT_TRANSPORTS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--sglang-dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")

    @property
    def urls(self) -> list[str]:
        return [u.strip() for u in (self.url or "").split(",") if u.strip()]


def serialize_named_tensors(tensors: dict) -> str:
    """[(name, tensor), ...] as SGLang's `MultiprocessingSerializer.serialize(..., output_str=True)` writes
    it: torch's ForkingPickler (storage in shared memory), base64."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(tensors.items()))
    return base64.b64encode(buf.getvalue()).decode()


@register_backend("sglang")
class SGLangBackend(RolloutBackend):
    """SGLang servers behind `/generate` (module docstring). Build with `connect`."""

    shares_weights = False

    def __init__(self, model_cfg, cfg: SGLangConfig, clients: list, *, dtype: torch.dtype = torch.float32,
                 version: int = -1, routed_experts: bool = False):
        from .vllm_backend import _Gate

        self.model_cfg, self.cfg, self.clients, self.dtype = model_cfg, cfg, clients, dtype
        self.version = version
        self._gate = _Gate()
        self._next = itertools.count()
        self.push_seconds: list[float] = []
        self._tp_sizes = [self._tp_size(c) for c in clients]
        routed = routed_experts and all(self._returns_routed_experts(c) for c in clients)
        self.capabilities = BackendCapabilities(routed_experts=routed, policy_versions=True)

    @classmethod
    def connect(cls, model_cfg, cfg: SGLangConfig, *, dtype: torch.dtype = torch.float32, version: int = -1,
                routed_experts: bool = False) -> "SGLangBackend":
        """The servers of `cfg.url` (their weights are whatever they loaded until the first push)."""
        import httpx

        from ..inference.client import HTTPRolloutClient

        if not cfg.urls:
            raise ValueError("--rollout-backend sglang needs --sglang-url URL[,URL...]: start SGLang with "
                             "python -m sglang.launch_server --model-path HF_DIR --skip-tokenizer-init "
                             "(README: Rollouts through vLLM (and SGLang))")
        moe_shape = (model_cfg.num_moe_layers, model_cfg.moe_router_topk)
        clients = [HTTPRolloutClient(url, model="sglang", flavor="sglang", moe_shape=moe_shape) for url in cfg.urls]
        try:
            return cls(model_cfg, cfg, clients, dtype=dtype, version=version, routed_experts=routed_experts)
        except httpx.HTTPError as error:
            for c in clients:
                c.close()
            raise RuntimeError(f"no SGLang server answers at {cfg.url}: {error}; start one (README: Rollouts "
                               "through vLLM (and SGLang)) or fix --sglang-url") from error

    @staticmethod
    def _tp_size(client) -> int:
        """The server's tensor-parallel size (one serialized payload per rank); 1 where it does not say."""
        response = client._http.get("/get_server_info")
        if response.status_code >= 400:
            return 1
        return int(response.json().get("tp_size") or 1)

    @staticmethod
    def _returns_routed_experts(client) -> bool:
        """Probe: does this server return routed experts (`--enable-return-routed-experts`)?"""
        probe = SamplingParams(max_tokens=1, temperature=0, return_routed_experts=True)
        try:
            data = client._post("/generate", client.sglang_body([0], probe))
        except ValueError:  # refused the field
            return False
        meta = data.get("meta_info") if isinstance(data, dict) else None
        return isinstance(meta, dict) and meta.get("routed_experts") is not None

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Prompts spread over the servers, one batched request to each."""
        prompts = [[int(t) for t in p] for p in prompts]
        k = min(len(self.clients), len(prompts))
        if k == 0:
            return []
        start = next(self._next)
        shares = [(self.clients[(start + i) % len(self.clients)], prompts[i::k]) for i in range(k)]
        with self._gate.generating():
            if k == 1:
                results = [self._request(*shares[0], [params] * len(prompts))]
            else:
                with concurrent.futures.ThreadPoolExecutor(k, thread_name_prefix="sglang") as pool:
                    results = list(pool.map(lambda s: self._request(s[0], s[1], [params] * len(s[1])), shares))
        out = [None] * len(prompts)
        for i, completions in enumerate(results):
            out[i::k] = completions
        return out

    def generate_n(self, prompt: list[int], params: SamplingParams, n: int) -> list[Completion]:
        """`n` samples of `prompt` in one batched request to one server, sample i seeded `params.seed + i`."""
        seeds = [None if params.seed is None else (params.seed + i) % 2 ** 63 for i in range(n)]
        client = self.clients[next(self._next) % len(self.clients)]
        prompt = [int(t) for t in prompt]
        with self._gate.generating():
            return self._request(client, [prompt] * n, [dataclasses.replace(params, seed=s) for s in seeds])

    def _request(self, client, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        """One /generate of a batch (SGLang answers a list, one result per prompt), tagged with our version."""
        import httpx

        p = params[0]
        if p.return_routed_experts and not self.capabilities.routed_experts:
            raise ValueError("routed experts were asked of SGLang servers that do not return them (router replay "
                             "is off with this backend; see SGLangBackend.capabilities)")
        bodies = [client.sglang_body(prompt, q) for prompt, q in zip(prompts, params)]
        body = {**bodies[0], "input_ids": prompts}
        if any(b["sampling_params"] != bodies[0]["sampling_params"] for b in bodies):
            body["sampling_params"] = [b["sampling_params"] for b in bodies]
        try:
            data = client._post("/generate", body)
        except httpx.HTTPError as error:
            raise RuntimeError(f"the SGLang server at {client.base_url} failed: {error}; check it is running "
                               "(--sglang-url)") from error
        if not isinstance(data, list) or len(data) != len(prompts):
            raise ValueError(f"SGLang's /generate at {client.base_url} answered a batch of {len(prompts)} with "
                             f"{len(data) if isinstance(data, list) else type(data).__name__} results")
        out = []
        for prompt, result in zip(prompts, data):
            c = client.sglang_completion(prompt, result, p)
            served = result["meta_info"].get("weight_version")
            if self.version >= 0 and str(served).lstrip("-").isdigit() and int(served) != self.version:
                raise RuntimeError(f"the SGLang server at {client.base_url} sampled with weights version {served}, "
                                   f"not the {self.version} this run pushed: does another run push to it?")
            if p.return_routed_experts and c.routed_experts is None:
                raise ValueError(f"the SGLang server at {client.base_url} returned no routed experts, though it did "
                                 "at start-up; router replay needs them for every sample")
            c.policy_versions = [self.version] * len(c.token_ids)
            out.append(c)
        return out

    # ---- weights -------------------------------------------------------------------------
    def update_weights(self, source, version: Optional[int] = None) -> int:
        """Push `source` ({checkpoint name: tensor}, our weights whole) to every server as `version` (default:
        the next); None only moves the version on (a rank that does not publish)."""
        new = self.version + 1 if version is None else int(version)
        if source is None:
            self.version = new
            return new
        if not isinstance(source, dict):
            raise ValueError(f"the sglang backend takes the policy's weights as {{checkpoint name: tensor}}; got "
                             f"{type(source).__name__}")
        from .vllm_backend import _unshared, export_hf_model, hf_files

        started = time.perf_counter()
        with self._gate.swapping():
            if self.cfg.weight_transport == "disk":
                out_dir = self.cfg.weight_dir or self._weight_dir()
                export_hf_model(self.model_cfg, source, out_dir, self.dtype)
                for client in self.clients:
                    client.update_weights(out_dir, version=new)
            else:
                _, tensors = hf_files(self.model_cfg, source, self.dtype)
                tensors = {k: v.contiguous() for k, v in _unshared(tensors).items()}
                for client, tp in zip(self.clients, self._tp_sizes):
                    body = {"serialized_named_tensors": [serialize_named_tensors(tensors) for _ in range(tp)],
                            "load_format": None, "flush_cache": True, "weight_version": str(new)}
                    reply = client._post("/update_weights_from_tensor", body)
                    if not (isinstance(reply, dict) and reply.get("success")):
                        raise ValueError(f"the SGLang server at {client.base_url} refused the weights of version "
                                         f"{new}: {reply.get('message') if isinstance(reply, dict) else reply}")
            self.version = new
        self.push_seconds.append(time.perf_counter() - started)
        return new

    def _weight_dir(self) -> str:
        if not hasattr(self, "_tmp_weight_dir"):
            self._tmp_weight_dir = tempfile.mkdtemp(prefix="sglang-weights-")
        return self._tmp_weight_dir

    def metrics(self) -> dict:
        out = {}
        if self.push_seconds:
            out["weight push seconds"] = self.push_seconds[-1]
            self.push_seconds.clear()
        return out

    def close(self) -> None:
        import shutil

        for client in self.clients:
            client.close()
        if hasattr(self, "_tmp_weight_dir"):
            shutil.rmtree(self._tmp_weight_dir, ignore_errors=True)


def start_for_ranks(model_cfg, cfg: SGLangConfig, state: Optional[dict], *, dtype: torch.dtype, version: int,
                    routed_experts: bool, log=print) -> SGLangBackend:
    """Every trainer rank's backend on the servers of --sglang-url; global rank 0 pushes `state` (our weights,
    whole, on rank 0 only) as `version`, the others wait for it."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    backend = SGLangBackend.connect(model_cfg, cfg, dtype=dtype, routed_experts=routed_experts)
    backend.update_weights(state if rank == 0 else None, version)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    log(f"> rollouts through SGLang at {', '.join(cfg.urls)} (weights by {cfg.weight_transport})")
    return backend
