"""The MTP layer's packed roll without host syncs: equal to megatron-core's own packed roll.

megatron-core rolls a packed batch document by document (`_roll_tensor_packed_seq`), reading
each document's offsets from the device. `models.mtp.ComposerMTPLayer` zeroes each document's
first token and takes the plain roll; both are checked against megatron-core's function and a
hand-written shift, and the model's MTP logits and gradients against megatron-core's layer.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionLayer,
    _roll_tensor_packed_seq,
    roll_tensor,
)

from megatron_composer.models.mtp import ComposerMTPLayer, zero_document_starts
from megatron_composer.platform.syncs import count_host_syncs


def _params(lengths):
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def _by_hand(x, lengths):
    """x[t + 1] within the document, 0 at each document's last token."""
    out, start = [], 0
    for n in lengths:
        doc = x[0, start:start + n].tolist()
        out += doc[1:] + [0]
        start += n
    return torch.tensor([out], dtype=x.dtype)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=7), st.integers(0, 2**31 - 1))
def test_zeroed_starts_then_plain_roll_is_the_packed_roll(lengths, seed):
    x = torch.randint(1, 1000, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    ours, _ = roll_tensor(zero_document_starts(x, tuple(lengths)), shifts=-1, dims=-1)
    theirs, _ = _roll_tensor_packed_seq(x, -1, -1, _params(lengths))
    assert torch.equal(ours, _by_hand(x, lengths))
    assert torch.equal(theirs, _by_hand(x, lengths))


def test_a_length_mismatch_names_both_sizes():
    with pytest.raises(ValueError, match="packed ids of 5 tokens, but the documents cover 6"):
        zero_document_starts(torch.ones(1, 5, dtype=torch.long), (2, 4))


def _tiny_model():
    from megatron_composer.config import get_preset
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    layout = ParallelLayout(world_size=env.world_size)
    initialize_parallel(layout, seed=1234)
    return build_model(get_preset("tiny"), layout, seq_length=32)


def _mtp_loss_and_grads(model, tokens, params):
    from megatron_composer.models import composer_forward

    model.zero_grad()
    _, mtp = composer_forward(model, tokens, torch.arange(tokens.shape[1]).expand_as(tokens), params)
    loss = F.cross_entropy(mtp[0][0].float(), tokens[0].roll(-2))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_mtp_layer_equals_megatron_core_on_a_packed_batch_and_reads_no_offsets(monkeypatch):
    model = _tiny_model()
    layers = list(model.mtp.layers)
    assert layers and all(type(layer) is ComposerMTPLayer for layer in layers)
    lengths = (12, 1, 7, 12)
    tokens = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(3))
    params = _params(lengths)
    with count_host_syncs("cpu") as syncs:
        ours = _mtp_loss_and_grads(model, tokens, params)
    assert not [s for s in syncs.syncs if "multi_token_prediction" in s.source], str(syncs)

    # megatron-core's own layer, same weights: its packed roll, document by document
    monkeypatch.setattr(ComposerMTPLayer, "_get_embeddings", MultiTokenPredictionLayer._get_embeddings)
    params = _params(lengths)  # made outside the count: its offsets are device data
    with count_host_syncs("cpu") as syncs:
        theirs = _mtp_loss_and_grads(model, tokens, params)
    assert [s for s in syncs.syncs if "multi_token_prediction" in s.source], "the reference read no offsets"
    assert torch.equal(ours[0], theirs[0])
    assert ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        assert torch.equal(ours[1][name], theirs[1][name]), name
