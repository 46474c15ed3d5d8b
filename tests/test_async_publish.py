"""Async RL publishing from sharded trainer ranks: the inference workers get the whole policy, bit for bit.

`TrainerWorker` directly on gloo ranks (no Ray): one rank is the reference;
two ranks at --expert-model-parallel-size 2 (each holds 4 of the 8 experts)
and under --data-parallel-sharding hsdp (FSDP2 shards as well) start from the
reference's weights. Every rank joins each publication (`gather_policy`);
rank 0's updates, rebuilt by a `WeightSubscriber` as an inference worker
rebuilds them, must hold

* at resume (version 0): the same names and bits as the one-rank run's;
* after a real step (version 1, a delta): every rank's weights after that
  step, each tensor taken whole from the rank that holds it and cast to bf16
  by torch, bit for bit.
"""
import pytest
import torch

from tests.distributed import run_distributed

TIMEOUT_S = 240
GROUP_SIZE = 2
COMPLETION_LENGTHS = ((5, 13), (9, 3))  # per group, per sample


def _argv(tokenizer_model, data_dir, load=None):
    argv = ["--model-preset", "tiny", "--num-layers", "2", "--seq-length", "128", "--tokenizer-model",
            tokenizer_model, "--data-cache-dir", data_dir, "--group-size", str(GROUP_SIZE),
            "--prompts-per-step", str(len(COMPLETION_LENGTHS)), "--max-new-tokens", "16", "--lr", "1e-3",
            "--lr-warmup-iters", "0", "--train-iters", "4", "--kl-coef", "0"]
    return argv + (["--load", load] if load else [])


def _groups(num_moe_layers: int, num_experts: int, topk: int):
    """Hand-made groups with different rewards, sampler log-probs and recorded routes for every token."""
    from megatron_composer.rl.async_rl.reconciler import Group
    from megatron_composer.rl.batches import RolloutSample

    g = torch.Generator().manual_seed(3)
    groups = []
    for gid, lengths in enumerate(COMPLETION_LENGTHS):
        samples = []
        for t, n in enumerate(lengths):
            prompt = torch.randint(300, 900, (6 + t,), generator=g).tolist()
            completion = torch.randint(300, 900, (n,), generator=g).tolist()
            routes = torch.rand(len(prompt) + n, num_moe_layers, num_experts, generator=g).argsort(-1)[..., :topk]
            samples.append(RolloutSample(gid, prompt, completion, (-1.0 - torch.rand(n, generator=g)).tolist(),
                                         routes.to(torch.int32), [0] * n, "length",
                                         rewards={"correctness": float(t)}, trajectory=t))
        groups.append(Group(10 + gid, samples, 0))
    return groups


def _bf16(state: dict) -> dict:
    return {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}


def _publish(rank, world, argv, start=None):
    """(rank 0: the rebuilt weights of versions 0 and 1; every rank: its whole tensors after the step, bf16)."""
    from megatron_composer.checkpoint import save_checkpoint
    from megatron_composer.checkpoint.state import model_state_dict
    from megatron_composer.inference.weight_sync import WeightSubscriber
    from megatron_composer.rl.async_rl.services import TrainerWorker

    worker = TrainerWorker(argv, rank, world)
    worker.setup("127.0.0.1", 0)  # the process group exists: setup joins it
    if start is not None:
        save_checkpoint(start, 1, worker.trainer.model, None, {"stage": "sft"})
    subscriber, published = WeightSubscriber(), None
    if rank == 0:
        first = subscriber.apply(worker.snapshot())
        assert subscriber.version == 0
    cfg = worker.trainer.model_cfg
    groups = _groups(len(worker.trainer.replay.replays), cfg.num_experts, cfg.moe_router_topk)
    metrics, version = worker.train_step(groups)
    assert metrics["trained groups"] == [10, 11] and metrics["policy loss"] != 0
    if rank == 0:
        update = worker.published(version)
        assert version == 1 and update.is_delta
        published = (first, subscriber.apply(update))
    whole = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
             for n, t in model_state_dict(worker.trainer.model).items()}
    worker.close()
    return published, _bf16(whole)


def _same_bits(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.int16) if t.dtype == torch.bfloat16 else got[name],
                           t.view(torch.int16) if t.dtype == torch.bfloat16 else t), name


@pytest.fixture(scope="module")
def one_rank(data_dir, tmp_path_factory):
    """The one-rank run's publications, and the weights-only checkpoint of its starting weights."""
    start = str(tmp_path_factory.mktemp("async_publish") / "start")
    args = (str(data_dir / "tokenizer.model"), str(data_dir))
    (published, whole), = run_distributed(_publish, 1, _argv(*args), start, timeout=TIMEOUT_S)
    _same_bits(published[1], whole)  # one rank: the update is the policy itself
    assert sum(".experts.7." in n for n in whole) >= 2  # all 8 routed experts, under their global names
    return args, start, published


@pytest.mark.parametrize("flags", [
    ["--expert-model-parallel-size", "2"],
    ["--expert-model-parallel-size", "2", "--data-parallel-sharding", "hsdp"],
], ids=["ep2", "hsdp-ep2"])
def test_sharded_trainer_ranks_publish_the_whole_policy(one_rank, flags):
    args, start, (want_first, want_second) = one_rank
    ranks = run_distributed(_publish, 2, _argv(*args, load=start) + flags, timeout=TIMEOUT_S)
    (first, second), _ = ranks[0]
    assert ranks[1][0] is None  # rank 1 joined the gather and keeps nothing
    _same_bits(first, want_first)  # the resumed weights: exactly the one-rank run's
    whole = {}
    for _, part in ranks:  # each tensor whole, from the rank that holds it (replicas must agree)
        for name, t in part.items():
            if name in whole:
                assert torch.equal(whole[name], t), name
            whole[name] = t
    assert len(whole) == len(second) and sum(".experts." in n for n in whole) > sum(
        ".experts." in n for n in ranks[0][1])  # rank 0 alone holds half the experts
    _same_bits(second, whole)
    for name, t in want_second.items():  # the sharded step equals the one-rank step up to reassociation
        torch.testing.assert_close(second[name].float(), t.float(), rtol=2 ** -7, atol=1e-5, msg=name)


def test_a_layout_whose_tensors_the_gather_cannot_join_is_refused_before_ray_starts():
    """TP splits tensors along dimensions the publish gather does not join: refused with the fix named,
    by the driver before Ray starts and by a trainer worker before it joins a process group."""
    ray = pytest.importorskip("ray")
    from megatron_composer.rl.async_rl.runner import AsyncRLRunner
    from megatron_composer.rl.async_rl.services import TrainerWorker

    argv = ["--async-rl", "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 splits tensors.*use "
                                         "--tensor-model-parallel-size 1 with --expert-model-parallel-size"):
        AsyncRLRunner(argv)
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2"):
        TrainerWorker(argv, 0, 2)
