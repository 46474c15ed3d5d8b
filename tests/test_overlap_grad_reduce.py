"""DDP's overlapped gradient reduce (`--overlap-grad-reduce`) against the reduce after the backward.

Two gloo ranks, two micro-batches each, the gradient buffer split into many
buckets: the overlapped run starts each bucket's all-reduce in the last
micro-batch's backward (none in the first micro-batch's) and ends with the
same reduced gradients, bit for bit, as one reduce after the backward.
"""
import pytest

from tests.distributed import run_distributed
from tests.test_trainer import UnevenDataset
from tests.trainers import make_trainer

BUCKET = 200_000  # parameters per bucket: the tiny preset's buffer splits into about 14


def _run(rank, world, overlap):
    tr = make_trainer(UnevenDataset(), micro_batch_size=1, global_batch_size=4, overlap_grad_reduce=overlap,
                      ddp_bucket_size=BUCKET)
    ddp = tr.model.module
    groups = ddp.bucket_groups + ddp.expert_parallel_bucket_groups
    launched = []  # per micro-batch: how many buckets' reduces had started when its backward ended
    forward_backward, step = tr.forward_backward, tr.optimizer.step

    def counted(*args):
        out = forward_backward(*args)
        launched[-1].append(sum(g.grad_reduce_handle is not None for g in groups))
        return out

    grads = []

    def capture():
        grads.append({n: g.detach().clone() for n, g in zip(tr.optimizer.names, tr.model.grads())})
        return step()

    tr.forward_backward, tr.optimizer.step = counted, capture
    results = []
    for _ in range(3):
        launched.append([])
        r = tr.step()
        results.append((r.lm_loss, r.mtp_loss, r.grad_norm))
    return dict(buckets=len(groups), launched=launched, grads=grads, results=results)


def test_overlapped_reduce_equals_the_reduce_after_the_backward():
    on = run_distributed(_run, 2, True)
    off = run_distributed(_run, 2, False)
    for rank in range(2):
        a, b = on[rank], off[rank]
        assert a["buckets"] >= 8 and b["buckets"] == 1  # megatron: one bucket without overlap
        # first update: megatron counts each bucket's gradients, then reduces after the backward;
        # from the second on every bucket's reduce starts in the last micro-batch's backward only
        assert a["launched"] == [[0, 0], [0, a["buckets"]], [0, a["buckets"]]]
        assert b["launched"] == [[0, 0]] * 3
        assert a["results"] == b["results"]
        for ga, gb in zip(a["grads"], b["grads"]):
            assert ga.keys() == gb.keys()
            for name in ga:
                assert ga[name].equal(gb[name]), name
    reduced = [on[rank]["grads"][1] for rank in range(2)]  # replicas hold the same sums
    assert all(reduced[0][n].equal(reduced[1][n]) for n in reduced[0])


def _final_norm_skipped(tr):
    """The decoder's final norm replaced by the identity: its weight gets no gradient."""
    tr.model.gpt.decoder.final_layernorm.forward = lambda hidden_states: hidden_states


def test_a_parameter_without_gradient_is_named():
    """megatron's overlapped reduce waits for every parameter of a bucket: a trainable parameter
    outside the loss would stall its bucket from the second update on; the first update names it.
    Without the overlap such a run trains."""
    tr = make_trainer(UnevenDataset(n=4))
    _final_norm_skipped(tr)
    with pytest.raises(RuntimeError, match=r"1 trainable parameters got no gradient in this update \(first: "
                                           r"\['decoder.final_layernorm.weight'\].*--no-overlap-grad-reduce"):
        tr.step()
    tr = make_trainer(UnevenDataset(n=4), overlap_grad_reduce=False)
    _final_norm_skipped(tr)
    assert not tr.step().skipped and not tr.step().skipped
