"""The SGLang rollout backend against a fake SGLang server speaking its documented protocol.

The fake implements what SGLang's `http_server.py` / `io_struct.py` define
(read on its main branch, 2026): `POST /generate` with `input_ids` (one
prompt, or a batch answered with a list), `sampling_params` (one dict or one
per prompt, `sampling_seed`), `return_logprob` -> `meta_info.
output_token_logprobs` [[logprob, id, text]], `return_routed_experts` ->
`meta_info.routed_experts` (base64 int32, flat [tokens, layers, topk]),
`meta_info.finish_reason` {"type": ...} and `weight_version`;
`/update_weights_from_tensor` (`serialized_named_tensors`: one
ForkingPickler payload, base64, per tensor-parallel rank) and
`/update_weights_from_disk` (`model_path`). Its "model" samples tokens from
a checksum of the weights it holds, so a push is visible in what it
generates. The real server is exercised by the `gpu` test at the end.
"""
import base64

import pytest
import torch

from megatron_composer.inference import SamplingParams
from megatron_composer.rl.sglang_backend import SGLangBackend, SGLangConfig
from tests.serving import SERVE_CONFIG, build_model, serve

CFG = SERVE_CONFIG
LAYERS, TOPK = CFG.num_moe_layers, CFG.moe_router_topk


class FakeSGLang:
    """SGLang's HTTP protocol over a toy model (module docstring); `seen` holds every request body."""

    def __init__(self, *, routed_experts=True, tp_size=1):
        self.routed_experts, self.tp_size = routed_experts, tp_size
        self.seen: list[tuple[str, dict]] = []
        self.weights: dict = {}
        self.weight_version = "default"
        self.hostile = None  # path -> a callable(body) answering in place of the fake

    def checksum(self) -> int:
        return int(sum(float(t.double().abs().sum()) for t in self.weights.values()) * 1000) % 97

    def sample(self, prompt, sampling) -> dict:
        seed = sampling.get("sampling_seed") or 0
        # SGLang checks stop tokens only without ignore_eos (`Req._check_token_based_finish`)
        stops = [] if sampling.get("ignore_eos") else sampling.get("stop_token_ids", [])
        ids, logprobs = [], []
        for j in range(sampling["max_new_tokens"]):
            token = (sum(prompt) + 7 * seed + 3 * j + self.checksum()) % CFG.vocab_size
            ids.append(token)
            logprobs.append(-0.125 * (j + 1))
            if token in stops:
                break
        finish = ({"type": "stop", "matched": ids[-1]} if ids[-1] in stops
                  else {"type": "length", "length": len(ids)})
        meta = {"id": "r", "prompt_tokens": len(prompt), "completion_tokens": len(ids), "finish_reason": finish,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)],
                "weight_version": self.weight_version}
        if self._routed:
            rows = len(prompt) + len(ids) - 1  # the last token is never fed back
            routes = (torch.arange(rows * LAYERS * TOPK, dtype=torch.int32) % CFG.num_experts)
            meta["routed_experts"] = base64.b64encode(routes.numpy().tobytes()).decode()
        return {"text": "", "output_ids": ids, "meta_info": meta}

    def app(self):
        from fastapi import FastAPI, Request

        app = FastAPI()

        @app.get("/get_server_info")
        def server_info():
            return {"tp_size": self.tp_size, "skip_tokenizer_init": True}

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            self.seen.append(("/generate", body))
            if self.hostile and "/generate" in self.hostile:
                return self.hostile["/generate"](body)
            self._routed = self.routed_experts and body.get("return_routed_experts")
            ids, sampling = body["input_ids"], body["sampling_params"]
            if ids and isinstance(ids[0], int):
                return self.sample(ids, sampling)
            if isinstance(sampling, dict):
                sampling = [sampling] * len(ids)
            return [self.sample(p, s) for p, s in zip(ids, sampling)]

        @app.post("/update_weights_from_tensor")
        async def from_tensor(request: Request):
            from multiprocessing.reduction import ForkingPickler

            import torch.multiprocessing  # noqa: F401

            body = await request.json()
            self.seen.append(("/update_weights_from_tensor", {k: v for k, v in body.items()
                                                               if k != "serialized_named_tensors"}))
            if self.hostile and "/update_weights_from_tensor" in self.hostile:
                return self.hostile["/update_weights_from_tensor"](body)
            payloads = body["serialized_named_tensors"]
            assert len(payloads) == self.tp_size
            for payload in payloads:  # every rank's payload is whole and loadable
                named = ForkingPickler.loads(base64.b64decode(payload, validate=True))
            self.weights = {name: t.clone() for name, t in named}
            self.weight_version = body.get("weight_version") or self.weight_version
            return {"success": True, "message": "Succeeded to update model weights."}

        @app.post("/update_weights_from_disk")
        async def from_disk(request: Request):
            from safetensors.torch import load_file

            body = await request.json()
            self.seen.append(("/update_weights_from_disk", body))
            self.weights = load_file(f"{body['model_path']}/model.safetensors")
            self.weight_version = body.get("weight_version") or self.weight_version
            return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

        return app


@pytest.fixture(scope="module")
def states():
    from megatron_composer.checkpoint.state import model_state_dict

    a = {k: v.detach().clone() for k, v in model_state_dict(build_model(seed=1)).items()}
    b = {k: v.detach().clone() for k, v in model_state_dict(build_model(seed=2)).items()}
    return a, b


def _hf(state):
    from megatron_composer.convert import hf_state_dict

    return hf_state_dict(CFG, state, dtype=torch.float32)


def _assert_holds(fake, state):
    """The fake holds `state` under Hugging Face names, exactly."""
    expected = _hf(state)
    assert sorted(fake.weights) == sorted(expected)
    for name, tensor in expected.items():
        assert fake.weights[name].dtype == tensor.dtype and torch.equal(fake.weights[name], tensor), name


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_requests_parsing_and_pushes(states, transport, tmp_path):
    a, b = states
    fake = FakeSGLang(tp_size=2 if transport == "tensor" else 1)
    with serve(fake.app()) as url:
        cfg = SGLangConfig(url=url, weight_transport=transport,
                           weight_dir=str(tmp_path / "hf") if transport == "disk" else None)
        backend = SGLangBackend.connect(CFG, cfg, routed_experts=True)
        assert backend.capabilities.routed_experts and backend.capabilities.policy_versions
        assert backend.update_weights(a, version=3) == 3
        _assert_holds(fake, a)
        push = fake.seen[-1]
        assert push[0] == f"/update_weights_from_{transport}" and push[1]["weight_version"] == "3"
        if transport == "tensor":
            assert push[1]["flush_cache"] is True
        else:
            assert push[1]["model_path"] == str(tmp_path / "hf")

        params = SamplingParams(max_tokens=5, temperature=0.7, top_p=1.0, stop_token_ids=(), seed=11,
                                logprobs=True, return_routed_experts=True)
        prompts = [[1, 2, 3], [4, 5]]
        out = backend.generate(prompts, params)
        body = fake.seen[-1][1]
        assert body["input_ids"] == prompts and body["return_logprob"] is True
        assert body["return_routed_experts"] is True
        assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
                                           "stop_token_ids": [], "ignore_eos": True, "sampling_seed": 11}
        checksum = fake.checksum()
        for prompt, c in zip(prompts, out):
            assert c.prompt_token_ids == prompt
            assert c.token_ids == [(sum(prompt) + 77 + 3 * j + checksum) % CFG.vocab_size for j in range(5)]
            assert c.logprobs == [-0.125, -0.25, -0.375, -0.5, -0.625]
            assert c.policy_versions == [3] * 5 and c.finish_reason == "length"
            total = len(prompt) + 5
            flat = torch.arange((total - 1) * LAYERS * TOPK, dtype=torch.int32) % CFG.num_experts
            assert c.routed_experts.shape == (total, LAYERS, TOPK)
            assert torch.equal(c.routed_experts[:-1], flat.reshape(total - 1, LAYERS, TOPK))
            assert (c.routed_experts[-1] == -1).all()

        # n samples: one batched request, sample i seeded seed + i
        group = backend.generate_n([9, 9], SamplingParams(max_tokens=2, seed=5, logprobs=True), 3)
        body = fake.seen[-1][1]
        assert body["input_ids"] == [[9, 9]] * 3
        assert [s["sampling_seed"] for s in body["sampling_params"]] == [5, 6, 7]
        assert [c.token_ids[0] for c in group] == [(18 + 7 * s + checksum) % CFG.vocab_size for s in (5, 6, 7)]

        # a stop token ends a sample with finish reason "stop"
        stop = (9 + 77 + checksum) % CFG.vocab_size
        c = backend.generate([[9]], SamplingParams(max_tokens=4, seed=11, stop_token_ids=(stop,)))[0]
        assert c.token_ids == [stop] and c.finish_reason == "stop"

        # A -> B -> A: the server holds each, and generates from it
        backend.update_weights(b, version=4)
        _assert_holds(fake, b)
        on_b = backend.generate(prompts, params)
        backend.update_weights(a, version=5)
        _assert_holds(fake, a)
        again = backend.generate(prompts, params)
        assert [c.token_ids for c in again] == [c.token_ids for c in out] != [c.token_ids for c in on_b]
        assert again[0].policy_versions == [5] * 5
        assert backend.metrics()["weight push seconds"] > 0
        backend.close()


def test_prompts_spread_over_servers_and_every_server_gets_the_weights(states):
    a, _ = states
    fakes = [FakeSGLang(), FakeSGLang()]
    with serve(fakes[0].app()) as url0, serve(fakes[1].app()) as url1:
        backend = SGLangBackend.connect(CFG, SGLangConfig(url=f"{url0}, {url1}"))
        backend.update_weights(a, version=1)
        for fake in fakes:
            _assert_holds(fake, a)
        prompts = [[1], [2], [3], [4], [5]]
        out = backend.generate(prompts, SamplingParams(max_tokens=2, seed=0))
        assert [c.prompt_token_ids for c in out] == prompts
        sent = sorted(p for fake in fakes for path, body in fake.seen if path == "/generate"
                      and isinstance(body["input_ids"][0], list) for p in body["input_ids"])
        assert sent == prompts
        assert all(any(path == "/generate" for path, _ in fake.seen) for fake in fakes)
        backend.close()


def test_a_server_without_routed_experts_turns_router_replay_off(states):
    import types

    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer

    fake = FakeSGLang(routed_experts=False)
    with serve(fake.app()) as url:
        backend = SGLangBackend.connect(CFG, SGLangConfig(url=url), routed_experts=True)
        assert backend.capabilities.routed_experts is False
        with pytest.raises(ValueError, match="do not return them"):
            backend.generate([[1]], SamplingParams(max_tokens=1, return_routed_experts=True))
        said = []
        stub = types.SimpleNamespace(backend=backend, model_cfg=CFG,
                                     log=types.SimpleNamespace(print=said.append))
        rl = RLTrainer._replay_for_backend(stub, RLConfig())
        assert RLConfig().algorithm.router_replay and not rl.algorithm.router_replay
        assert len(said) == 1 and "router replay off" in said[0] and "sglang" in said[0]
        backend.close()


def _meta(**changes):
    meta = {"output_token_logprobs": [[-0.5, 11, None]], "finish_reason": {"type": "length"},
            "weight_version": "default"}
    meta.update(changes)
    return {"text": "", "meta_info": meta}


@pytest.mark.parametrize("answer, error, match", [
    (lambda body: [_meta()] * 2, ValueError, r"answered a batch of 1 with 2 results"),
    (lambda body: {"meta_info": {}}, ValueError, r"answered a batch of 1 with dict"),
    (lambda body: [{"text": "", "meta_info": {"finish_reason": {"type": "length"}}}], ValueError,
     r"without per-token log-probs"),
    (lambda body: [{"meta_info": {"output_token_logprobs": [["x", 1]]}}], ValueError, r"without per-token log-probs"),
    (lambda body: [_meta(routed_experts="!!not base64!!")], ValueError, r"not base64"),
    (lambda body: [_meta(routed_experts=base64.b64encode(bytes(4 * LAYERS * TOPK * 9)).decode())], ValueError,
     r"bytes of routed experts for 3 tokens"),
    (lambda body: [_meta(routed_experts=base64.b64encode(bytes(4 * LAYERS * TOPK + 4)).decode())], ValueError,
     r"bytes of routed experts"),
    (lambda body: [_meta(routed_experts=None)], ValueError, r"returned no routed experts"),
    (lambda body: [_meta(weight_version="8", routed_experts=base64.b64encode(bytes(8 * LAYERS * TOPK)).decode())],
     RuntimeError, r"sampled with weights version 8, not the 2"),
    (lambda body: [_meta(finish_reason={"type": "abort", "message": "out of memory"})], RuntimeError,
     r"aborted the request: out of memory"),
])
def test_malformed_responses_raise_naming_the_server(answer, error, match):
    fake = FakeSGLang()
    with serve(fake.app()) as url:
        backend = SGLangBackend.connect(CFG, SGLangConfig(url=url), routed_experts=True, version=2)
        fake.hostile = {"/generate": answer}
        with pytest.raises(error, match=match) as raised:
            backend.generate([[1, 2]], SamplingParams(max_tokens=1, return_routed_experts=True))
        assert url in str(raised.value)
        backend.close()


def test_a_refused_push_and_a_missing_server_raise(states):
    a, _ = states
    fake = FakeSGLang()
    with serve(fake.app()) as url:
        backend = SGLangBackend.connect(CFG, SGLangConfig(url=url))
        fake.hostile = {"/update_weights_from_tensor": lambda body: {"success": False, "message": "shape mismatch"}}
        with pytest.raises(ValueError, match=rf"SGLang server at {url} refused the weights of version 1: "
                                             r"shape mismatch"):
            backend.update_weights(a, version=1)
        assert backend.version == -1
        with pytest.raises(ValueError, match="checkpoint name: tensor"):
            backend.update_weights("/ckpt/hf")
        backend.close()
    with pytest.raises(RuntimeError, match=rf"no SGLang server answers at {url}"):
        SGLangBackend.connect(CFG, SGLangConfig(url=url))


def test_flags():
    from megatron_composer.rl.arguments import parse_rl_args

    base = ["--model-preset", "tiny", "--rollout-backend", "sglang"]
    with pytest.raises(ValueError, match="needs --sglang-url"):
        parse_rl_args(base)
    with pytest.raises(ValueError, match="runs in the synchronous loop"):
        parse_rl_args(base + ["--sglang-url", "http://h:1", "--async-rl"])
    run = parse_rl_args(base + ["--sglang-url", "http://h:1,http://g:2", "--sglang-weight-transport", "disk"])
    assert run.rl.sglang.urls == ["http://h:1", "http://g:2"] and run.rl.sglang.weight_transport == "disk"
    with pytest.raises(ValueError, match="--sglang-weight-transport 'nccl'"):
        SGLangConfig(weight_transport="nccl")


# ---- real SGLang ---------------------------------------------------------------------------------------


def _sglang_on_cuda() -> bool:
    try:
        import sglang  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not _sglang_on_cuda(), reason="needs sglang installed and a CUDA device")
def test_real_sglang_greedy_equals_our_engine_and_pushes_a_b_a(tmp_path):
    """SGLang serving our `tiny-vllm` model (exported to Hugging Face): greedy tokens equal our engine's;
    B pushed gives our engine's B tokens, A pushed again gives A's."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    from megatron_composer.checkpoint.state import load_model_state_dict, model_state_dict
    from megatron_composer.config import get_preset
    from megatron_composer.inference.engine import Engine
    from megatron_composer.rl.vllm_backend import export_hf_model

    cfg = get_preset("tiny-vllm").replace(init_method_std=0.05)
    model_a = build_model(seed=1, cfg=cfg)
    a = {k: v.detach().clone() for k, v in model_state_dict(model_a).items()}
    b = {k: v.detach().clone() for k, v in model_state_dict(build_model(seed=2, cfg=cfg)).items()}
    model_dir = export_hf_model(cfg, a, str(tmp_path / "hf"), torch.float32)
    port = 30000 + os.getpid() % 1000
    log = open(tmp_path / "sglang.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir,
                               "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
                               "--disable-cuda-graph", "--mem-fraction-static", "0.3"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, open(tmp_path / "sglang.log").read()[-3000:]
            time.sleep(2)
        backend = SGLangBackend.connect(cfg, SGLangConfig(url=url))
        engine = Engine(model_a.to("cuda"), cfg, None, max_batch_size=4, max_model_len=256)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9)]
        greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=True)

        def ours(state):
            load_model_state_dict(engine.model, state)
            return [c.token_ids for c in engine.generate(prompts, greedy)]

        for version, state in enumerate((a, b, a)):
            backend.update_weights(state, version=version)
            theirs = backend.generate(prompts, greedy)
            assert [c.token_ids for c in theirs] == ours(state), f"version {version}"
            assert all(c.policy_versions == [version] * len(c.token_ids) for c in theirs)
        backend.close()
        engine.stop()
    finally:
        server.terminate()
        server.wait(timeout=60)
