"""Asynchronous RL under chaos: each kind of service killed once with SIGKILL in one run.

One `train_rl.py --async-rl` job on a Ray instance of its own, two trainer
ranks (data parallel), one inference worker, one environment worker and the
evaluator. A seeded random draws, for the inference worker, the environment
worker and the evaluator, the step after which each is killed, and for the
trainer the rank and the step (after the evaluator's replacement has
evaluated). What the README promises for each:

* inference, environment, evaluator: Ray starts a new process (a new pid of
  the same class); the groups the kills lost are launched again; the
  evaluator evaluates again after its kill; no step is skipped;
* trainer: the job ends with exit code 1 and one line naming the rank and
  pid that died, the last complete checkpoint (what the tracker in --save
  names) and the command that resumes (the job's own with `--load <save>`);
  no process of the job is left (every Ray process, actor and sandbox of
  the job is in its session);
* the printed command resumes from that checkpoint and finishes the run; the
  step rows of both lives hold every group id exactly once, in order: no
  completed group was lost and none was trained twice (the rollouts are
  synchronous, so a step's groups are the next ids; a lost group is the next
  step's first).

Seed: MC_CHAOS_SEED (default 0), printed in every failure message.
"""
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.test_async_rl import LIMIT_S, ROOT, _killpg, _rows, _wait_for

SEED = int(os.environ.get("MC_CHAOS_SEED", 0))
STEPS = 8
RESTARTED = {"inference": "InferenceWorker", "environment": "EnvWorker", "evaluator": "Evaluator"}


def _plan(seed: int) -> dict:
    """{service: step after which it is killed} and the trainer rank to kill, drawn from `seed`."""
    rng = random.Random(seed)
    plan = {kind: rng.randint(1, 3) for kind in RESTARTED}
    plan["trainer"] = rng.randint(max(plan.values()) + 1, 5)
    plan["rank"] = rng.randrange(2)
    return plan


def _session(sid: int) -> dict:
    """{pid: name} of the live processes in session `sid` (the job's: it was started in a new session)."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc.info["name"]
        except (ProcessLookupError, PermissionError):
            pass
    return found


def _left_after(sid: int, seconds: float = 30.0) -> dict:
    """The job's processes still alive `seconds` after its driver exited (none, when it shut down)."""
    deadline = time.monotonic() + seconds
    while True:
        left = _session(sid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _evaluated(log_path, after: int) -> bool:
    with open(log_path) as f:
        return any(int(v) > after for v in re.findall(r"eval of weights version (\d+)", f.read()))


@pytest.mark.slow
def test_each_async_service_killed_once_in_one_run(data_dir, tmp_path):
    pytest.importorskip("psutil")
    from megatron_composer.checkpoint import iteration_dir, latest_iteration

    plan = _plan(SEED)
    why = f"MC_CHAOS_SEED={SEED}: {plan}"
    save = str(tmp_path / "rl")
    script = os.path.join(ROOT, "train_rl.py")
    argv = ["--async-rl", "--env", "agentic-coding", "--task-families", "write-file", "--model-preset", "tiny",
            "--num-layers", "2", "--seq-length", "512", "--tokenizer-model", str(data_dir / "tokenizer.model"),
            "--data-cache-dir", str(data_dir), "--rl-micro-batch-tokens", "2048", "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "12", "--max-turns", "2", "--episode-workers", "4",
            "--lr", "1e-4", "--lr-warmup-iters", "0", "--train-iters", str(STEPS), "--save", save,
            "--save-interval", "2", "--eval-tasks", "2", "--eval-interval", "2", "--log-interval", "1",
            "--max-policy-lag", "3", "--trainer-ranks", "2", "--synchronous-rollouts", "--rollout-batch-size", "1"]
    env = dict(os.environ, RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled")
    deadline = time.monotonic() + LIMIT_S
    out, err = tmp_path / "first.out", tmp_path / "first.err"
    seen, killed = {}, {}  # the job's processes while it ran; {kind: pid killed}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        first = subprocess.Popen([sys.executable, script, *argv], cwd=ROOT, env=env, stdout=stdout, stderr=stderr,
                                 start_new_session=True)
        try:
            _wait_for("the services file", lambda: os.path.exists(os.path.join(save, "async_rl_services.json")),
                      first, deadline)
            with open(os.path.join(save, "async_rl_services.json")) as f:
                services = json.load(f)
            for kind, step in sorted(((k, plan[k]) for k in RESTARTED), key=lambda item: item[1]):
                _wait_for(f"step {step} ({why})", lambda s=step: any(r["iteration"] >= s for r in _rows(save)),
                          first, deadline)
                killed[kind] = services[kind][0]
                os.kill(killed[kind], signal.SIGKILL)
            _wait_for(f"step {plan['trainer']} and an evaluation by the new evaluator ({why})",
                      lambda: any(r["iteration"] >= plan["trainer"] for r in _rows(save))
                      and _evaluated(out, plan["evaluator"]), first, deadline)
            seen = _session(first.pid)
            dead = services["trainer"][plan["rank"]]
            os.kill(dead, signal.SIGKILL)
            first.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if first.poll() is None:
                _killpg(first)
    text, errors = out.read_text(), err.read_text()
    assert first.returncode == 1, (why, errors[-3000:])

    # the restarted services: a new process of each class, the lost groups launched again, no step skipped
    for kind, cls in RESTARTED.items():
        assert any(name.startswith(f"ray::{cls}") and pid != killed[kind] for pid, name in seen.items()), \
            (why, kind, seen)
    rows = _rows(save)
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= plan["trainer"], why
    assert rows[-1]["groups failed"] >= 1, why
    assert "starting at step 0" in text and "resuming at step" not in text

    # the trainer: one line, exit 1, the checkpoint the tracker names, no process left
    kept = latest_iteration(save)
    assert kept is not None and kept >= 2, why
    resume = [sys.executable, script, *argv, "--load", save]
    lines = [line for line in (text + errors).splitlines() if "async RL: trainer rank" in line]
    assert lines == [errors.strip().splitlines()[-1]], (why, errors[-3000:])
    # the step named is the last one logged, or one the trainer finished whose row the death cut short
    step = int(re.search(r"after step (\d+) of", lines[0]).group(1))
    assert step in (len(rows), len(rows) + 1), (why, lines[0])
    assert lines[0] == (f"async RL: trainer rank {plan['rank']} died (pid {dead} ended unexpectedly: killed, out of "
                        f"memory or crashed) after step {step} of {STEPS}; last complete checkpoint: "
                        f"{iteration_dir(save, kept)}; resume with: {shlex.join(resume)}"), why
    # the driver's own output (the workers' lines come prefixed "(EnvWorker pid=...)": a lost episode is
    # logged with its traceback, by design)
    assert not [line for line in (text + errors).splitlines() if line.startswith("Traceback")], (why, errors[-3000:])
    assert {"raylet", "gcs_server"} <= set(seen.values()), seen  # the session check below sees Ray's processes
    assert _left_after(first.pid) == {}, why

    # the printed command resumes from that checkpoint and finishes the run
    with open(tmp_path / "second.out", "w") as stdout:
        second = subprocess.Popen(shlex.split(lines[0].split("resume with: ", 1)[1]), cwd=ROOT, env=env,
                                  stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            second.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if second.poll() is None:
                _killpg(second)
    resumed_text = (tmp_path / "second.out").read_text()
    assert second.returncode == 0, (why, resumed_text[-3000:])
    assert f"resuming at step {kept}" in resumed_text
    assert _left_after(second.pid) == {}, why
    rows = _rows(save)
    first_job = rows[0]["job"]
    lives = [r for r in rows if r["job"] == first_job and r["iteration"] <= kept] + \
            [r for r in rows if r["job"] != first_job]
    assert [r["iteration"] for r in lives] == list(range(1, STEPS + 1)), why
    trained = [gid for r in lives for gid in r["trained groups"]]
    assert trained == list(range(2 * STEPS)), (why, trained)  # none lost, none trained twice
    assert latest_iteration(save) == STEPS
