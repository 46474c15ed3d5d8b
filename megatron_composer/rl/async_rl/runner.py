"""Asynchronous RL: the services of `services.py` as Ray actors, driven by the reconciler.

    python train_rl.py --async-rl ...                 a Ray instance of this job on this machine
    python train_rl.py --ray-address auto ...         an existing cluster (`ray start --head` / Slurm)

Before any worker starts, `placement.plan_placement` checks that the cluster
has one GPU per trainer rank, inference worker and evaluator (or none at all:
then everything runs on CPU) and raises naming both numbers when it has not;
each role then gets a placement group of its own (`placement.py`).

The driver's loop (`AsyncRLRunner.run`):

1. launch: the reconciler fills its free slots; each group goes to an
   environment worker, whose agent talks to one inference worker;
2. collect: a finished group enters the ready buffer; a failed one (its
   worker died, Ray restarts the worker) or one past `--group-timeout-s` (its
   worker is killed and restarted) is launched again; only in-flight samples
   are lost;
3. train: when the trainer is idle and `--prompts-per-step` fresh groups are
   ready (those past `--max-policy-lag` are dropped and resampled), every
   trainer rank takes the batch from the object store and steps; rollouts go
   on meanwhile;
4. sync: every trainer rank joins the gather of the new weights onto rank 0
   (`gather.gather_policy`: the experts of every EP rank, the whole tensors of
   HSDP shards), which encodes them as a delta (`weight_sync.BackgroundPublisher`)
   on a thread while its next step runs; each inference worker and the
   evaluator swap them in between decode steps, so sequences in flight
   continue and later tokens carry the new version; a subscriber that cannot
   apply a delta (it restarted) gets a full snapshot. With
   `--synchronous-rollouts` the driver waits until every inference worker has
   the new weights before it launches the next step's groups, so every token
   is sampled by the newest policy;
5. checkpoint every `--save-interval` steps with the reconciler's state inside
   (ready groups with their versions, ids owed), so a kill -9 of the whole job
   and a restart with `--load` loses or repeats no group; evaluate every
   `--eval-interval` steps on the evaluator (greedy, held-out tasks).

A dead trainer rank ends the job (its process group spans every rank): the
driver notices it at the first failed trainer call (every rank's `train_step`
is watched, not only rank 0's: a rank whose peer died may hang in a
collective), asks every rank which of them is gone, kills every actor, shuts
down the Ray instance it started and raises `failures.TrainerDied`, which
train_rl.py prints as one line with the last complete checkpoint and the
command that resumes from it. Metrics per step go to stdout, TensorBoard /
wandb (rl/...), and `report.StepReport` in `--save` (rl_steps.jsonl, reward_curve.png, async_rl.png).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Callable, Optional

from ...planner.inference import check_local_inference_worker
from ..environments import environment_class
from ..report import StepReport
from ..rollout import due
from .failures import TrainerDied, death_reason
from .gather import check_publishable
from .placement import ServiceLayout, actor_options, plan_placement, release, reserve
from .reconciler import Reconciler, decode_state, encode_state, token_lags
from .services import EnvWorker, Evaluator, InferenceWorker, RayBackend, RolloutSpec, ServerSync, TrainerWorker
from .vllm_service import CAPABILITIES as VLLM_CAPABILITIES, check_servers, close_workers, start_workers

class ServerLost(RuntimeError):
    """A vLLM server that cannot serve any more (past --vllm-restarts, or a --vllm-url one that stopped)."""


SERVICES_FILE = "async_rl_services.json"  # which process is which service (pids, for operators and tests)
PUBLISH = "publish"  # the trainer actors' concurrency group of `published` and `snapshot`


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("--async-rl needs Ray: pip install -e '.[rl]' (or `make demo`, which installs it)") \
            from None
    return ray


# A local instance's raylet shares the machine with the job: on a few busy cores (a CPU vLLM server, the
# trainer's intra-op threads) it can miss Ray's default health checks (5 failures of 10 s) and be declared
# dead, which kills every actor of a healthy job. Its death is seen by the driver anyway (the actors
# die with it), so the local instance waits minutes instead of seconds.
LOCAL_RAY_SYSTEM_CONFIG = {"health_check_timeout_ms": 30_000, "health_check_period_ms": 5_000,
                           "health_check_failure_threshold": 20}


def start_local_ray(ray, num_cpus: int, log_to_driver: bool = True, **options):
    """A new Ray instance of this job on this machine ("local": even where `ray start` left a cluster
    running, which ray.init() without an address would join), with patient health checks."""
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
             _system_config=dict(LOCAL_RAY_SYSTEM_CONFIG), **options)


class AsyncRLRunner:
    """The driver (module docstring). `on_step(runner, metrics)`: called after each step (tests inject faults)."""

    def __init__(self, run, *, on_step: Optional[Callable] = None):
        """`run`: the parsed `rl.arguments.RLRunConfig` (or train_rl.py's argv, parsed here)."""
        ray = self.ray = _ray()
        if isinstance(run, (list, tuple)):
            from ..arguments import parse_rl_args

            run = parse_rl_args(list(run))
        # before Ray starts: the inference workers need whole weights, which the trainer ranks gather
        check_publishable(run.parallel.tensor_model_parallel_size, run.parallel.pipeline_model_parallel_size,
                          run.parallel.expert_tensor_parallel_size)
        self.run_config, self.cfg, self.rl = run, run.training, run.rl
        args, rl = run.async_rl, self.rl  # args: the asynchronous services section
        self.on_step = on_step
        if not ray.is_initialized():
            if args.ray_address:
                ray.init(address=args.ray_address, log_to_driver=True)
            else:
                start_local_ray(ray, num_cpus=max(4, os.cpu_count() or 1), log_to_driver=True)
        cores = os.cpu_count() or 1
        world = args.trainer_ranks
        evaluated = bool(rl.rollout.eval_tasks and environment_class(rl.environment.name).held_out)
        # one GPU per trainer rank, inference worker and evaluator, or an error naming the numbers,
        # before any worker starts
        placement = plan_placement(ServiceLayout.of(args, evaluator=evaluated), ray.cluster_resources(),
                                   ray.available_resources())
        self.groups = reserve(ray, placement)
        # `published` and `snapshot` run in their own thread while the next train_step runs
        trainer_cls = ray.remote(num_cpus=0, concurrency_groups={PUBLISH: 1})(TrainerWorker)
        # torch threads: the inference workers keep one core each; more threads than cores make every
        # service crawl (intra-op pools spin)
        threads = max(1, (cores - args.inference_workers) // world)
        self.trainers = [trainer_cls.options(**actor_options(self.groups, "trainer", r)).remote(
            run, r, world, threads=threads, weight_dtype=args.weight_sync_dtype) for r in range(world)]
        self.version, self.train_iters, self.save_dir = 0, run.training.train_iters, self.cfg.checkpoint.save
        with self.watching_trainers():
            master, port = ray.get(self.trainers[0].address.remote())
            ray.get([t.setup.remote(master, port) for t in self.trainers])
            info = ray.get(self.trainers[0].describe.remote())
        self.version, self.train_iters = info["iteration"], info["train_iters"]
        spec = RolloutSpec(rl, info["tokenizer_model"], info["seq_length"], info["seed"], info["tasks"],
                           long_tail=args.rollout_long_tail, server_url=args.rollout_server)
        self.vllm = rl.rollout.backend == "vllm"
        if placement.gpus and args.inference_workers and not args.rollout_server and not self.vllm:
            # a whole model per GPU: refuse one that cannot fit, on the first inference worker's GPU
            ray.get(ray.remote(**actor_options(self.groups, "inference", 0))(check_local_inference_worker).remote(
                info["model_config"], info["seq_length"], rl.rollout.rollout_batch_size))
        restart = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
        infer_cls = ray.remote(**restart)(InferenceWorker)
        if args.rollout_server:  # an external server of ours; the driver pushes its weights
            self.inference = [ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(ServerSync).options(
                max_concurrency=1).remote(args.rollout_server)]
        elif self.vllm:  # each worker drives a vLLM server: its own, or one per --vllm-url
            self.inference = start_workers(ray, rl, args.inference_workers, info,
                                           lambda i: actor_options(self.groups, "inference", i))
        else:
            self.inference = [infer_cls.options(
                max_concurrency=4 * rl.rollout.group_size * rl.rollout.prompts_per_step + 8,
                **actor_options(self.groups, "inference", i)).remote(
                info["model_config"], info["tokenizer_model"], max_model_len=info["seq_length"],
                max_batch_size=rl.rollout.rollout_batch_size) for i in range(args.inference_workers)]
        env_cls = ray.remote(**restart)(EnvWorker)
        self.envs = [env_cls.options(max_concurrency=4 * rl.rollout.prompts_per_step + 4).remote(
            spec, None if args.rollout_server else
            RayBackend(self.inference[i % len(self.inference)], timeout_s=args.group_timeout_s,
                       capabilities=VLLM_CAPABILITIES if self.vllm else None))
            for i in range(args.env_workers)]
        self.evaluator = None
        if evaluated:
            self.evaluator = ray.remote(**restart)(Evaluator).options(**actor_options(self.groups, "evaluator", 0)).remote(
                spec, info["model_config"], count=rl.rollout.eval_tasks)
        inflight = args.max_inflight_groups or 2 * rl.rollout.prompts_per_step
        self.reconciler = Reconciler(rl.rollout.prompts_per_step, max_inflight_groups=inflight,
                                     max_policy_lag=args.max_policy_lag, synchronous=args.synchronous_rollouts)
        if info["buffer"] is not None:
            self.reconciler.load_state_dict(decode_state(info["buffer"]))
        self.log = run.logging.logger(0)
        self.expired: set = set()  # group refs whose worker was killed for running past the timeout
        self.job = f"{os.getpid()}-{int(time.time())}"  # tells this job's rows in the step log from a resumed one's
        self.report = StepReport(self.save_dir, f"async {rl.environment.name}: {rl.rollout.prompts_per_step} x {rl.rollout.group_size} per step",
                                 job=self.job)
        self.history, self.eval_history = self.report.history, self.report.eval_history
        self.log.print(f"> async RL: {world} trainer rank(s), {len(self.inference)} inference worker(s)"
                       f"{', one GPU each' if placement.gpus else ''}, "
                       f"{len(self.envs)} environment worker(s), evaluator {'on' if self.evaluator else 'off'}; "
                       f"{inflight} groups in flight, policy lag <= {args.max_policy_lag}"
                       f"{', synchronous rollouts' if args.synchronous_rollouts else ''}; "
                       + (f"resuming at step {self.version}" if self.version else "starting at step 0")
                       + (f" with {len(self.reconciler.ready)} ready groups" if info["buffer"] else ""))

    def _check_vllm_servers(self) -> None:
        """After a failed group or push: a vLLM server that cannot serve any more stops the run
        (`ServerLost`, which `_run` turns into a save and an error)."""
        failure = check_servers(self.ray, self.inference) if self.vllm else None
        if failure:
            raise ServerLost(failure)

    def _stop_for_lost_server(self, exc: "ServerLost", training, others: list, started: float) -> RuntimeError:
        """Finish the step in flight, save the weights with the completed groups not yet trained (the
        reconciler's buffer), and say where: no completed group is lost to a dead server."""
        if training is not None:
            self.pushes += self._finish_step(training, started)
        self._on_every_rank(others)
        ready = len(self.reconciler.ready)
        if not self.save_dir:
            return RuntimeError(f"{exc}, so the run stops at step {self.version}; nothing is saved (no --save): "
                                f"{ready} completed groups not yet trained are lost")
        self.save()
        where = os.path.join(self.save_dir, f"iter_{self.version:07d}")
        return RuntimeError(f"{exc}, so the run stops at step {self.version}; saved {where} with the {ready} "
                            f"completed groups not yet trained; resume with --load {self.save_dir}")

    def write_services(self) -> dict:
        """{service kind: [pid, ...]} of the actors now, also written to `--save`/async_rl_services.json."""
        ray = self.ray
        kinds = {"trainer": self.trainers, "inference": self.inference, "environment": self.envs,
                 "evaluator": [self.evaluator] if self.evaluator is not None else []}
        pids = {k: ray.get([a.pid.remote() for a in actors]) for k, actors in kinds.items()}
        if self.save_dir:
            os.makedirs(self.save_dir, exist_ok=True)
            with open(os.path.join(self.save_dir, SERVICES_FILE), "w") as f:
                json.dump(pids, f)
        return pids

    # ---- weights ---------------------------------------------------------------
    def subscribers(self) -> list:
        return self.inference + ([self.evaluator] if self.evaluator is not None else [])

    def sync_all(self, workers: Optional[list] = None) -> None:
        """A full snapshot to each of `workers` (default: the inference workers) not on the trainer's version
        (at the start, or after Ray restarted one); waits until they have it."""
        workers = self.inference if workers is None else workers
        behind = [w for w in workers if self._when_up(lambda: w.version.remote()) != self.version]
        if behind:
            snap = self._snapshot()
            for w in behind:
                if not self._when_up(lambda: w.update_weights.remote(snap)):
                    raise RuntimeError("internal: a subscriber refused a full snapshot")

    def _snapshot(self):
        """A ref to rank 0's full update of the newest weights (beside a running train_step)."""
        return self.trainers[0].snapshot.options(concurrency_group=PUBLISH).remote()

    def _when_up(self, call: Callable, timeout_s: float = 300.0):
        """ray.get(call()), retried while the actor is restarting (Ray brings it back; until then it is
        unavailable); an actor that died for good raises."""
        ray = self.ray
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(call())
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    # ---- a dead trainer rank ----------------------------------------------------------
    @contextlib.contextmanager
    def watching_trainers(self):
        """Turns a Ray error raised inside into `TrainerDied` when a trainer rank is gone (the error may be
        the death itself, or a surviving rank's failed collective, or a subscriber's lost update)."""
        ray = self.ray
        try:
            yield
        except ray.exceptions.RayError as exc:
            dead = self.dead_trainers()
            if not dead:
                raise
            raise TrainerDied(dead, step=self.version, train_iters=self.train_iters, save=self.save_dir) from exc

    def dead_trainers(self, timeout_s: float = 30.0) -> dict:
        """{rank: why} of the trainer ranks that are gone. Each rank is asked for its pid in its publish
        concurrency group, which answers beside a `train_step` hung in a collective; a rank that does not
        answer within `timeout_s` is counted alive."""
        ray = self.ray
        asked = [t.pid.options(concurrency_group=PUBLISH).remote() for t in self.trainers]
        ray.wait(asked, num_returns=len(asked), timeout=timeout_s)
        dead = {}
        for rank, ref in enumerate(asked):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as exc:
                dead[rank] = death_reason(exc)
            except ray.exceptions.GetTimeoutError:
                pass
        return dead

    def _on_every_rank(self, calls: list) -> list:
        """ray.get of one call per trainer rank, raising as soon as one fails: the others may be hung in a
        collective with it (gloo notices a dead peer, NCCL only at its timeout)."""
        left = list(calls)
        while left:
            done, left = self.ray.wait(left, num_returns=1)
            self.ray.get(done)
        return self.ray.get(calls)

    # ---- the loop ----------------------------------------------------------------
    def run(self) -> dict:
        """The loop of the module docstring until --train-iters; `TrainerDied` when a trainer rank dies."""
        with self.watching_trainers():
            return self._run()

    def _run(self) -> dict:
        ray, rec, rl = self.ray, self.reconciler, self.rl
        self._on_every_rank([t.prepare_save_dir.remote() for t in self.trainers])
        self.sync_all(self.subscribers())
        self.write_services()
        ray.get([w.reset_stats.remote() for w in self.inference if not self.run_config.async_rl.rollout_server])
        self._on_every_rank([t.start_clock.remote() for t in self.trainers])
        pending: dict = {}  # ObjectRef -> (group id, env worker, launch time)
        self.pushes: list = []  # (subscriber, ObjectRef of its update_weights)
        training = None  # (ref of rank 0's (metrics, version), token lags, launch time) of the step in flight
        others: list = []  # the other ranks' train_step refs not yet returned: a failed one is seen at once
        evals: list = []
        started = time.perf_counter()
        evaluated = None  # the version last sent for evaluation
        if self.evaluator is not None:
            evals.append(self.evaluator.evaluate.remote())
            evaluated = self.version
        try:
            while self.version < self.train_iters:
                for gid in rec.to_launch(self.version, trainer_busy=training is not None):
                    env = self.envs[gid % len(self.envs)]
                    pending[env.run_group.remote(gid, self.version)] = (gid, env, time.monotonic())
                if training is None:
                    batch = rec.take_batch(self.version)
                    if batch is not None:
                        lags = token_lags(batch, self.version)
                        batch_ref = ray.put(batch)
                        calls = [t.train_step.remote(batch_ref) for t in self.trainers]
                        training, others = (calls[0], lags, time.perf_counter()), calls[1:]
                waiting = list(pending) + ([training[0]] if training else []) + others
                done, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
                for ref in done:
                    if training is not None and ref == training[0]:
                        self.pushes += self._finish_step(training, started)
                        training = None
                    elif ref in others:
                        others.remove(ref)
                        ray.get(ref)  # raises a dead rank's error now, not when rank 0 gives up on it
                    else:
                        gid, _, _ = pending.pop(ref)
                        try:
                            rec.complete(ray.get(ref))
                        except (ray.exceptions.RayError, RuntimeError, ValueError) as exc:
                            self._check_vllm_servers()
                            self.log.print(f" group {gid} lost ({type(exc).__name__}): launched again")
                            rec.failed(gid)
                            self.sync_all()
                self._expire(pending)
                self.pushes = self._check_pushes(self.pushes)
                if self.evaluator is not None and rl.rollout.eval_interval and \
                        self.version % rl.rollout.eval_interval == 0 and evaluated != self.version:
                    evals.append(self.evaluator.evaluate.remote())  # queued behind this version's weights
                    evaluated = self.version
                evals = self._collect_evals(evals, wait=False)
        except ServerLost as exc:
            raise self._stop_for_lost_server(exc, training, others, started) from None
        for ref in pending:  # the last step's spare rollouts: not needed
            ray.cancel(ref)
        if self.evaluator is not None and evaluated != self.version:
            evals.append(self.evaluator.evaluate.remote())
        self._collect_evals(evals, wait=True)
        self.save(final=True)
        summary = self.summary(time.perf_counter() - started)
        self.plot()
        return summary

    def _finish_step(self, training, started: float) -> list:
        ray, rec = self.ray, self.reconciler
        step_ref, lags, launched = training
        metrics, version = ray.get(step_ref)
        self.version += 1
        if version != self.version:
            raise RuntimeError(f"internal: the trainer published weights version {version}, the driver expected "
                               f"{self.version}")
        # encoded on the trainer while its next step runs; each subscriber takes it when it is ready
        update_ref = self.trainers[0].published.options(concurrency_group=PUBLISH).remote(version)
        pushes = [(w, w.update_weights.remote(update_ref)) for w in self.subscribers()]
        if self.run_config.async_rl.synchronous_rollouts:  # on-policy: the next groups sample these weights
            pushes = self._await_inference(pushes)
        wall = time.perf_counter() - started
        stats = []
        for w in [] if self.run_config.async_rl.rollout_server else self.inference:
            try:
                stats.append(ray.get(w.stats.remote(), timeout=60))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # restarting: its counts start again from zero when it is back
        busy = sum(s["busy seconds"] for s in stats) / max(1e-9, sum(s["wall seconds"] for s in stats))
        generated = sum(s["generated tokens"] for s in stats)  # an external server's are its own metrics
        samples = (self.history[-1]["samples"] if self.history else 0) + self.rl.rollout.prompts_per_step * self.rl.rollout.group_size
        waited = (self.history[-1]["trainer waited"] if self.history else 0.0) + metrics["trainer wait seconds"]
        row = dict(metrics, iteration=self.version, samples=samples, wall=wall,
                   **{"samples/s": samples / wall, "generated tokens/s": generated / wall,
                      "trainer waited": waited, "trainer idle fraction": waited / wall,
                      "inference idle fraction": 1.0 - busy,
                      "staleness mean": sum(lags) / max(1, len(lags)), "staleness max": float(max(lags, default=0)),
                      "staleness": {str(k): lags.count(k) / max(1, len(lags)) for k in sorted(set(lags))},
                      "groups stale": float(rec.stats["stale"]), "groups failed": float(rec.stats["failed"])})
        self._log_step(row)
        if self.save_dir and due(self.version, self.cfg.checkpoint.save_interval, -1):
            self.save()
        if self.on_step is not None:
            self.on_step(self, row)
        return pushes

    def _log_step(self, row: dict) -> None:
        line = {k: row[k] for k in ("reward", "task all_pass", "policy loss", "staleness mean", "sync bytes",
                                    "trainer idle fraction", "samples/s", "train seconds") if k in row}
        scalars = {f"rl/{k}": v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        scalars.update({f"rl/staleness fraction lag {k}": v for k, v in row["staleness"].items()})
        self.log.log(self.version, self.train_iters, line, scalars)
        self.report.step(row)

    def _expire(self, pending: dict) -> None:
        """Groups past --group-timeout-s: their worker is killed (Ray restarts it) and they are relaunched."""
        now, limit = time.monotonic(), self.run_config.async_rl.group_timeout_s
        for ref, (gid, env, launched) in list(pending.items()):
            if now - launched > limit and ref not in self.expired:
                self.expired.add(ref)
                self.log.print(f" group {gid} ran past --group-timeout-s {limit:g}: restarting its worker")
                self.ray.kill(env, no_restart=False)  # its other groups fail and come back too

    def _check_pushes(self, pushes: list) -> list:
        ray = self.ray
        if not pushes:
            return pushes
        done, _ = ray.wait([r for _, r in pushes], num_returns=len(pushes), timeout=0)
        left, behind = [], []
        for w, r in pushes:
            if r not in done:
                left.append((w, r))
                continue
            try:
                ok = ray.get(r)
            except ray.exceptions.RayError:
                if self.dead_trainers():  # the update's source is gone: a snapshot would fail the same way
                    raise
                self._check_vllm_servers()  # a push into a dead vLLM server stops the run
                ok = False  # the subscriber died; Ray restarts it without weights
            if not ok and w not in behind:
                behind.append(w)
        if behind:  # without waiting: a busy evaluator takes its snapshot after its evaluation
            snap = self._snapshot()
            left += [(w, w.update_weights.remote(snap)) for w in behind]
        return left

    def _await_inference(self, pushes: list) -> list:
        """Wait until every inference worker has applied its push (one that refuses gets a snapshot and is
        waited for too); the evaluator's push stays pending."""
        ray = self.ray
        while True:
            inference = [r for w, r in pushes if any(w is i for i in self.inference)]
            if not inference:
                return pushes
            ray.wait(inference, num_returns=len(inference))
            pushes = self._check_pushes(pushes)

    def _collect_evals(self, evals: list, *, wait: bool) -> list:
        ray = self.ray
        if not evals:
            return evals
        done, left = ray.wait(evals, num_returns=len(evals) if wait else 1, timeout=None if wait else 0)
        for ref in done:
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self.log.print(f" an evaluation was lost ({type(exc).__name__}); the next one runs on schedule")
                snap = self._snapshot()  # Ray restarted it without weights
                self.pushes.append((self.evaluator, self.evaluator.update_weights.remote(snap)))
                continue
            if result is None:
                continue
            self.report.evaluation(result)
            self.log.print(f"> eval of weights version {result['iteration']}: solved {result['eval solved']:.3f} "
                           f"of {int(result['eval tasks'])} held-out tasks, correctness "
                           f"{result['eval correctness']:.3f}")
            self.log.scalars(result["iteration"], {f"rl/{k}": v for k, v in result.items() if k != "iteration"})
        return list(left)

    # ---- checkpoints and the report -------------------------------------------------
    def save(self, final: bool = False) -> None:
        if not self.save_dir:
            return
        if final and self.history and self.cfg.checkpoint.save_interval and \
                self.version % self.cfg.checkpoint.save_interval == 0:
            return  # this step was just saved
        buffer = encode_state(self.reconciler.state_dict())
        self._on_every_rank([t.save.remote(buffer) for t in self.trainers])

    def summary(self, wall: float) -> dict:
        h = self.history
        out = {"steps": len(h), "wall seconds": wall, "groups": self.reconciler.stats["trained"],
               "trainer idle fraction": h[-1]["trainer idle fraction"] if h else 0.0,
               "inference idle fraction": h[-1]["inference idle fraction"] if h else 0.0,
               "reward first": h[0]["reward"] if h else 0.0, "reward last": h[-1]["reward"] if h else 0.0,
               "sync bytes": sum(r.get("sync bytes", 0.0) for r in h[1:]) / max(1, len(h) - 1),
               "sync full bytes": h[-1].get("sync full bytes", 0.0) if h else 0.0,
               "stale groups": self.reconciler.stats["stale"], "failed groups": self.reconciler.stats["failed"]}
        self.log.print("> async RL done: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in out.items()))
        return out

    def plot(self) -> Optional[str]:
        return self.report.plot()

    def shutdown(self) -> None:
        """Kill every actor (a trainer rank hung in a collective too) and free the placement groups; the
        vLLM servers the inference workers started are stopped first (they run in sessions of their own)."""
        if self.vllm:
            close_workers(self.ray, self.inference, self.log.print)
        for actor in self.trainers + self.inference + self.envs + ([self.evaluator] if self.evaluator else []):
            self.ray.kill(actor, no_restart=True)
        release(self.groups)
        self.log.close()


def run_async_rl(run) -> dict:
    """train_rl.py --async-rl: build, run, shut the actors down, and shut down the Ray instance this call
    started (from a cluster it disconnects; a Ray the caller started stays up). An error inside an actor
    (a bad flag, a missing checkpoint) is raised here as itself, not wrapped in Ray's traceback; a dead
    trainer rank raises `TrainerDied`."""
    ray = _ray()
    started_ray = not ray.is_initialized()  # here: a local instance, or a connection to --ray-address
    runner = None
    try:
        runner = AsyncRLRunner(run)
        return runner.run()
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (ValueError, FileNotFoundError, RuntimeError)):
            raise cause from None
        raise
    finally:
        try:
            if runner is not None:
                runner.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
