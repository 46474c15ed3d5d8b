"""Dense and expert meshes: validation, rank-by-rank groups, and 8-rank training steps.

The report's layouts on 8 ranks: CPT CP=2 x DP=4 with EP=8, RL CP=8 with EP=8.
Group membership is checked rank by rank from megatron-core's RankGenerator
(no processes), then both layouts run one Trainer step on 8 gloo ranks, where
the live megatron-core groups must match the layout and both layouts must give
the same loss and gradient norm (same samples, same initial weights).
"""
import pytest
import torch
import torch.distributed as dist

from megatron_composer.parallel.layout import ParallelLayout
from tests.distributed import run_distributed

EVERY_RANK = list(range(8))


def test_cpt_layout_cp2_dp4_ep8_rank_by_rank():
    layout = ParallelLayout(world_size=8, cp=2, ep=8, num_experts=8)
    assert (layout.dp, layout.edp) == (4, 1)
    for rank in range(8):
        assert layout.group_of("cp", rank) == [rank - rank % 2, rank - rank % 2 + 1]
        assert layout.group_of("dp", rank) == [rank % 2 + 2 * i for i in range(4)]
        assert layout.group_of("dp_cp", rank) == EVERY_RANK
        assert layout.group_of("ep", rank) == EVERY_RANK
        assert layout.group_of("edp", rank) == [rank]
        assert layout.coordinates(rank)["cp"] == rank % 2
        assert layout.coordinates(rank)["dp"] == rank // 2
        assert layout.coordinates(rank)["ep"] == rank


def test_rl_layout_cp8_ep8_rank_by_rank():
    layout = ParallelLayout(world_size=8, cp=8, ep=8, num_experts=8)
    assert (layout.dp, layout.edp) == (1, 1)
    for rank in range(8):
        assert layout.group_of("cp", rank) == EVERY_RANK
        assert layout.group_of("dp", rank) == [rank]
        assert layout.group_of("ep", rank) == EVERY_RANK
        assert layout.group_of("edp", rank) == [rank]


def test_ep_smaller_than_dp_x_cp_leaves_expert_data_parallelism():
    layout = ParallelLayout(world_size=8, cp=2, ep=4, num_experts=8)
    assert layout.edp == 2
    assert layout.groups()["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups()["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_describe_lists_every_rank():
    text = ParallelLayout(world_size=8, cp=2, ep=8, num_experts=8).describe()
    assert "dense mesh:  TP=1 x CP=2 x DP=4 x PP=1" in text
    assert "expert mesh: ETP=1 x EP=8 x EDP=1 x PP=1 (1 of 8 experts per rank)" in text
    assert "rank 3: tp 0 of [3] | cp 1 of [2, 3] | dp 1 of [1, 3, 5, 7] | ep 3 of " \
           "[0, 1, 2, 3, 4, 5, 6, 7] | edp 0 of [3]" in text


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=4, ep=8), r"EP=8 does not divide DP x CP = 4 \(DP=4, CP=1\).*use EP in \[1, 2, 4\]"),
    (dict(world_size=8, cp=2, ep=8, num_experts=6), r"EP=8 does not divide the 6 experts; use EP in \[1, 2\]"),
    (dict(world_size=6, cp=4), r"world size 6 is not divisible by TP x CP x PP = 4 .*CP can be one of \[1, 2, 3, 6\]"),
    (dict(world_size=8, tp=2, etp=4, ep=4), r"ETP x EP = 4 x 4 does not divide TP x CP x DP = 8"),
    (dict(world_size=8, cp=0), r"CP must be >= 1, got 0"),
])
def test_bad_sizes_name_the_sizes_and_what_fits(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)


def test_from_cli_sizes():
    from megatron_composer.training.arguments import parse_args

    args = parse_args(["--context-parallel-size", "2", "--expert-model-parallel-size", "8"])
    assert ParallelLayout.from_sizes(8, args, 8) == ParallelLayout(world_size=8, cp=2, ep=8, num_experts=8)


# ---------------------------------------------------------------- 8 ranks


def _samples(n, seq, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (seq + 1,), generator=g)
        out.append({
            "tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(seq),
            "position_ids": torch.arange(seq), "cu_seqlens": torch.tensor([0, seq // 2, seq], dtype=torch.int32),
        })
    return out


def _e2e_body(rank, world):
    from megatron_composer.config import get_preset
    from tests.trainers import make_trainer

    data = _samples(4, 32, get_preset("tiny").vocab_size)
    out = {}
    for cp in (2, 8):
        trainer = make_trainer(data, cp=cp, ep=8, seq_length=32, micro_batch_size=1, global_batch_size=4,
                               lr=1e-3, lr_warmup_iters=0, lr_decay_iters=10)
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection.use_mpu_process_groups()
        live = {name: dist.get_process_group_ranks(g) for name, g in
                (("cp", pgs.cp), ("dp", pgs.dp), ("dp_cp", pgs.dp_cp), ("ep", pgs.ep), ("edp", pgs.expt_dp))}
        result = trainer.step()
        out[cp] = dict(live=live, lm=result.lm_loss, mtp=result.mtp_loss, norm=result.grad_norm,
                       skipped=result.skipped)
    return out


@pytest.mark.slow
def test_report_layouts_train_one_step_on_8_ranks():
    results = run_distributed(_e2e_body, 8)
    for cp in (2, 8):
        layout = ParallelLayout(world_size=8, cp=cp, ep=8, num_experts=8)
        for rank, r in enumerate(results):
            for name, ranks in r[cp]["live"].items():
                assert ranks == layout.group_of(name, rank), (cp, rank, name)
            assert not r[cp]["skipped"]
            assert r[cp]["lm"] == results[0][cp]["lm"]  # one reduced loss on every rank
    # Same 4 samples and initial weights: CP=2 x DP=4 and CP=8 x DP=1 agree.
    a, b = results[0][2], results[0][8]
    assert 7.0 < a["lm"] < 9.5  # ~ln(4096) at init
    for key in ("lm", "mtp", "norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
