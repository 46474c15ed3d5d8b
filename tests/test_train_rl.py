"""RL on the shared loop: packing / DP / CP invariance with router replay, and train_rl.py end to end.

The references are independent configurations of the same RL step: one
rank with every sample in one micro-batch, against small micro-batches, two
data-parallel ranks and two context-parallel ranks (gloo). Router replay is
checked against the engine's own records, token for token, on every rank.
"""
import json
import os

import pytest
import torch

from tests.distributed import run_distributed

SAMPLES = dict(prompts_per_step=2, group_size=3, max_new_tokens=8)


def _rl_trainer(tokenizer_model, cp=1, micro_batch_tokens=4096, **rl_fields):
    import torch.distributed as dist

    from megatron_composer.config import OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer

    init_distributed()
    model_cfg = get_preset("tiny").replace(num_layers=2, max_position_embeddings=512)
    cfg = TrainingConfig(seq_length=512, micro_batch_size=1, train_iters=1, stage="rl",
                         optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_iters=1))
    layout = ParallelLayout(world_size=dist.get_world_size(), cp=cp, num_experts=model_cfg.num_experts)
    # k1 KL in the reward: the reference model's forward runs on each rank's CP share too
    rl = RLConfig.from_flat(**{**SAMPLES, "kl_coef": 0.05, **rl_fields}, micro_batch_tokens=micro_batch_tokens)
    trainer = RLTrainer(model_cfg, layout, cfg, rl, Tokenizer(tokenizer_model))
    trainer.build_reference()
    # a deterministic verdict that differs between samples, so advantages are not all zero
    trainer.env.task.verify = lambda prompt, text: {"correctness": float(sum(map(ord, text)) % 3) / 2}
    return trainer


def _rl_step(rank, world, tokenizer_model, cp=1, micro_batch_tokens=4096):
    """The policy loss, the reduced dense gradients of one RL step, and whether every micro-batch's
    training forward routed by the engine's records."""
    trainer = _rl_trainer(tokenizer_model, cp, micro_batch_tokens)
    grads, replayed = {}, []
    step = trainer.optimizer.step

    def capture():
        for name, g in zip(trainer.optimizer.names, trainer.model.grads()):
            if g is not None and ".experts." not in name:
                grads[name] = g.detach().clone()
        return step()

    trainer.optimizer.step = capture
    forward = trainer.trainer.forward
    micro_batches = []
    update = trainer.trainer.update
    trainer.trainer.update = lambda batches: micro_batches.append(len(batches)) or update(batches)

    def checked_forward(batch):
        out = forward(batch)
        used = torch.stack([r.recorded_topk_idx for r in trainer.replay.replays], dim=1)
        want = batch.routed_experts[0].long()
        recorded = (want >= 0).all(dim=-1).all(dim=-1)
        replayed.append(bool(torch.equal(used[recorded], want[recorded])) and int(recorded.sum()) > 0)
        return out

    trainer.trainer.forward = checked_forward
    metrics = trainer.train_on(trainer.rollouts(0))
    # the reference is these very weights: k1 is 0 on every token up to the engine's fp32 rounding
    assert abs(metrics["kl to reference"]) < 1e-5
    return metrics["policy loss"], metrics["reward"], grads, replayed, sum(micro_batches)


def _dp2_then_cp2(rank, world, tokenizer_model):
    """Both two-rank layouts in one pair of processes (spawning is the costly part)."""
    return _rl_step(rank, world, tokenizer_model, 1, 600), _rl_step(rank, world, tokenizer_model, 2)


def _same(a, b, rel=1e-5):
    loss_a, reward_a, grads_a, _, _ = a
    loss_b, reward_b, grads_b, _, _ = b
    assert reward_a == reward_b
    assert loss_a == pytest.approx(loss_b, rel=rel, abs=1e-6)  # ~0 at ratio 1: the gradients carry the test
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        scale = grads_b[name].abs().max().item()
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-3, atol=1e-5 * scale + 1e-12, msg=name)


def test_rl_step_is_the_same_however_samples_are_packed_split_or_context_parallel(data_dir):
    tokenizer = str(data_dir / "tokenizer.model")
    whole = _rl_step(0, 1, tokenizer)
    assert whole[4] == 1 and all(whole[3])
    assert any(g.abs().max() > 0 for g in whole[2].values())
    small = _rl_step(0, 1, tokenizer, micro_batch_tokens=600)  # one or two samples per micro-batch
    assert small[4] > 1 and all(small[3])
    _same(small, whole)
    (dp2, cp2_rank0), (dp2_rank1, cp2_rank1) = run_distributed(_dp2_then_cp2, 2, tokenizer)
    assert all(dp2[3]) and all(dp2_rank1[3])
    _same(dp2, whole)
    assert all(cp2_rank0[3]) and all(cp2_rank1[3])  # zigzag shares of the records, replayed exactly
    _same(cp2_rank0, whole)


def test_train_rl_runs_saves_and_resumes(data_dir, tmp_path):
    from megatron_composer.checkpoint import read_meta
    from megatron_composer.rl.train import train_rl

    save = str(tmp_path / "rl")
    common = ["--model-preset", "tiny", "--num-layers", "2", "--seq-length", "256",
              "--tokenizer-model", str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir),
              "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "6", "--lr", "1e-4",
              "--kl-coef", "0.01", "--save", save, "--log-interval", "1"]
    first = train_rl(common + ["--train-iters", "2"])
    assert first.state.iteration == 2 and first.engine.version == 2
    assert os.path.exists(os.path.join(save, "reward_curve.png"))
    history = first.report.history
    # k1 is unbiased, not non-negative per sample: after one small update it is close to 0 either way
    assert "kl to reference" in history[-1] and abs(history[-1]["kl to reference"]) < 0.05
    resumed = train_rl(common + ["--train-iters", "3", "--load", save])
    assert resumed.state.iteration == 3 and read_meta(save)["iteration"] == 3
    # the prompt cursor continues: step 3 (groups 4, 5) uses the next prompts, not the first ones again
    assert resumed.group_ids(2) == [4, 5]
    assert resumed.env.task_of(4)[0].key != resumed.env.task_of(0)[0].key
    with open(os.path.join(save, "rl_steps.jsonl")) as f:
        assert [json.loads(line)["iteration"] for line in f] == [1, 2, 3]


@pytest.mark.parametrize("flag, more, match", [
    ("--expert-model-parallel-size", [], "--expert-model-parallel-size 2 shards them; add --async-rl"),
    ("--tensor-model-parallel-size", ["--expert-tensor-parallel-size", "2"],
     "--tensor-model-parallel-size 2 shards them, and --async-rl does not join TP shards"),
    ("--data-parallel-sharding", [], "--data-parallel-sharding hsdp shards them; add --async-rl")])
def test_the_synchronous_loop_refuses_sharded_weights(data_dir, flag, more, match):
    """The colocated engine needs whole weights: the synchronous loop refuses EP, TP and HSDP before
    building anything. EP and HSDP name --async-rl (whose inference workers hold the whole model); TP,
    which --async-rl refuses too, names the layouts that do shard the trainer."""
    from megatron_composer.rl.train import train_rl

    with pytest.raises(ValueError, match=match):
        train_rl(["--model-preset", "tiny", "--tokenizer-model", str(data_dir / "tokenizer.model"),
                  "--data-cache-dir", str(data_dir), flag, "hsdp" if "sharding" in flag else "2", *more])


@pytest.mark.parametrize("flag, value, match", [("--group-size", "0", "group-size"),
                                                ("--kl-placement", "nowhere", "invalid choice"),
                                                ("--reward", "speed=1", "unknown reward term"),
                                                ("--rl-micro-batch-tokens", "16", "rl-micro-batch-tokens")])
def test_bad_rl_flags_are_named(flag, value, match, capsys):
    from megatron_composer.rl.arguments import parse_rl_args

    with pytest.raises((ValueError, SystemExit)) as err:
        parse_rl_args([flag, value])
    message = str(err.value) if err.type is ValueError else capsys.readouterr().err
    assert match in message


def _agentic_dp2(rank, world, tokenizer_model):
    """One agentic RL step on 2 data-parallel ranks: the trajectories each rank trains on, and its metrics."""
    import torch.distributed as dist

    from megatron_composer.config import OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer

    init_distributed()
    model_cfg = get_preset("tiny").replace(num_layers=2, max_position_embeddings=512)
    cfg = TrainingConfig(seq_length=512, micro_batch_size=1, train_iters=1, stage="rl",
                         optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_iters=1))
    layout = ParallelLayout(world_size=dist.get_world_size(), num_experts=model_cfg.num_experts)
    rl = RLConfig.from_flat(env="agentic-coding", task_families="write-file", prompts_per_step=2, group_size=2,
                  max_new_tokens=16, max_turns=2, micro_batch_tokens=1024, episode_workers=2)
    trainer = RLTrainer(model_cfg, layout, cfg, rl, Tokenizer(tokenizer_model))
    samples = trainer.rollouts(0)
    _, metrics = trainer.prepare(samples)
    return [(s.trajectory, s.group, len(s.completion_ids)) for s in samples], metrics["reward"]


def test_agentic_rollouts_are_gathered_whole_on_data_parallel_ranks(data_dir):
    (rank0, reward0), (rank1, reward1) = run_distributed(_agentic_dp2, 2, str(data_dir / "tokenizer.model"))
    assert rank0 == rank1 and reward0 == reward1  # every rank holds every group's trajectories
    assert sorted({t for t, _, _ in rank0}) == [0, 1, 2, 3] and [g for _, g, _ in rank0] == [0, 0, 1, 1]


def test_train_rl_refuses_the_base_eval_flag_it_would_ignore():
    from megatron_composer.rl.arguments import parse_rl_args

    with pytest.raises(ValueError, match="--eval-base-interval 5 is a pretrain_cpt.py flag"):
        parse_rl_args(["--eval-base-interval", "5"])
