"""Dual-mesh HSDP (FSDP2) trains exactly like megatron-core DDP, and its
checkpoints load under DDP (and vice versa)."""
import pytest
import torch

from megatron_composer.data import RandomTokenDataset
from tests.distributed import run_distributed


def _train(rank, world, sharding, ep, shard, steps, save=None, load=None, optimizer="adam"):
    from megatron_composer.config import get_preset
    from megatron_composer.models import ParallelSizes
    from megatron_composer.platform import init_distributed
    from megatron_composer import checkpoint as ck
    from megatron_composer.optim.factory import build_muon_optimizer
    from megatron_composer.training.loop import Trainer

    init_distributed()
    factory = None
    if optimizer == "muon":
        factory = lambda m: build_muon_optimizer(m, lr=1e-3, granularity="head")  # noqa: E731
    tr = Trainer(get_preset("tiny"), ParallelSizes(expert_model_parallel_size=ep), RandomTokenDataset(32, 64, 4096),
                 seq_length=64, micro_batch_size=1, global_batch_size=4, warmup_iters=0, decay_iters=4,
                 data_parallel_sharding=sharding, dense_shard_size=shard, optimizer_factory=factory)
    if optimizer == "muon":
        from megatron_composer.optim import ShardedMuon

        assert isinstance(tr.optimizer.muon, ShardedMuon) == (sharding == "hsdp")
    if load:
        meta = ck.load_checkpoint(load, tr.model, tr.optimizer)
        tr.state.iteration, tr.state.consumed_samples = meta["iteration"], meta["consumed_samples"]
    out = []
    for _ in range(steps):
        r = tr.step()
        out.append((r.lm_loss, r.mtp_loss, r.grad_norm))
        if save and tr.state.iteration == 2:
            ck.save_checkpoint(save, tr.state.iteration, tr.model, tr.optimizer,
                               {"consumed_samples": tr.state.consumed_samples})
    if sharding == "hsdp":
        from torch.distributed.tensor import DTensor

        experts = [p for n, p in tr.model.named_parameters() if ".experts.local_experts." in n]
        assert all(isinstance(p, DTensor) for p in tr.model.parameters())
        assert experts[0].device_mesh.size() == world // ep  # wide expert mesh: all EDP ranks
    return out


def _close(a, b):
    for (la, ma, ga), (lb, mb, gb) in zip(a, b):
        assert la == pytest.approx(lb, rel=1e-5) and ma == pytest.approx(mb, rel=1e-4)
        assert ga == pytest.approx(gb, rel=1e-5)


def test_hsdp_matches_ddp_world4_ep2(tmp_path):
    """4 ranks: HSDP (dense: 2 replicas x 2 shards; experts: EP=2 x EDP=2 shards).

    Its checkpoint after 2 steps is resumed by megatron-core DDP on 2 ranks
    with EP=1; the next two steps (losses, gradient norms, hence gradients
    and optimizer updates) must equal the HSDP run's own steps 3 and 4.
    """
    hsdp = run_distributed(_train, 4, "hsdp", 2, 2, 4, str(tmp_path / "h"))
    ddp = run_distributed(_train, 2, "ddp", 1, None, 2, None, str(tmp_path / "h"))
    assert all(r == hsdp[0] for r in hsdp)  # every rank reports the same global numbers
    _close(hsdp[0][2:], ddp[0])


def test_sharded_muon_in_the_loop_matches_unsharded():
    """--optimizer muon: ShardedMuon on dual-mesh HSDP (world 2, EP=2) takes the
    same steps as Muon on megatron-core DDP."""
    hsdp = run_distributed(_train, 2, "hsdp", 2, 2, 3, None, None, "muon")
    ddp = run_distributed(_train, 2, "ddp", 2, None, 3, None, None, "muon")
    _close(hsdp[0], ddp[0])
