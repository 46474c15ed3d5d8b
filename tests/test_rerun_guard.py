"""A rerun into a --save that holds a run, end to end on every training entry point: refused before
any work with both fixes named; --load resumes; --overwrite-save starts over with the old run moved
aside. The rule itself is unit-tested in tests/test_checkpoint_reliability.py (G).

pretrain_cpt.py (CPT and SFT) runs tiny steps in this process; train_rl.py, sync and async, is
refused before it builds anything, so those checks cost no RL step."""
import os
from pathlib import Path

import pytest
import torch

from megatron_composer import checkpoint as ck
from megatron_composer.checkpoint.tracker import complete_iterations
from tests.trainers import pretrain_in_process

COMMON = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--lr-warmup-iters", "2", "--eval-iters", "1", "--log-interval", "1"]


def _tree(root) -> dict:
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _iterations(stdout) -> list[int]:
    return [int(line.split(" iteration ")[1].split("/")[0]) for line in stdout.splitlines()
            if "lm loss: " in line and " iteration " in line]


def _refused(out, save, load=None):
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"--save {save} already holds a checkpoint" in out.stderr
    assert f"Pass --load {save} to resume" in out.stderr and "--overwrite-save to start over" in out.stderr
    assert "Traceback" not in out.stderr


def test_cpt_rerun_without_load_is_refused_and_both_fixes_work(data_dir, tmp_path, capsys):
    """The issue's commands: --save D --save-interval 2 --train-iters 4, then --train-iters 6 without
    --load. Today the second run trains from iteration 1 and replaces D/iter_2 and D/iter_4."""
    d = str(tmp_path / "D")
    base = COMMON + ["--data-cache-dir", str(data_dir), "--save", d, "--save-interval", "2"]
    first = pretrain_in_process(base + ["--train-iters", "4"], capsys)
    assert first.returncode == 0, first.stderr[-2000:]
    assert complete_iterations(d) == [2, 4]
    before = _tree(d)

    rerun = pretrain_in_process(base + ["--train-iters", "6"], capsys)
    _refused(rerun, d)
    assert _iterations(rerun.stdout) == [] and _tree(d) == before  # before any step, nothing touched
    other = str(tmp_path / "other")
    pretrain_in_process(COMMON + ["--data-cache-dir", str(data_dir), "--save", other, "--train-iters", "1"], capsys)
    mixed = pretrain_in_process(base + ["--train-iters", "6", "--load", other], capsys)
    _refused(mixed, d)
    assert "names another checkpoint" in mixed.stderr and _tree(d) == before

    over = pretrain_in_process(base + ["--train-iters", "2", "--overwrite-save"], capsys)
    assert over.returncode == 0, over.stderr[-2000:]
    (aside,) = [n for n in os.listdir(d) if n.startswith(ck.OVERWRITTEN_PREFIX)]
    assert f"--overwrite-save: moved the earlier run in {d} to {os.path.join(d, aside)}" in over.stdout
    assert _iterations(over.stdout) == [1, 2] and complete_iterations(d) == [2]
    assert _tree(os.path.join(d, aside)) == before  # the first run, byte for byte

    resumed = pretrain_in_process(base + ["--train-iters", "4", "--load", d], capsys)
    assert resumed.returncode == 0 and _iterations(resumed.stdout) == [3, 4]
    assert os.listdir(d).count(aside) == 1 and complete_iterations(os.path.join(d, aside)) == [2, 4]


def test_first_launch_of_the_resume_idiom_still_starts(data_dir, tmp_path, capsys):
    """--save D --load D on a D that is missing, or holds only a tokenizer and logs, trains from scratch."""
    d = tmp_path / "D"
    out = pretrain_in_process(COMMON + ["--data-cache-dir", str(data_dir), "--train-iters", "1",
                                        "--save", str(d), "--load", str(d)], capsys)
    assert out.returncode == 0 and "training from scratch" in out.stdout
    e = tmp_path / "E"
    e.mkdir()
    (e / ck.TOKENIZER_MODEL).write_bytes((data_dir / "tokenizer.model").read_bytes())
    out = pretrain_in_process(COMMON + ["--data-cache-dir", str(data_dir), "--train-iters", "1",
                                        "--save", str(e)], capsys)
    assert out.returncode == 0 and complete_iterations(str(e)) == [1]


def _rl_args(data_dir, save, *more):
    return ["--model-preset", "tiny", "--num-layers", "2", "--seq-length", "256",
            "--tokenizer-model", str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir),
            "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "6", "--save", save, *more]


@pytest.mark.parametrize("mode", [[], ["--async-rl", "--env", "agentic-coding", "--task-families", "write-file"]],
                         ids=["sync", "async"])
def test_train_rl_rerun_without_load_is_refused_before_any_work(data_dir, tmp_path, capsys, monkeypatch, mode):
    """train_rl.py, synchronous and --async-rl: the same refusal, before a trainer is built or Ray starts."""
    import train_rl
    from megatron_composer.rl import build

    d = str(tmp_path / "rl")
    ck.save_checkpoint(d, 3, torch.nn.Linear(2, 2), None, {})
    before = _tree(d)

    def no_build(*args, **kwargs):
        raise AssertionError("built a trainer before refusing")

    monkeypatch.setattr(build, "RLTrainer", no_build)
    import megatron_composer.rl.async_rl.runner as runner

    monkeypatch.setattr(runner, "AsyncRLRunner", no_build)
    capsys.readouterr()
    for load in ([], ["--load", str(tmp_path / "sft")]):
        if load:
            ck.save_checkpoint(load[1], 1, torch.nn.Linear(2, 2), None, {})
        code = train_rl.main(_rl_args(data_dir, d, *mode, *load))
        out = capsys.readouterr()
        _refused(type("Out", (), {"returncode": code, "stdout": out.out, "stderr": out.err}), d)
    assert _tree(d) == before
