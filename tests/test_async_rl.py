"""Asynchronous RL on Ray end to end: kill -9 of the whole job and of each kind of service.

One job in two lives. The first runs on a Ray instance of its own and is
killed with SIGKILL (its whole process group: driver, Ray, every actor) once
its step-2 checkpoint is published. The second resumes from that checkpoint
on a loopback "cluster" started with `ray start --head` (`--ray-address`),
and while it runs the test kills an inference worker, an environment worker
and the evaluator with SIGKILL. The job must finish, train every group id at
most once over both lives, train the ready groups the checkpoint held, and
evaluate after its evaluator was killed.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = float(os.environ.get("MC_ASYNC_TEST_TIMEOUT", 480))

def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(what, check, proc, deadline):
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _rows(save):
    path = os.path.join(save, "rl_steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _killpg(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


@pytest.mark.slow
def test_a_killed_job_resumes_on_a_cluster_and_survives_killed_services(data_dir, tmp_path):
    from megatron_composer.checkpoint import latest_iteration, read_extra_file
    from megatron_composer.rl.async_rl.reconciler import decode_state
    from megatron_composer.rl.async_rl.services import TrainerWorker

    save = str(tmp_path / "rl")
    cmd = [sys.executable, os.path.join(ROOT, "train_rl.py"), "--async-rl", "--env", "agentic-coding",
           "--task-families", "write-file", "--model-preset", "tiny", "--num-layers", "2", "--seq-length", "512",
           "--tokenizer-model", str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir),
           "--rl-micro-batch-tokens", "2048", "--prompts-per-step", "2", "--group-size", "2",
           "--max-new-tokens", "12", "--max-turns", "2", "--episode-workers", "4", "--lr", "1e-4",
           "--lr-warmup-iters", "0", "--train-iters", "6", "--save", save, "--save-interval", "2",
           "--eval-tasks", "2", "--eval-interval", "3", "--log-interval", "1", "--max-policy-lag", "3"]
    # a private loopback cluster: no token authentication between its processes
    env = dict(os.environ, RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled")
    deadline = time.monotonic() + LIMIT_S
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            _wait_for("the step-2 checkpoint", lambda: os.path.isdir(save) and latest_iteration(save) == 2,
                      first, deadline)
        finally:
            _killpg(first)
    held = decode_state(read_extra_file(save, TrainerWorker.BUFFER_FILE))
    first_job = _rows(save)[0]["job"]

    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    port = _port()
    subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=180)
    try:
        with open(tmp_path / "second.log", "w") as log:
            second = subprocess.Popen(cmd + ["--load", save, "--ray-address", f"127.0.0.1:{port}"], cwd=ROOT,
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                _wait_for("a step of the resumed job",
                          lambda: any(r["job"] != first_job and r["iteration"] >= 3 for r in _rows(save)),
                          second, deadline)
                with open(os.path.join(save, "async_rl_services.json")) as f:
                    services = json.load(f)
                for kind in ("inference", "environment", "evaluator"):
                    os.kill(services[kind][0], signal.SIGKILL)
                    time.sleep(1.0)
                second.wait(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                if second.poll() is None:
                    _killpg(second)
        text = (tmp_path / "second.log").read_text()
        assert second.returncode == 0, text[-3000:]
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)

    rows = _rows(save)
    kept = [r for r in rows if r["job"] == first_job and r["iteration"] <= 2]
    resumed = [r for r in rows if r["job"] != first_job]
    assert [r["iteration"] for r in kept + resumed] == [1, 2, 3, 4, 5, 6]
    trained = [gid for r in kept + resumed for gid in r["trained groups"]]
    assert len(trained) == len(set(trained)) == 12, trained  # no group lost to the kill, none trained twice
    resumed_ids = {gid for r in resumed for gid in r["trained groups"]}
    assert {g.group_id for g in held["ready"]} <= resumed_ids
    assert set(held["relaunch"]) <= resumed_ids  # the groups in flight at the kill were sampled again
    assert resumed[-1]["groups failed"] >= 1  # the killed services lost in-flight groups, which came back
    assert "eval of weights version 6" in text
    assert latest_iteration(save) == 6 and os.path.exists(os.path.join(save, "async_rl.png"))
