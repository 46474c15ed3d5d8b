"""The feedback loss in the RL step: equal to a per-sample reference computed without packing,
and the same step however the samples are packed or split over data-parallel ranks (gloo)."""
import pytest
import torch

from tests.distributed import run_distributed

FIRST, SECOND = (0, 9), (13, 21)  # the two messages of every made-up trajectory: completion_ids[start:end]
HINTED = {0: [SECOND], 1: [], 2: [FIRST, SECOND], 3: [FIRST]}  # trajectory -> its hinted messages


def _trainer(tokenizer_model, micro_batch_tokens=4096, **rl_fields):
    import torch.distributed as dist

    from megatron_composer.config import OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer

    init_distributed()
    model_cfg = get_preset("tiny").replace(num_layers=2, max_position_embeddings=512)
    cfg = TrainingConfig(seq_length=512, micro_batch_size=1, train_iters=1, stage="rl", seed=7,
                         optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_iters=1))
    layout = ParallelLayout(world_size=dist.get_world_size(), num_experts=model_cfg.num_experts)
    rl = RLConfig.from_flat(**{"env": "agentic-coding", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 16,
                     "feedback_rules": "unknown_tool", "feedback_coef": 1.0, **rl_fields},
                  micro_batch_tokens=micro_batch_tokens)
    return RLTrainer(model_cfg, layout, cfg, rl, Tokenizer(tokenizer_model))


def _samples(tokenizer):
    """Four one-segment trajectories of made-up ids: a prompt, then turns each opened by <|assistant|>."""
    from megatron_composer.rl.batches import RolloutSample
    from megatron_composer.rl.feedback import Hint, note_ids

    g = torch.Generator().manual_seed(3)
    chat = tokenizer.chat
    samples = []
    for t, hinted in HINTED.items():
        prompt = [chat["system"], *torch.randint(300, 900, (20 + 3 * t,), generator=g).tolist(), chat["end"],
                  chat["assistant"]]
        body = torch.randint(300, 900, (16,), generator=g).tolist()
        completion = body[:8] + [chat["end"], chat["user"], 77, chat["end"], chat["assistant"]] + body[8:]
        trained = [1] * 8 + [1] + [0] * 4 + [1] * 8
        hints = []
        for start, end in hinted:
            assert (prompt + completion)[len(prompt) + start - 1] == chat["assistant"]
            note = note_ids(tokenizer, f"There is no tool number {t}{start}.")
            hints.append(Hint(("unknown_tool",), "", start, end, note))
        samples.append(RolloutSample(t // 2, prompt, completion, [-1.0] * len(completion), None,
                                     [0] * len(completion), "finish", rewards={"correctness": [0.0, 1.0, 0.5, 0.0][t]},
                                     trajectory=t, loss_mask=trained, hints=hints, info={"turns": 2.0}))
    return samples


def _step(rank, world, tokenizer_model, micro_batch_tokens=4096):
    trainer = _trainer(tokenizer_model, micro_batch_tokens)
    grads = {}
    step = trainer.optimizer.step

    def capture():
        for name, g in zip(trainer.optimizer.names, trainer.model.grads()):
            if g is not None and ".experts." not in name:
                grads[name] = g.detach().clone()
        return step()

    trainer.optimizer.step = capture
    micro_batches = []
    update = trainer.trainer.update
    trainer.trainer.update = lambda batches: micro_batches.append(len(batches)) or update(batches)
    metrics = trainer.train_on(_samples(trainer.tokenizer))
    return metrics, grads, sum(micro_batches)


def _reference_kl(tokenizer_model) -> float:
    """Mean reverse KL over every hinted position, each sample and context run alone (no packing)."""
    from megatron_composer.models import composer_forward
    from megatron_composer.rl.feedback import teacher_context

    trainer = _trainer(tokenizer_model)
    model = trainer.model
    model.eval()
    total, count = 0.0, 0

    def logp(ids):
        tokens = torch.tensor(ids)[None]
        with torch.no_grad():
            logits, _ = composer_forward(model, tokens, torch.arange(len(ids))[None])
        return torch.log_softmax(logits[0].double(), -1)

    for s in _samples(trainer.tokenizer):
        for hint in s.hints:
            student = logp(s.prompt_ids + s.completion_ids)
            ids, first = teacher_context(s, hint)
            teacher = logp(ids)
            n, at = hint.end - hint.start, len(s.prompt_ids) + hint.start - 1
            ls, lt = student[at:at + n], teacher[first:first + n]
            total += float((ls.exp() * (ls - lt)).sum())
            count += n
    return total / count


def _dp2(rank, world, tokenizer_model):
    return _step(rank, world, tokenizer_model)


def test_feedback_loss_equals_the_unpacked_reference_and_is_split_invariant(data_dir):
    tokenizer = str(data_dir / "tokenizer.model")
    whole_metrics, whole, batches = _step(0, 1, tokenizer)
    assert batches == 1
    # the reference runs each sample alone (other matmul shapes): a KL near 0 is a difference of float32
    # log-probs, so its last digits move (measured 3e-4 relative); a wrong alignment or count is off by far more
    assert whole_metrics["feedback kl"] == pytest.approx(_reference_kl(tokenizer), rel=1e-3)
    assert whole_metrics["feedback kl"] > 0 and whole_metrics["feedback hints unknown_tool"] == 4
    assert whole_metrics["feedback unknown_tool per trajectory"] == 1.0
    small_metrics, small, batches = _step(0, 1, tokenizer, micro_batch_tokens=80)
    assert batches >= 3
    ranks = run_distributed(_dp2, 2, tokenizer)
    for metrics, grads in [(small_metrics, small)] + [(m, g) for m, g, _ in ranks]:
        # a KL near 0 is a difference of float32 log-probs: packing moves its last digits
        assert metrics["feedback kl"] == pytest.approx(whole_metrics["feedback kl"], rel=1e-3)
        assert grads.keys() == whole.keys() and len(whole) > 10
        for name in whole:
            scale = whole[name].abs().max().item()
            torch.testing.assert_close(grads[name], whole[name], rtol=1e-3, atol=1e-5 * scale + 1e-12, msg=name)


def test_coefficient_zero_counts_the_mistakes_without_a_teacher(data_dir):
    trainer = _trainer(str(data_dir / "tokenizer.model"), feedback_coef=0.0)
    assert "feedback kl" not in [p.name for p in trainer.loss_plugins] and trainer.feedback_teacher is None
    metrics = trainer.train_on(_samples(trainer.tokenizer))
    assert "feedback kl" not in metrics and metrics["feedback hints"] == 4


def test_the_lagged_teacher_keeps_its_weights_for_lag_steps(data_dir):
    from megatron_composer.parallel.wrappers import unwrap

    trainer = _trainer(str(data_dir / "tokenizer.model"), feedback_teacher="lagged", feedback_teacher_lag=2)
    weights = trainer.feedback_teacher.logits_fn
    name, start = next((n, p.detach().clone()) for n, p in unwrap(trainer.model).named_parameters()
                       if "linear_fc1" in n)
    first = trainer.train_on(_samples(trainer.tokenizer))
    copy = dict(weights.copy.named_parameters())[name]
    assert torch.equal(copy, start)  # refreshed before step 1, from the weights then
    now = dict(unwrap(trainer.model).named_parameters())[name]
    assert not torch.equal(now, start)
    trainer.train_on(_samples(trainer.tokenizer))  # step 2: iteration 1, not a multiple of the lag
    assert torch.equal(dict(weights.copy.named_parameters())[name], start)
    trainer.train_on(_samples(trainer.tokenizer))  # step 3: iteration 2, refreshed
    assert not torch.equal(dict(weights.copy.named_parameters())[name], start)
    assert first["feedback kl"] > 0


class _MistakeThenFinish:
    """A `RolloutClient` on the real tokenizer: calls the unknown tool create_file, then finishes."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, prompts, params):
        from megatron_composer.data.tool_calls import format_tool_call
        from megatron_composer.inference.params import Completion

        out = []
        for prompt in prompts:
            seen = "unknown tool" in self.tok.decode([t for t in prompt if t < self.tok.vocab_size])
            text = (format_tool_call("finish", {"message": "ok"}) if seen else
                    format_tool_call("create_file", {"path": "a.txt", "content": "x"}))
            ids = self.tok.encode(text)[:params.max_tokens - 1] + [self.tok.chat["end"]]
            out.append(Completion(list(prompt), ids, [-1.0] * len(ids), [-1.0] * len(ids), None, [0] * len(ids),
                                  "stop"))
        return out


def test_the_async_services_carry_the_hints_to_the_trainer(data_dir, tmp_path, monkeypatch):
    """--async-rl: the environment worker attaches the hints, the trainer actor distills them."""
    from megatron_composer.rl.async_rl.services import EnvWorker, RolloutSpec, TrainerWorker

    argv = ["--model-preset", "tiny", "--num-layers", "2", "--seq-length", "512",
            "--tokenizer-model", str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir),
            "--env", "agentic-coding", "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "48",
            "--max-turns", "3", "--lr", "1e-3", "--lr-warmup-iters", "0", "--train-iters", "2",
            "--rl-micro-batch-tokens", "4096", "--feedback-rules", "unknown_tool", "--save", str(tmp_path / "rl")]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # the actor sets them: undone after the test
    trainer = TrainerWorker(argv, 0, 1)
    trainer.setup(*trainer.address())
    try:
        info = trainer.describe()
        spec = RolloutSpec(trainer.rl, info["tokenizer_model"], info["seq_length"], info["seed"], info["tasks"])
        env = EnvWorker(spec, _MistakeThenFinish(trainer.trainer.tokenizer))
        groups = [env.run_group(gid, 0) for gid in (3, 4)]
        assert all(len(s.hints) == 1 and s.hints[0].rules == ("unknown_tool",) for g in groups for s in g.samples)
        metrics, _ = trainer.train_step(groups)
        assert metrics["feedback hints unknown_tool"] == 4 and metrics["feedback kl"] > 0
        _resume_with_hints_in_the_buffer(trainer, argv, env, tmp_path)
    finally:
        trainer.close()


def _resume_with_hints_in_the_buffer(trainer, argv, env, tmp_path):
    """A checkpoint whose reconciler buffer holds hinted groups, then a new trainer actor on --load (what a
    killed job's restart does): the buffer loads (weights_only) and every hint comes back."""
    from megatron_composer.rl.async_rl.reconciler import Group, Reconciler, decode_state, encode_state
    from megatron_composer.rl.async_rl.services import TrainerWorker

    held = env.run_group(5, 1)
    rec = Reconciler(2, max_inflight_groups=2, max_policy_lag=2)
    rec.to_launch(1)
    rec.complete(Group(0, held.samples, launched_version=1))
    trainer.save(encode_state(rec.state_dict()))
    resumed = TrainerWorker(argv + ["--load", str(tmp_path / "rl")], 0, 1)
    resumed.setup(*resumed.address())
    try:
        info = resumed.describe()
        assert info["iteration"] == 1 and info["buffer"] is not None
        restored = Reconciler(2, max_inflight_groups=2, max_policy_lag=2)
        restored.load_state_dict(decode_state(info["buffer"]))
        (group,) = restored.ready
        assert [s.hints for s in group.samples] == [s.hints for s in held.samples]
        assert all(s.hints for s in group.samples)
        metrics, _ = resumed.train_step([group, group])  # the held groups train after the restart
        assert metrics["feedback hints unknown_tool"] == 2 * len(held.samples)
    finally:
        resumed.close()
