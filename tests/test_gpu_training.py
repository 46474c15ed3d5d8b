"""The Trainer on CUDA: equal to the CPU path, bf16 tracking fp32, bit-exact resume.

* CUDA fp32 equals CPU fp32: the same weights (the CUDA model's, copied) and
  the same global batch give the same logits, losses and reduced gradients
  within 1e-4, without MTP, with MTP, and on packed documents
  (--reset-attention-mask, "thd" cu_seqlens). The CPU side is the verified
  CPU path itself, run in a subprocess that sees no GPU (`reference` below),
  so it is an independent implementation of the same step (gloo, the CPU
  shims, the CPU attention kernels). Both sides build the `local` layers and
  run every fp32 GEMM in fp32 (`fp32_gemms`): TF32 off, and megatron-core's
  router GEMM on torch.mm rather than Transformer Engine's, which computes
  fp32 inputs with TF32 whatever torch's flags say.
* 20 --bf16 steps on CUDA track fp32 on CUDA (lm loss within 2% at every step).
* save at step 2 and resume to step 4 on CUDA gives the uninterrupted run's
  losses bit for bit, with the CUDA generator and megatron's RNG tracker
  streams restored; a checkpoint written on CPU loads into a CUDA run.

Needs CUDA (`make test-gpu`); the whole file runs in well under 2 minutes on one GPU.
"""
import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_composer import checkpoint as ck
from megatron_composer.data import sample_dict

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu

# name -> (model overrides, TrainingConfig fields): 2 micro-batches of 2 per step
CASES = {
    "no-mtp": ({"mtp_num_layers": 0}, {}),
    "mtp": ({}, {}),
    "packed-mtp": ({}, {"reset_attention_mask": True}),
}
FIELDS = {"micro_batch_size": 2, "global_batch_size": 4}


def _model_cfg(overrides):
    from megatron_composer.config import get_preset

    return dataclasses.replace(get_preset("tiny"), **overrides)


def _trainer(case, dataset=None, **fields):
    from tests.test_trainer import UnevenDataset
    from tests.trainers import make_trainer

    overrides, case_fields = CASES[case]
    return make_trainer(dataset if dataset is not None else UnevenDataset(),
                        model_cfg=_model_cfg(overrides), **{**FIELDS, **case_fields, **fields})


def _cpu(t):
    return t.detach().float().cpu().clone()


def _outputs(tr) -> dict:
    """Logits of the first micro-batch, then one step: its losses and the reduced
    gradients just before the update (all on the host)."""
    batch = tr.micro_batches(0)[0].to(tr.device)
    tr.model.eval()
    with torch.no_grad():
        out = tr.forward(batch)
    tr.model.train()
    grads, step = {}, tr.optimizer.step

    def capture():
        grads.update({n: _cpu(g) for n, g in zip(tr.optimizer.names, tr.model.grads()) if g is not None})
        return step()

    tr.optimizer.step = capture
    result = tr.step()
    tr.optimizer.step = step
    return {"logits": _cpu(out.logits), "mtp_logits": [_cpu(x) for x in out.mtp_logits],
            "lm": result.lm_loss, "mtp": result.mtp_loss, "grads": grads}


def _weights(tr) -> dict:
    return {k: v.detach().cpu().clone() for k, v in tr.model.gpt.state_dict().items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _load_weights(tr, weights) -> None:
    missing, unexpected = tr.model.gpt.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    tr.optimizer.copy_model_to_main()


def _resumed(load: str):
    """A Trainer of the "mtp" case resumed from `load`, and what it printed."""
    tr = _trainer("mtp", checkpoint={"load": load})
    notes = []
    tr.log.print = notes.append
    tr.resume()
    return tr, notes


def _saved_after_one_step(save: str) -> dict:
    tr = _trainer("mtp", checkpoint={"save": save})
    tr.step()
    tr.checkpoints.save()
    return _weights(tr)


def reference(request_path: str, result_path: str) -> None:
    """The CPU side (in a process that sees no GPU): each case's outputs with the given
    weights; a 1-step checkpoint of the "mtp" case written to a new directory; and the
    CUDA run's checkpoint resumed on CPU. Every step in `fp32_gemms`: where TE imports, its GEMM
    would otherwise be handed the router's CPU tensors."""
    request = torch.load(request_path, weights_only=False)
    results = {}
    with fp32_gemms():
        for case, weights in request["weights"].items():
            tr = _trainer(case)
            _load_weights(tr, weights)
            results[case] = _outputs(tr)
        results["cpu_checkpoint_weights"] = _saved_after_one_step(request["cpu_checkpoint"])
        tr, notes = _resumed(request["cuda_checkpoint"])
        results["cuda_checkpoint_on_cpu"] = {"iteration": tr.state.iteration, "weights": _weights(tr),
                                             "notes": notes, "skipped": tr.step().skipped}
    torch.save(results, result_path)


def _run_reference(tmp_path, weights) -> dict:
    request, result = tmp_path / "request.pt", tmp_path / "result.pt"
    torch.save({"weights": weights, "cpu_checkpoint": str(tmp_path / "cpu_ckpt"),
                "cuda_checkpoint": str(tmp_path / "cuda_ckpt")}, request)
    run = subprocess.run([sys.executable, "-m", "tests.test_gpu_training", str(request), str(result)],
                         cwd=REPO, env=reference_env(os.environ), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(result, weights_only=False)


def reference_env(environ) -> dict:
    """The CPU reference process's environment: no GPU visible, no launcher's rank variables, this
    repository first on PYTHONPATH, followed by the inherited PYTHONPATH (where `tools/gpu_check.sh`
    puts the packages it installs)."""
    env = dict(environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="8")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), environ.get("PYTHONPATH")) if p)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(name, None)
    return env


@contextlib.contextmanager
def fp32_gemms():
    """Every fp32 GEMM in fp32: torch's TF32 switches off, and megatron-core's router gating GEMM
    on its torch.mm path. megatron-core routes that GEMM through Transformer Engine's
    `general_gemm` whenever TE imports, whatever the layers are built from, and TE's cuBLASLt
    GEMM picks CUBLAS_COMPUTE_32F_FAST_TF32 for fp32 inputs without consulting torch's flags:
    a 10-bit mantissa, far beyond the parity's 1e-4."""
    from megatron.core.transformer.moe import moe_utils

    absent = object()
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             getattr(moe_utils, "te_general_gemm", absent))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, te_gemm = saved
        if te_gemm is absent:
            del moe_utils.te_general_gemm
        else:
            moe_utils.te_general_gemm = te_gemm


def _close(got, want, what):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(scale, 1e-6), msg=what)


def test_cuda_fp32_equals_cpu_fp32_and_cpu_checkpoints_load(tmp_path):
    weights, outputs = {}, {}
    for case in CASES:  # one Trainer at a time: each rebuilds megatron-core's parallel state
        tr = _trainer(case)
        assert tr.cfg.transformer.transformer_impl == "local", "the CPU side cannot build TE layers"
        gpt = tr.model.gpt
        placed = list(gpt.parameters()) + list(gpt.buffers()) + [p.main_grad for p in tr.model.params]
        assert all(t.device == tr.device and t.device.type == "cuda" for t in placed), case
        weights[case] = _weights(tr)
        with fp32_gemms():
            outputs[case] = _outputs(tr)
    cuda_checkpoint_weights = _saved_after_one_step(str(tmp_path / "cuda_ckpt"))
    ref = _run_reference(tmp_path, weights)
    for case, got in outputs.items():
        want = ref[case]
        _close(got["logits"], want["logits"], f"{case}: logits")
        assert len(got["mtp_logits"]) == len(want["mtp_logits"]) == (0 if case == "no-mtp" else 1)
        for depth, (a, b) in enumerate(zip(got["mtp_logits"], want["mtp_logits"]), start=1):
            _close(a, b, f"{case}: MTP depth {depth} logits")
        assert got["lm"] == pytest.approx(want["lm"], rel=1e-4) and got["lm"] > 7.0, case
        assert got["mtp"] == pytest.approx(want["mtp"], rel=1e-4, abs=1e-6), case
        assert got["grads"].keys() == want["grads"].keys() and len(got["grads"]) > 20
        for name in want["grads"]:
            _close(got["grads"][name], want["grads"][name], f"{case}: gradient of {name}")

    # checkpoints cross devices both ways: weights exact, a note on the random state
    cuda, notes = _resumed(str(tmp_path / "cpu_ckpt"))
    assert cuda.state.iteration == 1
    for name, value in _weights(cuda).items():
        assert torch.equal(value, ref["cpu_checkpoint_weights"][name]), name
    assert any("saved on cpu and this run is on cuda" in n for n in notes), notes
    assert not cuda.step().skipped
    on_cpu = ref["cuda_checkpoint_on_cpu"]
    assert on_cpu["iteration"] == 1 and not on_cpu["skipped"]
    for name, value in on_cpu["weights"].items():
        assert torch.equal(value, cuda_checkpoint_weights[name]), name
    assert any("saved on cuda and this run is on cpu" in n for n in on_cpu["notes"]), on_cpu["notes"]


class SmallAlphabet(torch.utils.data.Dataset):
    """Uniform random tokens from `ids` of the vocabulary: the loss falls smoothly from
    ln(vocab) toward ln(ids) (no memorization, whose chaotic phase amplifies rounding)."""

    def __init__(self, n=64, seq=64, ids=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(3, 3 + ids, (n, seq + 1), generator=g)
        self.rows = [sample_dict(r[:-1], r[1:], torch.ones(seq), np.array([0, seq], dtype=np.int32)) for r in data]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def test_bf16_tracks_fp32_for_20_steps():
    runs = {}
    for bf16 in (False, True):
        tr = _trainer("mtp", SmallAlphabet(), bf16=bf16, lr_warmup_iters=3, lr_decay_iters=20)
        assert (next(tr.model.gpt.parameters()).dtype == torch.bfloat16) == bf16
        runs[bf16] = [tr.step().lm_loss for _ in range(20)]
    fp32, bf16 = runs[False], runs[True]
    assert fp32[-1] < fp32[0] - 2.0, fp32  # it trained (8.3 -> 3.7 on CPU)
    for step, (a, b) in enumerate(zip(fp32, bf16)):
        assert abs(a - b) <= 0.02 * a, (step, fp32, bf16)
    assert fp32 != bf16  # bf16 compute really ran


def _rng_streams() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"cuda": torch.cuda.get_rng_state(), **{k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}


def _move_rng_streams() -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    for name in tracker.get_states():
        with tracker.fork(name):
            torch.rand(8, device="cuda")
    torch.rand(8, device="cuda")


def test_resume_on_cuda_is_bit_exact(tmp_path):
    """Deterministic algorithms (atomics-free scatter/index adds), the same kernels in
    one process: 4 uninterrupted steps equal 2 steps, save, resume, 2 steps."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ckpt = {"save": str(tmp_path), "load": str(tmp_path)}
        full = _trainer("mtp", bf16=True)
        reference_losses = [(r.lm_loss, r.mtp_loss) for r in (full.step() for _ in range(4))]
        first = _trainer("mtp", bf16=True, checkpoint=ckpt)
        losses = [(r.lm_loss, r.mtp_loss) for r in (first.step() for _ in range(2))]
        streams = _rng_streams()
        first.checkpoints.save()
        saved = torch.load(Path(ck.iteration_dir(str(tmp_path), 2)) / "rng_rank0.pt", weights_only=True)
        assert saved["device"] == "cuda" and saved["cuda_rng_tracker"].keys() == streams.keys() - {"cuda"}
        resumed = _trainer("mtp", bf16=True, checkpoint=ckpt)
        _move_rng_streams()  # away from where construction seeded them; the resume must bring them back
        assert not torch.equal(_rng_streams()["cuda"], streams["cuda"])
        resumed.resume()
        after = _rng_streams()
        assert after.keys() == streams.keys() and all(torch.equal(after[k], streams[k]) for k in streams)
        losses += [(r.lm_loss, r.mtp_loss) for r in (resumed.step() for _ in range(2))]
    finally:
        torch.use_deterministic_algorithms(False)
    assert losses == reference_losses


if __name__ == "__main__":
    reference(sys.argv[1], sys.argv[2])
