"""The `vllm` rollout backend: RL's samples from vLLM's OpenAI-compatible server.

    backend = VLLMBackend.launch(model_cfg, state, VLLMConfig(...), workdir)  # a server of ours
    backend = VLLMBackend.connect(model_cfg, VLLMConfig(url=...))            # a server the user runs
    backend.generate(prompts, params)      # token ids in and out, per-token log-probs and versions
    backend.generate_n(prompt, params, n)  # n samples of one prompt in one request
    backend.update_weights(state, v)       # {checkpoint name: tensor} -> vLLM, tagged version v
    backend.close()                        # stops a server of ours

Weights reach vLLM under Hugging Face DeepSeek-V3 names through the
converter's key map (`convert.hf_state_dict`), as one safetensors blob
(`/dev/shm` for a server of ours on this host, base64 in the request for one
elsewhere), loaded by `vllm_worker.WeightSwapExtension` on every vLLM worker.

Policy versions: vLLM does not tag tokens with weights versions, so the
backend makes every request sample one version. `update_weights` waits for
the requests in flight to finish and holds new ones until the swap is done (a
readers-writer gate in this process), so every token a request returns was
sampled by the weights of the version it is tagged with; `pause` / `resume`
also hold vLLM's own scheduler (`POST /pause?mode=keep`). By default a
request is a whole completion, so a push waits for the longest one. With
`--vllm-chunk-tokens K` a completion is generated K tokens per request, each
continuing from the prompt and the tokens so far (PipelineRL's in-flight
updates): a push lands between two chunks of the sequences in flight, which
then continue under the new weights, and each token carries the version of
the chunk that sampled it. The price is one more prefill of the sequence per
chunk where vLLM's prefix cache is off (MLA on CPU); chunk i > 0 of a seeded
request is seeded from the seed and the tokens so far, so a chunked run is as
reproducible as an unchunked one, though not token-equal to it.

Routed experts (router replay): vLLM returns them only with
`--enable-return-routed-experts`, which needs its GPU model runner; a server
that does not return them is found by a probe request at start-up, and the
RL trainer then routes with its own routers and says so (`router replay` 0 in
the metrics), never mixing replayed and unreplayed samples.

A server of ours that dies is started again on the last pushed weights
(`--vllm-restarts`, default once over the run) and the failed requests are
sent again; past that, or for a server given by URL, the call raises with the
server's log tail.
"""
from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Optional

import torch

from ..inference.params import Completion, SamplingParams
from .backends import BackendCapabilities, RolloutBackend, register_backend
from .vllm_server import SERVED_NAME, VLLMConfig, VLLMServer

_SHM = "/dev/shm"


def hf_files(model_cfg, state: dict, dtype: torch.dtype) -> tuple[dict, dict]:
    """(config.json dict, {HF name: tensor}) of our weights (checkpoint names) for vLLM."""
    from ..convert import hf_config_from_model, hf_state_dict

    config = hf_config_from_model(model_cfg, dtype=str(dtype).removeprefix("torch."))
    return config, hf_state_dict(model_cfg, state, dtype=dtype)


def export_hf_model(model_cfg, state: dict, out_dir: str, dtype: torch.dtype) -> str:
    """Write our weights as a Hugging Face DeepSeek-V3 directory vLLM serves (config.json,
    model.safetensors); returns `out_dir`."""
    from safetensors.torch import save_file

    config, tensors = hf_files(model_cfg, state, dtype)
    os.makedirs(out_dir, exist_ok=True)
    save_file(_unshared(tensors), os.path.join(out_dir, "model.safetensors.tmp"))
    os.replace(os.path.join(out_dir, "model.safetensors.tmp"), os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return out_dir


def _unshared(tensors: dict) -> dict:
    """safetensors refuses tensors sharing storage (the MTP layer's copies of the embedding / head)."""
    seen, out = set(), {}
    for name, t in tensors.items():
        out[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    return out


class _Gate:
    """Many generations at once, or one weight swap with none in flight (module docstring)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._active = 0
        self._swapping = False

    @contextmanager
    def generating(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._swapping)
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def swapping(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True
            self._cond.wait_for(lambda: self._active == 0)
        try:
            yield
        finally:
            with self._cond:
                self._swapping = False
                self._cond.notify_all()


@register_backend("vllm")
class VLLMBackend(RolloutBackend):
    """vLLM behind its OpenAI-compatible server (module docstring). Build with `launch` or `connect`."""

    shares_weights = False

    def __init__(self, model_cfg, cfg: VLLMConfig, url: str, *, server: Optional[VLLMServer] = None,
                 dtype: torch.dtype = torch.float32, version: int = 0):
        self.model_cfg, self.cfg, self.server, self.dtype = model_cfg, cfg, server, dtype
        self.version = version
        self.last_push: Optional[str] = None  # a server of ours: the last pushed weights (shared memory)
        self._gate = _Gate()
        self.push_seconds: list[float] = []
        self._spec_seen = (0.0, 0.0)
        self.restarts = 0
        self._connect(url)

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def launch(cls, model_cfg, state: dict, cfg: VLLMConfig, workdir: str, *, max_model_len: int,
               dtype: torch.dtype = torch.float32, version: int = 0, routed_experts: bool = False) -> "VLLMBackend":
        """Start a server of ours on `state` (our weights under checkpoint names) in `workdir` (its model
        dir and log), tagged `version`."""
        model_dir = export_hf_model(model_cfg, state, os.path.join(workdir, "vllm-model"), dtype)
        server = VLLMServer(cfg, model_dir, os.path.join(workdir, "vllm-server.log"),
                            dtype=str(dtype).removeprefix("torch."), max_model_len=cfg.max_model_len or max_model_len,
                            routed_experts=routed_experts)
        try:
            server.start()
            return cls(model_cfg, cfg, server.url, server=server, dtype=dtype, version=version)
        except BaseException:
            server.stop()
            raise

    @classmethod
    def connect(cls, model_cfg, cfg: VLLMConfig, *, dtype: torch.dtype = torch.float32,
                version: int = -1) -> "VLLMBackend":
        """A server the user runs at `cfg.url` (started with `vllm_server.server_command`'s extension, dev
        routes and log-probs mode; its weights are whatever it loaded until the first push)."""
        return cls(model_cfg, cfg, cfg.url, dtype=dtype, version=version)

    def _connect(self, url: str) -> None:
        import httpx

        from ..inference.client import HTTPRolloutClient

        try:
            self.client = HTTPRolloutClient(url, model=SERVED_NAME if self.server else None, flavor="vllm",
                                            moe_shape=(self.model_cfg.num_moe_layers, self.model_cfg.moe_router_topk))
            self.url = self.client.base_url
            routed = self._returns_routed_experts()
        except httpx.HTTPError as error:
            raise RuntimeError(f"no vLLM server answers at {url}: {error}; start one (README: Rollouts through "
                               "vLLM) or leave out --vllm-url to have the run start its own") from error
        self.capabilities = BackendCapabilities(routed_experts=routed, policy_versions=True)

    def _returns_routed_experts(self) -> bool:
        """Probe: does this server answer `return_routed_experts` (vLLM's GPU model runner only)?"""
        body = {"model": self.client.model, "prompt": [0], "max_tokens": 1, "temperature": 0,
                "return_token_ids": True}
        choice = self.client._post("/v1/completions", body)["choices"][0]
        return choice.get("routed_experts") is not None

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.cfg.chunk_tokens:
            return self._chunked_all(prompts, self._params(params))
        return self._retrying(lambda: self._tagged(self.client.generate(prompts, self._params(params))))

    def generate_n(self, prompt: list[int], params: SamplingParams, n: int) -> list[Completion]:
        """`n` samples of `prompt` in one request (vLLM forks them after one prefill where its prefix
        cache is on); sample i is seeded `params.seed + i`, vLLM's rule for `n`. Chunked: n requests."""
        if n == 1:
            return self.generate([prompt], params)
        if self.cfg.chunk_tokens:
            return super().generate_n(prompt, params, n)
        body = self.client._openai_body([int(t) for t in prompt], self._params(params))
        body["n"] = n

        def one():
            data = self.client._post("/v1/completions", body)
            return [self.client.openai_completion(prompt, choice, data, params) for choice in
                    sorted(data["choices"], key=lambda c: c["index"])]

        return self._retrying(lambda: self._tagged(one()))

    def _params(self, params: SamplingParams) -> SamplingParams:
        import dataclasses

        if params.return_routed_experts and not self.capabilities.routed_experts:
            raise ValueError("routed experts were asked of a vLLM server that does not return them "
                             "(router replay is off with this backend; see VLLMBackend.capabilities)")
        if params.speculative:  # vLLM speculates server-side (--vllm-mtp)
            params = dataclasses.replace(params, speculative=None, num_speculative_tokens=None)
        return params

    def _chunked_all(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        import concurrent.futures

        if len(prompts) == 1:
            return [self._chunked(prompts[0], params)]
        with concurrent.futures.ThreadPoolExecutor(len(prompts), thread_name_prefix="vllm-chunks") as pool:
            return list(pool.map(lambda p: self._chunked(p, params), prompts))

    def _chunked(self, prompt: list[int], params: SamplingParams) -> Completion:
        """One completion of `prompt`, `--vllm-chunk-tokens` tokens per request (module docstring): each
        chunk is sampled by one weights version, read inside the gate, and tagged with it."""
        import dataclasses

        if params.return_routed_experts:
            raise ValueError("--vllm-chunk-tokens with routed experts: a continued chunk re-routes the tokens "
                             "before it under newer weights; use --no-router-replay or --vllm-chunk-tokens 0")
        prompt = [int(t) for t in prompt]
        out = Completion(prompt_token_ids=prompt, token_ids=[], logprobs=[], sampling_logprobs=[],
                         routed_experts=None,
                         policy_versions=[], finish_reason="length", top_logprobs=[])
        while len(out.token_ids) < params.max_tokens:
            seed = params.seed
            if seed is not None and out.token_ids:  # a fresh random stream per chunk, reproducible
                seed = (seed * 1_000_003 + len(out.token_ids)) % 2 ** 63
            chunk_params = dataclasses.replace(
                params, seed=seed, max_tokens=min(self.cfg.chunk_tokens, params.max_tokens - len(out.token_ids)))
            context = prompt + out.token_ids
            chunk = self._retrying(lambda: self._tagged(self.client.generate([context], chunk_params)))[0]
            out.token_ids += chunk.token_ids
            out.logprobs += chunk.logprobs
            out.sampling_logprobs += chunk.sampling_logprobs
            out.top_logprobs += chunk.top_logprobs
            out.policy_versions += chunk.policy_versions
            out.text = None
            if chunk.finish_reason != "length" or len(chunk.token_ids) < chunk_params.max_tokens:
                out.finish_reason = chunk.finish_reason
                break
        return out

    def _tagged(self, completions: list[Completion]) -> list[Completion]:
        for c in completions:
            c.policy_versions = [self.version] * len(c.token_ids)
        return completions

    def _retrying(self, call):
        """`call` inside the gate; a dead server of ours is restarted (--vllm-restarts) and `call` re-sent."""
        import httpx

        while True:
            starts = self.server.starts if self.server is not None else 0
            try:
                with self._gate.generating():
                    return call()
            except (httpx.HTTPError, RuntimeError) as error:
                self._recover(error, starts)

    def _recover(self, error: BaseException, starts: int) -> None:
        """After `error` from a call made while the server had been started `starts` times: return to send
        it again (the server was restarted meanwhile, or is now), or raise a clear error."""
        if self.server is None:
            raise RuntimeError(f"the vLLM server at {self.url} failed: {error}; check it is running "
                               "(--vllm-url)") from error
        with self._gate.swapping():
            if self.server.starts != starts:  # another request's failure restarted it
                return
            if self.server.alive():
                raise error
            message = self.server.failure(f"exited with code {self.server.process.returncode}")
            if self.restarts >= self.cfg.restarts:
                raise RuntimeError(f"{message}\n(restarted {self.restarts} time(s) already; --vllm-restarts "
                                   f"{self.cfg.restarts})") from error
            self.restarts += 1
            print(f"[vllm] {message}\n[vllm] restarting it on the weights of version {self.version}", flush=True)
            self.server.start()  # on the weights it started with, then the last pushed ones
            self.client.close()
            self._connect(self.server.url)
            if self.last_push is not None:
                self._rpc("load_hf_weights", "path", self.last_push)

    # ---- weights -------------------------------------------------------------------------
    def update_weights(self, source, version: Optional[int] = None) -> int:
        """Push `source` ({checkpoint name: tensor}, our weights whole) to vLLM as `version` (default: the
        next); None only moves the version on (a rank that does not publish)."""
        new = self.version + 1 if version is None else int(version)
        if source is None:
            self.version = new
            return new
        if not isinstance(source, dict):
            raise ValueError(f"the vllm backend takes the policy's weights as {{checkpoint name: tensor}}; got "
                             f"{type(source).__name__}")
        from safetensors.torch import save, save_file

        import httpx

        started = time.perf_counter()
        _, tensors = hf_files(self.model_cfg, source, self.dtype)
        tensors = _unshared(tensors)
        while True:  # a server of ours that died is restarted (`_recover`) and the push sent again
            starts = self.server.starts if self.server is not None else 0
            try:
                with self._gate.swapping():
                    self._push(tensors, save, save_file)
                    self.version = new
                break
            except (httpx.HTTPError, RuntimeError) as error:
                self._recover(error, starts)
        self.push_seconds.append(time.perf_counter() - started)
        return new

    def _push(self, tensors: dict, save, save_file) -> None:
        if self.server is not None:  # this host: through shared memory, kept for a restart
            fd, path = tempfile.mkstemp(suffix=".safetensors", dir=_SHM if os.path.isdir(_SHM) else None)
            os.close(fd)
            try:
                save_file(tensors, path)
                self._rpc("load_hf_weights", "path", path)
            except BaseException:
                os.unlink(path)
                raise
            self._forget_last_push()
            self.last_push = path
        else:
            self._rpc("load_hf_weights", "b64", base64.b64encode(save(tensors)).decode())

    def _rpc(self, method: str, *args: str):
        """POST /collective_rpc (the server's dev routes); ValueError naming the fix when they are missing."""
        response = self.client._http.post("/collective_rpc", json={"method": method, "args": list(args)})
        if response.status_code == 404:
            raise ValueError(f"the vLLM server at {self.url} has no /collective_rpc: start it with "
                             f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                             f"megatron_composer.rl.vllm_worker.WeightSwapExtension (this checkout on its "
                             "PYTHONPATH)")
        return self.client._check(response)

    def metrics(self) -> dict:
        """Since the last call: the last push's seconds and, with --vllm-mtp, the share of drafted tokens
        vLLM accepted (its Prometheus counters)."""
        out = {}
        if self.push_seconds:
            out["weight push seconds"] = self.push_seconds[-1]
            self.push_seconds.clear()
        if self.cfg.mtp:
            counts = self.speculative_counts()
            if counts is not None:
                drafted = counts[1] - self._spec_seen[1]
                if drafted > 0:
                    out["mtp acceptance"] = (counts[0] - self._spec_seen[0]) / drafted
                self._spec_seen = counts
        return out

    def speculative_counts(self) -> Optional[tuple[float, float]]:
        """(accepted, drafted) tokens of vLLM's speculative decoding so far, from GET /metrics; None where the
        server does not export them."""
        text = self.client._http.get("/metrics").text
        found = {}
        for line in text.splitlines():
            for key in ("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"):
                if line.startswith(f"vllm:{key}"):
                    found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        if len(found) < 2:
            return None
        return found["spec_decode_num_accepted_tokens_total"], found["spec_decode_num_draft_tokens_total"]

    def pause(self) -> None:
        self.client._post("/pause?mode=keep", {})

    def resume(self) -> None:
        self.client._post("/resume", {})

    def _forget_last_push(self) -> None:
        if self.last_push is not None and os.path.exists(self.last_push):
            os.unlink(self.last_push)
        self.last_push = None

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.stop()
        self._forget_last_push()


def start_for_ranks(model_cfg, cfg: VLLMConfig, state: Optional[dict], *, dtype: torch.dtype, version: int,
                    max_model_len: int, routed_experts: bool, log=print) -> tuple[VLLMBackend, Optional[str]]:
    """The backend of every trainer rank: global rank 0 starts a server on `state` (our weights, whole, on
    rank 0 only) in a temporary directory, or connects to --vllm-url and pushes them; the other ranks
    connect to the URL rank 0 names. Returns (backend, the directory to remove at the end or None)."""
    import dataclasses

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    url, workdir, backend = [None], None, None
    if rank == 0:
        if cfg.url:
            backend = VLLMBackend.connect(model_cfg, cfg, dtype=dtype)
            backend.update_weights(state, version)
        else:
            workdir = tempfile.mkdtemp(prefix="vllm-rollouts-")
            log(f"> starting a vLLM server (log {workdir}/vllm-server.log)")
            try:
                backend = VLLMBackend.launch(model_cfg, state, cfg, workdir, max_model_len=max_model_len,
                                             dtype=dtype, version=version, routed_experts=routed_experts)
            except BaseException:  # the error quotes the log's tail; the directory goes
                import shutil

                shutil.rmtree(workdir, ignore_errors=True)
                raise
        url = [backend.url]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(url, src=0)
        if rank != 0:
            backend = VLLMBackend.connect(model_cfg, dataclasses.replace(cfg, url=url[0]), dtype=dtype,
                                          version=version)
    log(f"> rollouts through vLLM at {url[0]}")
    return backend, workdir
