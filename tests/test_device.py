"""The device-independent pieces of the GPU path, on CPU: the batch copy, the random
state a checkpoint keeps (format, old files, files from another kind of device), and
the host syncs of one training step (a fixed few, not one per parameter)."""
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_composer import checkpoint as ck
from megatron_composer.checkpoint.rng import FORMAT, restore_rng_state, rng_state
from megatron_composer.training.batches import collate
from megatron_composer.data import sample_dict

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- Batch.to
def _packed_batch():
    rows = [sample_dict(torch.arange(8), torch.arange(1, 9), torch.ones(8), [0, 3, 8]),
            sample_dict(torch.arange(8), torch.arange(1, 9), torch.ones(8), [0, 5, 8])]
    return collate(rows, reset_attention_mask=True)


def test_batch_to_moves_every_tensor_and_keeps_max_seqlen_an_int():
    batch = _packed_batch()
    moved = batch.to(torch.device("meta"))
    for name in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).shape == getattr(batch, name).shape
    params = moved.packed_seq_params
    assert params.cu_seqlens_q.device.type == "meta" and params.cu_seqlens_kv.device.type == "meta"
    assert params.max_seqlen_q == 5 and type(params.max_seqlen_q) is int
    assert batch.tokens.device.type == "cpu"  # the host batch is not modified
    assert batch.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 8, 13, 16]
    assert batch.to(torch.device("cpu")) is batch


def test_moved_packed_batch_gives_its_cp_layout_without_reading_the_device():
    """CP attention asks every layer for the zigzag layout; on a moved batch the
    document lengths come from the host copy (meta tensors cannot be read at all)."""
    from megatron_composer.parallel import ZigzagLayout

    rows = [sample_dict(torch.arange(8), torch.arange(1, 9), torch.ones(8), [0, 4, 8]),
            sample_dict(torch.arange(8), torch.arange(1, 9), torch.ones(8), [0, 8])]
    moved = collate(rows, reset_attention_mask=True).to(torch.device("meta"))
    layout = ZigzagLayout.for_local_tokens(8, 2, moved.packed_seq_params)
    assert layout.doc_lengths == (4, 4, 8)


# ---------------------------------------------------------------- rng files
def _tracker():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the tracker forks the CPU generator
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run reading a CUDA run's state")


def _draws():
    """Draws from the CPU generator, the device's, and the tracker's model-parallel stream."""
    with _tracker().fork():
        forked = torch.rand(4, device=DEVICE)
    return torch.rand(4), torch.rand(4, device=DEVICE), forked


@pytest.fixture
def seeded_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_composer.platform import apply_cpu_shims

    apply_cpu_shims()
    saved = _tracker().get_states() if mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED else None
    _tracker().reset()
    _tracker().add("model-parallel-rng", 1234)
    yield
    if saved is not None:
        _tracker().set_states(saved)


def test_rng_state_round_trip_restores_the_cpu_generator_and_the_tracker(seeded_tracker):
    torch.manual_seed(3)
    _draws()
    state = rng_state()
    assert state["format"] == FORMAT == 2 and state["device"] == DEVICE and ("cuda" in state) == (DEVICE == "cuda")
    assert set(state["cuda_rng_tracker"]) == {"model-parallel-rng"}
    expected = _draws()
    _draws()  # move both streams on
    assert restore_rng_state(state) is None
    for got, want in zip(_draws(), expected):
        assert torch.equal(got, want)


def test_format_1_file_restores_the_cpu_generator(seeded_tracker):
    torch.manual_seed(5)
    old = {"torch": torch.get_rng_state()}  # what checkpoints held before format 2
    want = torch.rand(3)
    torch.rand(10)
    note = restore_rng_state(old)
    assert (note is None) == (DEVICE == "cpu")  # on a GPU: saved on cpu, noted
    assert torch.equal(torch.rand(3), want)


@cpu_only
def test_cuda_state_on_a_cpu_run_restores_the_cpu_generator_with_a_note(seeded_tracker):
    torch.manual_seed(7)
    saved = {"format": 2, "device": "cuda", "torch": torch.get_rng_state(),
             "cuda": torch.zeros(16, dtype=torch.uint8),
             "cuda_rng_tracker": {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}}
    want = torch.rand(3)
    tracker_before = {k: v.clone() for k, v in _tracker().get_states().items()}
    note = restore_rng_state(saved)
    assert "saved on cuda and this run is on cpu" in note and "not bit-exact" in note
    assert torch.equal(torch.rand(3), want)
    for name, state in _tracker().get_states().items():
        assert torch.equal(state, tracker_before[name])  # a CPU generator cannot take a Philox state
    # a format-1 file of a CUDA run (per-GPU list) is recognized as such too
    assert "saved on cuda" in restore_rng_state({"torch": torch.get_rng_state(), "cuda": [saved["cuda"]]})


def test_rng_tracker_with_other_streams_is_noted_not_half_restored(seeded_tracker):
    state = rng_state()
    state["cuda_rng_tracker"] = {"expert-parallel-rng": state["cuda_rng_tracker"]["model-parallel-rng"]}
    note = restore_rng_state(state)
    assert "['expert-parallel-rng'] differ from this run's ['model-parallel-rng']" in note


def test_newer_rng_format_is_refused():
    with pytest.raises(ValueError, match="rng state format 3 is newer than this version reads"):
        restore_rng_state({"format": 3, "torch": torch.get_rng_state()})


@cpu_only
def test_checkpoint_from_a_cuda_run_loads_on_cpu_with_a_warning(tmp_path, seeded_tracker):
    model = torch.nn.Linear(4, 2)
    ck.save_checkpoint(str(tmp_path), 1, model, None, {})
    rng_file = Path(ck.iteration_dir(str(tmp_path), 1)) / "rng_rank0.pt"
    saved = torch.load(rng_file, weights_only=True)
    assert saved["format"] == 2 and saved["device"] == "cpu"
    torch.save(dict(saved, device="cuda", cuda=torch.zeros(16, dtype=torch.uint8)), rng_file)
    with pytest.warns(UserWarning, match="saved on cuda and this run is on cpu"):
        meta = ck.load_checkpoint(str(tmp_path), model, verify=False)
    assert "rng_rank0.pt" in meta["rng_note"]
    assert torch.equal(torch.get_rng_state(), saved["torch"])


# ---------------------------------------------------------------- host syncs
_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
          torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__}
_STEP_FILES = ("training/trainer.py", "optim/", "parallel/parallelize.py")


class _HostSyncs(TorchFunctionMode):
    """Call sites of tensor -> Python conversions (a device sync on a GPU) made
    directly by the step's own code (trainer, optimizers, gradient handling)."""

    def __init__(self):
        super().__init__()
        self.sites = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNCS:
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if "megatron_composer/" in caller and caller.split("megatron_composer/")[1].startswith(_STEP_FILES):
                self.sites.append((caller.split("megatron_composer/")[1], sys._getframe(1).f_lineno))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_a_training_step_syncs_the_host_a_fixed_few_times(optimizer):
    from tests.test_trainer import UnevenDataset
    from tests.trainers import make_trainer

    tr = make_trainer(UnevenDataset(n=8), optimizer=optimizer, micro_batch_size=2, global_batch_size=4)
    assert len(tr.model.params) > 20
    tr.step()  # optimizer state exists from here on
    with _HostSyncs() as syncs:
        result = tr.step()
    assert not result.skipped
    # the grad norm (skip decision, clip factor); the logged losses with the finite-weights flag.
    # None of them in a loop: the model has more than 20 parameters.
    assert len(syncs.sites) <= 2, syncs.sites


# ---------------------------------------------------------------- device selection
def test_local_rank_beyond_the_visible_gpus_is_named(monkeypatch):
    from megatron_composer.platform import distributed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="LOCAL_RANK 1 but this node shows 1 GPUs"):
        distributed._select_gpu(1)
    if not torch.cuda.is_available():
        assert distributed.local_device() == torch.device("cpu")
