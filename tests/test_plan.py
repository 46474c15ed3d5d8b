"""The run planner (`megatron_composer.planner`, `tools/plan.py`).

Exact: parameter, gradient and optimizer-state bytes equal the storages a
real Trainer allocates on every rank (DDP and dual-mesh HSDP, world 2 and 4,
uneven shards included). Estimated: activation peaks within 20% of the peak
of live tensor storages measured during a tiny model's forward + backward on
CPU (and of `torch.cuda.max_memory_allocated` on a GPU). The CLI runs the
report's two layouts and refuses bad input with exit code 2.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]

# One Trainer per case, built one after another on the same ranks:
# (sharding, EP, --dense-shard-size, optimizer, bf16, model overrides).
# Odd sizes (kv_lora_rank 31 -> kv_down rows 47, moe_ffn 95 -> fc1 rows 190)
# give uneven FSDP2 chunks, so padding and per-rank optimizer state differ.
UNEVEN = {"kv_lora_rank": 31, "moe_ffn_hidden_size": 95}
CASES = {
    2: [("ddp", 2, None, "adam", False, {}),
        ("hsdp", 2, 2, "muon", True, UNEVEN)],
    4: [("ddp", 2, None, "muon", True, {}),
        ("hsdp", 2, 2, "adam", False, UNEVEN)],
}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        st = _local(t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class CollectiveBytes:
    """Bytes this rank sends through torch.distributed while installed, by (function, phase):
    all-gather (n-1) x input, reduce-scatter (n-1)/n x input, all-reduce 2 (n-1)/n x tensor,
    all-to-all the input rows addressed to other ranks (ring / pairwise algorithms)."""

    def __init__(self):
        import collections

        self.sent = collections.Counter()
        self.phase = "step"
        self._originals = {}

    def _bytes(self, name, args, kwargs):
        import torch.distributed as dist

        group = kwargs.get("group", args[2] if name == "all_gather" and len(args) > 2 else None)
        if name == "reduce_scatter" and group is None and len(args) > 3:
            group = args[3]
        n = dist.get_world_size(group)
        if name == "all_gather":
            return (n - 1) * _arg(args, kwargs, 1, "input_tensor").nbytes
        if name == "reduce_scatter":
            return (n - 1) * _arg(args, kwargs, 1, "input").nbytes // n
        if name == "all_reduce":
            return 2 * (n - 1) * _arg(args, kwargs, 0, "tensor").nbytes // n
        x = _arg(args, kwargs, 1, "input")
        splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        row = x.nbytes // max(x.shape[0], 1)
        own = int(splits[dist.get_rank(group)]) if splits is not None else x.shape[0] // n
        return x.nbytes - own * row

    def __enter__(self):
        import torch.distributed as dist

        kinds = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
                 "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
                 "all_reduce": "all_reduce", "all_to_all_single": "all_to_all_single"}
        for name, kind in kinds.items():
            original = self._originals[name] = getattr(dist, name)

            def counted(*args, _kind=kind, _original=original, **kwargs):
                self.sent[(_kind, self.phase)] += self._bytes(_kind, args, kwargs)
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self._originals.items():
            setattr(dist, name, original)


def _arg(args, kwargs, index, name):
    return args[index] if len(args) > index else kwargs[name]


def _measure_states(rank, world, cases):
    """Per case: the real model's (name, shape) list, the bytes this rank holds, and the
    bytes it sends per collective during one step."""
    from megatron_composer.config import get_preset
    from megatron_composer.data import RandomTokenDataset
    from tests.trainers import make_trainer

    out = []
    for sharding, ep, shard, optimizer, bf16, overrides in cases:
        model_cfg = get_preset("tiny").replace(**overrides)
        tr = make_trainer(RandomTokenDataset(8, 32, 4096), model_cfg=model_cfg, ep=ep, micro_batch_size=1,
                          global_batch_size=world, seq_length=32, optimizer=optimizer, bf16=bf16,
                          data_parallel_sharding=sharding, dense_shard_size=shard)
        seen = {}
        comm = CollectiveBytes()

        def measured_step(tr=tr, step=tr.optimizer.step, seen=seen, comm=comm):
            # the reduced gradients exist between backward and the update
            seen["gradients"] = _storage_bytes(g for g in tr.model.grads() if g is not None)
            comm.phase = "optimizer"
            return step()

        tr.optimizer.step = measured_step
        with comm:
            tr.step()
        state = []
        for o in tr.optimizer.optimizers:
            for s in o.state.values():
                for key, v in s.items():
                    if key == "step":
                        assert v.ndim == 0 and v.device.type == "cpu"  # AdamW's host counter, not counted
                    else:
                        state.append(v)
        names = [(n, tuple(_local(p).shape) if sharding == "ddp" else tuple(p.shape))
                 for n, p in tr.model.gpt.named_parameters()]
        out.append({
            "names": names,
            "parameters": _storage_bytes(tr.model.gpt.parameters()),
            "main_weights": _storage_bytes(tr.optimizer.opt_params) if tr.optimizer.mixed_precision else 0,
            "gradients": seen["gradients"],
            "optimizer_state": _storage_bytes(state),
            "sent": dict(comm.sent),
        })
    return out


def _planned_collectives(cfg, inventory, world, sharding, ep, shard, optimizer, bf16) -> dict:
    """The planner's bytes for one step of `_measure_states`' trainer, by torch.distributed function."""
    from megatron_composer.planner import default_dense_shard_size
    from megatron_composer.planner.comm import CommSetup, collectives

    setup = CommSetup(world_size=world, cp=1, ep=ep, sharding=sharding,
                      dense_shard_size=shard or default_dense_shard_size(world, 1), micro_batches=1, tokens=32,
                      a=2 if bf16 else 4, nvlink_domain=world, optimizer=optimizer)
    kinds = {"FSDP all-gather": "all_gather", "FSDP reduce-scatter": "reduce_scatter",
             "HSDP replica all-reduce": "all_reduce", "DDP all-reduce": "all_reduce",
             "EP all-to-all": "all_to_all_single", "Muon all-to-all": "muon"}
    planned = dict.fromkeys(kinds.values(), 0)
    for col in collectives(cfg, inventory, setup):
        planned[next(v for k, v in kinds.items() if col.name.startswith(k))] += col.bytes_per_step
    return planned


@pytest.mark.parametrize("world", [2, 4])
def test_state_bytes_equal_a_real_model_on_every_rank(world):
    """Planner bytes == storages of the built tiny model, rank by rank, DDP and HSDP."""
    from megatron_composer.config import get_preset
    from megatron_composer.planner import parameter_inventory, state_bytes

    measured = run_distributed(_measure_states, world, CASES[world], timeout=300)
    for i, (sharding, ep, shard, optimizer, bf16, overrides) in enumerate(CASES[world]):
        cfg = get_preset("tiny").replace(**overrides)
        inventory = parameter_inventory(cfg, ep)
        for rank in range(world):
            got = measured[rank][i]
            assert got["names"] == [(p.name, p.shape) for p in inventory]
            plan = state_bytes(inventory, cfg, sharding=sharding, world_size=world, ep=ep, dense_shard_size=shard,
                               optimizer=optimizer, bf16=bf16, rank=rank)
            case = f"world {world} rank {rank} {sharding} EP{ep} {optimizer} bf16={bf16} {overrides}"
            for key in ("parameters", "main_weights", "gradients", "optimizer_state"):
                assert getattr(plan, key) == got[key], (case, key, getattr(plan, key), got[key])
        if overrides:  # uneven chunks: the last rank holds less optimizer state than rank 0
            assert measured[-1][i]["optimizer_state"] < measured[0][i]["optimizer_state"]
        _check_collectives(measured, i, cfg, inventory, world, sharding, ep, shard, optimizer, bf16)


def _check_collectives(measured, i, cfg, inventory, world, sharding, ep, shard, optimizer, bf16):
    """Planned bytes per step against the bytes each rank handed to torch.distributed: FSDP2's
    all-gathers and reduce-scatters within 3% (the planner leaves out FSDP2's padding), the
    gradient all-reduces within 3% plus 64 KiB (loss counts, norms, flags and expert-bias
    counts are left out), Muon's all-to-alls exactly (the busiest rank), and EP's within 35%
    (the planner assumes balanced routing; a freshly initialized router is not)."""
    planned = _planned_collectives(cfg, inventory, world, sharding, ep, shard, optimizer, bf16)
    case = f"world {world} {sharding} EP{ep} {optimizer} bf16={bf16}"
    for rank in range(world):
        sent = measured[rank][i]["sent"]
        got = {name: sent.get((name, "step"), 0) for name in planned}
        for name in ("all_gather", "reduce_scatter"):
            assert got[name] == pytest.approx(planned[name], rel=0.03), (case, rank, name, got, planned)
        reduced = got["all_reduce"] + sent.get(("all_reduce", "optimizer"), 0)
        assert abs(reduced - planned["all_reduce"]) <= 0.03 * planned["all_reduce"] + 65536, (case, rank, got)
        assert got["all_to_all_single"] == pytest.approx(planned["all_to_all_single"], rel=0.35), (case, rank, got)
        assert got["all_to_all_single"] > 0 if ep > 1 else got["all_to_all_single"] == 0
    busiest = max(measured[r][i]["sent"].get(("all_to_all_single", "optimizer"), 0) for r in range(world))
    assert busiest == planned["muon"], (case, busiest, planned["muon"])


# ---------------------------------------------------------------- exact, against hand formulas

def test_kimi_inventory_holds_the_published_parameter_count():
    """Kimi K2.5's inventory (EP = 1, MTP included, expert bias not: a buffer) is within 2% of
    the published 1.04T. (The inventory is `count_parameters`' source: test_model.py checks
    both against a built model and a hand formula.)"""
    from megatron_composer.config import PRESETS
    from megatron_composer.planner import parameter_inventory

    kimi = parameter_inventory(PRESETS["kimi-k2.5"])
    assert sum(p.numel for p in kimi) == pytest.approx(1.04e12, rel=0.02)  # the report's 1.04T


def test_kimi_state_bytes_by_hand():
    """Kimi K2.5 on 128 GPUs, EP 8, every dim divisible by the shard sizes: HSDP rank 0 holds
    dense/8 + experts-of-its-EP-rank/16 fp32 elements (x2 for gradients, x2 more for AdamW),
    DDP with --bf16 the whole dense part and its 48 experts."""
    from megatron_composer.config import get_preset
    from megatron_composer.planner import parameter_inventory, state_bytes

    c = get_preset("kimi-k2.5")
    h, f = c.hidden_size, c.moe_ffn_hidden_size
    experts = c.num_moe_layers * (c.num_experts // 8) * 3 * h * f  # one EP rank's routed-expert elements
    dense = sum(p.numel for p in parameter_inventory(c, 8)) - experts
    inv = parameter_inventory(c, 8)
    hsdp = state_bytes(inv, c, sharding="hsdp", world_size=128, ep=8, dense_shard_size=8, optimizer="adam", bf16=True)
    per_rank = dense // 8 + experts // 16
    assert (hsdp.parameters, hsdp.gradients, hsdp.optimizer_state, hsdp.main_weights) == (
        4 * per_rank, 4 * per_rank, 8 * per_rank, 0)
    ddp = state_bytes(inv, c, sharding="ddp", world_size=128, ep=8, optimizer="adam", bf16=True)
    assert (ddp.parameters, ddp.main_weights, ddp.gradients, ddp.optimizer_state) == (
        2 * (dense + experts), 4 * (dense + experts), 4 * (dense + experts), 8 * (dense + experts))
    muon = state_bytes(inv, c, sharding="hsdp", world_size=128, ep=8, dense_shard_size=8, optimizer="muon")
    matrices = experts // 16 + sum(p.numel for p in inv if not p.expert and len(p.shape) == 2
                                   and "embedding" not in p.name and "output_layer" not in p.name
                                   and "router" not in p.name) // 8
    assert muon.optimizer_state == 4 * matrices + 8 * (per_rank - matrices)


# ---------------------------------------------------------------- activations, against measured peaks

class LivePeak:
    """Peak bytes of the tensor storages that ops create inside the `with` block and that are
    still alive, measured through every op's outputs (a TorchDispatchMode; backward ops included).

    What is measured: real allocations, each storage from its creation until it is freed (a
    weakref finalizer) or resized (megatron-core's recompute frees outputs with
    `storage.resize_(0)`, so live sizes are re-read at every candidate peak). Not seen:
    kernels' internal scratch. Outputs that alias an input (views, in-place ops) are not new.
    """

    def __new__(cls):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        def storages(tree):
            for t in tree_flatten(tree)[0]:
                if isinstance(t, torch.Tensor):
                    yield t.untyped_storage()

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.live, self.nominal, self.peak = {}, 0, 0

            def _freed(self, ptr, n):
                if self.live.pop(ptr, None) is not None:
                    self.nominal -= n

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                inputs = {st.data_ptr() for st in storages((args, kwargs))}
                out = func(*args, **kwargs)
                for st in storages(out):
                    ptr, n = st.data_ptr(), st.nbytes()
                    if n and ptr not in inputs and ptr not in self.live:
                        self.live[ptr] = weakref.ref(st)
                        self.nominal += n
                        weakref.finalize(st, self._freed, ptr, n)
                if self.nominal > self.peak:  # nominal >= actual, so only then can the peak move
                    self.peak = max(self.peak, sum(s.nbytes() for s in (r() for r in self.live.values()) if s))
                return out

        return _Mode()


def _forward_backward(tr):
    """Trainer.step's forward and backward of its first micro-batch, as a function."""
    batch = tr.micro_batches(0)[0].to(tr.device)
    shift = tr.shift_for(batch)
    counts = tr.global_counts([batch], [shift]).clamp(min=1).float()

    def run():
        out = tr.forward(batch)
        sums = [p.loss_sum(batch, out, shift) for p in tr.loss_plugins]
        sum(p.scale * s / n for p, s, n in zip(tr.loss_plugins, sums, counts)).backward()
    return run


def _recompute(name):
    from megatron_composer.config.training import RecomputeConfig

    return {"none": RecomputeConfig(), "full": RecomputeConfig("full", "uniform", 1),
            "block2": RecomputeConfig("full", "block", 2),
            "selective": RecomputeConfig("selective", recompute_modules=("moe", "mla_up_proj"))}[name]


def _activation_case(recompute, mb, seq, vocab, bf16=False):
    from megatron_composer.config import get_preset
    from megatron_composer.data import RandomTokenDataset
    from megatron_composer.planner import ActivationSetup, activation_plan
    from tests.trainers import make_trainer

    cfg = get_preset("tiny").replace(vocab_size=vocab)
    tr = make_trainer(RandomTokenDataset(4, seq, vocab), model_cfg=cfg, micro_batch_size=mb, global_batch_size=mb,
                      seq_length=seq, recompute=_recompute(recompute), bf16=bf16)
    device = tr.device.type
    plan = activation_plan(cfg, ActivationSetup(mb, seq, bf16=bf16, sharding="ddp", recompute=_recompute(recompute),
                                                device=device))
    return tr, _forward_backward(tr), plan


# (recompute, micro-batch, sequence, vocabulary): vocabulary 4096 at 128 tokens makes the
# logits and the output layer's gradients the peak; vocabulary 512 at 256 tokens the layers.
ACTIVATION_CASES = [("none", 1, 256, 512), ("selective", 1, 256, 512), ("full", 2, 64, 4096)]


@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=["-".join(map(str, c)) for c in ACTIVATION_CASES])
def test_activation_estimate_within_20_percent_of_the_cpu_peak(case):
    """The tiny model's forward + backward (the trainer's, DDP on one rank, fp32): live tensor
    storages peak within 20% of the planner's activation-side total."""
    _, run, plan = _activation_case(*case)
    run()  # the gradient buffers exist from here on, as in every step after the first
    peak = LivePeak()
    with peak:
        run()
    assert plan.total == pytest.approx(peak.peak, rel=0.2), (case, plan, peak.peak)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [("none", 1, 256, 512, False), ("full", 2, 64, 4096, False),
                                  ("none", 2, 512, 4096, True)], ids=["none-fp32", "full-fp32", "none-bf16"])
def test_activation_estimate_within_20_percent_of_cuda_max_memory_allocated(case):
    """The same on CUDA: torch.cuda.max_memory_allocated over the forward + backward, above what
    was allocated before it, within 20% of the plan (CUDA fusions, bf16 weight gradients)."""
    import torch

    _, run, plan = _activation_case(*case)
    run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert plan.total == pytest.approx(peak, rel=0.2), (case, plan, peak)


# ---------------------------------------------------------------- the command line

def _main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_cli", ROOT / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


CPT = ["--model-preset", "kimi-k2.5", "--stage", "cpt-32k", "--gpus-per-node", "8", "--gpu", "h200",
       "--tp", "1", "--cp", "2", "--ep", "8"]
RL = ["--model-preset", "kimi-k2.5", "--stage", "cpt-256k", "--nodes", "128", "--gpus-per-node", "4",
      "--gpu", "gb200", "--tp", "1", "--cp", "8", "--ep", "8", "--dense-shard-size", "16", "--recompute"]


def test_report_layouts_plan_as_json(capsys):
    """The report's layouts as in the README: CPT EP8 / CP2 (64 nodes of 8 H200) and RL EP8 / CP8
    at 256K (128 trays of 4 GB200), both with full recompute, fit; the JSON holds the categories,
    collectives and the step time."""
    main = _main()
    for argv in (CPT + ["--nodes", "64", "--dense-shard-size", "16", "--recompute"], RL):
        assert main(argv + ["--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        mem = d["memory_bytes"]
        assert d["fits"] is True and mem["total"] == sum(v for k, v in mem.items() if k != "total")
        assert mem["total"] <= d["capacity_bytes"]
        assert set(d["exact_memory_categories"]) == {"parameters", "main_weights", "gradients", "optimizer_state"}
        names = " ".join(d["communication_bytes"])
        for collective in ("FSDP all-gather", "FSDP reduce-scatter", "EP all-to-all", "CP latent all-gather"):
            assert collective in names
        assert d["step_seconds"] > d["seconds"]["compute"] > 0


def test_layout_that_does_not_fit_names_the_knob(capsys):
    """16 nodes of H200 cannot hold the CPT layout without recompute: exit 1, and the advice
    names recompute and says what fits together."""
    main = _main()
    assert main(CPT + ["--nodes", "16"]) == 1
    text = capsys.readouterr().out
    assert "fits" in text and "NO" in text and "does not fit" in text
    assert "--recompute-granularity full" in text and "(fits)" in text


def test_muon_plans_its_all_to_alls_and_cli_runs_as_a_script():
    """`python tools/plan.py ... --optimizer muon --json` from a shell: Muon's all-to-alls appear
    and its optimizer state is half of AdamW's on the Muon matrices."""
    cmd = [sys.executable, str(ROOT / "tools" / "plan.py"), *CPT, "--nodes", "32", "--dense-shard-size", "16",
           "--optimizer", "muon", "--recompute", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode in (0, 1), done.stderr
    d = json.loads(done.stdout)
    assert isinstance(d["fits"], bool)
    assert any(name.startswith("Muon all-to-all") for name in d["communication_bytes"])


@pytest.mark.parametrize("argv, message", [
    (["--model-preset", "kimi-k3"], "unknown --model-preset 'kimi-k3'"),
    (["--stage", "cpt-1m"], "unknown --stage 'cpt-1m'"),
    (["--gpu", "a100"], "unknown --gpu 'a100'"),
    (["--nodes", "2", "--ep", "7"], "EP=7"),
    (["--nodes", "2", "--cp", "3"], "not divisible by TP x CP x PP = 3"),
    (["--nodes", "2", "--cp", "4", "--dense-shard-size", "2"], "--dense-shard-size 2 must be a multiple of CP=4"),
    (["--nodes", "2", "--cp", "4", "--seq-length", "1004"], "seq_len 1004 is not divisible by 2*cp=8"),
    (["--nodes", "2", "--global-batch-size", "17"], "--global-batch-size 17 is not divisible"),
    (["--nodes", "2", "--tp", "2"], "--tp 2"),
], ids=["preset", "stage", "gpu", "ep", "cp", "shard", "seq", "batch", "tp"])
def test_bad_input_exits_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _main()(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err
