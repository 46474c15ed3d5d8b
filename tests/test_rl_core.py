"""The RL core: PPO mini-batches that really clip, log-probs at the sampling temperature, the flags that
refuse what cannot be exact, the effort weights and user reward terms (in a fresh process, as a Ray actor
is), the loss normalization against Dr.GRPO's reference, and no branch on the environment outside its
registry."""
import ast
import multiprocessing
import os
import pathlib

import pytest
import torch

SAMPLES = dict(prompts_per_step=2, group_size=2, max_new_tokens=8)


def _trainer(tokenizer_model, lr=1e-2, **rl_fields):
    from megatron_composer.config import OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer

    init_distributed()
    model_cfg = get_preset("tiny").replace(num_layers=2, max_position_embeddings=512)
    cfg = TrainingConfig(seq_length=512, micro_batch_size=1, train_iters=4, stage="rl", seed=3,
                         optimizer=OptimizerConfig(lr=lr, min_lr=lr, lr_warmup_iters=0, lr_decay_iters=4,
                                                   clip_grad=0.0))
    layout = ParallelLayout(world_size=1, num_experts=model_cfg.num_experts)
    rl = RLConfig.from_flat(**{**SAMPLES, **rl_fields})
    return RLTrainer(model_cfg, layout, cfg, rl, Tokenizer(tokenizer_model))


def _made_up_samples(tokenizer, lengths=(8, 8, 8, 8)):
    """Four single-turn samples of two groups, rewards 1, 0 | 0.5, 0 (nonzero advantages), sampler
    log-probs of -2 (so the truncated importance weight is exp(old + 2) capped at 2: the same in every run)."""
    from megatron_composer.rl.batches import RolloutSample

    g = torch.Generator().manual_seed(5)
    out = []
    for t, (reward, n) in enumerate(zip((1.0, 0.0, 0.5, 0.0), lengths)):
        prompt = torch.randint(300, 900, (12 + t,), generator=g).tolist()
        completion = torch.randint(300, 900, (n,), generator=g).tolist()
        out.append(RolloutSample(t // 2, prompt, completion, [-2.0] * n, None, [0] * n, "length",
                                 rewards={"correctness": reward}, trajectory=t))
    return out


def _updates(tokenizer_model, **rl_fields):
    """The dense gradients of each optimizer update of one RL step, and the step's metrics."""
    trainer = _trainer(tokenizer_model, **rl_fields)
    grads, step = [], trainer.optimizer.step

    def capture():
        grads.append({n: g.detach().clone() for n, g in zip(trainer.optimizer.names, trainer.model.grads())
                      if g is not None and ".experts." not in n})
        return step()

    trainer.optimizer.step = capture
    metrics = trainer.train_on(_made_up_samples(trainer.tokenizer))
    return grads, metrics


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_ppo_mini_batches_make_the_ratio_depart_from_one_and_a_tight_clip_act(data_dir):
    tok = str(data_dir / "tokenizer.model")
    plain, plain_metrics = _updates(tok, ppo_mini_batches=2, tis_cap=2.0)  # dr_grpo: ratio, no clipping
    wide, _ = _updates(tok, ppo_mini_batches=2, policy_loss="ppo_clip", clip_eps_low=1e9, tis_cap=2.0)
    tight, tight_metrics = _updates(tok, ppo_mini_batches=2, policy_loss="ppo_clip", clip_eps_low=1e-3,
                                    tis_cap=2.0)
    assert len(plain) == len(tight) == 2 and plain_metrics["updates"] == 2.0
    # first update: the old log-probs are the weights' own, ratio 1, nothing to clip
    assert _max_diff(plain[0], tight[0]) == 0.0 and _max_diff(plain[0], wide[0]) == 0.0
    # second update: the first moved the weights, so the ratio departs from 1 and a tight clip cuts gradients
    scale = max(g.abs().max().item() for g in plain[1].values())
    assert _max_diff(plain[1], tight[1]) > 1e-3 * scale
    assert _max_diff(plain[1], wide[1]) <= 1e-6 * scale  # no clip equals the unclipped loss
    # the metrics are computed: half the tokens (the first update's) sit at ratio 1, the rest do not
    assert 0.0 < tight_metrics["clip_fraction"] < 1.0
    assert plain_metrics["ratio_mean"] != 1.0


def test_lr_zero_is_a_control_whose_weights_do_not_move(data_dir):
    """--lr 0 (a control arm): a step with real, nonzero gradients leaves every weight bit for bit as it
    was, except the routers' expert biases, which aux-loss-free balancing moves by its own rate."""
    trainer = _trainer(str(data_dir / "tokenizer.model"), lr=0.0)
    before = {n: p.detach().clone() for n, p in trainer.model.gpt.named_parameters()}
    metrics = trainer.train_on(_made_up_samples(trainer.tokenizer))
    assert metrics["updates"] == 1.0 and metrics["grad norm"] > 0
    assert metrics["effort"] == 8.0  # logged without a length term: 8 final-message tokens each, weight 1
    moved = [n for n, p in trainer.model.gpt.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(before) > 10 and moved == [], moved


def test_one_update_per_step_keeps_the_ratio_at_one(data_dir):
    _, metrics = _updates(str(data_dir / "tokenizer.model"), tis_cap=2.0)
    assert metrics["updates"] == 1.0 and metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0


def test_the_policy_loss_is_the_token_sum_over_samples_times_the_generation_budget(data_dir):
    """Dr.GRPO's reference constant: each sample's token sum divided by the generation budget, averaged
    over samples, i.e. sum over every trained token of -w_t A_t / (samples x max new tokens). At ratio 1
    and without importance weights (w = 1) the loss is that sum, computed here from the samples alone."""
    trainer = _trainer(str(data_dir / "tokenizer.model"), tis_cap=None)
    lengths = (8, 3, 6, 2)  # every completion token is trained (positions P - 1 .. n - 2)
    metrics = trainer.train_on(_made_up_samples(trainer.tokenizer, lengths))
    advantages = (0.5, -0.5, 0.25, -0.25)  # rewards 1, 0 | 0.5, 0 minus their group means
    token_sum = -sum(a * n for a, n in zip(advantages, lengths))  # -(4 - 1.5 + 1.5 - 0.5) = -3.5
    samples, budget = 4, SAMPLES["max_new_tokens"]
    assert metrics["policy loss"] == pytest.approx(token_sum / (samples * budget), rel=1e-5)


def test_trainer_log_probs_are_the_samplers_at_the_sampling_temperature(data_dir):
    trainer = _trainer(str(data_dir / "tokenizer.model"), temperature=0.7, tis_cap=2.0)
    metrics = trainer.train_on(trainer.rollouts(0))
    # the engine drew from softmax(z / 0.7) and reports that log-prob; the trainer scores the same
    assert metrics["logp mismatch mean"] < 1e-4
    assert metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("flags, match", [
    (["--top-p", "0.9"], "--top-p 0.9 samples from a truncated distribution"),
    (["--policy-loss", "ppo_clip"], "--ppo-mini-batches 2 or more"),
    (["--ppo-mini-batches", "3"], "must divide --prompts-per-step 4"),
    (["--clip-eps-low", "0.2"], "has no effect with --policy-loss dr_grpo"),
    (["--policy-loss", "reinforce"], "unknown policy loss 'reinforce'"),
    (["--length-penalty-weights", "speed=1"], "unknown key 'speed'"),
    (["--reward-module", "no_such_module_here"], "no_such_module_here"),
])
def test_rl_flags_that_cannot_be_exact_are_refused_with_the_fix(flags, match):
    from megatron_composer.rl.arguments import parse_rl_args

    with pytest.raises(ValueError, match=match):
        parse_rl_args(flags)


def test_length_penalty_weights_reach_the_length_term():
    from megatron_composer.rl.arguments import parse_rl_args
    from megatron_composer.rl.rewards import EffortCounts, reward_terms

    rl = parse_rl_args(["--length-penalty-weights", "tool_calls=2,turns=1,tool_output=0",
                        "--reward", "correctness=1,length=0.5"]).rl
    counts = EffortCounts(thinking_tokens=10, tool_call_tokens=4, tool_output_tokens=100, final_message_tokens=6,
                          tool_calls=3, turns=2)
    sample = type("Sample", (), {"effort_counts": counts})()
    x = 10 + 4 + 0 * 100 + 6 + 2 * 3 + 1 * 2  # = 28
    k, q = 1e-3, 0.5
    expected = -((1 + k * x) ** (1 - q) - 1) / (k * (1 - q))
    assert reward_terms(rl.reward)["length"](sample) == pytest.approx(expected, rel=1e-12)


TERMS_MODULE = '''
from megatron_composer.rl.rewards import register_reward_term

register_reward_term("core_brevity", lambda sample: -0.25 * sample.effort_counts.final_message_tokens)
'''


def _score_in_a_fresh_process(run, queue):
    """What a Ray trainer actor does with the driver's config: a new interpreter, the config unpickled."""
    try:
        from megatron_composer.rl.async_rl.services import TrainerWorker
        from megatron_composer.rl.batches import RolloutSample

        worker = TrainerWorker(run, 0, 1)
        worker.setup(*worker.address())
        sample = RolloutSample(0, [1, 2], [3, 4, 5], [-1.0] * 3, None, [0] * 3, "stop",
                               rewards={"correctness": 1.0}, trajectory=0)
        from megatron_composer.rl.rewards import score
        from megatron_composer.rl.trainer import _Scored

        totals, per_term = score([_Scored(sample)], worker.trainer.reward_weights, worker.trainer.reward_terms)
        queue.put((float(totals[0]), float(per_term["core_brevity"][0])))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put(repr(exc))


def test_a_reward_module_is_found_in_a_fresh_process_like_a_ray_actor(data_dir, tmp_path, monkeypatch):
    from megatron_composer.rl.arguments import parse_rl_args

    import sys

    from megatron_composer.rl.rewards import REWARD_TERMS

    (tmp_path / "core_terms.py").write_text(TERMS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    run = parse_rl_args(["--model-preset", "tiny", "--num-layers", "2", "--seq-length", "256",
                         "--tokenizer-model", str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir),
                         "--reward-module", "core_terms", "--reward", "correctness=1,core_brevity=1"])
    # parsing imported the module here too; the fresh process must find it on its own, and the registry of
    # this process goes back to what it was
    REWARD_TERMS.pop("core_brevity")
    sys.modules.pop("core_terms")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_score_in_a_fresh_process, args=(run, queue))
    child.start()
    try:
        result = queue.get(timeout=240)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert result == (1.0 - 0.75, -0.75), result  # 3 completion tokens, one turn: brevity -0.25 x 3


def test_no_branch_on_the_environment_outside_its_registry():
    """`.env` is compared with nothing outside rl/environments.py, and no environment's name is spelled
    anywhere else in the library's code (the registry and each class's `name` are the only places)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "megatron_composer"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "environments.py" and path.parent.name == "rl":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Attribute) and o.attr == "env" for o in operands):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} compares .env")
            if isinstance(node, ast.Constant) and node.value in ("single-turn", "agentic-coding"):
                if not (path.name == "agentic.py" or path.name == "config.py"):  # ENV_NAME, the default
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} spells {node.value!r}")
    assert offenders == []


def test_a_backend_without_routed_experts_refuses_router_replay():
    from megatron_composer.rl.backends import BACKENDS, BackendCapabilities, RolloutBackend, check_backend, \
        register_backend

    class Plain(RolloutBackend):
        capabilities = BackendCapabilities(routed_experts=False, policy_versions=False)

    with pytest.raises(ValueError, match="--no-router-replay"):
        check_backend(Plain(), router_replay=True)
    check_backend(Plain(), router_replay=False)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("engine")(Plain)
    assert {"engine", "http"} <= set(BACKENDS)
