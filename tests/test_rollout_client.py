"""RolloutClient: the in-process Engine and HTTPRolloutClient give the same rollouts.

Against our server the reference is the same engine in process. vLLM's and
SGLang's response shapes are checked on canned responses written from their
documentation (see `inference/client.py`), through httpx's mock transport.
"""
import base64
import json

import httpx
import pytest
import torch

from megatron_composer.inference import SamplingParams
from megatron_composer.inference.client import HTTPRolloutClient, RolloutClient
from megatron_composer.inference.engine import Engine
from megatron_composer.inference.server import create_app
from tests.serving import SERVE_CONFIG, build_model, save_model, serve


@pytest.fixture(scope="module")
def engine():
    engine = Engine(build_model(), SERVE_CONFIG, None, max_batch_size=8, max_model_len=64)
    yield engine
    engine.stop()


def test_http_client_returns_what_the_engine_returns(engine, tmp_path):
    assert isinstance(engine, RolloutClient)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, return_routed_experts=True)
    with serve(create_app(engine, model_name="tiny")) as url:
        client = HTTPRolloutClient(url, max_concurrency=4)
        assert isinstance(client, RolloutClient) and client.flavor == "megatron-composer" and client.model == "tiny"
        remote = client.generate(prompts, params)
        local = engine.generate(prompts, params)
        for r, e in zip(remote, local):
            assert r.prompt_token_ids == e.prompt_token_ids and r.token_ids == e.token_ids
            assert r.finish_reason == e.finish_reason and r.policy_versions == e.policy_versions
            assert r.logprobs == pytest.approx(e.logprobs, abs=1e-5)
            assert r.sampling_logprobs == pytest.approx(e.sampling_logprobs, abs=1e-5)
            assert [[t for t, _ in row] for row in r.top_logprobs] == [[t for t, _ in row] for row in e.top_logprobs]
            assert r.routed_experts.dtype == torch.int32 and torch.equal(r.routed_experts, e.routed_experts)

        path = save_model(tmp_path / "ckpt", engine.model)
        assert client.update_weights(path, version=3) == 3 == engine.version
        assert client.generate(prompts[:1], params)[0].policy_versions == [3] * 8
        with pytest.raises(ValueError, match="no checkpoint at /nowhere"):
            client.update_weights("/nowhere")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            client.generate([[SERVE_CONFIG.vocab_size]], params)
        client.close()


def test_http_client_pushes_published_updates_as_bytes(engine):
    """update_weights(WeightUpdate): a full update, then a delta, arrive bit for bit (bf16, torch's own
    cast); a delta on a version the server does not hold raises StaleBaseError; numbers are refused."""
    from megatron_composer.checkpoint import model_state_dict
    from megatron_composer.inference.weight_sync import StaleBaseError, WeightPublisher

    original = {n: t.detach().clone() for n, t in model_state_dict(engine.model).items()}
    published = {n: t + 0.01 for n, t in original.items()}
    publisher = WeightPublisher(torch.bfloat16)
    try:
        with serve(create_app(engine, model_name="tiny")) as url, HTTPRolloutClient(url) as client:
            assert client.update_weights(publisher.publish(published, version=11)) == 11 == engine.version
            name = next(iter(published))
            published[name].view(-1)[0] = 3.0
            assert client.update_weights(publisher.publish(published, version=12), version=12) == 12
            served = model_state_dict(engine.model)
            assert all(torch.equal(served[n], t.to(torch.bfloat16).float()) for n, t in published.items())
            assert served[name].view(-1)[0].item() == 3.0
            stale = WeightPublisher(torch.bfloat16)
            stale.publish(published, version=1)
            with pytest.raises(StaleBaseError, match="cannot apply to version 12"):
                client.update_weights(stale.publish(original, version=2))
            assert engine.version == 12
            with pytest.raises(ValueError, match="never as lists of numbers"):
                client.update_weights({name: {"indices": [0], "values": [1.0]}})
    finally:
        engine.update_weights(original, version=0)


def _mock_client(flavor, routes, **kwargs):
    """An HTTPRolloutClient whose server is `routes` {path: handler(json body) -> json reply}."""
    seen = []

    def handle(request):
        body = json.loads(request.content or b"{}")
        seen.append((request.url.path, body))
        return httpx.Response(200, json=routes[request.url.path](body))

    client = HTTPRolloutClient("http://server/v1", model="m", flavor=flavor, **kwargs)
    client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(handle))
    return client, seen


def test_vllm_responses():
    def completions(body):
        assert body["prompt"] == [7, 8] and body["return_tokens_as_token_ids"] and body["ignore_eos"]
        return {"prompt_routed_experts": [[[0, 1]], [[1, 2]]], "choices": [{
            "finish_reason": "length", "token_ids": None, "routed_experts": [[[2, 3]], [[3, 0]]],
            "logprobs": {"tokens": ["token_id:11", "token_id:12"], "token_logprobs": [-0.5, -1.5],
                         "top_logprobs": [{"token_id:11": -0.5, "token_id:4": -2.0}, {"token_id:12": -1.5}]}}]}

    routes = {"/v1/completions": completions, "/init_weight_transfer_engine": lambda b: {},
              "/start_weight_update": lambda b: {}, "/update_weights": lambda b: {},
              "/finish_weight_update": lambda b: {}}
    client, seen = _mock_client("vllm", routes)
    params = SamplingParams(max_tokens=2, logprobs=True, top_logprobs=2, return_routed_experts=True)
    out = client.generate([[7, 8]], params)[0]
    assert out.token_ids == [11, 12] and out.logprobs == [-0.5, -1.5] and out.policy_versions == [-1, -1]
    assert out.top_logprobs == [[(11, -0.5), (4, -2.0)], [(12, -1.5)]]
    assert out.routed_experts.tolist() == [[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]]]
    assert client.update_weights("/ckpt/hf") == 0
    assert [path for path, _ in seen[1:]] == ["/init_weight_transfer_engine", "/start_weight_update",
                                              "/update_weights", "/finish_weight_update"]
    assert seen[3][1] == {"update_info": {"path": "/ckpt/hf"}} and seen[4][1] == {"weight_version": "0"}
    with pytest.raises(ValueError, match="take a checkpoint path"):
        client.update_weights({"w": {"indices": [0], "values": [1.0]}})


def test_sglang_responses():
    routes_flat = torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]]], dtype=torch.int32)  # prompt + 1 of 2 generated

    def generate(body):
        assert body["input_ids"] == [7, 8] and body["sampling_params"]["max_new_tokens"] == 2
        return {"text": "ab", "meta_info": {
            "output_token_logprobs": [[-0.5, 11, "a"], [-1.5, 12, "b"]], "finish_reason": {"type": "stop"},
            "weight_version": "4", "routed_experts": base64.b64encode(routes_flat.numpy().tobytes()).decode()}}

    routes = {"/generate": generate, "/update_weights_from_disk": lambda b: {"success": True, "message": ""}}
    client, seen = _mock_client("sglang", routes, moe_shape=(1, 2))
    out = client.generate([[7, 8]], SamplingParams(max_tokens=2, logprobs=True, return_routed_experts=True))[0]
    assert out.token_ids == [11, 12] and out.logprobs == [-0.5, -1.5] and out.finish_reason == "stop"
    assert out.policy_versions == [4, 4]
    assert out.routed_experts.tolist() == routes_flat.tolist() + [[[-1, -1]]]
    assert client.update_weights("/ckpt/hf", version=9) == 9
    assert seen[-1] == ("/update_weights_from_disk", {"model_path": "/ckpt/hf", "weight_version": "9"})


def test_the_agent_loop_is_the_same_over_http_and_in_process(tmp_path):
    """Token in, token out through our server: the same trajectory ids, masks and log-probs."""
    from megatron_composer.rl.agent import Agent, AgentConfig
    from megatron_composer.rl.tools import ToolSet
    from tests.serving import train_small_tokenizer

    tokenizer = train_small_tokenizer(str(tmp_path / "tok"))
    engine = Engine(build_model(), SERVE_CONFIG, tokenizer, max_batch_size=4, max_model_len=256)
    config = AgentConfig(max_turns=2, max_turn_tokens=24, max_context_tokens=256, temperature=1.0,
                         return_routed_experts=True)
    runs = []
    with serve(create_app(engine, model_name="tiny")) as url:
        client = HTTPRolloutClient(url, max_concurrency=2)
        for source in (engine, client):
            workspace = tmp_path / f"ws{len(runs)}"
            workspace.mkdir()
            runs.append(Agent(source, tokenizer, config).run(ToolSet(workspace), "list the files", seed=7,
                                                             system="You are an agent."))
        client.close()
    engine.stop()
    local, remote = runs
    assert [s.ids for s in remote.segments] == [s.ids for s in local.segments]
    assert [s.trained for s in remote.segments] == [s.trained for s in local.segments]
    for r, e in zip(remote.segments, local.segments):
        assert r.logprobs == pytest.approx(e.logprobs, abs=1e-5)
        assert torch.equal(r.padded_routes(), e.padded_routes())
    assert remote.counts == local.counts and remote.stop_reason == local.stop_reason
