"""Async RL placement without a Ray cluster: one GPU per trainer rank, inference worker and evaluator.

* Ray's one-GPU-per-actor view, simulated per trainer rank (CUDA_VISIBLE_DEVICES
  holds the one GPU Ray assigned, `ray.get_gpu_ids()` returns it, torch sees one
  device): every rank selects cuda:0 and keeps its global rank;
* a layout the cluster cannot hold is refused, naming the GPUs it needs and has,
  before any actor is created (the driver on a stand-in for Ray that records
  each actor it is asked to start);
* on a cluster with GPUs the evaluator asks for one, like the trainer ranks
  and inference workers, each in its role's placement group.
"""
import types

import pytest
import torch

from megatron_composer.rl.async_rl.placement import (
    Placement,
    PlacementError,
    ServiceLayout,
    local_gpu_index,
    plan_placement,
)

ray = pytest.importorskip("ray")


def _fake_trainer(seen):
    """build_rl_trainer's stand-in: the distributed bootstrap only, recording what it chose (its model has no
    weights for `setup` to publish)."""
    from megatron_composer.platform import distributed as pd

    def build(run, log=None):
        env = pd.init_distributed()
        seen.update(env=env, device=pd.local_device())
        return types.SimpleNamespace(rl=run.rl, log=types.SimpleNamespace(close=lambda: None), resume=lambda: None,
                                     model=torch.nn.Module(), state=types.SimpleNamespace(iteration=0))

    return build


@pytest.mark.parametrize("rank", range(4))
def test_every_trainer_rank_takes_the_one_gpu_ray_leaves_it(rank, monkeypatch):
    import megatron_composer.rl.build as build
    from megatron_composer.platform import distributed as pd
    from megatron_composer.rl.arguments import parse_rl_args
    from megatron_composer.rl.async_rl.services import TrainerWorker

    gpu = 4 + rank  # the node's GPU Ray assigned this actor (not its rank)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # restored after the test: setup() writes them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(gpu))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [gpu])
    selected, groups = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: selected[-1])
    monkeypatch.setattr(pd, "apply_library_fixes", lambda: [])
    monkeypatch.setattr(pd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pd.dist, "init_process_group", lambda **kw: groups.append(kw))
    monkeypatch.setattr(pd.dist, "get_rank", lambda: groups[-1]["rank"])
    monkeypatch.setattr(pd.dist, "get_world_size", lambda: groups[-1]["world_size"])
    seen = {}
    monkeypatch.setattr(build, "build_rl_trainer", _fake_trainer(seen))

    worker = TrainerWorker(parse_rl_args([]), rank, 4, threads=torch.get_num_threads())
    worker.setup("10.0.0.1", 29555)
    assert selected == [0] and seen["device"] == torch.device("cuda", 0)
    assert seen["env"].rank == rank and seen["env"].world_size == 4 and seen["env"].local_rank == 0
    (group,) = groups
    assert (group["rank"], group["world_size"], group["backend"]) == (rank, 4, "nccl")
    assert group["init_method"] == "tcp://10.0.0.1:29555"


@pytest.mark.parametrize("assigned, visible, index", [
    ([], None, 0),                 # no GPU asked for (CPU run)
    ([5], "5", 0),                 # Ray's default: the actor sees its own GPU only
    (["3"], "0,1,2,3", 3),         # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all stay visible
    ([2], None, 2),
    ([6], "6, 7", 0),
])
def test_the_local_device_is_the_assigned_gpu_among_the_visible_ones(assigned, visible, index):
    assert local_gpu_index(assigned, visible) == index


@pytest.mark.parametrize("assigned, visible, match", [
    ([2], "0,1", r"assigned GPU 2, which CUDA_VISIBLE_DEVICES='0,1' does not list"),
    ([1, 2], "1,2", r"holds GPUs \[1, 2\]; a trainer rank takes exactly one"),
])
def test_an_assignment_that_names_no_single_visible_gpu_is_refused(assigned, visible, match):
    with pytest.raises(PlacementError, match=match):
        local_gpu_index(assigned, visible)


def _async(**kw):
    return types.SimpleNamespace(**{"trainer_ranks": 2, "inference_workers": 1, "rollout_server": None, **kw})


def test_the_layout_counts_one_actor_per_model_holding_service():
    assert ServiceLayout.of(_async(), evaluator=True) == ServiceLayout(2, 1, 1)
    assert ServiceLayout.of(_async(inference_workers=3), evaluator=False) == ServiceLayout(2, 3, 0)
    # an external server replaces the inference workers
    assert ServiceLayout.of(_async(rollout_server="http://h:8000"), evaluator=True) == ServiceLayout(2, 0, 1)


def test_a_layout_that_fits_is_placed_on_gpus_and_a_cluster_without_gpus_runs_on_cpu():
    layout = ServiceLayout(2, 1, 1)
    assert plan_placement(layout, {"CPU": 16, "GPU": 8}, {"CPU": 3, "GPU": 4}) == Placement(layout, gpus=True)
    assert plan_placement(layout, {"CPU": 4}) == Placement(layout, gpus=False)
    assert plan_placement(layout, {"CPU": 4, "GPU": 0}) == Placement(layout, gpus=False)


@pytest.mark.parametrize("cluster, available, numbers", [
    ({"GPU": 3}, None, "has 3 GPUs, 3 of them free"),
    ({"GPU": 8}, {"GPU": 3}, "has 8 GPUs, 3 of them free"),  # another job holds 5
])
def test_a_layout_the_cluster_cannot_hold_is_refused_with_the_numbers(cluster, available, numbers):
    with pytest.raises(PlacementError) as err:
        plan_placement(ServiceLayout(2, 1, 1), cluster, available)
    text = str(err.value)
    assert "need 4 GPUs, one per actor: 2 trainer (--trainer-ranks), 1 inference (--inference-workers), " \
           "1 evaluator (--eval-tasks 0 turns it off)" in text
    assert numbers in text and "ray start --num-gpus 0" in text


class _StandInRay:
    """Enough of Ray for `AsyncRLRunner.__init__`: records every actor it is asked to start and its options."""

    def __init__(self, gpus: int, info: dict):
        self.gpus, self.info, self.started = gpus, info, []
        self.exceptions = ray.exceptions

    def is_initialized(self):
        return True

    def cluster_resources(self):
        return {"CPU": 8.0, "GPU": float(self.gpus)}

    def available_resources(self):
        return self.cluster_resources()

    def get(self, value, timeout=None):
        return value

    def remote(self, **options):
        def wrap(cls):
            return _StandInClass(self, cls, options)

        return wrap


class _StandInClass:
    def __init__(self, fake, cls, options):
        self.fake, self.cls, self.options_ = fake, cls, options

    def options(self, **more):
        return _StandInClass(self.fake, self.cls, {**self.options_, **more})

    def remote(self, *args, **kwargs):
        actor = types.SimpleNamespace(cls=self.cls.__name__, options=self.options_, args=args)
        self.fake.started.append(actor)
        answers = {"address": ("10.0.0.1", 29555), "setup": None, "describe": self.fake.info}
        for name, value in answers.items():
            setattr(actor, name, types.SimpleNamespace(remote=lambda *a, v=value, **k: v))
        return actor


def _runner_on(gpus, monkeypatch, tmp_path, flags=()):
    from megatron_composer.rl.async_rl import runner as runner_module

    info = {"iteration": 0, "train_iters": 2, "tokenizer_model": "t.model", "seq_length": 64, "seed": 0,
            "tasks": 4, "model_config": {}, "buffer": None}
    fake = _StandInRay(gpus, info)
    monkeypatch.setattr(runner_module, "_ray", lambda: fake)
    # the placement groups Ray would make: one per role, named after it
    monkeypatch.setattr(runner_module, "reserve", lambda ray, placement: {
        role: f"group of {role}" for role in ("trainer", "inference", "evaluator")
        if placement.gpus and placement.layout.count(role)}, raising=False)
    argv = ["--async-rl", "--env", "agentic-coding", "--eval-tasks", "2", "--trainer-ranks", "2",
            "--inference-workers", "1", "--env-workers", "1", "--save", str(tmp_path / "rl"), *flags]
    return fake, lambda: runner_module.AsyncRLRunner(argv)


def test_the_driver_refuses_a_layout_that_does_not_fit_before_starting_any_actor(monkeypatch, tmp_path):
    fake, make = _runner_on(3, monkeypatch, tmp_path)
    with pytest.raises(PlacementError, match="need 4 GPUs.*has 3 GPUs, 3 of them free"):
        make()
    assert fake.started == []


def test_on_gpus_every_model_holding_actor_asks_for_one_in_its_roles_group(monkeypatch, tmp_path):
    fake, make = _runner_on(4, monkeypatch, tmp_path)
    make()
    placed = {}
    for actor in fake.started:
        strategy = actor.options.get("scheduling_strategy")
        placed.setdefault(actor.cls, []).append(
            (actor.options.get("num_gpus"), getattr(strategy, "placement_group", None),
             getattr(strategy, "placement_group_bundle_index", None)))
    assert placed["Evaluator"] == [(1, "group of evaluator", 0)]
    assert placed["TrainerWorker"] == [(1, "group of trainer", 0), (1, "group of trainer", 1)]
    assert placed["InferenceWorker"] == [(1, "group of inference", 0)]
    assert all(n in (None, 0) for n, _, _ in placed["EnvWorker"])  # environments hold no model


def test_on_a_cluster_without_gpus_nothing_asks_for_one(monkeypatch, tmp_path):
    fake, make = _runner_on(0, monkeypatch, tmp_path, flags=("--trainer-ranks", "3"))
    make()
    assert len(fake.started) == 3 + 1 + 1 + 1
    assert all(a.options.get("num_gpus", 0) == 0 and "scheduling_strategy" not in a.options for a in fake.started)
