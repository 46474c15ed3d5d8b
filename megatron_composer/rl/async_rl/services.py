"""The four RL services as plain classes; `runner.py` makes each a Ray actor.

    TrainerWorker     one per rank: builds `RLTrainer` from train_rl.py's flags inside its own
                      torch.distributed group (gloo on CPU, NCCL on GPU, on the GPU Ray assigned it),
                      takes one policy update per batch of groups, publishes the new weights (every
                      rank joins `gather.gather_policy`, which joins the expert-parallel and HSDP
                      shards on rank 0; rank 0 encodes them with `weight_sync` on a thread while the
                      next step runs), saves policy-aware checkpoints (the reconciler's buffer rides
                      in the checkpoint).
    InferenceWorker   our engine in a background loop; generates for the environment workers; swaps
                      in published weights between two decode steps while sequences run on.
    EnvWorker         runs one group's rollouts: agent episodes in sandboxes (agentic-coding) or one
                      completion per sample (single-turn), scored by the task; returns a `Group`.
    Evaluator         an inference worker of its own plus held-out episodes, run when asked.

Every class works without Ray (the tests call them directly); Ray only places
them in processes and restarts the stateless ones (`max_restarts`).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import torch

from ..backends import BackendCapabilities, RolloutBackend, check_backend
from ..rollout import renumber
from .reconciler import Group
from ...inference.weight_sync import (BackgroundPublisher, StaleBaseError, WeightPublisher, WeightSubscriber,
                                      WeightUpdate)
from .gather import check_publishable, gather_policy
from .placement import local_gpu_index

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _threads(n: int) -> None:
    """Each service gets its share of the machine's cores (one torch pool per process)."""
    torch.set_num_threads(max(1, n))


def _ray_gpu_ids() -> list:
    """The GPU ids Ray assigned this process (none outside a Ray worker)."""
    try:
        import ray
    except ImportError:
        return []
    return list(ray.get_gpu_ids()) if ray.is_initialized() else []


class TrainerWorker:
    """One training rank (module docstring). `run`: the parsed `rl.arguments.RLRunConfig`."""

    BUFFER_FILE = "rl_buffer.pt"

    def __init__(self, run, rank: int, world_size: int, *, threads: int = 1, weight_dtype: str = "bf16"):
        # the driver keeps the loggers (TensorBoard, wandb)
        from ...training.arguments import LoggingConfig

        if isinstance(run, (list, tuple)):  # train_rl.py's flags (tests, benchmarks)
            from ..arguments import parse_rl_args

            run = parse_rl_args(list(run))
        self.run = dataclasses.replace(run, logging=LoggingConfig())
        if run.rl.rollout.backend == "vllm":  # the inference workers drive vLLM; the trainer starts none
            self.run = dataclasses.replace(self.run, rl=run.rl.replace(rollout_backend="engine"))
        p = run.parallel
        check_publishable(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                          p.expert_tensor_parallel_size)
        self.rank, self.world_size, self.threads = rank, world_size, threads
        self.publisher = BackgroundPublisher(WeightPublisher(_DTYPES[weight_dtype])) if rank == 0 else None

    def address(self) -> tuple[str, int]:
        """This process's node address and a free port there: rank 0's rendezvous for the others."""
        import socket

        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray: this machine
            host = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the trainer's process group (every rank at once), build and resume the trainer, and publish
        the resumed weights (the version `snapshot` serves until the first step).

        The global rank is this worker's rank; the local device is the GPU Ray assigned this actor
        (`placement.local_gpu_index`: cuda:0 of the one device Ray leaves visible), not the rank.
        """
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(local_gpu_index(_ray_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))),
                          LOCAL_WORLD_SIZE="1", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        _threads(self.threads)
        from ..build import build_rl_trainer

        self.trainer = build_rl_trainer(self.run)
        self.rl, self.log = self.trainer.rl, self.trainer.log
        self.trainer.resume()
        self.publish(full=True)
        self.idle_since = time.perf_counter()

    def pid(self) -> int:
        return os.getpid()

    def start_clock(self) -> None:
        """The trainer's idle time counts from here (the runner's start), not from its construction."""
        self.idle_since = time.perf_counter()

    def describe(self) -> dict:
        """What the other services need: the model config, the tokenizer, the task pool, where RL stands."""
        t = self.trainer
        resumed = self._resumed_buffer()
        return {"model_config": dataclasses.asdict(t.model_cfg), "tokenizer_model": str(t.tokenizer.model_path),
                "seq_length": min(t.cfg.seq_length, t.model_cfg.max_position_embeddings),
                "iteration": t.state.iteration, "train_iters": t.cfg.train_iters, "tasks": len(t.env.pool),
                "seed": t.cfg.seed, "buffer": resumed}

    def _resumed_buffer(self) -> Optional[bytes]:
        """The reconciler state of the checkpoint this run resumed (None: a fresh RL run)."""
        load = self.trainer.cfg.checkpoint.load
        if not load or self.trainer.state.iteration == 0:
            return None
        from ...checkpoint import read_extra_file

        return read_extra_file(load, self.BUFFER_FILE)

    def publish(self, *, full: bool = False) -> Optional[int]:
        """Gather this iteration's whole weights onto rank 0 in the wire dtype and queue them for encoding:
        their version on rank 0 (`published` returns its update once encoded), None on the other ranks.
        A collective: every rank calls it (`train_step` and `setup` do)."""
        to_host = self.publisher.publisher.copy_tensor if self.publisher is not None else None
        state = gather_policy(self.trainer.model, to_host)
        if self.publisher is None:
            return None
        version = self.trainer.state.iteration
        self.publisher.enqueue(state, version, full=full)
        return version

    def published(self, version: int) -> Optional[WeightUpdate]:
        """The update of weights `version` (rank 0), waiting while it is encoded; None on the other ranks.
        Runs in the actor's "publish" concurrency group, beside the next `train_step`."""
        return None if self.publisher is None else self.publisher.result(version)

    def snapshot(self) -> Optional[WeightUpdate]:
        """A full update of the last published weights (for a worker that starts or restarted; `setup`
        published the resumed ones). Rank 0 alone: no collective, so it runs beside a `train_step`."""
        return None if self.publisher is None else self.publisher.snapshot()

    def train_step(self, groups: list[Group]) -> tuple[dict, Optional[int]]:
        """One policy update on one step's groups: (metrics, the version `published` returns on rank 0,
        else None). The step waits for the gather and copy of the weights, not for their encoding; the
        metrics carry the sizes and time of the newest update encoded by then ("sync version")."""
        waited = time.perf_counter() - self.idle_since
        samples = renumber(groups, self.rl.rollout.group_size)  # the step's groups 0 .. prompts_per_step - 1
        metrics = self.trainer.train_on(samples)
        metrics["trainer wait seconds"] = waited
        metrics["trained groups"] = [g.group_id for g in groups]
        started = time.perf_counter()
        version = self.publish()
        if version is not None:
            metrics["publish seconds"] = time.perf_counter() - started
            last = self.publisher.last
            if last is not None:
                metrics.update({"sync bytes": float(last.sent_bytes), "sync full bytes": float(last.raw_bytes),
                                "sync seconds": last.seconds, "sync version": float(last.version)})
        self.idle_since = time.perf_counter()
        return metrics, version

    def save(self, buffer: bytes) -> str:
        """A checkpoint of this iteration with the reconciler's state inside (collective over ranks)."""
        self.trainer.trainer.extra_files[self.BUFFER_FILE] = buffer
        self.trainer.checkpoints.save()
        from ...checkpoint import iteration_dir

        return iteration_dir(self.trainer.cfg.checkpoint.save, self.trainer.state.iteration)

    def prepare_save_dir(self) -> None:
        if self.trainer.cfg.checkpoint.save:
            self.trainer.checkpoints.prepare_save_dir()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.log.close()


def build_engine(model_config: dict, *, max_model_len: int, max_batch_size: int, tokenizer=None):
    """An engine on a freshly built model of `model_config` (its weights come from a snapshot)."""
    from ...convert.config import model_config_from_dict
    from ...inference.engine import Engine
    from ...models import build_model
    from ...parallel.layout import ParallelLayout, initialize_parallel
    from ...platform import init_distributed

    cfg = model_config_from_dict(model_config)
    init_distributed()
    layout = ParallelLayout(world_size=1)
    initialize_parallel(layout, seed=0)
    model = build_model(cfg, layout, torch.float32, seq_length=max_model_len)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return Engine(model, cfg, tokenizer, max_batch_size=max_batch_size, max_model_len=max_model_len)


class InferenceWorker:
    """Our engine behind `generate`, taking published weights in flight (module docstring)."""

    def __init__(self, model_config: dict, tokenizer_model: str, *, max_model_len: int, max_batch_size: int = 64,
                 threads: int = 1):
        _threads(threads)
        from ...data.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(tokenizer_model)
        self.engine = build_engine(model_config, max_model_len=max_model_len, max_batch_size=max_batch_size,
                                   tokenizer=self.tokenizer)
        self.subscriber = WeightSubscriber()
        self.started = time.perf_counter()
        self.engine.start()

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> Optional[int]:
        return self.subscriber.version

    def update_weights(self, update: WeightUpdate) -> bool:
        """Apply a published update between two decode steps; False when it does not follow this worker's
        version (the runner then sends a snapshot)."""
        if self.subscriber.version is not None and update.version <= self.subscriber.version:
            return True  # already have it (a snapshot overtook it)
        try:
            state = self.subscriber.apply(update)
        except ValueError:
            return False
        self.engine.update_weights(state, version=update.version)
        return True

    def generate(self, prompts: list, params) -> list:
        if self.subscriber.version is None:
            raise RuntimeError("this inference worker has no weights yet (it started or restarted); the "
                               "runner sends a snapshot before it serves again")
        return self.engine.generate(prompts, params)

    def stats(self) -> dict:
        wall = time.perf_counter() - self.started
        return {"busy seconds": self.engine.busy_seconds, "wall seconds": wall,
                "generated tokens": self.engine.generated_tokens}

    def reset_stats(self) -> None:
        self.engine.busy_seconds, self.engine.generated_tokens = 0.0, 0
        self.started = time.perf_counter()


class RayBackend(RolloutBackend):
    """A `RolloutBackend` over an inference worker's Ray handle (the environments call `generate`)."""

    name = "ray"
    capabilities = BackendCapabilities(routed_experts=True, policy_versions=True)

    def __init__(self, handle, timeout_s: Optional[float] = None,
                 capabilities: Optional[BackendCapabilities] = None):
        self.handle, self.timeout_s = handle, timeout_s
        if capabilities is not None:  # a vLLM worker's (`vllm_service.CAPABILITIES`)
            self.capabilities = capabilities

    def generate(self, prompts, params):
        import ray

        return ray.get(self.handle.generate.remote(prompts, params), timeout=self.timeout_s)

    def update_weights(self, source, version=None):
        import ray

        return ray.get(self.handle.update_weights.remote(source))


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What an environment worker needs to run a group (picklable; from train_rl.py's flags)."""

    rl: object  # RLConfig
    tokenizer_model: str
    seq_length: int
    seed: int
    tasks: int
    split: str = "train"
    long_tail: Optional[float] = None  # single-turn benchmark: Pareto shape of per-sample lengths, no stop
    server_url: Optional[str] = None  # an external OpenAI-compatible server instead of our inference workers


class EnvWorker:
    """Runs whole groups of the `--env` environment against a rollout backend (module docstring)."""

    def __init__(self, spec: RolloutSpec, backend=None, threads: int = 1):
        """`backend`: a `RolloutBackend` (an inference worker's `RayBackend`); None: HTTP to spec.server_url."""
        _threads(threads)
        from ...data.tokenizer import Tokenizer
        from ..environments import build_environment
        from ..feedback import build_rules
        from ..rewards import import_reward_terms

        import_reward_terms(spec.rl.reward.modules)  # terms registered by user code, in this process too
        if backend is None:
            from ..backends import HTTPBackend

            backend = HTTPBackend(spec.server_url, max_concurrency=max(8, 4 * spec.rl.rollout.group_size))
        if isinstance(backend, RolloutBackend):
            check_backend(backend, router_replay=spec.rl.algorithm.router_replay)
        self.spec, self.backend, self.rl = spec, backend, spec.rl
        self.tokenizer = Tokenizer(spec.tokenizer_model)
        self.env = build_environment(self.rl, self.tokenizer, spec.seq_length, split=spec.split,
                                     long_tail=spec.long_tail)
        self.env.set_feedback_rules(build_rules(self.rl, client=backend, tokenizer=self.tokenizer))
        if len(self.env.pool) != spec.tasks:
            raise RuntimeError(f"internal: this environment worker sees {len(self.env.pool)} tasks, the trainer "
                               f"{spec.tasks}")

    def pid(self) -> int:
        return os.getpid()

    def run_group(self, group_id: int, launched_version: int) -> Group:
        samples = self.env.run_group(self.backend, group_id, self.env.seeds(self.spec.seed, group_id))
        return Group(group_id, samples, launched_version)


class Evaluator(InferenceWorker):
    """Held-out greedy episodes on its own engine; `evaluate()` scores the weights it has now."""

    def __init__(self, spec: RolloutSpec, model_config: dict, *, count: int, threads: int = 1):
        super().__init__(model_config, spec.tokenizer_model, max_model_len=spec.seq_length,
                         max_batch_size=max(1, spec.rl.environment.episode_workers), threads=threads)
        from ..backends import EngineBackend
        from ..environments import build_environment

        self.env = build_environment(spec.rl, self.tokenizer, spec.seq_length, split="eval", count=count)
        self.backend = EngineBackend(self.engine)
        self.workers = spec.rl.environment.episode_workers

    def evaluate(self) -> Optional[dict]:
        """Greedy episodes of the held-out tasks on the weights this evaluator has now."""
        if self.subscriber.version is None:
            raise RuntimeError("the evaluator has no weights yet (it started or restarted)")
        version = self.subscriber.version
        result = self.env.evaluate(self.backend, workers=self.workers)
        return None if result is None else dict(result, iteration=version)


class ServerSync:
    """Weight sync to an external server of ours (`python -m megatron_composer.inference.server`).

    The server takes the published updates themselves (binary, POST /v1/weights) and rebuilds each
    version bit-exact, as an inference worker does, so that it serves exactly the published bf16
    weights; a delta that does not follow its version is refused, and the runner then sends a
    snapshot. vLLM and SGLang load weights from a checkpoint in their own format instead; they are
    refused here with that said (vLLM servers are driven by `vllm_service` workers instead).
    """

    def __init__(self, url: str):
        from ...inference.client import HTTPRolloutClient

        self.client = HTTPRolloutClient(url)
        if self.client.flavor != "megatron-composer":
            raise ValueError(f"--rollout-server {url} is a {self.client.flavor} server, which loads weights "
                             f"from a checkpoint in its own format; in-flight pushes of each step's weights go "
                             f"to our server (python -m megatron_composer.inference.server --load ...), or to "
                             f"vLLM servers through --rollout-backend vllm --vllm-url URL[,URL...]")
        self._version: Optional[int] = None

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> Optional[int]:
        return self._version

    def update_weights(self, update: WeightUpdate) -> bool:
        if self._version is not None and update.version <= self._version:
            return True
        try:
            self._version = self.client.update_weights(update)
        except StaleBaseError:
            return False
        return True
