"""Activation recompute with our MLA attention: same numbers, fewer saved bytes.

For the tiny model (with MTP) on 2 gloo ranks, at CP=2 (latent all-gather
attention) and CP=1 (DP=2), plain and packed batches: recompute of
"mla_up_proj", of "core_attn" and full recompute give the logits and every
parameter gradient of the run without recompute (fp32, relative 1e-6), and the
forward leaves fewer bytes saved for backward (measured with
`torch.autograd.graph.saved_tensors_hooks`: the storages still allocated when
the forward ends, so tensors megatron-core frees after use do not count).
"""
import pytest
import torch

from tests.distributed import run_distributed
from tests.test_cp_attention import CASES, TINY, _batch

RTOL = 1e-6
RECOMPUTE = {
    "none": {},
    "mla_up_proj": dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
    "core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
RUNS = [(2, "plain"), (2, "packed"), (1, "packed")]


def saved_bytes(saved, exclude=()) -> int:
    """Bytes of the distinct storages behind `saved` tensors that are still allocated,
    leaving out those of `exclude` (the parameters)."""
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    storages = {}
    for t in saved:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _step(model, batch, cp):
    """Forward (saved tensors recorded) and backward on this rank's share of `batch`."""
    from megatron.core import parallel_state

    from megatron_composer.models import composer_forward
    from megatron_composer.parallel import zigzag_batch
    from megatron_composer.training.losses import lm_loss

    local = zigzag_batch(batch, cp, parallel_state.get_context_parallel_rank())
    model.zero_grad(set_to_none=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, mtp = composer_forward(model, local.tokens, local.position_ids,
                                       local.packed_seq_params)
        lm_sum, _ = lm_loss(logits, local.labels, local.loss_mask)
        mtp_sum, _ = lm_loss(mtp[0], local.labels, local.loss_mask)
        loss = lm_sum + 0.1 * mtp_sum
    nbytes = saved_bytes(saved, exclude=list(model.parameters()))
    saved.clear()  # drop our references before backward
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), grads, nbytes


def _body(rank, world):
    from megatron_composer.checkpoint import load_model_state_dict, model_state_dict
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    results, state = {}, None
    for cp in sorted({cp for cp, _ in RUNS}, reverse=True):
        layout = ParallelLayout(world_size=env.world_size, cp=cp, num_experts=TINY.num_experts)
        for mode, overrides in RECOMPUTE.items():
            initialize_parallel(layout, seed=1234)
            model = build_model(TINY, layout, seq_length=64, **overrides)
            if state is None:  # every model starts from the first one's weights
                state = {k: v.clone() for k, v in model_state_dict(model).items()}
            load_model_state_dict(model, state)
            for run_cp, name in RUNS:
                if run_cp == cp:
                    results[(cp, name, mode)] = _step(model, _batch(**CASES[name]), cp)
    return results


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_body, 2, timeout=300)


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("mode", ["mla_up_proj", "core_attn", "full"])
@pytest.mark.parametrize("cp,name", RUNS)
def test_recompute_keeps_outputs_and_gradients_and_saves_memory(runs, cp, name, mode):
    for results in runs:
        logits, grads, nbytes = results[(cp, name, mode)]
        ref_logits, ref_grads, ref_nbytes = results[(cp, name, "none")]
        assert _rel_err(logits, ref_logits) < RTOL
        assert grads.keys() == ref_grads.keys()
        errors = {n: _rel_err(grads[n], ref_grads[n]) for n in ref_grads}
        worst = max(errors, key=errors.get)
        assert errors[worst] < RTOL, (worst, errors[worst])
        assert nbytes < ref_nbytes, (mode, nbytes, ref_nbytes)
        if mode == "mla_up_proj":  # at least the expanded keys of every attention layer are freed
            assert ref_nbytes - nbytes >= _key_bytes(name), (ref_nbytes - nbytes, _key_bytes(name))


def _key_bytes(name) -> int:
    """fp32 bytes of the full-sequence keys [s, b, n, qk+rope], summed over all attention
    layers (decoder and MTP)."""
    case = CASES[name]
    tokens = sum(case["doc_lengths"]) * case["rows"]
    layers = TINY.num_layers + TINY.mtp_num_layers
    return 4 * tokens * TINY.num_attention_heads * (TINY.qk_head_dim + TINY.qk_pos_emb_head_dim) * layers
