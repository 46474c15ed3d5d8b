"""The four RL services as plain classes; `runner.py` makes each a Ray actor.

    TrainerWorker     one per rank: builds `RLTrainer` from train_rl.py's flags inside its own
                      torch.distributed group (gloo on CPU, NCCL on GPU), takes one policy update per
                      batch of groups, publishes the new weights (rank 0, `weight_sync`), saves
                      policy-aware checkpoints (the reconciler's buffer rides in the checkpoint).
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
import math
import os
import time
from typing import Optional, Sequence

import torch

from .reconciler import Group
from ...inference.weight_sync import StaleBaseError, WeightPublisher, WeightSubscriber, WeightUpdate

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _threads(n: int) -> None:
    """Each service gets its share of the machine's cores (one torch pool per process)."""
    torch.set_num_threads(max(1, n))


class TrainerWorker:
    """One training rank (module docstring). `argv`: train_rl.py's flags."""

    BUFFER_FILE = "rl_buffer.pt"

    def __init__(self, argv: Sequence[str], rank: int, world_size: int, *, threads: int = 1,
                 weight_dtype: str = "bf16"):
        self.argv, self.rank, self.world_size, self.threads = list(argv), rank, world_size, threads
        self.publisher = WeightPublisher(_DTYPES[weight_dtype]) if rank == 0 else None

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
        """Join the trainer's process group (every rank at once) and build and resume the trainer."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.rank),
                          LOCAL_WORLD_SIZE=str(self.world_size), MASTER_ADDR=master_addr,
                          MASTER_PORT=str(master_port))
        _threads(self.threads)
        from ..train import build_rl_trainer

        self.args, self.rl, self.trainer, self.log = build_rl_trainer(self.argv)
        self.trainer.resume()
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
                "iteration": t.state.iteration, "train_iters": t.cfg.train_iters, "tasks": len(t.prompts),
                "seed": t.cfg.seed, "buffer": resumed}

    def _resumed_buffer(self) -> Optional[bytes]:
        """The reconciler state of the checkpoint this run resumed (None: a fresh RL run)."""
        load = self.trainer.cfg.checkpoint.load
        if not load or self.trainer.state.iteration == 0:
            return None
        from ...checkpoint import read_extra_file

        return read_extra_file(load, self.BUFFER_FILE)

    def publish(self, *, full: bool = False) -> Optional[WeightUpdate]:
        """This step's weights for the inference workers (rank 0; the others return None)."""
        if self.publisher is None:
            return None
        from ...checkpoint import model_state_dict

        state = model_state_dict(self.trainer.model)
        return self.publisher.publish(state, self.trainer.state.iteration, full=full)

    def snapshot(self) -> Optional[WeightUpdate]:
        """A full update of the last published weights (for a worker that starts or restarted)."""
        if self.publisher is None:
            return None
        return self.publisher.snapshot() if self.publisher.version is not None else self.publish(full=True)

    def train_step(self, groups: list[Group]) -> tuple[dict, Optional[WeightUpdate]]:
        """One policy update on one step's groups; (metrics, the new weights' update on rank 0)."""
        waited = time.perf_counter() - self.idle_since
        samples = renumber(groups, self.rl.group_size)
        metrics = self.trainer.train_on(samples)
        metrics["trainer wait seconds"] = waited
        metrics["trained groups"] = [g.group_id for g in groups]
        update = self.publish()
        if update is not None:
            metrics.update({"sync bytes": float(update.sent_bytes), "sync full bytes": float(update.raw_bytes),
                            "sync seconds": update.seconds})
        self.idle_since = time.perf_counter()
        return metrics, update

    def save(self, buffer: bytes) -> str:
        """A checkpoint of this iteration with the reconciler's state inside (collective over ranks)."""
        self.trainer.checkpoint_files[self.BUFFER_FILE] = buffer
        self.trainer.checkpoints.save()
        from ...checkpoint import iteration_dir

        return iteration_dir(self.trainer.cfg.checkpoint.save, self.trainer.state.iteration)

    def prepare_save_dir(self) -> None:
        if self.trainer.cfg.checkpoint.save:
            self.trainer.checkpoints.prepare_save_dir()

    def close(self) -> None:
        self.log.close()


def renumber(groups: Sequence[Group], group_size: int) -> list:
    """The samples of `groups` as one step's: group k of the step is groups[k], trajectories k * G + i."""
    samples = []
    for k, g in enumerate(groups):
        first = {}
        for s in g.samples:
            first.setdefault(s.trajectory, len(first))
        for s in g.samples:
            samples.append(dataclasses.replace(s, group=k, trajectory=k * group_size + first[s.trajectory]))
    return samples


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


class RemoteClient:
    """A `RolloutClient` over an inference worker's Ray handle (the agent calls `generate`)."""

    def __init__(self, handle, timeout_s: Optional[float] = None):
        self.handle, self.timeout_s = handle, timeout_s

    def generate(self, prompts, params):
        import ray

        return ray.get(self.handle.generate.remote(prompts, params), timeout=self.timeout_s)


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
    """Runs whole groups against an inference client (module docstring)."""

    def __init__(self, spec: RolloutSpec, client=None, threads: int = 1):
        """`client`: a `RolloutClient` (an inference worker's `RemoteClient`); None: HTTP to spec.server_url."""
        _threads(threads)
        from ...data.tokenizer import Tokenizer

        if client is None:
            from ...inference.client import HTTPRolloutClient

            client = HTTPRolloutClient(spec.server_url, max_concurrency=max(8, 4 * spec.rl.group_size))
        self.spec, self.client, self.rl = spec, client, spec.rl
        self.tokenizer = Tokenizer(spec.tokenizer_model)
        if self.rl.env == "agentic-coding":
            from ..agent import Agent
            from ..agentic import AgenticCodingEnv
            from ..trainer import agent_config, fitting_tasks

            self.sandbox_kwargs = {"timeout_s": self.rl.sandbox_timeout_s}
            self.env = AgenticCodingEnv(self.rl.families, split=spec.split, sandbox_kwargs=self.sandbox_kwargs)
            self.agent = Agent(client, self.tokenizer, agent_config(self.rl, spec.seq_length,
                                                                    routed_experts=self.rl.router_replay))
            self.pool = fitting_tasks(self.rl, self.env, self.agent, spec.seq_length)
            from ..feedback import build_rules

            self.feedback_rules = build_rules(self.rl, client=client, tokenizer=self.tokenizer)
        else:
            from ..tasks import get_task
            from ..trainer import fitting_prompts

            self.task = get_task(self.rl.task)
            self.pool = fitting_prompts(self.rl, self.task, self.tokenizer, spec.seq_length)
        if len(self.pool) != spec.tasks:
            raise RuntimeError(f"internal: this environment worker sees {len(self.pool)} tasks, the trainer "
                               f"{spec.tasks}")

    def pid(self) -> int:
        return os.getpid()

    def seed(self, group_id: int, index: int) -> int:
        return (self.spec.seed * 1_000_003 + group_id * self.rl.group_size + index) % (2 ** 63)

    def run_group(self, group_id: int, launched_version: int) -> Group:
        rl = self.rl
        task = self.pool[group_id % len(self.pool)]
        seeds = [self.seed(group_id, i) for i in range(rl.group_size)]
        if rl.env == "agentic-coding":
            from ..trainer import episode_samples

            results = self.env.episodes(self.agent, [(task, s) for s in seeds], max_workers=rl.episode_workers)
            samples = episode_samples(results, [group_id] * rl.group_size, rl.group_size, self.tokenizer,
                                      self.feedback_rules, rl.feedback_hint_role)
        else:
            samples = self._single_turn(group_id, task, seeds)
        return Group(group_id, samples, launched_version)

    def _single_turn(self, group_id: int, task, seeds: list[int]) -> list:
        import concurrent.futures

        from ...inference import SamplingParams
        from ..trainer import completion_sample

        rl, tok = self.rl, self.tokenizer
        prompt, ids = task
        lengths = [rl.max_new_tokens] * len(seeds)
        stop = (tok.chat["end"], tok.eod)
        if self.spec.long_tail:  # a long-tailed length per sample (benchmark): Pareto, median ~ max / 8
            import random

            rng = random.Random(seeds[0])
            lengths = [max(1, min(rl.max_new_tokens, math.ceil(rl.max_new_tokens / 8 * rng.paretovariate(
                self.spec.long_tail)))) for _ in seeds]
            stop = ()
        params = [SamplingParams(max_tokens=n, temperature=rl.temperature, top_p=rl.top_p, seed=s,
                                 stop_token_ids=stop, logprobs=True, return_routed_experts=rl.router_replay)
                  for n, s in zip(lengths, seeds)]
        with concurrent.futures.ThreadPoolExecutor(len(params)) as pool:  # one batch in the engine
            outs = list(pool.map(lambda p: self.client.generate([ids], p)[0], params))
        return [completion_sample(group_id, i, out, tok, self.task, prompt) for i, out in enumerate(outs)]


class Evaluator(InferenceWorker):
    """Held-out greedy episodes on its own engine; `evaluate(update)` scores the given weights."""

    def __init__(self, spec: RolloutSpec, model_config: dict, *, count: int, threads: int = 1):
        super().__init__(model_config, spec.tokenizer_model, max_model_len=spec.seq_length,
                         max_batch_size=max(1, spec.rl.episode_workers), threads=threads)
        from ..agent import Agent
        from ..agentic import AgenticCodingEnv
        from ..trainer import agent_config

        rl = spec.rl
        self.env = AgenticCodingEnv(rl.families, split="eval", count=count,
                                    sandbox_kwargs={"timeout_s": rl.sandbox_timeout_s})
        self.agent = Agent(self.engine, self.tokenizer, agent_config(rl, spec.seq_length, routed_experts=False,
                                                                     temperature=0.0))
        self.workers = rl.episode_workers

    def evaluate(self) -> dict:
        """Greedy episodes of the held-out tasks on the weights this evaluator has now."""
        if self.subscriber.version is None:
            raise RuntimeError("the evaluator has no weights yet (it started or restarted)")
        version = self.subscriber.version
        tasks = self.env.tasks()
        results = self.env.episodes(self.agent, [(t, i) for i, t in enumerate(tasks)], max_workers=self.workers)
        n = max(1, len(results))
        return {"iteration": version, "eval solved": sum(r.verdict["all_pass"] for r in results) / n,
                "eval correctness": sum(r.verdict["correctness"] for r in results) / n,
                "eval turns": sum(r.trajectory.counts.turns for r in results) / n, "eval tasks": float(len(results))}


class ServerSync:
    """Weight sync to an external server of ours (`python -m megatron_composer.inference.server`).

    The server takes the published updates themselves (binary, POST /v1/weights) and rebuilds each
    version bit-exact, as an inference worker does, so that it serves exactly the published bf16
    weights; a delta that does not follow its version is refused, and the runner then sends a
    snapshot. vLLM and SGLang load weights from a checkpoint in their own format instead; they are
    refused here with that said.
    """

    def __init__(self, url: str):
        from ...inference.client import HTTPRolloutClient

        self.client = HTTPRolloutClient(url)
        if self.client.flavor != "megatron-composer":
            raise ValueError(f"--rollout-server {url} is a {self.client.flavor} server, which loads weights "
                             f"from a checkpoint in its own format; in-flight pushes of each step's weights go "
                             f"to our server (python -m megatron_composer.inference.server --load ...)")
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
