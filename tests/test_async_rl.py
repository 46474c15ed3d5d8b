"""Asynchronous RL on Ray end to end: kill -9 of the whole job and of each kind of service; placement.

The first test: one job in two lives, on two trainer ranks at expert-parallel
size 2 (each publication gathers both ranks' experts for the inference
workers, which hold the whole model). The first runs on a Ray instance of its
own and is killed with SIGKILL (its whole process group: driver, Ray, every
actor) once it has logged step 3, after its step-2 checkpoint. The second
resumes from that checkpoint on a loopback "cluster" started with
`ray start --head` (`--ray-address`), and while it runs the test kills an
inference worker, an environment worker and the evaluator with SIGKILL. The
job must finish, train every group id exactly once over both lives, and
evaluate after its evaluator was killed.

Same trajectory: the run is on-policy and deterministic (`--synchronous-rollouts`:
a step's groups are launched once every inference worker has the newest
weights, so every token is sampled by them; `--rollout-batch-size 1`: each
sequence is decoded alone, so its log-probs do not depend on what else the
engine batched; each group's sampling seeds follow from its id). So the
resumed life's step 3 must equal the first life's step 3, which ran
uninterrupted from the same checkpoint, bit for bit: the same groups and
rewards, the sampler's log-probs (their mismatch with the trainer's), the
losses and the gradient norm. (The tiny model from random init gives every
trajectory of a group the same reward, so the policy loss is 0 here and the
gradient is the MTP and router losses'; `test_async_publish.py` steps on groups
whose rewards differ.)

The second places stand-in actors on a loopback Ray instance that declares
GPUs (the placement checks and groups of `rl/async_rl/placement.py`).
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
# a step's measures that follow from its groups and weights alone (not from timing)
TRAJECTORY = ("trained groups", "reward", "advantage abs", "completion length", "policy loss", "grad norm",
              "mtp loss", "entropy", "logp mismatch mean", "logp mismatch p99", "replaced experts", "lr")

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


def _ray_head(port: int, env: dict, log_path) -> subprocess.Popen:
    """`ray start --head --block` in a session of its own (ready once it says it blocks). Not `ray stop` to
    end it: that stops every Ray instance on the machine, other tests' included; `_end_session` ends this one."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    with open(log_path, "w") as log:
        head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=4",
                                 "--include-dashboard=false", "--disable-usage-stats"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while "--block" not in log_path.read_text():
        if head.poll() is not None or time.monotonic() > deadline:
            _end_session(head)
            raise AssertionError(f"ray start --head did not come up: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return head


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _end_session(proc: subprocess.Popen, seconds: float = 60.0) -> None:
    """SIGKILL every process of the session `proc` leads (it was started with start_new_session) until none
    is left; processes of other sessions (other tests' Ray instances) are untouched."""
    deadline = time.monotonic() + seconds
    while True:
        left = []
        for name in os.listdir("/proc"):
            try:
                if name.isdigit() and os.getsid(int(name)) == proc.pid and not _zombie(int(name)):
                    os.kill(int(name), signal.SIGKILL)
                    left.append(int(name))
            except (ProcessLookupError, PermissionError):
                pass
        if proc.poll() is None:
            proc.wait(timeout=30)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.5)


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
           "--eval-tasks", "2", "--eval-interval", "3", "--log-interval", "1", "--max-policy-lag", "3",
           "--trainer-ranks", "2", "--expert-model-parallel-size", "2",  # one gloo group of two trainer actors
           "--synchronous-rollouts", "--rollout-batch-size", "1"]  # deterministic: see the module docstring
    # a private loopback cluster: no token authentication between its processes
    env = dict(os.environ, RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled")
    deadline = time.monotonic() + LIMIT_S
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            _wait_for("step 3 after the step-2 checkpoint", lambda: any(r["iteration"] >= 3 for r in _rows(save)),
                      first, deadline)
        finally:
            _killpg(first)
    resumed_at = latest_iteration(save)
    held = decode_state(read_extra_file(save, TrainerWorker.BUFFER_FILE))
    first_rows = _rows(save)
    first_job = first_rows[0]["job"]
    uninterrupted = {r["iteration"]: r for r in first_rows if r["iteration"] > resumed_at}
    assert resumed_at == 2 and uninterrupted, f"killed after the step-{resumed_at} checkpoint: no step to compare"
    # on-policy: nothing in flight or waiting at a checkpoint
    assert not held["ready"] and not held["relaunch"] and held["next_group_id"] == 2 * resumed_at

    port = _port()
    head = _ray_head(port, env, tmp_path / "ray_head.log")
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
        _end_session(head)

    rows = _rows(save)
    kept = [r for r in rows if r["job"] == first_job and r["iteration"] <= resumed_at]
    resumed = [r for r in rows if r["job"] != first_job]
    assert [r["iteration"] for r in kept + resumed] == [1, 2, 3, 4, 5, 6]
    trained = [gid for r in kept + resumed for gid in r["trained groups"]]
    assert trained == list(range(12)), trained  # no group lost to the kill, none trained twice
    assert all(r["staleness max"] == 0 for r in kept + resumed)  # every token sampled by the newest weights
    for r in resumed:  # the resumed trajectory is the uninterrupted one
        if r["iteration"] in uninterrupted:
            want = uninterrupted[r["iteration"]]
            assert want["grad norm"] > 0 and "logp mismatch mean" in want
            compared = [k for k in want if k in TRAJECTORY or k.startswith(("reward ", "task "))]
            assert {k: r[k] for k in compared} == {k: want[k] for k in compared}
    assert resumed[-1]["groups failed"] >= 1  # the killed services lost in-flight groups, which came back
    assert "eval of weights version 6" in text
    assert latest_iteration(save) == 6 and os.path.exists(os.path.join(save, "async_rl.png"))


class _Probe:
    """A stand-in actor: what Ray assigned it, and a call that blocks until released."""

    def __init__(self):
        import threading

        self.released = threading.Event()

    def assigned(self):
        import ray

        from megatron_composer.rl.async_rl.placement import local_gpu_index

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return [str(g) for g in ray.get_gpu_ids()], visible, local_gpu_index(ray.get_gpu_ids(), visible)

    def wait_released(self):
        return self.released.wait(60)

    def release(self):
        self.released.set()
        return True


@pytest.mark.slow
def test_placement_on_a_loopback_cluster_with_gpus(tmp_path, monkeypatch):
    """A Ray instance declaring 3 GPUs (none need exist: Ray only hands out their ids): a layout needing 4
    is refused before anything is reserved; one needing 3 gets one GPU per actor, each its local cuda:0;
    the trainer's `published` runs in its own concurrency group beside a blocked default-group call."""
    ray = pytest.importorskip("ray")
    from megatron_composer.rl.async_rl.placement import (PlacementError, ServiceLayout, actor_options,
                                                         plan_placement, release, reserve)
    from megatron_composer.rl.async_rl.runner import PUBLISH, AsyncRLRunner, start_local_ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a private loopback instance
    # `make test` hides the GPUs (CUDA_VISIBLE_DEVICES=); Ray refuses to declare GPUs that list hides
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    start_local_ray(ray, num_cpus=2, num_gpus=3, log_to_driver=False)
    try:
        argv = ["--async-rl", "--env", "agentic-coding", "--eval-tasks", "2", "--trainer-ranks", "2",
                "--inference-workers", "1", "--save", str(tmp_path / "rl")]
        with pytest.raises(PlacementError, match="need 4 GPUs.*has 3 GPUs, 3 of them free"):
            AsyncRLRunner(argv)
        assert ray.util.placement_group_table() == {} and ray.available_resources()["GPU"] == 3

        placement = plan_placement(ServiceLayout(2, 1, 0), ray.cluster_resources(), ray.available_resources())
        groups = reserve(ray, placement, timeout_s=60)
        probe = ray.remote(num_cpus=0, concurrency_groups={PUBLISH: 1})(_Probe)
        actors = [probe.options(**actor_options(groups, role, i)).remote()
                  for role, n in (("trainer", 2), ("inference", 1)) for i in range(n)]
        seen = ray.get([a.assigned.remote() for a in actors], timeout=120)
        assert sorted(ids[0] for ids, _, _ in seen) == ["0", "1", "2"]
        assert all(ids == [visible] and local == 0 for ids, visible, local in seen)
        blocked = actors[0].wait_released.options(concurrency_group=PUBLISH).remote()
        assert ray.get(actors[0].release.remote(), timeout=30)  # the default group is not held up
        assert ray.get(blocked, timeout=30)
        for a in actors:
            ray.kill(a)
        release(groups)
    finally:
        ray.shutdown()
