"""Pad tokens stay out of the routers' expert-bias counts and change nothing else.

A packed batch padded as the zigzag split pads it (every document to a
multiple of 2 * CP) and marked in `padding_mask` routes, in the decoder's and
the MTP layer's routers, exactly the token counts of the unpadded batch; its
real positions' logits are the unpadded ones; a filler micro-batch counts
nothing. Checked with and without full activation recompute (whose counting
happens in the backward's recompute), and at TP=2 with sequence parallelism
(each rank routes, and masks, its share of the positions).
"""
import pytest
import torch

from megatron_composer.parallel import pad_batch, packed_seq_params_for
from megatron_composer.training.batches import Batch
from tests.distributed import run_distributed
from tests.test_inference_engine import SMALL, build

DOCS = (7, 3, 5)  # padded to multiples of 4, as CP=2 does: 8, 4, 8


def _batch(docs=DOCS) -> Batch:
    g = torch.Generator().manual_seed(3)
    s = sum(docs)
    tokens = torch.randint(3, SMALL.vocab_size, (1, s), generator=g)
    segments = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None]
    positions = torch.cat([torch.arange(n) for n in docs])[None]
    return Batch(tokens, tokens, torch.ones(1, s), positions, segments, packed_seq_params_for(docs))


def _routers(model):
    return [m for m in model.modules() if getattr(m, "local_tokens_per_expert", None) is not None]


def _counts(model, batch, padding_mask):
    """[routers, experts] tokens each router counted for the expert biases in one forward and backward,
    and the (detached) main and MTP logits."""
    from megatron_composer.models import composer_forward

    for r in _routers(model):
        r.local_tokens_per_expert.zero_()
    logits, mtp = composer_forward(model, batch.tokens, batch.position_ids, batch.packed_seq_params, padding_mask)
    (logits.float().square().mean() + sum(m.float().square().mean() for m in mtp)).backward()
    model.zero_grad(set_to_none=True)
    counts = torch.stack([r.local_tokens_per_expert.clone() for r in _routers(model)])
    return counts, logits.detach(), [m.detach() for m in mtp]


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recompute"])
def test_padded_batch_counts_the_unpadded_batch_tokens(recompute):
    from megatron_composer.config.training import RecomputeConfig

    kw = {"recompute": RecomputeConfig("full", "uniform", 1)} if recompute else {}
    model = build(**kw).train()
    names = [n for n, m in model.named_modules() if getattr(m, "local_tokens_per_expert", None) is not None]
    assert any(n.startswith("mtp.") for n in names) and any(n.startswith("decoder.") for n in names)
    batch = _batch()
    padded = pad_batch(batch, 4)
    assert padded.tokens.shape[1] == 20 and int(padded.padding_mask.sum()) == 5

    want, logits, mtp = _counts(model, batch, None)
    assert int(want.sum()) == len(names) * sum(DOCS) * SMALL.moe_router_topk
    got, padded_logits, padded_mtp = _counts(model, padded, padded.padding_mask)
    assert torch.equal(got, want)
    unmasked, _, _ = _counts(model, padded, None)  # what the routers counted before the mask
    assert int(unmasked.sum()) == len(names) * 20 * SMALL.moe_router_topk
    real = ~padded.padding_mask[0]
    torch.testing.assert_close(padded_logits[:, real], logits)
    for a, b in zip(padded_mtp, mtp):
        torch.testing.assert_close(a[:, real], b)


def test_filler_micro_batch_counts_nothing():
    from megatron_composer.rl.batches import filler_batch

    model = build().train()
    filler = filler_batch(8)
    counts, _, _ = _counts(model, filler, filler.padding_mask)
    assert counts.sum() == 0
    counts, _, _ = _counts(model, filler, None)
    assert counts.sum() > 0


def test_padding_mask_must_match_the_tokens():
    from megatron_composer.models import composer_forward

    model = build().train()
    batch = _batch()
    with pytest.raises(ValueError, match="padding_mask of shape \\(1, 14\\) for input ids of shape \\(1, 15\\)"):
        composer_forward(model, batch.tokens, batch.position_ids, batch.packed_seq_params,
                         torch.zeros(1, 14, dtype=torch.bool))


def _tp2_counts(rank, world):
    """(unpadded, padded and masked, padded unmasked) counts summed over the two TP ranks."""
    import torch.distributed as dist

    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    init_distributed()
    layout = ParallelLayout(world_size=world, tp=2, etp=2, num_experts=SMALL.num_experts)
    initialize_parallel(layout, seed=7)
    model = build_model(SMALL, layout, seq_length=SMALL.max_position_embeddings).train()
    assert model.config.sequence_parallel
    batch = _batch((7, 3, 6))  # 16 tokens; padded to 8 + 4 + 8: both split evenly over TP=2
    padded = pad_batch(batch, 4)
    out = []
    for b, mask in ((batch, None), (padded, padded.padding_mask), (padded, None)):
        counts = _counts(model, b, mask)[0]
        dist.all_reduce(counts)
        out.append(counts)
    return out


def test_padding_mask_follows_the_sequence_parallel_split():
    want, got, unmasked = run_distributed(_tp2_counts, 2, timeout=120)[0]
    assert torch.equal(got, want)
    assert not torch.equal(unmasked, want)
