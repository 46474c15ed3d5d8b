"""Checkpoints under failure: killed saves, damaged files, full or unwritable disks,
load targets that are not checkpoints, non-finite weights."""
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_composer import checkpoint as ck
from megatron_composer.checkpoint import CheckpointError, CheckpointSaveError
from tests.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]


def _model(seed=0, width=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 4))


def _stepped_adam(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return opt


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _save(root, iteration, model, opt=None, tag=""):
    return ck.save_checkpoint(str(root), iteration, model, opt, {"tag": tag})


def _shard(root, iteration=1):
    return Path(ck.iteration_dir(str(root), iteration)) / "__0_0.distcp"


# ---------------------------------------------------------------- A: killed saves
_KILLED_RESAVE = """
import os, sys, torch
sys.path.insert(0, {repo!r})
from tests.test_checkpoint_reliability import _model, _save
root, point = sys.argv[1], sys.argv[2]
model = _model(0)
_save(root, 1, model, tag="first")
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
def die(*args, **kwargs):
    os.kill(os.getpid(), 9)
if point == "moving the new copy into place":
    real_rename, real_replace = os.rename, os.replace
    def guarded(real):
        def call(src, dst, *a, **k):
            if os.path.basename(str(src)).startswith("iter_") and str(src).endswith(".tmp"):
                die()
            return real(src, dst, *a, **k)
        return call
    os.rename, os.replace = guarded(real_rename), guarded(real_replace)
else:  # writing the shards
    from torch.distributed.checkpoint.filesystem import FileSystem
    FileSystem.create_stream = die
_save(root, 1, model, tag="second")
"""


@pytest.mark.parametrize("point", ["moving the new copy into place", "writing the shards"])
def test_kill_during_a_resave_keeps_latest_loadable(tmp_path, point):
    """kill -9 while iteration 1 is re-saved: `latest` (1) still loads the first copy."""
    script = _KILLED_RESAVE.format(repo=str(REPO))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path), point], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == -9, out.stderr[-2000:]
    assert ck.latest_iteration(str(tmp_path)) == 1
    fresh = _model(5)
    assert ck.load_checkpoint(str(tmp_path), fresh)["tag"] == "first"
    assert _same(fresh, _model(0))

    removed = ck.remove_stale_tmp(str(tmp_path))
    assert str(tmp_path / "iter_0000001.tmp") in removed
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", ck.TRACKER]
    fresh = _model(5)
    assert ck.load_checkpoint(str(tmp_path), fresh)["tag"] == "first" and _same(fresh, _model(0))
    # and the re-save goes through once nothing kills it
    _save(tmp_path, 1, _model(3), tag="second")
    assert ck.load_checkpoint(str(tmp_path), fresh)["tag"] == "second" and _same(fresh, _model(3))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", ck.TRACKER]


def test_resave_over_a_leftover_old_copy(tmp_path):
    """A re-save killed after moving iter_1 aside (iter_1.old, no iter_1) is settled by the next save."""
    _save(tmp_path, 1, _model(0), tag="first")
    os.rename(tmp_path / "iter_0000001", tmp_path / "iter_0000001.old")
    assert ck.load_checkpoint(str(tmp_path), _model(5))["tag"] == "first"  # readers use the old copy
    _save(tmp_path, 1, _model(3), tag="second")
    fresh = _model(5)
    assert ck.load_checkpoint(str(tmp_path), fresh)["tag"] == "second" and _same(fresh, _model(3))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", ck.TRACKER]


# ---------------------------------------------------------------- B: damaged files
def test_flipped_byte_in_a_shard_is_named(tmp_path):
    model = _model(0, width=256)
    _save(tmp_path, 1, model)
    shard = _shard(tmp_path)
    data = bytearray(shard.read_bytes())
    at = bytes(data).index(model[0].weight.detach().numpy().tobytes())  # the tensor's raw bytes
    data[at + 100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp fails its checksum"):
        ck.load_checkpoint(str(tmp_path), _model(1, width=256))
    unverified = _model(1, width=256)
    ck.load_checkpoint(str(tmp_path), unverified, verify=False)  # what loading did before checksums
    assert not _same(unverified, model) and not _same(unverified, _model(1, width=256))


def test_manifest_covers_every_file_of_the_iteration(tmp_path):
    from megatron_composer.checkpoint.integrity import MANIFEST, file_digest, read_manifest

    model = _model(0)
    _save(tmp_path, 1, model, _stepped_adam(model))
    it_dir = Path(ck.iteration_dir(str(tmp_path), 1))
    manifest = read_manifest(str(it_dir))
    files = sorted(p.name for p in it_dir.iterdir() if p.name != MANIFEST)
    assert sorted(manifest) == files and {".metadata", "meta.json", "rng_rank0.pt", "__0_0.distcp"} <= set(files)
    import xxhash

    meta = (it_dir / "meta.json").read_bytes()
    assert manifest["meta.json"] == {"bytes": len(meta), "xxh3_64": xxhash.xxh3_64(meta).hexdigest()}
    assert file_digest(str(it_dir / "meta.json")) == xxhash.xxh3_64_hexdigest(meta)


class _WithMainParams:
    """An optimizer wrapper with state the model's parameters do not key: an fp32 copy of each."""

    def __init__(self, model):
        self.inner = _stepped_adam(model)
        self.main = {p: p.detach().double() + 0.5 for p in model.parameters()}

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def sharded_state_dict(self, names):
        from megatron_composer.checkpoint.state import name_keyed_optimizer_state

        state = name_keyed_optimizer_state(self.inner, names)
        state.update({f"{names[p]}/main": m for p, m in self.main.items()})
        return state

    def load_sharded_state_dict(self, state, names):
        from megatron_composer.checkpoint.state import load_name_keyed_optimizer_state

        load_name_keyed_optimizer_state(self.inner, state, names)
        for p, m in self.main.items():
            m.copy_(state[f"{names[p]}/main"])


def test_optimizer_with_its_own_name_keyed_state(tmp_path):
    model = _model(0)
    opt = _WithMainParams(model)
    _save(tmp_path, 1, model, opt)
    target = _model(1)
    restored = _WithMainParams(target)
    ck.load_checkpoint(str(tmp_path), target, restored)
    for saved, loaded in zip(opt.main.values(), restored.main.values()):
        assert torch.equal(saved, loaded) and loaded.dtype == torch.float64
    assert torch.equal(restored.inner.state[target[0].weight]["exp_avg"], opt.inner.state[model[0].weight]["exp_avg"])
    n, count = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    # fp32 weights, exp_avg, exp_avg_sq; fp32 step scalars; fp64 main copies
    assert ck.expected_checkpoint_bytes(model, opt) == 3 * 4 * n + 4 * count + 8 * n


# ---------------------------------------------------------------- C: every load failure is one clear error
def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


_DAMAGE = {
    # name: (damage(root), verify, text the message must hold)
    "truncated shard": (lambda r: _truncate(_shard(r)), True, r"__0_0\.distcp has \d+ bytes, \d+ were written"),
    "truncated shard, unverified": (lambda r: _truncate(_shard(r)), False,
                                    r"could not read checkpoint .*iter_0000001.*damaged"),
    "missing shard": (lambda r: _shard(r).unlink(), True, r"__0_0\.distcp is missing"),
    "missing shard, unverified": (lambda r: _shard(r).unlink(), False, r"__0_0\.distcp.*damaged or incomplete"),
    "bad meta.json": (lambda r: (_shard(r).parent / "meta.json").write_text("{"), True,
                      r"meta\.json \(JSONDecodeError"),
    "bad rng file": (lambda r: (_shard(r).parent / "rng_rank0.pt").write_bytes(b"junk"), False,
                     r"rng file .*rng_rank0\.pt is unreadable"),
    "bad .metadata": (lambda r: (_shard(r).parent / ".metadata").write_bytes(b"junk"), False,
                      r"cannot read .*iter_0000001/\.metadata \(UnpicklingError.*damaged"),
    "tracker names a missing iteration": (lambda r: (r / ck.TRACKER).write_text("7"), True,
                                          r"iter_0000007 does not exist; write 1 .* into .*latest_checkpointed"),
    "tracker holds garbage": (lambda r: (r / ck.TRACKER).write_text("seven"), True, r"holds 'seven'; write 1"),
}


@pytest.mark.parametrize("kind", sorted(_DAMAGE))
def test_load_failure_is_one_checkpoint_error(tmp_path, kind):
    damage, verify, text = _DAMAGE[kind]
    model = _model(0)
    _save(tmp_path, 1, model, _stepped_adam(model))
    damage(tmp_path)
    target = _model(1)
    with pytest.raises(CheckpointError, match=text) as err:
        ck.load_checkpoint(str(tmp_path), target, _stepped_adam(target), verify=verify)
    assert len(str(err.value).splitlines()) <= 2 and "Traceback" not in str(err.value)


def test_wrong_model_flags_name_the_mismatched_tensor(tmp_path):
    _save(tmp_path, 1, _model(0, width=16))
    with pytest.raises(CheckpointError) as err:
        ck.load_checkpoint(str(tmp_path), _model(0, width=32))
    msg = str(err.value)
    assert "model.0.weight" in msg and "32" in msg and "16" in msg, msg  # DCP's key and both sizes survive
    assert "matching model flags" in msg and len(msg.splitlines()) <= 2


# ---------------------------------------------------------------- D: full or unwritable --save
def test_check_save_dir(tmp_path, monkeypatch):
    root = tmp_path / "new" / "ckpt"
    ck.check_save_dir(str(root), 1000)
    assert root.is_dir() and not list(root.iterdir())  # created; the probe is gone

    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=f"--save {tmp_path / 'file' / 'sub'} is not writable"):
        ck.check_save_dir(str(tmp_path / "file" / "sub"), 1000)

    real_open = os.open

    def refuse(path, *args, **kwargs):
        if ".write_probe" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(CheckpointError, match="is not writable .*Permission denied"):
        ck.check_save_dir(str(root), 1000)
    monkeypatch.setattr(os, "open", real_open)

    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(CheckpointError, match=f"--save {root} has 4096 bytes .* needs about 123456789 bytes"):
        ck.check_save_dir(str(root), 123456789)


def test_expected_checkpoint_bytes(tmp_path):
    model = _model(0)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert ck.expected_checkpoint_bytes(model) == 4 * n
    assert ck.expected_checkpoint_bytes(model, opt) == 3 * 4 * n  # before the first step: estimated
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert ck.expected_checkpoint_bytes(model, opt) == 3 * 4 * n + 4 * len(params)  # + fp32 step scalars
    _save(tmp_path, 1, model, opt)
    on_disk = sum(f.stat().st_size for f in _shard(tmp_path).parent.glob("*.distcp"))
    assert 3 * 4 * n <= on_disk <= 3 * 4 * n + 2048 * 4 * len(params)  # plus DCP's per-tensor framing


def _enospc_stream(self, path, mode):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


@pytest.mark.parametrize("iteration", [1, 2], ids=["re-save", "new iteration"])
def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, iteration):
    from torch.distributed.checkpoint.filesystem import FileSystem

    _save(tmp_path, 1, _model(0), tag="first")
    monkeypatch.setattr(FileSystem, "create_stream", _enospc_stream)
    with pytest.raises(CheckpointSaveError,
                       match=r"iter_000000\d\.tmp: .*No space left on device.*iter_0000001 is kept"):
        _save(tmp_path, iteration, _model(1), tag="second")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", ck.TRACKER]  # no partial .tmp left
    fresh = _model(5)
    assert ck.load_checkpoint(str(tmp_path), fresh)["tag"] == "first" and _same(fresh, _model(0))


def test_tracker_write_failure_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1, _model(0), tag="first")
    real_replace = os.replace

    def refuse(src, dst, *args, **kwargs):
        if str(dst).endswith(ck.TRACKER):
            raise PermissionError(errno.EACCES, "Permission denied", str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(CheckpointSaveError, match="Permission denied"):
        _save(tmp_path, 2, _model(1), tag="second")
    monkeypatch.undo()
    assert ck.latest_iteration(str(tmp_path)) == 1
    assert ck.load_checkpoint(str(tmp_path), _model(5))["tag"] == "first"


def test_save_under_a_file_names_the_path(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointSaveError, match=f"{tmp_path / 'file' / 'ckpt'}.*Not a directory"):
        _save(tmp_path / "file" / "ckpt", 1, _model(0))


# ---------------------------------------------------------------- E: what a load target is
def test_load_target_kind(tmp_path):
    assert ck.load_target_kind(str(tmp_path / "nope")) == "missing"
    (tmp_path / "empty").mkdir()
    assert ck.load_target_kind(str(tmp_path / "empty")) == "empty"
    (tmp_path / "empty" / "iter_0000003.tmp").mkdir()  # a first save that was killed
    assert ck.load_target_kind(str(tmp_path / "empty")) == "empty"
    assert not ck.is_checkpoint_dir(str(tmp_path / "empty"))

    root = tmp_path / "ckpt"
    _save(root, 4, _model(0))
    assert ck.load_target_kind(str(root)) == "checkpoint" and ck.is_checkpoint_dir(str(root))
    with pytest.raises(CheckpointError, match=f"is one iteration of a checkpoint; pass its parent {root}"):
        ck.load_target_kind(str(root / "iter_0000004"))
    (root / ck.TRACKER).write_text("9")
    with pytest.raises(CheckpointError, match="iter_0000009 does not exist; write 4"):
        ck.load_target_kind(str(root))
    assert not ck.is_checkpoint_dir(str(root))
    (root / ck.TRACKER).unlink()
    with pytest.raises(CheckpointError, match="has iteration dirs but no latest_checkpointed_iteration.txt; write 4"):
        ck.load_target_kind(str(root))

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"other is not a checkpoint .*notes\.txt"):
        ck.load_target_kind(str(tmp_path / "other"))
    with pytest.raises(CheckpointError, match="is a file"):
        ck.load_target_kind(str(tmp_path / "other" / "notes.txt"))


def test_locate_checkpoint_from_a_root_or_an_iteration_dir(tmp_path):
    """The one lookup: a root (the tracker's iteration or a chosen one) and an iteration dir give
    the same location; what is not a readable checkpoint is one CheckpointError naming it."""
    root = tmp_path / "ckpt"
    _save(root, 2, _model(0), tag="two")
    _save(root, 3, _model(1), tag="three")
    latest = ck.locate_checkpoint(str(root))
    assert (latest.root, latest.iteration, latest.dir) == (str(root), 3, str(root / "iter_0000003"))
    assert latest.meta["tag"] == "three" and latest.meta["iteration"] == 3
    chosen = ck.locate_checkpoint(str(root), 2)
    assert (chosen.iteration, chosen.dir, chosen.meta["tag"]) == (2, str(root / "iter_0000002"), "two")
    assert ck.locate_checkpoint(str(root / "iter_0000002")) == chosen
    with pytest.raises(CheckpointError, match="holds iteration 2, not 3; pass its root"):
        ck.locate_checkpoint(str(root / "iter_0000002"), 3)
    with pytest.raises(CheckpointError, match="iter_0000007 does not exist; write 3"):
        ck.locate_checkpoint(str(root), 7)
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path / 'nope'}: it does not exist"):
        ck.locate_checkpoint(str(tmp_path / "nope"))
    (root / "iter_0000002" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"iter_0000002 is incomplete \(no \.metadata\)"):
        ck.locate_checkpoint(str(root / "iter_0000002"))
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        ck.locate_checkpoint(str(root / ck.TRACKER))
    assert ck.read_extra_file(str(root / "iter_0000003"), "meta.json") == (root / "iter_0000003" / "meta.json").read_bytes()


def test_a_checkpoint_carries_its_tokenizer_written_once(tmp_path):
    """save_checkpoint(tokenizer_model=...) copies the file into ROOT before the iteration is published;
    later saves leave an identical copy alone; checkpoint_tokenizer finds it from the root or an
    iteration dir, and a killed first save that got as far as the tokenizer still counts as empty."""
    tok = tmp_path / "tok.model"
    tok.write_bytes(b"sentencepiece bytes \x00\x01")
    root = tmp_path / "ckpt"
    assert ck.checkpoint_tokenizer(str(root)) is None
    ck.save_checkpoint(str(root), 1, _model(0), None, {}, tokenizer_model=str(tok))
    carried = root / ck.TOKENIZER_MODEL
    assert carried.read_bytes() == tok.read_bytes()
    assert ck.checkpoint_tokenizer(str(root)) == str(carried)
    assert ck.checkpoint_tokenizer(str(root / "iter_0000001")) == str(carried)
    written = carried.stat().st_mtime_ns
    ck.save_checkpoint(str(root), 2, _model(0), None, {}, tokenizer_model=str(tok))
    assert carried.stat().st_mtime_ns == written and sorted(p.name for p in root.iterdir()) == [
        "iter_0000001", "iter_0000002", ck.TRACKER, ck.TOKENIZER_MODEL]

    with pytest.raises(CheckpointSaveError, match="cannot read the tokenizer model .*missing.model"):
        ck.save_checkpoint(str(root), 3, _model(0), None, {}, tokenizer_model=str(tmp_path / "missing.model"))
    assert ck.latest_iteration(str(root)) == 2 and not (root / "iter_0000003").exists()

    first = tmp_path / "first"
    first.mkdir()
    (first / ck.TOKENIZER_MODEL).write_bytes(tok.read_bytes())
    (first / "iter_0000001.tmp").mkdir()
    assert ck.load_target_kind(str(first)) == "empty"

    converted = tmp_path / "converted"
    (converted / "hf_assets").mkdir(parents=True)
    (converted / "hf_assets" / "tokenizer.model").write_bytes(b"hf")
    assert ck.checkpoint_tokenizer(str(converted)) == str(converted / "hf_assets" / "tokenizer.model")


# ---------------------------------------------------------------- F: non-finite weights
def test_non_finite_weights_are_not_saved(tmp_path):
    _save(tmp_path, 1, _model(0), tag="first")
    bad = _model(1)
    with torch.no_grad():
        bad[2].weight[1, 3] = float("nan")
    with pytest.raises(CheckpointError, match=r"model tensor 2\.weight holds NaN or Inf. Nothing was written; "
                                              r".*iter_0000001 stays the latest"):
        _save(tmp_path, 2, bad)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", ck.TRACKER]


# ---------------------------------------------------------------- G: a --save that holds another run
def _tree(root) -> dict:
    """relative path -> bytes of every file under `root`."""
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_save_holding_a_run_is_refused_unless_it_is_loaded(tmp_path):
    """The rerun without --load (issue: it replaced iter_2 and iter_4 silently) and --load of another
    checkpoint are refused, naming both fixes; nothing in --save changes. --load D itself resumes."""
    d, other = tmp_path / "D", tmp_path / "other"
    for it in (2, 4):
        _save(d, it, _model(it))
    _save(other, 1, _model(9))
    before = _tree(d)
    for load in (None, str(other)):
        with pytest.raises(CheckpointError) as err:
            ck.guard_save_dir(str(d), load)
        text = str(err.value)
        assert f"--save {d} already holds a checkpoint (iterations 2, 4)" in text
        assert f"--load {d} to resume" in text and "--overwrite-save to start over" in text
        assert ("names another checkpoint" if load else "would start at iteration 0") in text
    assert _tree(d) == before
    assert ck.guard_save_dir(str(d), str(d)) is None
    assert ck.guard_save_dir(str(d) + "/", str(d)) is None  # the same directory spelled differently
    assert _tree(d) == before


def test_a_save_without_a_checkpoint_is_taken(tmp_path):
    """A missing or empty D, D with only a tokenizer and logs, or the debris of a killed first save:
    no checkpoint to lose, so any --load (or none) goes ahead, with or without --overwrite-save."""
    empty, logs, debris = tmp_path / "empty", tmp_path / "logs", tmp_path / "debris"
    empty.mkdir()
    logs.mkdir()
    (logs / ck.TOKENIZER_MODEL).write_bytes(b"tok")
    (logs / "rl_steps.jsonl").write_text("{}\n")
    debris.mkdir()
    (debris / "iter_0000002.tmp").mkdir()
    for d in (tmp_path / "missing", empty, logs, debris):
        before = _tree(d) if d.exists() else None
        for load in (None, str(d)):
            assert ck.guard_save_dir(str(d), load) is None
        assert ck.guard_save_dir(str(d), None, overwrite_save=True) is None
        assert (_tree(d) if d.exists() else None) == before


def test_overwrite_save_moves_the_earlier_run_aside(tmp_path):
    """--overwrite-save moves everything in D (checkpoint, tokenizer, logs) into D/overwritten-<time>/
    byte for byte; D is then a fresh, loadable-as-empty directory, and a second move nests nothing."""
    d = tmp_path / "D"
    for it in (2, 4):
        _save(d, it, _model(it))
    (d / "rl_steps.jsonl").write_text('{"iteration": 1}\n')
    before = _tree(d)
    moved = ck.guard_save_dir(str(d), None, overwrite_save=True)
    assert os.path.dirname(moved) == str(d) and os.path.basename(moved).startswith(ck.OVERWRITTEN_PREFIX)
    assert os.listdir(d) == [os.path.basename(moved)]
    assert _tree(moved) == before
    assert ck.load_target_kind(str(d)) == "empty" and ck.held_iterations(str(d)) is None
    _save(d, 2, _model(7))
    again = ck.guard_save_dir(str(d), str(tmp_path / "elsewhere"), overwrite_save=True)
    assert sorted(os.listdir(d)) == sorted([os.path.basename(moved), os.path.basename(again)])
    assert _tree(moved) == before and ck.latest_iteration(again) == 2


def test_overwrite_save_is_refused_where_it_would_move_what_it_loads(tmp_path):
    d = tmp_path / "D"
    _save(d, 2, _model(2))
    _save(d / "inner", 1, _model(1))
    before = _tree(d)
    with pytest.raises(CheckpointError, match="would move aside the checkpoint it loads"):
        ck.guard_save_dir(str(d), str(d), overwrite_save=True)
    with pytest.raises(CheckpointError, match=f"--load {d / 'inner'} is inside --save {d}"):
        ck.guard_save_dir(str(d), str(d / "inner"), overwrite_save=True)
    assert _tree(d) == before


def test_a_move_cut_short_leaves_no_tracker_naming_a_moved_iteration(tmp_path, monkeypatch):
    """The tracker moves first: a move that stops after it leaves iterations without a tracker, which
    the next launch still refuses (and --overwrite-save then moves too); nothing is lost."""
    d = tmp_path / "D"
    for it in (2, 4):
        _save(d, it, _model(it))
    before = _tree(d)
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append(os.path.basename(src))
        if len(calls) == 2:
            raise OSError("killed")
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="killed"):
        ck.guard_save_dir(str(d), None, overwrite_save=True)
    monkeypatch.setattr(os, "rename", real)
    assert calls[0] == ck.TRACKER and not (d / ck.TRACKER).exists()
    with pytest.raises(CheckpointError, match=r"already holds a checkpoint \(iterations 2, 4\)"):
        ck.guard_save_dir(str(d), None)
    ck.guard_save_dir(str(d), None, overwrite_save=True)
    moved = {k.split("/", 1)[1]: v for k, v in _tree(d).items()}
    assert moved == before


# ---------------------------------------------------------------- several ranks
def _two_ranks(rank, world, root):
    model = _model(0, width=64)
    opt = _stepped_adam(model)
    _save(root, 1, model, opt, tag="first")
    out = {}
    real_fsync = os.fsync
    if rank == 1:  # only one rank's disk fails
        os.fsync = lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
    try:
        _save(root, 2, model, opt)
    except CheckpointSaveError as exc:
        out["enospc"] = str(exc)
    os.fsync = real_fsync
    with torch.no_grad():
        if rank == 1:
            model[0].weight[0, 0] = float("inf")
    try:
        _save(root, 2, model, opt)
    except CheckpointError as exc:
        out["nonfinite"] = str(exc)
    out["listing"] = sorted(os.listdir(root))
    torch.distributed.barrier()
    if rank == 0:  # damage a file that rank 1 verifies
        from megatron_composer.checkpoint.integrity import files_for_rank, read_manifest

        it_dir = ck.iteration_dir(root, 1)
        name = files_for_rank(sorted(read_manifest(it_dir)), 1, 2)[0]
        with open(os.path.join(it_dir, name), "ab") as f:
            f.write(b"x")
        out["damaged"] = name
    torch.distributed.barrier()
    try:
        ck.load_checkpoint(root, _model(2, width=64))
    except CheckpointError as exc:
        out["damage"] = str(exc)
    return out


def test_failures_on_one_rank_reach_every_rank(tmp_path):
    """world 2: a full disk, a NaN and a damaged file seen by rank 1 only make both
    ranks raise the same error (none waits in a collective), and iteration 1 survives."""
    outs = run_distributed(_two_ranks, 2, str(tmp_path))
    for out in outs:
        assert out["enospc"].startswith("could not save iteration 2") and "rank 1: " in out["enospc"]
        assert "No space left on device" in out["enospc"]
        assert "rank 1: refusing to save iteration 2" in out["nonfinite"] and "0.weight" in out["nonfinite"]
        assert out["listing"] == ["iter_0000001", ck.TRACKER]
        assert f"rank 1: {tmp_path}/iter_0000001/{outs[0]['damaged']} has" in out["damage"]


def _sized_gpt(rank, world, root, sharding):
    from megatron_composer.data import RandomTokenDataset
    from tests.trainers import make_trainer

    tr = make_trainer(RandomTokenDataset(8, 64, 4096), ep=2, micro_batch_size=1, global_batch_size=2,
                      data_parallel_sharding=sharding, dense_shard_size=2 if sharding == "hsdp" else None)
    expected = ck.expected_checkpoint_bytes(tr.model)
    ck.save_checkpoint(root, 1, tr.model, None, {})
    return expected, len(ck.model_state_dict(tr.model))


@pytest.mark.parametrize("sharding", ["ddp", "hsdp"])
def test_expected_bytes_match_the_files_under_expert_parallelism(tmp_path, sharding):
    """EP=2 on 2 ranks: each rank holds half the experts under the same local names,
    and HSDP holds shards of every tensor; the estimate must still be the global size."""
    (expected, n), _ = run_distributed(_sized_gpt, 2, str(tmp_path), sharding)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "iter_0000001").glob("*.distcp"))
    assert expected <= on_disk <= expected + 2048 * 2 * n, (expected, on_disk)


def _guard_two_ranks(rank, world, root):
    refused = None
    try:
        ck.guard_save_dir(root, None)
    except CheckpointError as exc:
        refused = str(exc)
    moved = ck.guard_save_dir(root, None, overwrite_save=True)
    return refused, moved, sorted(os.listdir(root))


def test_the_save_guard_agrees_on_every_rank(tmp_path):
    """world 2: both ranks refuse with the same message; with --overwrite-save rank 0 alone moves the run
    and every rank returns where it went, after the move (the gather is the barrier)."""
    _save(tmp_path, 3, _model(3))
    outs = run_distributed(_guard_two_ranks, 2, str(tmp_path))
    assert outs[0] == outs[1]
    refused, moved, listing = outs[0]
    assert "already holds a checkpoint (iterations 3)" in refused
    assert listing == [os.path.basename(moved)] and ck.latest_iteration(moved) == 3
