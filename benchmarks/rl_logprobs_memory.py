"""Peak memory of the RL losses' vocabulary-sized work: chunked (ours) vs the unchunked formulas.

    python benchmarks/rl_logprobs_memory.py [--tokens 4096] [--vocab 32768] [--dtype bf16] [--device cpu]

One packed micro-batch of `--tokens` positions; its logits [1, T, V] come out
of an output layer (hidden [T, 1, 64] @ W^T, so their gradient flows on to a
layer, as in training). Measured over the loss's forward and backward, above
what is live before it (logits, batch, teacher table; the output layer's
weight and hidden gradients, a few MiB, are in both):

  policy loss    log-probs at temperature 0.8, entropy metric, dr_grpo with
                 TIS and k1 in the loss (`rl.loss.PolicyLoss`), against the
                 same loss on -cross_entropy(logits.float() / T) and the entropy
                 of log_softmax(logits.float() / T) (the unchunked formulas)
  feedback KL    reverse KL on half the positions against a full-vocabulary
                 teacher table (`rl.feedback_loss.FeedbackLoss`), against
                 feedback_kl on all target rows at once

Peak: on CUDA torch.cuda.max_memory_allocated; on CPU the most bytes held at
once by the storages that aten ops create (a TorchDispatchMode that adds a
storage's bytes when an op creates it and subtracts them when it is freed).
"largest" is the largest single allocation; seconds: the best of two runs
outside the measuring mode. Prints one line per loss and variant and the
ratio of the peaks, unchunked / chunked.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import weakref
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_composer.parallel import shift_left  # noqa: E402
from megatron_composer.rl.algorithms import policy_gradient_loss  # noqa: E402
from megatron_composer.rl.config import RLConfig  # noqa: E402
from megatron_composer.rl.feedback_loss import FeedbackLoss, FeedbackTable, feedback_kl  # noqa: E402
from megatron_composer.rl.loss import PolicyLoss  # noqa: E402
from megatron_composer.training.loss_plugins import ModelOutput  # noqa: E402

TEMPERATURE = 0.8
HIDDEN = 64


class LiveBytes(TorchDispatchMode):
    """Peak bytes held at once by the storages aten ops create while the mode is on, and the largest one."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.largest = 0, 0, 0
        self.tracked: set[int] = set()

    def _freed(self, ptr: int, nbytes: int) -> None:
        self.tracked.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in inputs or ptr in self.tracked or nbytes == 0:
                continue
            self.tracked.add(ptr)
            self.live += nbytes
            self.peak, self.largest = max(self.peak, self.live), max(self.largest, nbytes)
            weakref.finalize(storage, self._freed, ptr, nbytes)
        return out


def measure(fn, hidden, weight, device):
    """(peak extra bytes, largest allocation or None) of fn(logits) (forward and backward), on fresh logits."""
    logits = logits_of(hidden, weight)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(logits)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, None
    with LiveBytes() as mode:
        fn(logits)
    return mode.peak, mode.largest


def seconds(fn, hidden, weight, device, repeats=2):
    """Best wall time of fn(logits) (forward and backward), outside the measuring mode."""
    best = float("inf")
    for _ in range(repeats):
        logits = logits_of(hidden, weight)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(logits)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def make_inputs(tokens, vocab, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 1, HIDDEN, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, HIDDEN, generator=g) / HIDDEN ** 0.5 * 3).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    rows = torch.where(torch.arange(tokens) % 2 == 0, torch.arange(tokens) // 2, -1)[None].to(device)
    teacher = torch.log_softmax(torch.randn(tokens // 2, vocab, generator=g), -1).to(device)
    batch = SimpleNamespace(tokens=labels, labels=labels, loss_mask=torch.ones(1, tokens, device=device),
                            advantages=torch.randn(1, tokens, generator=g).to(device),
                            sampler_logp=-torch.rand(1, tokens, generator=g).to(device) * 5,
                            ref_logp=-torch.rand(1, tokens, generator=g).to(device) * 5, old_logp=None,
                            normalizer_share=float(tokens), feedback_rows=rows, feedback_table=FeedbackTable(teacher))
    return hidden, weight, batch


def logits_of(hidden, weight):
    """[1, T, V] from megatron's [T, 1, V] storage, made by an output layer."""
    return (hidden @ weight.t()).transpose(0, 1)


def policy_chunked(batch, rl):
    def run(logits):
        PolicyLoss(rl).loss_sum(batch, ModelOutput(logits, []), shift_left).backward()
    return run


def policy_unchunked(batch, rl):
    def run(logits):
        scaled = logits[0].float() / TEMPERATURE
        logp = -torch.nn.functional.cross_entropy(scaled, batch.labels[0], reduction="none")
        with torch.no_grad():
            log_probs = torch.log_softmax(scaled.detach(), dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        alg = rl.algorithm
        loss, _ = policy_gradient_loss(logp, logp.detach(), batch.advantages[0], batch.loss_mask[0], normalizer=1.0,
                                       sampler_logp=batch.sampler_logp[0], tis_cap=alg.tis_cap, entropy=entropy,
                                       ref_logp=batch.ref_logp[0], kl_coef=alg.kl_coef, kl_kind=alg.kl_kind,
                                       policy_loss=alg.policy_loss)
        loss.backward()
    return run


def feedback_chunked(batch):
    def run(logits):
        FeedbackLoss().loss_sum(batch, ModelOutput(logits, []), shift_left).backward()
    return run


def feedback_unchunked(batch):
    def run(logits):
        at = (batch.feedback_rows[0] >= 0).nonzero().squeeze(1)
        table = batch.feedback_table
        feedback_kl(logits[0, at], table.logp[batch.feedback_rows[0, at]]).sum().backward()
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    rl = RLConfig.from_flat(temperature=TEMPERATURE, tis_cap=2.0, kl_coef=0.05, kl_placement="loss", kl_kind="k1")
    hidden, weight, batch = make_inputs(args.tokens, args.vocab, dtype, device)
    t, v = args.tokens, args.vocab
    mib = 2 ** 20
    print(f"T={t} V={v} logits {args.dtype} {t * v * dtype.itemsize / mib:.0f} MiB, fp32 [T, V] "
          f"{t * v * 4 / mib:.0f} MiB, device {device}")
    for name, chunked, unchunked in (
            ("policy loss", policy_chunked(batch, rl), policy_unchunked(batch, rl)),
            ("feedback KL", feedback_chunked(batch), feedback_unchunked(batch))):
        results = {}
        for variant, fn in (("unchunked", unchunked), ("chunked", chunked)):
            hidden.grad = weight.grad = None
            peak, largest = measure(fn, hidden, weight, device)
            results[variant] = peak
            extra = "" if largest is None else f"  largest {largest / mib:8.1f} MiB"
            wall = seconds(fn, hidden, weight, device)
            print(f"{name:12s} {variant:9s}  peak {peak / mib:8.1f} MiB{extra}  {wall:6.2f} s")
        print(f"{name:12s} ratio unchunked / chunked peak: {results['unchunked'] / max(results['chunked'], 1):.1f}x")


if __name__ == "__main__":
    main()
