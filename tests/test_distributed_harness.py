import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_all_reduce_over_gloo():
    assert run_distributed(_sum_ranks, 2) == [1.0, 1.0]


def test_rank_failure_surfaces():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(_fail_on_one, 2)
