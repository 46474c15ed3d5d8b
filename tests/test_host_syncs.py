"""Host syncs: the counter on hand-written snippets with known counts, and the
budget of one training step of the tiny preset (one rank, and CP=2).

The counter's counts are checked against snippets whose syncs are known from
how CUDA runs them (each snippet one kind of sync, pure device ops none), so
the step budgets below rest on a counter checked independently of the step.
"""
import inspect

import pytest
import torch

from megatron_composer.parallel.zigzag import packed_doc_lengths
from megatron_composer.platform import apply_cpu_shims
from megatron_composer.platform.syncs import count_host_syncs, track_host_tensors
from tests.distributed import run_distributed
from tests.test_trainer import UnevenDataset
from tests.trainers import make_trainer

# (snippet, known syncs on CUDA); x is [6] float, m a bool mask of it, r [6] int repeats
ONE_SYNC_EACH = {
    "item": lambda x, m, r: x.sum().item(),
    "bool": lambda x, m, r: bool(x.sum() > 0),
    "int": lambda x, m, r: int(x[0]),
    "float": lambda x, m, r: float(x[0]),
    "tolist of 6 elements": lambda x, m, r: x.tolist(),
    "numpy": lambda x, m, r: x.detach().numpy(),
    "cpu": lambda x, m, r: x.cpu(),
    "to cpu": lambda x, m, r: x.to("cpu"),
    "to cpu and dtype": lambda x, m, r: x.to("cpu", torch.float64),
    "nonzero": lambda x, m, r: torch.nonzero(m),
    "Tensor.nonzero": lambda x, m, r: m.nonzero(),
    "where(cond)": lambda x, m, r: torch.where(m),
    "masked_select": lambda x, m, r: torch.masked_select(x, m),
    "bool-mask index": lambda x, m, r: x[m],
    "bool-mask assignment of a tensor": lambda x, m, r: x.detach().clone().__setitem__(m, x[:3].detach()),
    "repeat_interleave": lambda x, m, r: torch.repeat_interleave(x, r),
    "unique": lambda x, m, r: torch.unique(x),
    "equal": lambda x, m, r: torch.equal(x, x),
    "tensor from data onto the device": lambda x, m, r: torch.tensor([1, 2], device=x.device),
}

NO_SYNC = {
    "arithmetic and reductions": lambda x, m, r: (x * 2 + 1).sum() / x.numel(),
    "softmax and matmul": lambda x, m, r: torch.softmax(x.view(2, 3) @ x.view(3, 2), -1),
    "integer index": lambda x, m, r: x[torch.arange(3, device=x.device)],
    "index_select": lambda x, m, r: x.index_select(0, r),
    "masked_fill and 3-arg where": lambda x, m, r: torch.where(m, x, 0.0).masked_fill(~m, 1.0),
    "repeat_interleave with output_size": lambda x, m, r: torch.repeat_interleave(x, r, output_size=9),
    "dtype cast": lambda x, m, r: x.to(torch.float64).to(dtype=torch.int32),
    "non-blocking copy": lambda x, m, r: x.to("cpu", non_blocking=True),
    "any (a tensor, not a bool)": lambda x, m, r: m.any(),
    "bool-mask assignment of a scalar (masked_fill)": lambda x, m, r: x.detach().clone().__setitem__(m, 0.0),
    "host tensor from data": lambda x, m, r: torch.tensor([1, 2]),
    "backward of dense ops": lambda x, m, r: (x.exp() * x).sum().backward(),
}


def _inputs():
    x = torch.arange(6.0, requires_grad=True)
    m = torch.tensor([True, False, True, True, False, False])
    r = torch.tensor([1, 2, 1, 3, 1, 1])
    return x, m, r


@pytest.mark.parametrize("name", list(ONE_SYNC_EACH))
def test_each_sync_kind_counts_once(name):
    x, m, r = _inputs()
    with count_host_syncs("cpu") as syncs:
        ONE_SYNC_EACH[name](x, m, r)
    assert syncs.total == 1, f"{name}: {syncs}"


@pytest.mark.parametrize("name", list(NO_SYNC))
def test_device_work_counts_zero(name):
    x, m, r = _inputs()
    with count_host_syncs("cpu") as syncs:
        NO_SYNC[name](x, m, r)
    assert syncs.total == 0, f"{name}: {syncs}"


def test_backward_of_a_bool_mask_index_syncs_again():
    """x[m]'s backward scatters through the same bool mask (index_put): a second nonzero on CUDA."""
    x, m, _ = _inputs()
    with count_host_syncs("cpu") as syncs:
        x[m].sum().backward()
    assert [s.op for s in syncs.syncs] == ["aten.index", "aten.index_put"]


def test_reads_of_host_tensors_do_not_count_when_the_step_runs_on_a_gpu():
    """With a GPU as the step's device, CPU tensors are host data: reading them waits for nothing."""
    x, m, r = _inputs()
    with count_host_syncs("cuda") as syncs:
        for snippet in ONE_SYNC_EACH.values():
            snippet(x, m, r)
    assert syncs.total == 0, str(syncs)


def test_copies_onto_a_device_count_only_when_blocking():
    """The GPU rule on a stand-in device (meta): a blocking host-to-device copy waits for the
    stream, a non-blocking one and a copy within the device do not."""
    host, on_device = torch.ones(4), torch.ones(4, device="meta")
    with count_host_syncs("meta") as syncs:
        host.to("meta")
        host.to("meta", non_blocking=True)
        on_device.to("meta")
        on_device.to(torch.float64)
        torch.empty(4, device="meta").copy_(host)
        torch.empty(4, device="meta").copy_(host, non_blocking=True)
    assert [s.op for s in syncs.syncs] == ["Tensor.to(host to device)", "aten.copy_"]


def test_tolist_is_counted_once_not_per_element_nor_by_the_copy_inside():
    x = torch.arange(1000)
    with count_host_syncs("cpu") as syncs:
        x.tolist()
        x.view(10, 100).tolist()
    assert syncs.total == 2


def test_a_sync_is_attributed_to_the_innermost_project_line():
    """packed_doc_lengths reads cu_seqlens with tolist: the source is that line of zigzag.py."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_composer.parallel import zigzag

    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 8]))
    lines, first = inspect.getsourcelines(zigzag.packed_doc_lengths)
    tolist_line = first + next(i for i, text in enumerate(lines) if ".tolist()" in text)
    with count_host_syncs("cpu") as syncs:
        zigzag.packed_doc_lengths(params)
    assert [(s.op, s.source) for s in syncs.syncs] == [
        ("Tensor.tolist", f"megatron_composer/parallel/zigzag.py:{tolist_line}")]
    assert str(syncs) == f"1 (1 x Tensor.tolist at megatron_composer/parallel/zigzag.py:{tolist_line})"


def test_host_data_is_known_by_its_factory_and_reading_it_is_free():
    """Without a GPU: tensors made with no device (or "cpu") and what is computed from them
    only are host data; moving them to a device blocks, reading them does not."""
    x, _, _ = _inputs()
    with count_host_syncs("cpu") as syncs:
        plan = torch.arange(8).view(2, 4)[1]  # host index math
        plan.tolist(), plan.sum().item(), torch.zeros(2, device="cpu").tolist()
        plan.to(x.device, non_blocking=True)
        plan.to(x.device)  # blocking host-to-device copy
        (x.detach()[:4] + plan.to(x.device, non_blocking=True)).tolist()  # device data now
    assert [s.op for s in syncs.syncs] == ["Tensor.to(host to device)", "Tensor.tolist"]


def test_host_data_made_under_track_host_tensors_stays_host_data():
    with track_host_tensors():
        step = torch.tensor(0.0, device="cpu")  # as torch.optim keeps its step counters
    device_value = torch.tensor(1.0)  # made while nothing tracks: device data
    with count_host_syncs("cpu") as syncs:
        step.add_(1)
        step.item(), device_value.item()
    assert [s.op for s in syncs.syncs] == ["Tensor.item"]


def test_a_device_value_target_is_the_device_and_the_cpu_string_is_the_host():
    x, _, _ = _inputs()
    with count_host_syncs("cpu") as syncs:
        x.to(x.device), x.to(device=torch.device("cpu"))
        x.to("cpu")
    assert syncs.total == 1


def test_explicit_waits_count():
    """torch.cuda.synchronize and an event's synchronize (the CPU shims' stand-ins here)."""
    apply_cpu_shims()
    with count_host_syncs("cpu") as syncs:
        torch.cuda.synchronize()
        torch.cuda.current_stream().record_event().synchronize()
    assert [s.op for s in syncs.syncs] == ["torch.cuda.synchronize", "Event.synchronize"]


# ------------------------------------------------------------- one training step
ONE_RANK_BUDGET = 3  # the logged loss sums, the gradient norm, the finite-weights flag
# Under CP the attention and the loss shift add none (index plans are host math, copied to the
# device once per layout). Under CP > 1 megatron-core's MTP rolls a packed batch document by
# document, reading each document's offsets from the device (`_roll_tensor_packed_seq`; at CP = 1
# `models.mtp` rolls without them): those are counted apart.
MTP_PACKED_ROLL = "megatron/core/transformer/multi_token_prediction.py"
CP_CODE = ("megatron_composer/attention/", "megatron_composer/parallel/")


def _step_syncs(rank, world, **fields):
    """Host syncs of one tiny-preset step (after a first one) from micro-batches built outside:
    (printable record, total, sources)."""
    with track_host_tensors():  # the trainer's host data (optimizer step counters, index plans)
        tr = make_trainer(UnevenDataset(), **fields)
        tr.step()
        tr.micro_batches(tr.state.consumed_samples)  # the next batch's zigzag plans
    # made again outside: the batch tensors are device data, as after Batch.to on a GPU
    batches = tr.micro_batches(tr.state.consumed_samples)
    for b in batches:  # the CP shift plans read them from the host batch, before its copy to the GPU
        if b.packed_seq_params is not None:
            packed_doc_lengths(b.packed_seq_params)
    with count_host_syncs("cpu") as syncs:
        tr.train_step(batches)
    return str(syncs), syncs.total, [s.source for s in syncs.syncs]


def test_one_rank_step_stays_within_the_sync_budget():
    text, total, _ = _step_syncs(0, 1)
    print(f"host syncs per step: {text}")
    assert total <= ONE_RANK_BUDGET, f"host syncs per step: {text}"


# megatron-core's unfused RoPE of a packed batch splits it by `cu_seqlens.tolist()` and compares
# `cu_seqlens[-1]`: 2 syncs per attention layer per micro-batch (`apply_rotary_pos_emb` with "thd";
# the fused YaRN RoPE on CUDA takes the device offsets). Counted apart.
THD_ROPE = "megatron/core/models/common/embeddings/rope_utils.py"


def test_one_rank_packed_step_adds_no_sync_of_its_own():
    """Packed documents at CP = 1: the attention and the MTP roll (`models.mtp`) read no document
    offsets; everything but megatron-core's unfused packed RoPE stays within the budget."""
    text, total, sources = _step_syncs(0, 1, micro_batch_size=1, global_batch_size=2, reset_attention_mask=True)
    print(f"host syncs per step, packed documents: {text}")
    assert len([s for s in sources if not s.startswith(THD_ROPE)]) <= ONE_RANK_BUDGET, text


def test_cp2_packed_step_adds_no_sync_of_its_own():
    """CP=2 on packed documents: no sync in the CP attention or the loss shift, and within the
    one-rank budget apart from megatron-core's packed MTP roll."""
    results = run_distributed(_step_syncs, 2, cp=2, micro_batch_size=1, global_batch_size=1,
                              reset_attention_mask=True, pad_to_multiple=True, timeout=300)
    for rank, (text, _, sources) in enumerate(results):
        print(f"host syncs per step at CP=2, rank {rank}: {text}")
        assert not [s for s in sources if s.startswith(CP_CODE)], text
        assert len([s for s in sources if not s.startswith(MTP_PACKED_ROLL)]) <= ONE_RANK_BUDGET, text
