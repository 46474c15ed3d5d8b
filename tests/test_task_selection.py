"""Harder tasks: the zero-signal filter and the solve-rate selection rule against hand-computed cases, the
drop leaving the update's gradient as it was, and the estimates carried through a checkpoint's meta."""
import pytest
import torch

from megatron_composer.rl.task_selection import (SolveRates, parse_bounds, select_tasks, solved, trained_groups,
                                                 zero_signal_groups)
from megatron_composer.rl.trainer import RLTrainer
from tests.test_rl_core import _made_up_samples


def test_zero_signal_groups_by_hand():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [0.5, 0.5, 0.25]])
    assert zero_signal_groups(rewards).tolist() == [True, True, False, False]


def test_solve_rate_is_laplaces_rule():
    rates = SolveRates()
    assert rates.rate("a") == 0.5  # (0 + 1) / (0 + 2)
    rates.update("a", 8, 8)
    rates.update("b", 0, 8)
    rates.update("c", 3, 4)
    rates.update("c", 1, 4)
    assert (rates.rate("a"), rates.rate("b"), rates.rate("c")) == (9 / 10, 1 / 10, 5 / 10)
    again = SolveRates()
    again.load_state_dict(rates.state_dict())
    assert again.counts == {"a": [8, 8], "b": [0, 8], "c": [4, 8]}
    assert solved({"all_pass": 1.0, "correctness": 1.0}) and not solved({"all_pass": 0.0, "correctness": 1.0})
    assert solved({"correctness": 1.0}) and not solved({"correctness": 0.75})


def test_selection_rule_by_hand():
    rates = [0.95, 0.5, 0.05, 0.3, 0.9, 0.1]  # eligible within [0.1, 0.9]: 1, 3, 4, 5
    assert select_tasks(rates, 3, 0, (0.1, 0.9)) == ([1, 3, 4], 5, False)
    assert select_tasks(rates, 3, 5, (0.1, 0.9)) == ([5, 1, 3], 4, False)  # wraps past the end
    assert select_tasks(rates, 6, 2, (0.1, 0.9)) == ([3, 4, 5, 1, 3, 4], 5, False)  # fewer eligible: repeats
    assert select_tasks(rates, 2, 4, (0.2, 0.4)) == ([3, 3], 4, False)
    assert select_tasks(rates, 2, 1, (0.6, 0.8)) == ([1, 2], 3, True)  # none eligible: in order, a fallback
    assert parse_bounds("0.1,0.9") == (0.1, 0.9)
    for bad in ("0.9,0.1", "0.1", "a,b", "-0.1,0.5"):
        with pytest.raises(ValueError, match="--task-solve-rate-bounds"):
            parse_bounds(bad)


def test_trained_groups_keep_one_per_mini_batch():
    zero = torch.tensor([True, False, True, True, True, True])
    assert trained_groups(zero, 3) == [1, 3]  # mini-batch 2 has no signal: its first group
    assert trained_groups(zero, 6) == [1]
    assert trained_groups(torch.tensor([False, False]), 1) == [0, 1]
    # expert parallelism over 4 data-parallel ranks, groups of 2: two groups give every rank a sample
    assert trained_groups(zero, 3, least=2) == [0, 1, 3, 4]


def _no_mtp_trainer(tokenizer_model, dense_layers, **rl_fields):
    """test_rl_core's trainer without MTP (the policy loss is the step's only gradient)."""
    from megatron_composer.config import OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.config import RLConfig

    init_distributed()
    model_cfg = get_preset("tiny").replace(num_layers=2, first_k_dense_layers=dense_layers, mtp_num_layers=0,
                                           max_position_embeddings=512)
    cfg = TrainingConfig(seq_length=512, micro_batch_size=1, train_iters=4, stage="rl", seed=3,
                         optimizer=OptimizerConfig(lr=1e-2, min_lr=1e-2, lr_warmup_iters=0, lr_decay_iters=4,
                                                   clip_grad=0.0))
    rl = RLConfig.from_flat(prompts_per_step=2, group_size=2, max_new_tokens=8, **rl_fields)
    return RLTrainer(model_cfg, ParallelLayout(world_size=1, num_experts=model_cfg.num_experts), cfg, rl,
                     Tokenizer(tokenizer_model))


def _samples(tokenizer, rewards):
    samples = _made_up_samples(tokenizer)
    for s, r in zip(samples, rewards):
        s.rewards = {"correctness": r}
    return samples


@pytest.mark.parametrize("dense_layers", [2, 1])
def test_dropping_zero_signal_groups_leaves_the_gradient(data_dir, dense_layers):
    """Group 1 (rewards 0, 0) has no signal: the step without it packs half the tokens and its gradient equals
    the full step's (zero advantages, one constant normalizer): bit for bit in a dense model; with an MoE
    layer to rounding, its expert GEMMs batching other tokens."""
    grads, packed = {}, {}
    for drop in (False, True):
        trainer = _no_mtp_trainer(str(data_dir / "tokenizer.model"), dense_layers,
                                  drop_zero_signal_groups=drop)
        step = trainer.optimizer.step

        def capture(drop=drop, trainer=trainer, step=step):
            grads[drop] = {n: g.detach().clone() for n, g in zip(trainer.optimizer.names, trainer.model.grads())
                           if g is not None and ".experts." not in n}
            return step()

        trainer.optimizer.step = capture
        minis, metrics = trainer.prepare(_samples(trainer.tokenizer, (1.0, 0.0, 0.0, 0.0)))
        packed[drop] = sum(int(batch.loss_mask.sum()) for batch in minis[0])  # trained tokens
        assert (metrics["zero-signal groups"], metrics["dropped groups"]) == (1.0, float(drop))
        trainer.train_on(_samples(trainer.tokenizer, (1.0, 0.0, 0.0, 0.0)))
    assert (packed[False], packed[True]) == (4 * 8, 2 * 8)  # samples x completion tokens
    assert grads[False].keys() == grads[True].keys() and grads[False]
    for name, g in grads[False].items():
        if dense_layers == 2:
            assert torch.equal(g, grads[True][name]), name
        else:
            torch.testing.assert_close(grads[True][name], g, rtol=0, atol=1e-5 * float(g.abs().max()) + 1e-30)
