"""Where RL gets rollouts: the in-process `Engine`, or any OpenAI-compatible server over HTTP.

`RolloutClient` is what the RL loop depends on: `generate(prompts, params)`
returns one `Completion` per prompt (token ids in, token ids out) and
`update_weights(source, version)` pushes new weights. `Engine` satisfies it as
it is; `HTTPRolloutClient` talks to our server (`server.py`), vLLM or SGLang.
It sends prompts as token ids and reads generated ids back, so text is never
re-tokenized; requests go out concurrently (a thread pool) so the server
batches them.

What corresponds to what, as read in the vLLM docs (routed experts: v0.21;
weight-transfer routes: v0.29; the "disk" weight-transfer backend: the docs
of vLLM's main branch, after v0.32) and in SGLang's `io_struct.py` /
R3 notes on its main branch (2026):

    ours                                vLLM                                   SGLang
    python -m megatron_composer.        vllm serve MODEL                       python -m sglang.launch_server
      inference.server --load CKPT        --enable-return-routed-experts         --model-path MODEL
                                                                                 --enable-return-routed-experts
    POST /v1/completions,               POST /v1/completions, "prompt": ids,   POST /generate, "input_ids": ids,
      "prompt": ids                       "return_token_ids": true               "sampling_params": {...}
    choice.token_ids                    choice.token_ids                       meta_info.output_token_logprobs
                                                                                 [[logprob, id, text], ...]
    "logprobs": k -> choice.logprobs    the same; "return_tokens_as_token_ids" "return_logprob": true,
                                          writes tokens as "token_id:ID"         "top_logprobs_num": k
    "return_routed_experts": true ->    (server flag) prompt_routed_experts    "return_routed_experts": true ->
      choice.routed_experts [P+G,L,k]     [P,L,k] + choice.routed_experts       meta_info.routed_experts,
                                          [G,L,k]                                base64 int32 (flat)
    choice.policy_versions (per token)  GET /weight_info                       meta_info.weight_version
    POST /v1/weights {"path": CKPT},    VLLM_SERVER_DEV_MODE=1, --weight-      POST /update_weights_from_disk
      or a WeightUpdate's bytes
                                          transfer-config '{"backend":"disk"}':  {"model_path": ...,
                                          /init_weight_transfer_engine,          "weight_version": "..."}
                                          /start_weight_update, /update_weights
                                          {"update_info": {"path"}},
                                          /finish_weight_update {"weight_version"}

vLLM and SGLang load weights in their own (Hugging Face) format: export a
checkpoint with `tools/convert_checkpoint.py --direction mcore-to-hf` before
pushing its path; published `WeightUpdate`s (full or delta, binary:
`weight_sync.encode_update`) go to our server only. Routed experts come back in our layout whatever the
server: int32 [prompt + generated, num_moe_layers, topk], -1 where a server
gives no row (the last generated token is never fed back through the
model). Policy versions fall back to the version the response names, then
to the last version this client pushed, then to -1.
"""
from __future__ import annotations

import base64
import concurrent.futures
from typing import Protocol, runtime_checkable

import torch

from .params import Completion, SamplingParams
from .weight_sync import CONTENT_TYPE, StaleBaseError, WeightUpdate, encode_update

FLAVORS = ("megatron-composer", "vllm", "sglang")


@runtime_checkable
class RolloutClient(Protocol):
    """A rollout source: `Engine` in process, or `HTTPRolloutClient`."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One Completion per prompt (token ids), in order; blocks until all finish."""

    def update_weights(self, source, version: int | None = None) -> int:
        """Push new weights (a checkpoint path, or what the backend takes); returns the new version."""


def _full_routes(rows: list | None, total: int, moe_shape: tuple[int, int] | None) -> torch.Tensor | None:
    """Routes as int32 [total, layers, topk]: rows past the given ones are -1."""
    if rows is None:
        return None
    routes = torch.as_tensor(rows, dtype=torch.int32)
    if routes.numel() == 0:
        layers, topk = moe_shape or (0, 0)
        routes = routes.reshape(0, layers, topk)
    full = torch.full((total, *routes.shape[1:]), -1, dtype=torch.int32)
    full[:min(total, len(routes))] = routes[:total]
    return full


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"logprob token {token!r} is not 'token_id:ID'; the server must honour "
                         "return_tokens_as_token_ids (vLLM) or return token_ids")
    return int(token.split(":", 1)[1])


class HTTPRolloutClient:
    """`RolloutClient` over an OpenAI-compatible server (ours, vLLM or SGLang).

    Args:
        base_url: the server root, e.g. "http://127.0.0.1:8000" (a trailing "/v1" is accepted).
        model: the model id to send; default: the first of GET /v1/models.
        api_key: sent as a Bearer token.
        timeout: seconds per HTTP request.
        max_concurrency: requests in flight at once (threads and connections).
        flavor: "megatron-composer", "vllm" or "sglang"; default: detected from
            /v1/models `owned_by`.
        moe_shape: (num_moe_layers, moe_router_topk), needed to reshape SGLang's
            flat routed experts.
    """

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600, max_concurrency: int = 64, flavor: str | None = None,
                 moe_shape: tuple[int, int] | None = None):
        import httpx

        root = base_url.rstrip("/")
        self.base_url = root.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="rollout-http")
        self.moe_shape = moe_shape
        self.version = -1  # the last version this client pushed
        self._vllm_transfer_ready = False  # vLLM wants /init_weight_transfer_engine once
        self.model, self.flavor = model, flavor
        if model is None or flavor is None:
            card = self._get("/v1/models")["data"][0]
            self.model = model or card["id"]
            self.flavor = flavor or card.get("owned_by")
        if self.flavor not in FLAVORS:
            raise ValueError(f"server at {self.base_url} is owned_by {self.flavor!r}; pass flavor= one of {FLAVORS}")

    def close(self) -> None:
        self._pool.shutdown()
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- HTTP
    def _check(self, response):
        if response.status_code < 400:
            return response.json()
        try:
            body = response.json()
            message = body["error"]["message"] if isinstance(body.get("error"), dict) else str(body)
        except (ValueError, KeyError, TypeError, AttributeError):
            message = response.text
        where = f"{response.request.method} {response.request.url}"
        if response.status_code == 409:
            raise StaleBaseError(f"{where}: {message}")
        if response.status_code < 500:
            raise ValueError(f"{where}: {message}")
        raise RuntimeError(f"{where} answered {response.status_code}: {message}")

    def _get(self, path: str) -> dict:
        return self._check(self._http.get(path))

    def _post(self, path: str, body: dict) -> dict:
        return self._check(self._http.post(path, json=body))

    # -------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        one = self._generate_sglang if self.flavor == "sglang" else self._generate_openai
        if self.flavor == "sglang" and params.return_routed_experts and self.moe_shape is None:
            raise ValueError("SGLang returns routed experts flat; pass moe_shape=(num_moe_layers, topk)")
        futures = [self._pool.submit(one, [int(t) for t in prompt], params) for prompt in prompts]
        return [f.result() for f in futures]

    def _openai_body(self, prompt: list[int], p: SamplingParams) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": p.max_tokens, "temperature": p.temperature,
                "top_p": p.top_p, "top_k": p.top_k or -1, "stop_token_ids": list(p.stop_token_ids),
                "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.logprobs or p.top_logprobs or self.flavor == "vllm":
            body["logprobs"] = p.top_logprobs
        if self.flavor == "megatron-composer":
            body["return_routed_experts"] = p.return_routed_experts
            if p.speculative:
                body["speculative"] = p.speculative
                body["num_speculative_tokens"] = p.num_speculative_tokens
        return body

    def _generate_openai(self, prompt: list[int], p: SamplingParams) -> Completion:
        data = self._post("/v1/completions", self._openai_body(prompt, p))
        return self.openai_completion(prompt, data["choices"][0], data, p)

    def openai_completion(self, prompt: list[int], choice: dict, data: dict, p: SamplingParams) -> Completion:
        """One choice of a /v1/completions response (`data`) as a `Completion`."""
        logprobs = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:
            ids = [_token_id(t) for t in logprobs.get("tokens") or []]
        top = []
        if p.top_logprobs:
            top = [sorted(((_token_id(t), lp) for t, lp in row.items()), key=lambda x: -x[1])
                   for row in logprobs.get("top_logprobs") or []]
        routes = choice.get("routed_experts")
        if self.flavor == "vllm" and p.return_routed_experts and routes is not None:
            routes = (data.get("prompt_routed_experts") or []) + routes
        versions = choice.get("policy_versions") or [self.version] * len(ids)
        return Completion(
            prompt_token_ids=prompt, token_ids=list(ids),
            logprobs=list(logprobs.get("token_logprobs") or []) if p.logprobs else [],
            sampling_logprobs=list(choice.get("sampling_logprobs") or []) if p.logprobs else [],
            routed_experts=_full_routes(routes, len(prompt) + len(ids), self.moe_shape) if p.return_routed_experts
            else None,
            policy_versions=list(versions), finish_reason=choice.get("finish_reason") or "stop",
            text=choice.get("text"), top_logprobs=top)

    def _generate_sglang(self, prompt: list[int], p: SamplingParams) -> Completion:
        return self.sglang_completion(prompt, self._post("/generate", self.sglang_body(prompt, p)), p)

    def sglang_body(self, prompt, p: SamplingParams) -> dict:
        """SGLang's /generate request of `prompt` (token ids, or a list of prompts: a batch)."""
        # SGLang's ignore_eos also ignores stop_token_ids (`Req._check_token_based_finish`): set only where
        # there are none, so a sample stops on ours and nowhere else (our exported config names no eos)
        sampling = {"max_new_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                    "top_k": p.top_k or -1, "stop_token_ids": list(p.stop_token_ids),
                    "ignore_eos": not p.stop_token_ids}
        if p.stop:
            sampling["stop"] = list(p.stop)
        if p.seed is not None:
            sampling["sampling_seed"] = int(p.seed)
        return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True,
                "top_logprobs_num": p.top_logprobs, "return_routed_experts": p.return_routed_experts}

    def sglang_completion(self, prompt: list[int], data, p: SamplingParams) -> Completion:
        """One result of SGLang's /generate (`data`) as a `Completion`; a malformed one raises a ValueError
        naming the server (never a silently wrong sample)."""
        where = f"SGLang's /generate at {self.base_url}"
        try:
            meta = data["meta_info"]
            tokens = meta["output_token_logprobs"]
            ids = [int(row[1]) for row in tokens]
            logprobs = [float(row[0]) for row in tokens]
        except (KeyError, TypeError, IndexError, ValueError) as error:
            raise ValueError(f"{where} answered without per-token log-probs (meta_info.output_token_logprobs "
                             f"[[logprob, id, text], ...]): {str(data)[:200]}") from error
        version = meta.get("weight_version")
        versions = [int(version) if str(version).lstrip("-").isdigit() else self.version] * len(ids)
        routes = None
        if p.return_routed_experts and meta.get("routed_experts") is not None:
            routes = self._sglang_routes(meta["routed_experts"], len(prompt) + len(ids), where)
        top = [[(int(row[1]), float(row[0])) for row in position]
               for position in meta.get("output_top_logprobs") or []] if p.top_logprobs else []
        finish = meta.get("finish_reason") or {}
        reason = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
        if reason == "abort":
            raise RuntimeError(f"{where} aborted the request: {finish.get('message', finish)}")
        return Completion(
            prompt_token_ids=prompt, token_ids=ids, logprobs=logprobs if p.logprobs else [], sampling_logprobs=[],
            routed_experts=_full_routes(routes, len(prompt) + len(ids), self.moe_shape) if p.return_routed_experts
            else None,
            policy_versions=versions, finish_reason=reason, text=data.get("text"), top_logprobs=top)

    def _sglang_routes(self, encoded, total: int, where: str) -> torch.Tensor:
        """SGLang's routed experts (base64 int32, flat [tokens, layers, topk]) as a tensor; a row count past
        the sequence, short of all but its last token, or not a whole number of rows raises."""
        layers, topk = self.moe_shape
        try:
            raw = base64.b64decode(encoded, validate=True)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where} sent routed experts that are not base64: {str(encoded)[:80]!r}") from error
        row = 4 * layers * topk
        if len(raw) % row or not total - 1 <= len(raw) // row <= total:
            raise ValueError(f"{where} sent {len(raw)} bytes of routed experts for {total} tokens; expected int32 "
                             f"[{total - 1} or {total}, {layers} MoE layers, top-{topk}] ({row} bytes a token): is "
                             "it serving this model?")
        return torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, layers, topk)

    # -------------------------------------------------------------- weights
    def update_weights(self, source, version: int | None = None) -> int:
        """Push weights: a checkpoint path (any flavor; vLLM and SGLang need their own format) or, for our
        server, a published `WeightUpdate` (its version is the new one). Returns the new version.

        A delta that does not follow the server's weights raises StaleBaseError (a ValueError): push the
        publisher's snapshot() instead."""
        if isinstance(source, WeightUpdate) and self.flavor == "megatron-composer":
            if version is not None and int(version) != source.version:
                raise ValueError(f"version={version} but the update is version {source.version}; a WeightUpdate "
                                 "carries its own version")
            response = self._http.post("/v1/weights", content=encode_update(source),
                                       headers={"content-type": CONTENT_TYPE})
            self.version = self._check(response)["version"]
            return self.version
        if not isinstance(source, str):
            what = "a checkpoint path or a WeightUpdate" if self.flavor == "megatron-composer" else "a checkpoint path"
            raise ValueError(f"{self.flavor} servers take {what}; got {type(source).__name__} (weights go as "
                             "binary WeightUpdates, never as lists of numbers)")
        if self.flavor == "megatron-composer":
            self.version = self._post("/v1/weights", {"path": source, "version": version})["version"]
            return self.version
        new = self.version + 1 if version is None else int(version)
        if self.flavor == "sglang":
            reply = self._post("/update_weights_from_disk", {"model_path": source, "weight_version": str(new)})
            if not reply.get("success", False):
                raise ValueError(f"SGLang refused the weights at {source}: {reply.get('message')}")
        else:
            if not self._vllm_transfer_ready:
                self._post("/init_weight_transfer_engine", {"init_info": {}})
                self._vllm_transfer_ready = True
            self._post("/start_weight_update", {})
            self._post("/update_weights", {"update_info": {"path": source}})
            self._post("/finish_weight_update", {"weight_version": str(new)})
        self.version = new
        return new
