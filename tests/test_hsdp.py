"""Dual-mesh HSDP (FSDP2) trains exactly like megatron-core DDP, and its
checkpoints load under DDP (and vice versa)."""
import pytest

from megatron_composer.data import RandomTokenDataset
from tests.distributed import run_distributed


def _train(rank, world, sharding, ep, shard, steps, save=None, load=None, optimizer="adam"):
    from megatron_composer import checkpoint as ck
    from tests.trainers import make_trainer

    tr = make_trainer(RandomTokenDataset(32, 64, 4096), ep=ep, micro_batch_size=1, global_batch_size=4,
                      lr=1e-3, lr_warmup_iters=0, lr_decay_iters=4, optimizer=optimizer,
                      data_parallel_sharding=sharding, dense_shard_size=shard)
    if optimizer == "muon":
        from megatron_composer.optim import ShardedMuon

        assert isinstance(tr.optimizer.optimizers[0], ShardedMuon) == (sharding == "hsdp")
    if load:
        meta = ck.load_checkpoint(load, tr.model, tr.optimizer)
        tr.load_state_dict(meta)
    out = []
    for _ in range(steps):
        r = tr.step()
        out.append((r.lm_loss, r.mtp_loss, r.grad_norm))
        if save and tr.state.iteration == 2:
            ck.save_checkpoint(save, tr.state.iteration, tr.model, tr.optimizer,
                               {"consumed_samples": tr.state.consumed_samples})
    if sharding == "hsdp":
        from torch.distributed.tensor import DTensor

        experts = [p for n, p in tr.model.gpt.named_parameters() if ".experts.local_experts." in n]
        assert all(isinstance(p, DTensor) for p in tr.model.gpt.parameters())
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


def test_ddp_checkpoint_continues_identically_under_hsdp(tmp_path):
    """The other direction: megatron-core DDP (world 2, EP=1) saves after 2 steps;
    HSDP (world 2, EP=2, dense weights sharded over both ranks) resumes it and
    its two steps equal DDP's own steps 3 and 4."""
    ddp = run_distributed(_train, 2, "ddp", 1, None, 4, str(tmp_path / "d"))
    hsdp = run_distributed(_train, 2, "hsdp", 2, 2, 2, None, str(tmp_path / "d"))
    _close(hsdp[0], ddp[0][2:])
