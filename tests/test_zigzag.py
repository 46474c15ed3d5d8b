"""Zigzag split: hand-computed indices, round trips, padding, shifts, load balance (pure)."""
import pytest
import torch

from megatron_composer.parallel import (
    Segment,
    ZigzagLayout,
    document_padding,
    pad_batch,
    packed_seq_params_for,
    shift_left,
    shift_plan,
    zigzag_batch,
    zigzag_chunks,
    zigzag_merge,
    zigzag_split,
)
from megatron_composer.training.batches import Batch


def test_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i():
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError, match="CP rank 4 is outside CP size 4"):
        zigzag_chunks(4, 4)


def test_local_indices_by_hand():
    cp2 = ZigzagLayout((8,), 2)  # chunks of 2: [01][23][45][67]
    assert cp2.local_indices(0).tolist() == [0, 1, 6, 7]
    assert cp2.local_indices(1).tolist() == [2, 3, 4, 5]
    cp4 = ZigzagLayout((16,), 4)
    assert [cp4.local_indices(r).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # packed: each document is split on its own; documents stay in order
    packed = ZigzagLayout((8, 4), 2)
    assert packed.local_indices(0).tolist() == [0, 1, 6, 7, 8, 11]
    assert packed.local_indices(1).tolist() == [2, 3, 4, 5, 9, 10]
    assert packed.positions(0).tolist() == [0, 1, 6, 7, 0, 3]
    assert packed.positions(1).tolist() == [2, 3, 4, 5, 1, 2]
    # the naive baseline
    assert ZigzagLayout((8,), 2, "contiguous").local_indices(1).tolist() == [4, 5, 6, 7]


def test_query_segments_by_hand():
    layout = ZigzagLayout((8,), 2)
    assert layout.query_segments(0) == [Segment(0, 2, 0, 2), Segment(2, 4, 0, 8)]
    assert layout.query_segments(1) == [Segment(0, 2, 0, 4), Segment(2, 4, 0, 6)]
    packed = ZigzagLayout((8, 4), 2)
    assert packed.query_segments(1) == [Segment(0, 2, 0, 4), Segment(2, 4, 0, 6),
                                        Segment(4, 5, 8, 10), Segment(5, 6, 8, 11)]


@pytest.mark.parametrize("lengths,cp", [((8,), 2), ((64,), 4), ((16, 8, 24), 2), ((32, 16, 48), 8)])
def test_split_merge_round_trip(lengths, cp):
    layout = ZigzagLayout(lengths, cp)
    x = torch.randn(3, sum(lengths), 5)
    parts = [zigzag_split(x, layout, r) for r in range(cp)]
    assert all(p.shape == (3, layout.local_length, 5) for p in parts)
    torch.testing.assert_close(zigzag_merge(parts, layout), x, rtol=0, atol=0)
    gathered = layout.gather_order()  # what a rank-major all-gather of global indices holds
    assert gathered[layout.unzigzag_index()].tolist() == list(range(sum(lengths)))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work_exactly(cp):
    seq = 262144
    layout = ZigzagLayout((seq,), cp)
    work = [layout.causal_work(r) for r in range(cp)]
    assert sum(work) == seq * (seq + 1) // 2
    assert max(work) / (sum(work) / cp) <= 1.01
    assert len(set(work)) == 1  # exactly equal
    # packed documents of different lengths: balanced too (each document is)
    packed = ZigzagLayout(tuple(2 * cp * n for n in (1, 7, 30, 2, 100)), cp)
    work = [packed.causal_work(r) for r in range(cp)]
    assert max(work) / (sum(work) / cp) <= 1.01
    # the contiguous split is not: the last rank scores ~2x the mean
    naive = ZigzagLayout((seq,), cp, "contiguous")
    work = [naive.causal_work(r) for r in range(cp)]
    assert max(work) / (sum(work) / cp) == pytest.approx((2 * cp - 1) / cp, rel=1e-3)


def test_indivisible_lengths_name_the_length_and_the_fix():
    with pytest.raises(ValueError, match=r"seq_len 1001 is not divisible by 2\*cp=4; pad to 1004 "
                                         r"or use --pad-to-multiple"):
        ZigzagLayout((1001,), 2)
    with pytest.raises(ValueError, match=r"document 1 of length 7 is not divisible by 2\*cp=4; "
                                         r"pad to 8 or use --pad-to-multiple"):
        ZigzagLayout((8, 7), 2)


def _batch(lengths, rows=1, packed=True):
    s = sum(lengths)
    tokens = torch.arange(10, 10 + rows * s).view(rows, s)
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    return Batch(tokens, tokens + 1000, torch.ones(rows, s), positions.expand(rows, s).clone(),
                 segments.expand(rows, s).clone(), packed_seq_params_for(lengths) if packed else None)


def test_padding_by_hand():
    plan = document_padding([3, 5], 4)
    assert plan.lengths == (4, 8)
    assert plan.source.tolist() == [0, 1, 2, 2, 3, 4, 5, 6, 7, 7, 7, 7]
    assert plan.step.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 2, 3]
    padded = pad_batch(_batch([3, 5]), 4)
    assert padded.tokens.tolist() == [[10, 11, 12, 0, 13, 14, 15, 16, 17, 0, 0, 0]]
    assert padded.labels[0, 3].item() == 0
    assert padded.loss_mask.tolist() == [[1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]]
    assert padded.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert padded.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]]
    assert padded.packed_seq_params.cu_seqlens_q.tolist() == [0, 4, 12]
    assert padded.padding_mask.tolist() == [[False] * 3 + [True] + [False] * 5 + [True] * 3]
    assert pad_batch(_batch([4, 8]), 4).padding_mask is None  # nothing to pad
    # plain sequences pad at the end of every row
    plain = pad_batch(_batch([6], rows=2, packed=False), 4)
    assert plain.tokens.shape == (2, 8) and plain.packed_seq_params is None
    assert plain.loss_mask[:, 6:].sum() == 0
    assert plain.padding_mask.tolist() == [[False] * 6 + [True] * 2] * 2


def test_zigzag_batch_splits_every_field_and_keeps_global_cu_seqlens():
    batch = _batch([8, 4])
    with pytest.raises(ValueError, match="document 0 of length 8 is not divisible by 2\\*cp=16"):
        zigzag_batch(batch, 8, 0)
    local = zigzag_batch(batch, 2, 1)
    assert local.tokens.tolist() == [[12, 13, 14, 15, 19, 20]]
    assert local.labels.tolist() == [[1012, 1013, 1014, 1015, 1019, 1020]]
    assert local.position_ids.tolist() == [[2, 3, 4, 5, 1, 2]]
    assert local.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1]]
    assert local.packed_seq_params.cu_seqlens_q.tolist() == [0, 8, 12]
    padded = zigzag_batch(_batch([7, 3]), 2, 0, pad_to_multiple=True)
    assert padded.packed_seq_params.cu_seqlens_q.tolist() == [0, 8, 12]
    assert padded.tokens.tolist() == [[10, 11, 16, 0, 17, 0]]
    assert padded.loss_mask.tolist() == [[1, 1, 1, 0, 1, 0]]
    assert padded.padding_mask.tolist() == [[False, False, False, True, False, True]]
    assert local.padding_mask is None


def _simulated_cp_shift(x, layout, shift, fill):
    """`cp_shift_left` on every rank, with the all-gather done by hand."""
    parts = [zigzag_split(x, layout, r) for r in range(layout.cp_size)]
    plans = [shift_plan(layout, r, shift) for r in range(layout.cp_size)]
    gathered = torch.cat([p.index_select(1, plan.heads) for p, plan in zip(parts, plans)], dim=1)
    outs = []
    for part, plan in zip(parts, plans):
        out = torch.cat([part, gathered], dim=1).index_select(1, plan.source)
        outs.append(out.masked_fill(~plan.valid.view(1, -1), fill))
    return zigzag_merge(outs, layout)


def _documentwise_shift(x, lengths, shift, fill):
    outs, at = [], 0
    for n in lengths:
        outs.append(shift_left(x[:, at:at + n], shift, fill))
        at += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("lengths,cp,shift", [((16,), 2, 1), ((16,), 4, 2), ((8, 16, 24), 2, 1),
                                              ((16, 32), 8, 1), ((8, 16), 2, 2),
                                              # shifts spanning several 1-token chunks
                                              ((8, 16), 4, 2), ((8,), 4, 3), ((8,), 4, 9)])
def test_cp_shift_plan_equals_the_global_shift(lengths, cp, shift):
    layout = ZigzagLayout(lengths, cp)
    x = torch.arange(2 * sum(lengths)).view(2, -1)
    expected = _documentwise_shift(x, lengths, shift, -1)
    assert _simulated_cp_shift(x, layout, shift, -1).tolist() == expected.tolist()


def test_shift_must_be_positive():
    with pytest.raises(ValueError, match="shift must be >= 1, got 0"):
        shift_plan(ZigzagLayout((8,), 2), 0, 0)


def test_layout_from_local_tokens():
    assert ZigzagLayout.for_local_tokens(16, 4).doc_lengths == (64,)
    assert ZigzagLayout.for_local_tokens(6, 2, packed_seq_params_for([8, 4])).doc_lengths == (8, 4)
    with pytest.raises(ValueError, match="cu_seqlens cover 12 tokens, but this rank holds 4 x CP=2"):
        ZigzagLayout.for_local_tokens(4, 2, packed_seq_params_for([8, 4]))


def test_cli_refuses_an_indivisible_seq_length_unless_padding():
    from megatron_composer.training.arguments import parse_args

    with pytest.raises(ValueError, match=r"--seq-length: seq_len 1001 is not divisible by 2\*cp=4; "
                                         r"pad to 1004 or use --pad-to-multiple"):
        parse_args(["--context-parallel-size", "2", "--seq-length", "1001"])
    assert parse_args(["--context-parallel-size", "2", "--seq-length", "1001",
                       "--pad-to-multiple"]).seq_length == 1001


def test_device_index_tensors_are_copied_once_without_a_sync():
    """The per-layer / per-loss index tensors on a device (meta stands for a GPU here): one
    non-blocking copy per plan and device, the same tensor for every later layer, equal to
    the host plan."""
    from megatron_composer.parallel.cp_shift import device_shift_plan
    from megatron_composer.platform.syncs import count_host_syncs

    layout, meta = ZigzagLayout((8, 16), 2), torch.device("meta")
    with count_host_syncs(meta) as syncs:
        first = [layout.positions(1, meta), layout.unzigzag_index(meta), layout.local_indices(0, meta)]
        again = [layout.positions(1, meta), layout.unzigzag_index(meta), layout.local_indices(0, meta)]
        plans = [device_shift_plan(layout, 1, 2, meta) for _ in range(2)]
    assert syncs.total == 0, str(syncs)
    assert all(a is b for a, b in zip(first, again)) and plans[0] is plans[1]
    assert all(t.device.type == "meta" for t in first + [plans[0].heads, plans[0].source, plans[0].valid])
    assert [t.shape for t in first] == [layout.positions(1).shape, layout.unzigzag_index().shape,
                                        layout.local_indices(0).shape]
    cpu = torch.device("cpu")
    assert torch.equal(layout.positions(1, cpu), layout.positions(1))
