"""Tensor parallelism: the tiny model at TP=2 trains like TP=1.

Two gloo ranks at TP=2 (sequence parallel, local spec) start from the TP=1
model's weights, sharded the way megatron-core lays them out (column- or
row-wise blocks; SwiGLU's fc1 keeps a gate block and an up block per rank),
and take trainer steps on the same data. Each step's losses and every
gradient, gathered back to the full shape, must match the TP=1 run.
"""
import torch

from megatron_composer.config import get_preset
from tests.distributed import run_distributed

TINY = get_preset("tiny")
STEPS = 2


def _dataset():
    from megatron_composer.data.random_tokens import RandomTokenDataset

    return RandomTokenDataset(16, 64, TINY.vocab_size, seed=3)


def _is_glu_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def _shard(name: str, full: torch.Tensor, local_shape, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s TP shard of a full TP=1 tensor (the test's own model of megatron's layout)."""
    if tuple(full.shape) == tuple(local_shape):
        return full
    dim = next(d for d, (a, b) in enumerate(zip(full.shape, local_shape)) if a != b)
    if _is_glu_fc1(name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def _unshard(name: str, local: torch.Tensor, full_shape, group, tp: int) -> torch.Tensor:
    import torch.distributed as dist

    if tuple(local.shape) == tuple(full_shape):
        return local
    dim = next(d for d, (a, b) in enumerate(zip(full_shape, local.shape)) if a != b)
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if _is_glu_fc1(name):
        gates, ups = zip(*(p.chunk(2, dim=dim) for p in parts))
        return torch.cat([*gates, *ups], dim=dim)
    return torch.cat(parts, dim=dim)


def _train(tp: int, init_path=None, optimizer="adam"):
    """(losses per step, {name: full grad} per step, full initial state) of a few trainer steps."""
    from megatron.core import parallel_state

    from tests.trainers import make_trainer

    tr = make_trainer(_dataset(), tp=tp, etp=tp, optimizer=optimizer)
    gpt = tr.model.gpt
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    rank = parallel_state.get_tensor_model_parallel_rank()
    full_shapes = {}
    if init_path is not None:
        full = torch.load(init_path)
        full_shapes = {k: v.shape for k, v in full.items()}
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                p.copy_(_shard(name, full[name], p.shape, rank, tp))
    names = [n for n, p in gpt.named_parameters() if p.requires_grad]
    init = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    grads = []
    step = tr.optimizer.step

    def capture():
        grads.append({n: _unshard(n, g.detach().clone(), full_shapes.get(n, g.shape), group, tp)
                      for n, g in zip(names, tr.model.grads()) if g is not None})
        return step()

    tr.optimizer.step = capture
    losses = [tr.step().losses for _ in range(STEPS)]
    return losses, grads, init


def _tp2(rank, world, init_path, optimizer):
    losses, grads, _ = _train(2, init_path, optimizer)
    return losses, grads


def _compare(tmp_path, optimizer):
    ref_losses, ref_grads, init = _train(1, optimizer=optimizer)
    path = tmp_path / "init.pt"
    torch.save(init, path)
    (losses, grads), (losses1, grads1) = run_distributed(_tp2, 2, str(path), optimizer, timeout=300)
    assert losses == losses1  # both TP ranks report the same global losses
    for step in range(STEPS):
        for name in ref_losses[step]:
            assert abs(losses[step][name] - ref_losses[step][name]) < 1e-5, (step, name)
        assert grads[step].keys() == ref_grads[step].keys()
        for name, ref in ref_grads[step].items():
            torch.testing.assert_close(grads[step][name], ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{step} {name}: {m}")


def test_tp2_matches_tp1_losses_and_gradients(tmp_path):
    _compare(tmp_path, "adam")
