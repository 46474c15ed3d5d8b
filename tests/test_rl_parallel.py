"""One RL step (`RLTrainer.train_on`) at the CPT trainer's parallel layouts equals the step on one rank.

The samples are made by hand (no engine: the synchronous loop's colocated
engine refuses sharded weights), with uneven lengths and recorded routes for
router replay; the step has two PPO mini-batches (so the second update's
ratio departs from 1) and the k1 KL in the reward against a reference model
built at the same layout. Every run starts from the same weights (saved by
the one-rank run under global names) and is compared with the one-rank run:
the policy loss, each gradient under its global name (experts gathered from
the ranks that own them) and the updated weights, the expert biases included
(pad tokens of the zigzag split and filler micro-batches are kept out of
their counts by the batches' `padding_mask`).
"""
import pytest
import torch

from tests.distributed import run_distributed

GROUPS, GROUP_SIZE = 2, 4
COMPLETION_LENGTHS = (5, 23, 9, 31, 14, 3, 27, 11)  # uneven: packing and the zigzag split pad differently
TIMEOUT_S = 180
SCALARS = ("policy loss", "kl to reference", "replaced experts", "advantage abs")


def _samples(num_moe_layers: int, num_experts: int, topk: int):
    """GROUPS x GROUP_SIZE single-turn samples with different verdicts, sampler log-probs and routes
    recorded for every token (distinct experts per token, as a router picks them)."""
    from megatron_composer.rl.batches import RolloutSample

    g = torch.Generator().manual_seed(11)
    out = []
    for t, n in enumerate(COMPLETION_LENGTHS):
        prompt = torch.randint(300, 900, (7 + 2 * t,), generator=g).tolist()
        completion = torch.randint(300, 900, (n,), generator=g).tolist()
        sampler = (-1.5 - torch.rand(n, generator=g)).tolist()
        length = len(prompt) + n
        routes = torch.rand(length, num_moe_layers, num_experts, generator=g).argsort(-1)[..., :topk]
        out.append(RolloutSample(t // GROUP_SIZE, prompt, completion, sampler, routes.to(torch.int32), [0] * n,
                                 "length", rewards={"correctness": float(t % 3) / 2}, trajectory=t))
    return out


def _trainer(tokenizer_model, load, *, ep=1, cp=1, sharding="ddp", dense_shard_size=None):
    import torch.distributed as dist

    from megatron_composer.config import CheckpointConfig, OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer

    init_distributed()
    model_cfg = get_preset("tiny").replace(num_layers=2, max_position_embeddings=256)
    cfg = TrainingConfig(seq_length=256, micro_batch_size=1, train_iters=1, stage="rl",
                         data_parallel_sharding=sharding, dense_shard_size=dense_shard_size,
                         checkpoint=CheckpointConfig(load=load),
                         optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_iters=1))
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = ParallelLayout(world_size=world, cp=cp, ep=ep, num_experts=model_cfg.num_experts)
    rl = RLConfig.from_flat(prompts_per_step=GROUPS, group_size=GROUP_SIZE, max_new_tokens=32, kl_coef=0.05,
                            ppo_mini_batches=2, micro_batch_tokens=64, replay_plausibility_threshold=0.99)
    return RLTrainer(model_cfg, layout, cfg, rl, Tokenizer(tokenizer_model))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _rl_step(rank, world, tokenizer_model, start, save=False, probe=None, **layout):
    """({metric: value} of SCALARS, {global name: gradient of the first update}, {global name: weight
    after the step}) on this rank, resumed from the weights-only checkpoint `start` (which the one-rank
    run saves first), the reference model loaded from it at the same layout."""
    from megatron_composer.checkpoint import save_checkpoint
    from megatron_composer.checkpoint.state import global_param_names, model_state_dict

    trainer = _trainer(tokenizer_model, start, **layout)
    if save:
        save_checkpoint(start, 1, trainer.model, None, {"stage": "sft"})
    trainer.resume()
    names = global_param_names(trainer.model)
    grads, step = {}, trainer.optimizer.step

    def capture():
        if not grads:
            for name, g in zip(trainer.optimizer.names, trainer.model.grads()):
                if g is not None:
                    grads[names[name]] = _full(g)
        return step()

    trainer.optimizer.step = capture
    samples = _samples(len(trainer.replay.replays), trainer.model_cfg.num_experts,
                       trainer.model_cfg.moe_router_topk)
    metrics = trainer.train_on(samples)
    if probe is not None:
        probe(trainer)
    state = {name: _full(v) for name, v in model_state_dict(trainer.model).items()}
    return {k: metrics[k] for k in SCALARS}, grads, state


def _merged(per_rank: list) -> tuple:
    """The step's metrics (the same on every rank), and every rank's gradients and weights under their
    global names (a name that several ranks hold must hold the same value on each)."""
    grads, weights = {}, {}
    for _, g, w in per_rank:
        for into, part in ((grads, g), (weights, w)):
            for name, value in part.items():
                if name in into:
                    torch.testing.assert_close(value, into[name], rtol=0, atol=0, msg=name)
                into[name] = value
    for r in per_rank[1:]:
        assert r[0] == per_rank[0][0], f"the ranks report different metrics: {r[0]} and {per_rank[0][0]}"
    return per_rank[0][0], grads, weights


def _assert_same(got, want, rel=1e-5):
    """`got` equals `want`: the metrics, every gradient and every weight (expert biases included)."""
    metrics, grads, weights = got
    metrics_want, grads_want, weights_want = want
    for name in SCALARS:
        assert metrics[name] == pytest.approx(metrics_want[name], rel=rel, abs=1e-7), name
    assert grads.keys() == grads_want.keys() and weights.keys() == weights_want.keys()
    assert sum(".experts." in n for n in grads) >= 8  # every expert of the MoE layer, gathered
    for name in grads_want:
        scale = grads_want[name].abs().max().item()
        torch.testing.assert_close(grads[name], grads_want[name], rtol=1e-3, atol=rel * scale + 1e-12, msg=name)
    assert sum(n.endswith("expert_bias") for n in weights_want) >= 2  # decoder and MTP routers
    for name in weights_want:
        torch.testing.assert_close(weights[name], weights_want[name], rtol=0, atol=rel, msg=name)


@pytest.fixture(scope="module")
def one_rank(data_dir, tmp_path_factory):
    """The one-rank step and the weights every layout starts from."""
    weights = str(tmp_path_factory.mktemp("rl_parallel") / "sft")
    tokenizer = str(data_dir / "tokenizer.model")
    reference = run_distributed(_rl_step, 1, tokenizer, weights, True, timeout=TIMEOUT_S)
    metrics, grads, _ = reference[0]
    # the second update's ratio departs from 1; the filter replaces some of the made-up routes
    assert metrics["policy loss"] != 0 and 0 < metrics["replaced experts"] < 1 and metrics["kl to reference"] != 0
    assert all(g.abs().max() > 0 for n, g in grads.items() if ".experts." in n)
    return tokenizer, weights, _merged(reference)


def test_rl_step_at_ep2_equals_one_rank(one_rank):
    """EP=2 on 2 ranks: data-parallel over the dense weights, 4 experts a rank; each rank replays the
    routes of its own samples' tokens."""
    tokenizer, weights, want = one_rank
    _assert_same(_merged(run_distributed(_rl_step, 2, tokenizer, weights, ep=2, timeout=TIMEOUT_S)), want)


def test_rl_step_at_cp2_equals_one_rank(one_rank):
    """CP=2 on 2 ranks, no data parallelism: every sample split zigzag over the pair, its routes with its
    tokens; every rank holds every expert."""
    tokenizer, weights, want = one_rank
    _assert_same(_merged(run_distributed(_rl_step, 2, tokenizer, weights, cp=2, timeout=TIMEOUT_S)), want)


def _reference_sharded_like_policy(trainer):
    """HSDP: after the step the reference holds this rank's shard of each weight, as the policy does (the
    dense weights halved over the 2 ranks), not a whole copy."""
    from megatron_composer.parallel.wrappers import unwrap

    local = lambda p: getattr(p, "_local_tensor", p)  # noqa: E731
    reference = dict(trainer.reference.module.named_parameters())
    policy = dict(unwrap(trainer.model).named_parameters())
    assert reference.keys() == policy.keys()
    for name, p in policy.items():
        assert local(reference[name]).shape == local(p).shape, name
    dense = [p for name, p in reference.items() if ".experts." not in name]
    assert sum(local(p).numel() for p in dense) < 0.6 * sum(p.numel() for p in dense)


def _hsdp(rank, world, tokenizer, weights):
    """HSDP on 2 ranks: the dense weights sharded over both, EP=2."""
    return _rl_step(rank, world, tokenizer, weights, ep=2, sharding="hsdp", dense_shard_size=2,
                    probe=_reference_sharded_like_policy)


def test_rl_step_under_hsdp_equals_one_rank(one_rank):
    """--data-parallel-sharding hsdp: dense weights sharded over the 2 ranks, experts split (EP=2); the
    reference model sharded like the policy gives the one-rank KL."""
    tokenizer, weights, want = one_rank
    _assert_same(_merged(run_distributed(_hsdp, 2, tokenizer, weights, timeout=TIMEOUT_S)), want)


def test_rl_step_at_ep2_cp2_equals_one_rank(one_rank):
    """EP=2 x CP=2 on 4 ranks: each sample's tokens, routes, log-probs, advantages and loss mask are
    split zigzag over the CP pair; the two CP pairs are data-parallel, the experts split over them.
    The zigzag split pads every sample to a multiple of 2 * CP tokens; the routers leave those pad
    tokens out of the expert-bias counts, so the biases move exactly as on one rank."""
    tokenizer, weights, want = one_rank
    got = _merged(run_distributed(_rl_step, 4, tokenizer, weights, ep=2, cp=2, timeout=TIMEOUT_S))
    _assert_same(got, want)
