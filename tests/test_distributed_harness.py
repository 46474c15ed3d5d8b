import datetime
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, resolve_timeout, run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _rank0_waits_in_all_reduce_rank1_sleeps(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)
    return rank


def _mismatched_collectives(rank, world_size):
    """Rank 0 all-reduces while rank 1 waits for a message nobody sends: both block."""
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        dist.recv(torch.empty(1), src=0)
    return rank


def _group_timeout(rank, world_size):
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout


def test_all_reduce_over_gloo():
    assert run_distributed(_sum_ranks, 2) == [1.0, 1.0]


def test_rank_failure_surfaces():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(_fail_on_one, 2)


@pytest.mark.parametrize("body", [_rank0_waits_in_all_reduce_rank1_sleeps, _mismatched_collectives])
def test_deadlocked_ranks_are_killed_after_the_timeout(body):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 10 s: ranks \[0, 1\] had not finished"):
        run_distributed(body, 2, timeout=10)
    assert time.monotonic() - start < 20


def test_process_group_gets_the_timeout():
    assert run_distributed(_group_timeout, 2, timeout=42) == [datetime.timedelta(seconds=42)] * 2


def test_timeout_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT_S == 120
    monkeypatch.setenv(TIMEOUT_ENV, "300")
    assert resolve_timeout(None) == 300 and resolve_timeout(15) == 15
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='soon'"):
        resolve_timeout(None)
    with pytest.raises(ValueError, match="timeout 0 must be a positive"):
        resolve_timeout(0)
