"""A dead trainer rank's one line (`rl/async_rl/failures.py`, train_rl.py): the command that resumes,
the last complete checkpoint, the reason in a few words, exit code 1. The end-to-end run that kills a
trainer rank is `test_async_chaos.py`."""
import shlex
import sys

import pytest
import torch

from megatron_composer import checkpoint as ck
from megatron_composer.rl.async_rl.failures import TrainerDied, death_reason, resume_argv

KILLED = "pid 41 ended unexpectedly: killed, out of memory or crashed"


def test_resume_argv_loads_save_in_place_of_any_load_and_drops_what_would_restart_the_run():
    argv = ["--async-rl", "--load", "runs/sft", "--save", "runs/rl", "--overwrite-save", "--finetune",
            "--no-load-optim", "--lr", "1e-4"]
    assert resume_argv(argv, "runs/rl") == ["--async-rl", "--save", "runs/rl", "--lr", "1e-4", "--load", "runs/rl"]
    assert resume_argv(["--load=runs/sft", "--save", "runs/rl"], "runs/rl") == ["--save", "runs/rl", "--load",
                                                                                "runs/rl"]
    assert resume_argv(["--save", "runs/rl"], "runs/rl") == ["--save", "runs/rl", "--load", "runs/rl"]


def test_the_resume_command_parses_to_a_full_resume_of_save(tmp_path):
    from megatron_composer.rl.arguments import parse_rl_args

    save = str(tmp_path / "rl")
    argv = ["--async-rl", "--load", str(tmp_path / "sft"), "--save", save, "--overwrite-save", "--finetune"]
    run = parse_rl_args(resume_argv(argv, save))
    ckpt = run.training.checkpoint
    assert (ckpt.load, ckpt.save, ckpt.overwrite_save, ckpt.finetune) == (save, save, False, False)


def test_the_line_names_the_rank_the_last_complete_checkpoint_and_the_command(tmp_path):
    save = str(tmp_path / "rl")
    argv = ["--async-rl", "--load", "runs/sft", "--save", save, "--train-iters", "6"]
    ck.save_checkpoint(save, 2, torch.nn.Linear(2, 2), None, {})
    ck.save_checkpoint(save, 4, torch.nn.Linear(2, 2), None, {})
    died = TrainerDied({1: KILLED}, step=5, train_iters=6, save=save)
    assert died.checkpoint == str(tmp_path / "rl" / "iter_0000004")
    assert died.line(["python", "train_rl.py"], argv) == (
        f"async RL: trainer rank 1 died ({KILLED}) after step 5 of 6; last complete checkpoint: "
        f"{tmp_path}/rl/iter_0000004; resume with: python train_rl.py --async-rl --save {save} --train-iters 6 "
        f"--load {save}")


def test_without_a_checkpoint_the_line_gives_the_command_itself(tmp_path):
    argv = ["--async-rl", "--load", "runs/sft", "--save", str(tmp_path / "rl")]
    died = TrainerDied({0: KILLED, 1: "pid 42 exited: out of time"}, step=1, train_iters=6, save=str(tmp_path / "rl"))
    assert died.line(["python", "train_rl.py"], argv) == (
        f"async RL: trainer ranks 0, 1 died (rank 0: {KILLED}; rank 1: pid 42 exited: out of time) after step 1 "
        f"of 6; last complete checkpoint: none; start again with: python train_rl.py {shlex.join(argv)}")
    unsaved = TrainerDied({0: KILLED}, step=1, train_iters=6, save=None)
    assert "last complete checkpoint: none (no --save); start again with: python train_rl.py --async-rl" in \
        unsaved.line(["python", "train_rl.py"], ["--async-rl"])


def test_death_reason_from_rays_own_error():
    ray = pytest.importorskip("ray")
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    # the words Ray's core worker uses for a process that ended without exiting (kill -9, OOM, SIGSEGV)
    lost = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
            "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes ...")
    context = ActorDiedErrorContext(class_name="TrainerWorker", actor_id=bytes(16), pid=41, error_message=lost)
    assert death_reason(ray.exceptions.ActorDiedError(context)) == KILLED
    exited = ("The actor is dead because its worker process has died. Worker exit type: INTENDED_USER_EXIT Worker "
              "exit detail: Worker exits by an user request. exit_actor() is called.")
    context = ActorDiedErrorContext(class_name="TrainerWorker", actor_id=bytes(16), pid=41, error_message=exited)
    assert death_reason(ray.exceptions.ActorDiedError(context)) == "pid 41 exited: Worker exits by an user request"


def test_train_rl_prints_one_line_and_exits_1(data_dir, tmp_path, capsys, monkeypatch):
    import train_rl
    from megatron_composer.rl.async_rl import runner

    save = str(tmp_path / "rl")
    ck.save_checkpoint(save, 2, torch.nn.Linear(2, 2), None, {})

    def dies(run):
        raise TrainerDied({1: KILLED}, step=3, train_iters=run.training.train_iters, save=run.training.checkpoint.save)

    monkeypatch.setattr(runner, "run_async_rl", dies)
    monkeypatch.setattr("sys.argv", ["train_rl.py"])
    argv = ["--async-rl", "--env", "agentic-coding", "--model-preset", "tiny", "--tokenizer-model",
            str(data_dir / "tokenizer.model"), "--train-iters", "6", "--save", save, "--load", save]
    capsys.readouterr()
    assert train_rl.main(argv) == 1
    out = capsys.readouterr()
    assert out.err.splitlines() == [
        f"async RL: trainer rank 1 died ({KILLED}) after step 3 of 6; last complete checkpoint: {save}/iter_0000002; "
        f"resume with: {sys.executable} train_rl.py --async-rl --env agentic-coding --model-preset tiny "
        f"--tokenizer-model {data_dir}/tokenizer.model --train-iters 6 --save {save} --load {save}"]
