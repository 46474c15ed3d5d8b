"""The async RL services in one process, without Ray: trainer -> weights -> inference -> environment -> trainer.

The weights an inference worker serves after a sync are checked bit for bit
against the trainer's own parameters cast to bf16 by torch (the reference),
after the full snapshot and after a delta of a real training step.
"""
import dataclasses
import os

import pytest
import torch


@pytest.fixture
def clean_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _served_equal_trainer_bf16(inference, trainer):
    from megatron_composer.checkpoint import model_state_dict

    served = model_state_dict(inference.engine.model)
    for name, t in model_state_dict(trainer.model).items():
        ref = t.detach().to(torch.bfloat16).to(served[name].dtype) if t.is_floating_point() else t
        assert torch.equal(served[name], ref), name


def test_one_async_round_trip_serves_the_trained_weights_exactly(data_dir, tmp_path, clean_env):
    from megatron_composer.checkpoint import read_extra_file
    from megatron_composer.rl.async_rl.reconciler import Reconciler, decode_state, encode_state
    from megatron_composer.rl.async_rl.services import EnvWorker, InferenceWorker, RolloutSpec, TrainerWorker

    argv = ["--model-preset", "tiny", "--num-layers", "2", "--seq-length", "256",
            "--tokenizer-model", str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir),
            "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "6", "--lr", "1e-3",
            "--lr-warmup-iters", "0", "--train-iters", "4", "--save", str(tmp_path / "rl")]
    trainer = TrainerWorker(argv, 0, 1)
    trainer.setup(*trainer.address())
    info = trainer.describe()
    assert info["iteration"] == 0 and info["buffer"] is None
    inference = InferenceWorker(info["model_config"], info["tokenizer_model"], max_model_len=info["seq_length"],
                                max_batch_size=8)
    try:
        with pytest.raises(RuntimeError, match="no weights yet"):
            inference.generate([[1, 2]], None)
        assert inference.update_weights(trainer.snapshot())
        _served_equal_trainer_bf16(inference, trainer.trainer)
        env = EnvWorker(RolloutSpec(trainer.rl, info["tokenizer_model"], info["seq_length"], info["seed"],
                                    info["tasks"]), inference)
        groups = [env.run_group(gid, 0) for gid in (5, 9)]  # any ids: the trainer renumbers them
        for g in groups:
            assert [s.trajectory for s in g.samples] == [0, 1]
            assert all(v == 0 for s in g.samples for v in s.policy_versions) and g.oldest_version == 0
        metrics, version = trainer.train_step(groups)
        update = trainer.published(version)  # encoded off the step, as the runner asks for it
        assert metrics["trained groups"] == [5, 9] and version == 1 and update.is_delta and update.version == 1
        assert inference.update_weights(update) and inference.engine.version == 1
        _served_equal_trainer_bf16(inference, trainer.trainer)
        later = env.run_group(10, 1)
        assert all(v == 1 for s in later.samples for v in s.policy_versions)
        # a worker that restarted has no base for the delta: refused, then a snapshot brings it level
        fresh = InferenceWorker(info["model_config"], info["tokenizer_model"], max_model_len=info["seq_length"],
                                max_batch_size=2)
        try:
            assert not fresh.update_weights(update)
            assert fresh.update_weights(trainer.snapshot()) and fresh.version() == 1
            _served_equal_trainer_bf16(fresh, trainer.trainer)
        finally:
            fresh.engine.stop()
        # the policy-aware checkpoint holds the reconciler's buffer, byte for byte
        rec = Reconciler(2, max_inflight_groups=2, max_policy_lag=1)
        rec.to_launch(1)
        rec.complete(dataclasses.replace(later, group_id=0))
        buffer = encode_state(rec.state_dict())
        saved = trainer.save(buffer)
        assert read_extra_file(str(tmp_path / "rl"), TrainerWorker.BUFFER_FILE) == buffer
        assert os.path.basename(saved) == "iter_0000001"
        (ready,) = decode_state(read_extra_file(saved, TrainerWorker.BUFFER_FILE))["ready"]
        assert ready.samples[0].completion_ids == later.samples[0].completion_ids
        _through_our_server(trainer, info, env)
    finally:
        inference.engine.stop()
        trainer.close()


@pytest.mark.parametrize("flags, match", [(["--max-inflight-groups", "0"], "--max-inflight-groups 0 must be >= 1"),
                                          (["--trainer-ranks", "0"], "--trainer-ranks 0 must be >= 1"),
                                          (["--max-policy-lag", "-1"], "--max-policy-lag -1 must be >= 0"),
                                          (["--group-timeout-s", "0"], "--group-timeout-s 0.0 > 0")])
def test_bad_async_flags_are_named(flags, match):
    from megatron_composer.rl.arguments import parse_rl_args

    with pytest.raises(ValueError, match=match):
        parse_rl_args(["--async-rl"] + flags)


def test_the_driver_keeps_the_loggers_and_ray_address_implies_async():
    from megatron_composer.rl.arguments import parse_rl_args
    from megatron_composer.rl.async_rl.services import TrainerWorker
    from megatron_composer.training.arguments import LoggingConfig

    run = parse_rl_args(["--tensorboard-dir", "tb", "--lr", "1e-4", "--wandb-project=p", "--save", "s"])
    assert run.logging.tensorboard_dir == "tb" and run.logging.wandb_project == "p"
    worker = TrainerWorker(run, 0, 1)  # the actor gets the typed configs, not the command line
    assert worker.run.logging == LoggingConfig()
    assert worker.run.training == run.training and worker.run.rl == run.rl
    assert parse_rl_args(["--ray-address", "auto"]).async_rl.enabled
    assert not parse_rl_args([]).async_rl.enabled


def test_a_group_past_its_timeout_gets_its_worker_killed_for_a_restart():
    import time
    import types

    from megatron_composer.rl.async_rl.runner import AsyncRLRunner

    killed, printed = [], []
    runner = object.__new__(AsyncRLRunner)  # only the timeout logic: no Ray, no actors
    runner.ray = types.SimpleNamespace(kill=lambda actor, no_restart: killed.append((actor, no_restart)))
    runner.run_config = types.SimpleNamespace(async_rl=types.SimpleNamespace(group_timeout_s=5.0))
    runner.log = types.SimpleNamespace(print=printed.append)
    runner.expired = set()
    now = time.monotonic()
    pending = {"hung": (3, "env-a", now - 6.0), "fine": (4, "env-b", now - 1.0)}
    runner._expire(pending)
    runner._expire(pending)  # still pending while the kill lands: not killed again
    assert killed == [("env-a", False)]  # Ray restarts it; its groups fail and are launched again
    assert "group 3 ran past --group-timeout-s 5" in printed[0]


def _through_our_server(trainer, info, local_env):
    """--rollout-server: an environment worker samples over HTTP from our server, which the driver's
    ServerSync keeps on the published weights, bit for bit."""
    from megatron_composer.inference.server import create_app
    from megatron_composer.rl.async_rl.services import EnvWorker, ServerSync, build_engine
    from tests.serving import serve

    engine = build_engine(info["model_config"], max_model_len=info["seq_length"], max_batch_size=8,
                          tokenizer=local_env.tokenizer)
    with serve(create_app(engine, model_name="tiny")) as url:
        sync = ServerSync(url)
        assert sync.update_weights(trainer.snapshot()) and engine.version == 1
        served = type("Served", (), {"engine": engine})
        _served_equal_trainer_bf16(served, trainer.trainer)
        spec = dataclasses.replace(local_env.spec, server_url=url)
        group = EnvWorker(spec).run_group(11, 1)
        assert [s.trajectory for s in group.samples] == [0, 1]
        assert all(v == 1 for s in group.samples for v in s.policy_versions)
        _, version = trainer.train_step([group, dataclasses.replace(group, group_id=12)])
        update = trainer.published(version)
        assert sync.update_weights(update) and engine.version == 2
        _served_equal_trainer_bf16(served, trainer.trainer)
    engine.stop()
