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


# ---------------------------------------------------------------- RL (`planner.rl`, `planner.inference`)
GiB = 1 << 30


def _engine(cfg, slots, max_len):
    from megatron_composer.inference.engine import Engine
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    init_distributed()
    initialize_parallel(ParallelLayout(world_size=1), seed=0)
    model = build_model(cfg, ParallelLayout(world_size=1), seq_length=max_len)
    return model, Engine(model, cfg, max_batch_size=slots, max_model_len=max_len)


def test_engine_weights_and_latent_cache_are_what_the_engine_allocates():
    """The tiny model: the inference plan's weights are the built model's parameters (2 bytes each in
    bf16, 4 in the fp32 start-up), its latent cache the engine's trunk + MTP caches (fp32 on CPU), and both
    equal the architecture's arithmetic."""
    from megatron_composer.config import get_preset
    from megatron_composer.planner.inference import EngineShape, engine_memory, kv_cache_bytes

    cfg = get_preset("tiny")
    model, engine = _engine(cfg, slots=3, max_len=100)
    cache = engine.runner.cache.data.nbytes + engine.runner.mtp_cache.data.nbytes
    # (4 layers + 1 MTP layer) x 3 slots x 101 positions x (kv_lora 32 + rope 16) x 4 bytes
    assert kv_cache_bytes(cfg, 3, 100, bytes_per_value=4) == cache == 5 * 3 * 101 * 48 * 4
    params = sum(p.numel() for p in model.parameters())
    moe_layers, experts = 4, 8 * 3 * 128 * 96  # 3 MoE layers + the MTP layer's, each 8 experts of 3 matrices
    assert params == 1_638_624 + moe_layers * experts  # dense + routed experts
    memory = engine_memory(cfg, EngineShape(max_model_len=100, max_batch_size=3, reserved_bytes=0))
    assert memory["weights"] == 2 * params and memory["startup"] == 4 * params
    assert memory["kv_cache"] == 5 * 3 * 101 * 48 * 2  # bf16 on a GPU
    split = engine_memory(cfg, EngineShape(100, 4, gpus_per_worker=2, reserved_bytes=0))
    assert split["weights"] == 2 * (1_638_624 + moe_layers * experts // 2)
    assert split["kv_cache"] == 5 * 2 * 101 * 48 * 2  # each GPU caches half of the 4 slots


def test_inference_worker_that_cannot_fit_is_refused_with_its_numbers():
    """kimi-k2.5 on one H200 at 64 slots x 32768 tokens: the weights alone are over; a small model with
    too many slots is told the largest --rollout-batch-size that fits."""
    from megatron_composer.config import get_preset
    from megatron_composer.planner.hardware import get_gpu
    from megatron_composer.planner.inference import EngineShape, check_inference_worker_fits

    h200 = get_gpu("h200").memory_bytes
    with pytest.raises(ValueError) as exc:
        check_inference_worker_fits(get_preset("kimi-k2.5"), EngineShape(32768, 64), h200, "kimi-k2.5")
    text = str(exc.value)
    weights = 2 * 1_026_408_209_408 / GiB  # Kimi K2.5's 1.03T parameters (MTP none) in bf16
    cache = 61 * 64 * 32769 * (512 + 64) * 2 / GiB  # 61 layers x slots x positions x latent width
    assert f"bf16 weights {weights:.1f} GiB" in text and f"latent KV cache {cache:.1f} GiB" in text
    assert "64 slots x 32769 tokens" in text and "131.3 GiB" in text and "the weights alone do not fit" in text
    small = get_preset("small")
    check_inference_worker_fits(small, EngineShape(32768, 64), h200)  # fits: returns its memory
    with pytest.raises(ValueError, match=r"use --rollout-batch-size (\d+) or less") as exc:
        check_inference_worker_fits(small, EngineShape(32768, 4096), h200)
    n = int(exc.value.args[0].split("--rollout-batch-size ")[1].split()[0])
    check_inference_worker_fits(small, EngineShape(32768, n), h200)  # the suggested size fits, one more does not
    with pytest.raises(ValueError):
        check_inference_worker_fits(small, EngineShape(32768, n + 1), h200)


def test_logprob_peak_is_what_the_policy_loss_holds():
    """PolicyLoss.loss_sum on fp32 logits [T, V] (CPU): the live tensor storages it creates peak at
    LOSS_CHUNKS_LIVE fp32 chunks of CPU_LOSS_CHUNK_ELEMENTS (within 5%), what the plan counts."""
    import types

    import torch

    from megatron_composer.planner.activations import CPU_LOSS_CHUNK_ELEMENTS, LOSS_CHUNKS_LIVE
    from megatron_composer.planner.rl import LOGPROB_FP32_TENSORS, logprob_bytes
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.loss import PolicyLoss

    T, V = 512, 2048
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, T, V, generator=g, requires_grad=True)
    zeros = torch.zeros(1, T)
    batch = types.SimpleNamespace(labels=torch.randint(0, V, (1, T), generator=g), loss_mask=torch.ones(1, T),
                                  tokens=torch.zeros(1, T, dtype=torch.long), ref_logp=zeros, old_logp=None,
                                  advantages=torch.randn(1, T, generator=g), sampler_logp=zeros, normalizer_share=1.0)
    loss = PolicyLoss(RLConfig())
    peak = LivePeak()
    with peak:
        loss.loss_sum(batch, types.SimpleNamespace(logits=logits), None)
    assert LOGPROB_FP32_TENSORS == 5 and logprob_bytes(_tiny_vocab(V), T, chunked=False) == 5 * T * V * 4
    chunks = LOSS_CHUNKS_LIVE * CPU_LOSS_CHUNK_ELEMENTS * 4
    assert CPU_LOSS_CHUNK_ELEMENTS < T * V  # several chunks: the measurement says something
    assert peak.peak == pytest.approx(chunks, rel=0.05), peak.peak


def _tiny_vocab(vocab):
    from megatron_composer.config import get_preset

    return get_preset("tiny").replace(vocab_size=vocab)


def _rl_setup(**changes):
    from megatron_composer.config import get_preset
    from megatron_composer.planner.hardware import get_gpu
    from megatron_composer.planner.plan import PlanSetup
    from megatron_composer.planner.rl import RLPlanSetup, RolloutShape

    cluster = PlanSetup(get_preset("tiny"), stage="rl", nodes=1, gpus_per_node=8, gpu=get_gpu("h200"), cp=4,
                        data_parallel_sharding="ddp", model_preset="tiny")
    rollout = RolloutShape(prompt_tokens=1000, response_tokens=2001, prompts_per_step=4, group_size=8,
                           rollout_batch_size=16, seq_length=4096, micro_batch_tokens=8192)
    return RLPlanSetup(cluster, rollout, **changes)


def test_rl_packing_reference_and_colocated_cache_by_hand():
    """Samples of 3001 tokens pack two per 8192-token micro-batch (6002, padded to 2 x CP = 8: 6008); 32
    samples over DP = 8 / CP 4 = 2 ranks are 8 micro-batches each; --kl-coef adds the fp32 reference of the
    rank's EP share; the synchronous driver keeps the colocated engine's cache; async does not."""
    from megatron_composer.planner.rl import make_rl_plan, micro_batches_per_rank, packed_length, trainer_memory

    sync = _rl_setup()
    assert packed_length(sync) == 6008 and micro_batches_per_rank(sync, 2) == 8
    t = make_rl_plan(sync).trainer.setup
    assert (t.seq, t.cp, t.dp, t.micro_batches, t.document_length) == (6008, 4, 2, 8, 3001)
    memory, parts = trainer_memory(sync)
    assert memory["reference_model"] == 0
    assert memory["colocated_kv_cache"] == 5 * 16 * 4097 * 48 * 2  # layers + MTP, slots, positions, width, bf16
    assert memory["transient"] == max(parts["logprobs"], parts["backward"])
    assert parts["logprobs"] == 3 * (6008 // 4) * 4096 * 4  # three fp32 chunks, each the whole [T x V] here
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    ref = trainer_memory(_rl_setup(kl_coef=0.1).replace(cluster=sync.cluster.replace(ep=2)))[0]
    assert ref["reference_model"] == 4 * (1_638_624 + 4 * 8 * 3 * 128 * 96 // 2)  # dense + half the experts, fp32
    plan = make_rl_plan(_rl_setup(kl_coef=0.1))
    assert plan.trainer.flops["no_grad_forward"] == pytest.approx(plan.trainer.flops["model"] / 3)
    workers = make_rl_plan(_rl_setup(inference_workers=4))
    assert workers.trainer.setup.world_size == 4 and workers.trainer.memory["colocated_kv_cache"] == 0
    assert workers.inference_memory["kv_cache"] == memory["colocated_kv_cache"]
    assert workers.step_seconds == max(workers.rollout["rollout"], workers.trainer.step_seconds)
    assert plan.step_seconds == plan.rollout["rollout"] + plan.trainer.step_seconds


RL_SMALL = ["--stage", "rl", "--model-preset", "small", "--nodes", "4", "--cp", "8", "--data-parallel-sharding", "ddp",
            "--trainer-ranks", "8", "--inference-workers", "16", "--seq-length", "32768", "--prompt-tokens", "2048",
            "--prompts-per-step", "128", "--group-size", "16", "--rl-micro-batch-tokens", "65536"]


def test_rl_cli_plans_trainer_and_inference(capsys):
    """--stage rl: the small model's async layout fits (exit 0) with the trainer's and the inference
    GPU's tables; kimi-k2.5 does not (exit 1), the advice naming the inference worker's numbers."""
    main = _main()
    assert main(RL_SMALL) == 0
    text = capsys.readouterr().out
    for line in ("memory per trainer GPU (rank 0)", "memory per inference GPU", "reference model", "latent KV cache",
                 "log-probs or backward working set", "RL step (max of rollout, train)"):
        assert line in text, line
    assert main(RL_SMALL + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # small: 12 layers + 1 MTP layer, 64 slots of 32769 positions, latent 256 + rope 32, bf16
    assert d["stage"] == "rl" and d["fits"] and d["inference_memory_bytes"]["kv_cache"] == 13 * 64 * 32769 * 288 * 2
    kimi = [a if a != "small" else "kimi-k2.5" for a in RL_SMALL]
    assert main(kimi) == 1
    assert "an inference worker holds the whole model of kimi-k2.5" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--prompt-tokens", "30000", "--response-tokens", "4000"], "= 34000 exceeds --seq-length 32768"),
    (["--inference-workers", "30"], "need 38 GPUs; 4 x 8 has 32"),
    (["--rl-micro-batch-tokens", "16384"], "--rl-micro-batch-tokens 16384 is below --seq-length 32768"),
    (["--global-batch-size", "64"], "drop --micro-batch-size / --global-batch-size"),
], ids=["rollout", "gpus", "micro", "batch"])
def test_rl_bad_input_exits_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _main()(RL_SMALL + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err


def test_async_start_up_check_reads_the_workers_gpu(monkeypatch):
    """`check_local_inference_worker` (the async driver's start-up check, run on an inference GPU): the
    model config as the trainer describes it (a dict), against the device's memory; no GPU, no check."""
    import dataclasses

    import torch

    from megatron_composer.config import get_preset
    from megatron_composer.planner.inference import check_local_inference_worker

    kimi = dataclasses.asdict(get_preset("kimi-k2.5"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_local_inference_worker(kimi, 32768, 64)  # a CPU worker: nothing to check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 141 * 10**9}))
    with pytest.raises(ValueError, match=r"needs 3828.7 GiB but the GPU has 131.3 GiB"):
        check_local_inference_worker(kimi, 32768, 64)
    check_local_inference_worker(dataclasses.asdict(get_preset("small")), 32768, 64)
