"""pretrain_cpt.py end to end: kill -9 and resume, stage changes, --load and --save checks.

Each run of the entry script is a subprocess on the cached embedded data with tiny shapes;
the checks that stop before the first step call its main() in this process.
"""
import functools
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainers import pretrain_in_process

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--lr-warmup-iters", "2", "--eval-iters", "1"]


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _run(args, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "pretrain_cpt.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=_env(), cwd=REPO)


def _losses(stdout) -> dict[int, str]:
    """iteration -> the printed lm loss (as text: compared exactly)."""
    out = {}
    for line in stdout.splitlines():
        if "lm loss: " in line and " iteration " in line:
            it = int(line.split(" iteration ")[1].split("/")[0])
            out[it] = line.split("lm loss: ")[1].split(" ")[0]
    return out


def _ok(out):
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_kill_9_and_rerun_the_same_command_gives_the_same_losses(data_dir, tmp_path):
    """--save D --load D: kill -9 at a random iteration, run the same command again;
    every iteration's loss equals an uninterrupted run's, digit for digit."""
    iters = 8
    args = COMMON + ["--data-cache-dir", str(data_dir), "--train-iters", str(iters), "--save-interval", "2"]
    reference = _losses(_ok(_run(args + ["--save", str(tmp_path / "ref")])).stdout)
    assert sorted(reference) == list(range(1, iters + 1))

    ckpt = str(tmp_path / "ckpt")
    kill_at = random.Random(os.getpid()).randint(3, 6)
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain_cpt.py"), *args, "--save", ckpt, "--load", ckpt],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    seen = ""
    deadline = time.time() + 240
    for line in proc.stdout:
        seen += line
        if f" iteration {kill_at:8d}/" in line or time.time() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert f" iteration {kill_at:8d}/" in seen, seen[-3000:]
    assert "training from scratch" in seen
    first = _losses(seen)

    second = _ok(_run(args + ["--save", ckpt, "--load", ckpt]))
    # the last complete save-interval checkpoint: kill_at's own save may have been cut short
    resumed_at = int(second.stdout.split(f"loaded checkpoint from {ckpt} at iteration ")[1].split()[0])
    assert resumed_at % 2 == 0 and kill_at - 2 <= resumed_at <= kill_at, (kill_at, resumed_at)
    after = _losses(second.stdout)
    assert sorted(after) == list(range(resumed_at + 1, iters + 1))
    for it, loss in {**first, **after}.items():
        assert loss == reference[it], (it, loss, reference[it])


def test_stage_change_loads_weights_only_and_no_load_optim(data_dir, tmp_path):
    base = COMMON + ["--data-cache-dir", str(data_dir)]
    _ok(_run(base + ["--train-iters", "2", "--save", str(tmp_path / "32k")]))
    # cpt-32k -> cpt-256k: weights only, iteration 0, fresh optimizer
    out = _ok(_run(base + ["--stage", "cpt-256k", "--train-iters", "1", "--load", str(tmp_path / "32k"),
                           "--save", str(tmp_path / "256k")]))
    assert "(weights only: stage cpt-32k -> cpt-256k)" in out.stdout
    assert sorted(_losses(out.stdout)) == [1]
    # same stage with --no-load-optim: the iteration continues, the optimizer starts fresh
    resumed = _losses(_ok(_run(base + ["--train-iters", "4", "--load", str(tmp_path / "32k")])).stdout)
    out = _ok(_run(base + ["--train-iters", "4", "--load", str(tmp_path / "32k"), "--no-load-optim"]))
    assert "optimizer state not loaded: --no-load-optim" in out.stdout
    fresh = _losses(out.stdout)
    assert sorted(fresh) == sorted(resumed) == [3, 4]
    # Same weights and data at iteration 3, so the same loss; a fresh AdamW state makes
    # a different update, so iteration 4 differs.
    assert fresh[3] == resumed[3] and fresh[4] != resumed[4]


def test_load_must_name_a_checkpoint(data_dir, tmp_path, capsys):
    base = COMMON + ["--data-cache-dir", str(data_dir), "--train-iters", "1"]
    main = functools.partial(pretrain_in_process, capsys=capsys)  # each stops before the first step
    missing = main(base + ["--load", str(tmp_path / "nope")])
    assert missing.returncode == 2 and f"--load {tmp_path / 'nope'} does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr and "iteration" not in missing.stdout
    (tmp_path / "empty").mkdir()
    empty = main(base + ["--load", str(tmp_path / "empty")])
    assert empty.returncode == 2 and "is an empty directory" in empty.stderr
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a checkpoint")
    junk = main(base + ["--load", str(tmp_path / "junk")])
    assert junk.returncode == 2 and str(tmp_path / "junk") in junk.stderr and "Traceback" not in junk.stderr


def test_unusable_save_dir_fails_before_training(data_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("a file, not a directory")
    out = pretrain_in_process(COMMON + ["--data-cache-dir", str(data_dir), "--train-iters", "3",
                                        "--save", str(tmp_path / "file" / "ckpt")], capsys)
    assert out.returncode == 2 and str(tmp_path / "file") in out.stderr
    assert "Traceback" not in out.stderr
    assert not _losses(out.stdout)  # found at start-up, before any step


@pytest.mark.parametrize("flags, message", [
    (["--lr=-1e-3"], "--lr must be >= 0"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr 0.01 is larger than --lr 0.001"),
    (["--min-lr", "-1"], "--min-lr must be >= 0"),
    (["--max-skipped-iterations", "0"], "--max-skipped-iterations must be >= 1"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be >= 1"),
])
def test_bad_values_name_their_flag(flags, message):
    from megatron_composer.training.arguments import parse_args

    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_args(flags)


def test_distributed_timeout_reaches_process_group_creation(monkeypatch):
    """--distributed-timeout-minutes is handed to init_distributed, which passes it
    to init_process_group on every launcher path (tests/test_platform_cpu.py)."""
    from megatron_composer.training import pretrain as entry

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(timeout_minutes):
        seen["timeout"] = timeout_minutes
        raise Stop

    monkeypatch.setattr(entry, "init_distributed", fake_init)
    with pytest.raises(Stop):
        entry.pretrain(["--distributed-timeout-minutes", "3"])
    assert seen == {"timeout": 3}
