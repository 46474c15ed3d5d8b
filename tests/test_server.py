"""The OpenAI-compatible server end to end on loopback, with the official `openai` client and raw HTTP.

A tiny random model in a real `Engine`; the references are the same engine
called in process, and OpenAI's wire format as its client parses it.
"""
import json
import threading
import time

import httpx
import openai
import pytest
import torch

from megatron_composer.inference import SamplingParams
from megatron_composer.inference.engine import Engine
from megatron_composer.inference.server import create_app
from tests.serving import (
    SERVE_CONFIG,
    build_model,
    save_model,
    serve,
    train_small_tokenizer,
)

MAX_MODEL_LEN = 384
MODEL = "tiny-serve"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_small_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = Engine(build_model(), SERVE_CONFIG, tokenizer, max_batch_size=8, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def base_url(engine):
    with serve(create_app(engine, model_name=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def greedy(tokenizer, max_tokens=8, **kw):
    """What the server asks the engine for a greedy request (it stops at end of document)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, stop_token_ids=(tokenizer.eod,), **kw)


def test_completions_text_prompt_matches_the_engine(client, engine, tokenizer):
    prompt = "def add(a, b):\n    return"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    ref = engine.generate([tokenizer.encode(prompt)], greedy(tokenizer, logprobs=True, top_logprobs=3))[0]
    choice = choice_extra = r.choices[0]
    choice_extra = choice.model_extra
    assert choice_extra["token_ids"] == ref.token_ids and choice_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert choice_extra["policy_versions"] == [engine.version] * len(ref.token_ids)
    assert choice.finish_reason == ref.finish_reason and r.object == "text_completion" and r.model == MODEL
    assert choice.text == tokenizer.decode([t for t in ref.token_ids if t != tokenizer.eod])
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert [len(top) for top in lp.top_logprobs] == [3] * len(ref.token_ids)
    assert lp.tokens == [tokenizer.decode([t]) if not tokenizer.id_to_piece(t).startswith("<0x")
                         else lp.tokens[i] for i, t in enumerate(ref.token_ids)]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(ref.token_ids)


def test_completions_token_prompts_batch_and_n(client, engine, tokenizer):
    prompts = [[5, 17, 300, 42], [7, 8, 9]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2,
                                  extra_body={"return_routed_experts": True})
    refs = engine.generate(prompts, greedy(tokenizer, max_tokens=6, return_routed_experts=True))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for choice, ref in zip(r.choices, [refs[0], refs[0], refs[1], refs[1]]):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == ref.prompt_token_ids and extra["token_ids"] == ref.token_ids
        assert torch.equal(torch.tensor(extra["routed_experts"], dtype=torch.int32), ref.routed_experts)
    assert "routed_experts" not in client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1).choices[0].model_extra


def test_chat_with_logprobs_and_tools(client, engine, tokenizer):
    from megatron_composer.data.sft import render_chat
    from megatron_composer.data.tool_calls import messages_for_template

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2, tools=tools)
    prompt, _ = render_chat(messages_for_template(messages, tools), tokenizer, add_generation_prompt=True)
    stops = (tokenizer.eod, tokenizer.chat["end"])
    ref = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=stops,
                                                   logprobs=True, top_logprobs=2))[0]
    choice = r.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt and choice.model_extra["token_ids"] == ref.token_ids
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(ref.logprobs, abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.bytes == list(c.token.encode()) or len(c.bytes) == 1 for c in content)


def test_streaming_equals_the_whole_response(client):
    whole = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=10, temperature=0, logprobs=1)
    chunks = list(client.completions.create(model=MODEL, prompt="import os\n", max_tokens=10, temperature=0,
                                            logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert ids == whole.choices[0].model_extra["token_ids"]
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert logprobs == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)

    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, logprobs=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks) and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == \
        len(whole.choices[0].model_extra["token_ids"])
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_raw_sse_framing(base_url):
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[0][len("data: "):])["choices"][0]["prompt_token_ids"] == [3, 4, 5]


def test_concurrent_requests_share_the_engine_batch(client, engine):
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0]
             for p in prompts[:2]]
    engine.max_running = 0
    barrier, results = threading.Barrier(len(prompts)), [None] * len(prompts)

    def ask(i):
        barrier.wait()
        results[i] = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.max_running >= 4  # several HTTP requests decoded in the same steps
    for single, batched in zip(alone, results):
        assert batched.choices[0].model_extra["token_ids"] == single.model_extra["token_ids"]


def test_client_disconnect_cancels_the_stream(engine, base_url):
    handles = []

    class Recorder:
        """The real engine; remembers the handles the server gets."""

        def __getattr__(self, name):
            return getattr(engine, name)

        def add_request(self, *args, **kwargs):
            handles.append(engine.add_request(*args, **kwargs))
            return handles[-1]

    budget = MAX_MODEL_LEN - 4
    body = {"prompt": [1, 2, 3], "max_tokens": budget, "stream": True, "ignore_eos": True}
    with serve(create_app(Recorder(), model_name=MODEL)) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            next(response.iter_lines())
        deadline = time.monotonic() + 20
        while not handles[0].done() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert handles[0].done() and len(handles[0].result().token_ids) < budget


BAD_REQUESTS = [
    ("/v1/completions", "{not json", "not valid JSON"),
    ("/v1/completions", [1, 2], "not a JSON object"),
    ("/v1/completions", {"prompt": 3}, "prompt must be"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens=-1"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature=-0.5"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n=0"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "top_logprobs=21"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop="),
    ("/v1/completions", {"prompt": "x", "speculative": "beam"}, "speculative"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed="),
    ("/v1/completions", {"prompt": [600, 1]}, "600 is outside the vocabulary"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/completions", {"prompt": [1] * MAX_MODEL_LEN}, "max_model_len"),
    ("/v1/completions", {"prompt": "x", "n": 200}, "at most"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages is empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role 'wizard'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, "tools[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs logprobs"),
    ("/v1/weights", {"path": "/no/such/checkpoint"}, "no checkpoint at /no/such/checkpoint"),
    ("/v1/weights", {}, "path: Field required"),
    ("/v1/weights", {"delta": {"output_layer.weight": {"indices": [0], "values": [1.0]}}}, "path: Field required"),
    ("/v1/weights", "[1.0, 2.0]", "not a JSON object"),
]


@pytest.mark.parametrize("path, body, message", BAD_REQUESTS, ids=[f"{p}:{m}" for p, _, m in BAD_REQUESTS])
def test_bad_requests_get_a_4xx_naming_the_problem(base_url, engine, path, body, message):
    version = engine.version
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{base_url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok", "version": version}


def test_unknown_fields_are_harmless_and_wrong_model_is_404(base_url):
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
    r = httpx.post(f"{base_url}/v1/completions", json={"model": "gpt-9", "prompt": [1]})
    assert r.status_code == 404 and "'gpt-9' is not served" in r.json()["error"]["message"]
    assert httpx.get(f"{base_url}/v1/nothing").json()["error"]["message"] == "Not Found"


def test_models_health_and_openapi(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    spec = httpx.get(f"{base_url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/weights", "/v1/models", "/health"} <= set(spec["paths"])


def _bf16(state: dict) -> dict:
    """What a bf16 weight update makes of fp32 weights: torch's own round-to-nearest-even cast."""
    return {n: t.detach().to(torch.bfloat16).float() for n, t in state.items()}


def _post_update(url, update) -> httpx.Response:
    from megatron_composer.inference.weight_sync import encode_update

    return httpx.post(f"{url}/v1/weights", content=encode_update(update),
                      headers={"content-type": "application/octet-stream"}, timeout=60)


def test_weight_updates_by_path_and_as_binary_updates(tokenizer, tmp_path):
    """A checkpoint path (JSON), then published updates as bytes: a full one, a delta on it, and a
    delta on another version (409: the server asks for a full one); the served weights are the
    published bf16 values bit for bit, and tokens carry each version."""
    from megatron_composer.checkpoint import model_state_dict
    from megatron_composer.inference.weight_sync import WeightPublisher

    other = save_model(tmp_path / "other", build_model(seed=99))
    engine = Engine(build_model(), SERVE_CONFIG, tokenizer, max_model_len=MAX_MODEL_LEN)
    body = {"prompt": [4, 5, 6], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        with serve(create_app(engine, model_name=MODEL)) as url:
            before = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
            assert before["policy_versions"] == [0] * 8
            reload = httpx.post(f"{url}/v1/weights", json={"path": other, "version": 5}, timeout=60)
            assert reload.json() == {"version": 5}
            after = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
            assert after["policy_versions"] == [5] * 8 and after["token_ids"] != before["token_ids"]

            published = model_state_dict(build_model(seed=7))
            publisher = WeightPublisher(torch.bfloat16)
            full = publisher.publish(published, version=6)
            assert not full.is_delta and _post_update(url, full).json() == {"version": 6}
            served = model_state_dict(engine.model)
            assert all(torch.equal(served[n], t) for n, t in _bf16(published).items())

            name = next(n for n in published if n.endswith("linear_kv_up_proj.weight"))
            published[name].view(-1)[[0, 3, 7]] = torch.tensor([0.25, -0.5, 1.0])
            delta = publisher.publish(published, version=7)
            assert delta.is_delta and delta.sent_bytes < full.sent_bytes / 4
            assert _post_update(url, delta).json() == {"version": 7}
            assert model_state_dict(engine.model)[name].view(-1)[[0, 3, 7]].tolist() == [0.25, -0.5, 1.0]
            assert all(torch.equal(model_state_dict(engine.model)[n], t) for n, t in _bf16(published).items())
            assert httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["policy_versions"] == [7] * 8

            assert httpx.post(f"{url}/v1/weights", json={"path": other}, timeout=60).json() == {"version": 8}
            r = _post_update(url, publisher.publish(published, version=9))  # a delta on 7; the server reloaded
            assert r.status_code == 409 and "snapshot" in r.json()["error"]["message"]
            assert httpx.get(f"{url}/v1/weights").json() == {"version": 8}
            assert _post_update(url, publisher.snapshot()).json() == {"version": 9}
            assert all(torch.equal(model_state_dict(engine.model)[n], t) for n, t in _bf16(published).items())
    finally:
        engine.stop()


def _hostile_updates():
    """(id, bytes or a function of the served state -> bytes, message) of updates the server must refuse."""
    from megatron_composer.inference.weight_sync import WeightPublisher, encode_update

    def publish(change):
        def make(state):
            state = change({n: t.clone() for n, t in state.items()})
            return encode_update(WeightPublisher(None).publish(state, version=50))
        return make

    def first(state):
        return next(iter(state))

    def truncated(state):
        data = encode_update(WeightPublisher(torch.bfloat16).publish(state, version=50))
        return data[: len(data) // 2]

    def swapped_payload(state):
        a, b = list(state)[:2]
        update = WeightPublisher(torch.bfloat16).publish(state, version=50)
        update.tensors[a].data = update.tensors[b].data
        return encode_update(update)

    def other_format(state):
        from safetensors.torch import save

        return save({first(state): state[first(state)]})

    return [
        ("empty", b"", "not a weight update"),
        ("garbage", b"\x00" * 8 + b"{not json}", "not a weight update"),
        ("truncated", truncated, "not a weight update"),
        ("another safetensors", other_format, "format"),
        ("unknown name", publish(lambda s: {"decoder.nope.weight": s[first(s)]}), "not a tensor of this model"),
        ("wrong shape", publish(lambda s: {first(s): s[first(s)][:1]}), "the model's is"),
        ("integer weights", publish(lambda s: {first(s): s[first(s)].to(torch.int32)}), "send floating-point"),
        ("NaN", publish(lambda s: {first(s): torch.full_like(s[first(s)], float("nan"))}), "NaN or Inf"),
        ("a payload of another tensor", swapped_payload, "is corrupt"),
    ]


HOSTILE = _hostile_updates()


@pytest.mark.parametrize("make, message", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_weight_updates_get_a_400_and_change_nothing(base_url, engine, make, message):
    from megatron_composer.checkpoint import model_state_dict

    state = {n: t.detach().clone() for n, t in model_state_dict(engine.model).items()}
    version = engine.version
    data = make(state) if callable(make) else make
    r = httpx.post(f"{base_url}/v1/weights", content=data, headers={"content-type": "application/octet-stream"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok", "version": version}
    assert all(torch.equal(t, state[n]) for n, t in model_state_dict(engine.model).items())
