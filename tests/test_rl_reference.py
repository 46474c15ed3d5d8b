"""--reference-offload: the RL step with the reference model's weights in host memory between uses equals
the step with them resident, exactly (the same forwards on the same weights), on one rank and under HSDP
(2 ranks, EP=2, the reference sharded like the policy). The offloaded reference runs its forwards on the
trainer's device and is back on the host after the step (pinned under CUDA).

The HSDP reference's shards and its KL against the one-rank step are checked in tests/test_rl_parallel.py.
"""
import pytest
import torch

from tests.distributed import run_distributed
from tests.test_rl_parallel import GROUP_SIZE, GROUPS, _samples

TIMEOUT_S = 180


def _step(tokenizer_model, offload, **layout):
    """(metrics, {name: weight after the step}, devices of the reference during its forwards, the
    reference's parameters after the step) of one RL step, every trainer built from the same seed."""
    import torch.distributed as dist

    from megatron_composer.checkpoint.state import model_state_dict
    from megatron_composer.config import OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer

    init_distributed()
    ep, sharding = layout.get("ep", 1), layout.get("sharding", "ddp")
    model_cfg = get_preset("tiny").replace(num_layers=2, max_position_embeddings=256)
    cfg = TrainingConfig(seq_length=256, micro_batch_size=1, train_iters=1, stage="rl",
                         data_parallel_sharding=sharding,
                         optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_iters=1))
    rl = RLConfig.from_flat(prompts_per_step=GROUPS, group_size=GROUP_SIZE, max_new_tokens=32, kl_coef=0.05,
                            micro_batch_tokens=64, reference_offload=offload)
    trainer = RLTrainer(model_cfg, ParallelLayout(world_size=dist.get_world_size(), ep=ep,
                                                  num_experts=model_cfg.num_experts),
                        cfg, rl, Tokenizer(tokenizer_model))
    trainer.resume()  # no --load: the reference is the policy's initial weights
    devices, forward = [], trainer._forward_logprobs

    def recording(model, batch):
        if model is not None:
            devices.append(next(model.parameters()).device)
        return forward(model, batch)

    trainer._forward_logprobs = recording
    metrics = trainer.train_on(_samples(len(trainer.replay.replays), model_cfg.num_experts, model_cfg.moe_router_topk))
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
               for k, v in model_state_dict(trainer.model).items()}
    local = [getattr(p, "_local_tensor", p) for p in trainer.reference.module.parameters()]
    return metrics, weights, devices, trainer.device, local


def _both(rank, world, tokenizer_model, **layout):
    """The step without, then with --reference-offload, each on a fresh trainer."""
    return _step(tokenizer_model, False, **layout), _step(tokenizer_model, True, **layout)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, {"ep": 2, "sharding": "hsdp"})], ids=["one_rank", "hsdp"])
def test_reference_offload_step_equals_resident(data_dir, world, layout):
    for resident, offloaded in run_distributed(_both, world, str(data_dir / "tokenizer.model"), **layout,
                                               timeout=TIMEOUT_S):
        metrics, weights, devices, device, _ = resident
        metrics_off, weights_off, devices_off, _, host = offloaded
        assert metrics["kl to reference"] != 0
        for name in ("kl to reference", "reward", "advantage abs", "policy loss", "grad norm"):
            assert metrics_off[name] == metrics[name], name
        assert weights_off.keys() == weights.keys()
        for name in weights:
            torch.testing.assert_close(weights_off[name], weights[name], rtol=0, atol=0, msg=name)
        assert devices_off and all(d == device for d in devices_off + devices)
        assert all(t.device.type == "cpu" for t in host)
        if device.type == "cuda":
            assert all(t.is_pinned() for t in host)


def test_planner_reference_follows_hsdp_and_offload():
    """The planner's reference bytes: the fp32 EP share under DDP; under HSDP rank 0's padded shards (dense
    tensors over the dense shard group of 4 = CP, experts over EDP = 8 / EP 2 = 4: ceil of dim 0 over the
    group, as torch.chunk); offloaded, none resident and a reference phase that holds it (`planner/rl.py`)."""
    from megatron_composer.config.model import parameter_inventory
    from megatron_composer.planner.rl import reference_bytes, trainer_memory
    from tests.test_plan import _rl_setup

    ddp = _rl_setup(kl_coef=0.1)
    ddp = ddp.replace(cluster=ddp.cluster.replace(ep=2))
    inventory = parameter_inventory(ddp.model, 2)
    assert reference_bytes(ddp) == 4 * sum(p.numel for p in inventory)
    hsdp = ddp.replace(cluster=ddp.cluster.replace(data_parallel_sharding="hsdp", dense_shard_size=4))
    by_hand = 0
    for p in inventory:
        rest = p.numel // p.shape[0]
        by_hand += 4 * -(-p.shape[0] // 4) * rest  # dense over 4, experts over EDP 4: the same group size here
    assert reference_bytes(hsdp) == by_hand < reference_bytes(ddp) / 3
    memory, parts = trainer_memory(hsdp)
    assert memory["reference_model"] == by_hand and parts["reference_phase"] is None
    offloaded, parts = trainer_memory(hsdp.replace(reference_offload=True))
    assert offloaded["reference_model"] == 0 and offloaded["total"] == memory["total"] - by_hand
    assert parts["reference_phase"] > by_hand + offloaded["parameters"] + offloaded["optimizer_state"]
