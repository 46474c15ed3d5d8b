"""`--async-rl --rollout-backend vllm`: an inference worker that drives a vLLM server.

    VLLMInferenceWorker(model_config, max_model_len=..., vllm=VLLMConfig(...), url=None)

The same calls as `services.InferenceWorker` (`update_weights`, `generate`,
`version`, `stats`), so the driver and the environment workers do not tell
them apart. Each worker owns one vLLM server: one it starts itself on the
first weights it is given (the driver's first snapshot), or the one at its `--vllm-url`
(one worker per URL). Every published policy version is pushed into that
server as it arrives (`VLLMBackend.update_weights`), so with
`--vllm-chunk-tokens K` the sequences in flight continue under the new weights
after their current chunk and each token carries the version that sampled it.

A server of the worker's own that dies is started again on the last pushed
weights and the failed requests are sent again (`--vllm-restarts`): no group
notices. A server past its restarts, or one given by URL that stops
answering, makes `failure()` say so; the driver then stops the run with that
message instead of relaunching groups against a dead server.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from typing import Optional

import torch

from ..backends import BackendCapabilities
from ..vllm_server import VLLMConfig

# what a worker returns to the environments: per-token versions, no routed experts (router replay is
# refused with this backend in the async loop: `check_router_replay`)
CAPABILITIES = BackendCapabilities(routed_experts=False, policy_versions=True)


def vllm_urls(cfg: VLLMConfig) -> list[str]:
    """The comma-separated `--vllm-url` servers (none: each worker starts its own)."""
    return [u.strip() for u in (cfg.url or "").split(",") if u.strip()]


def check_router_replay(router_replay: bool, num_moe_layers: int) -> None:
    if router_replay and num_moe_layers:
        raise ValueError("--async-rl --rollout-backend vllm does not return routed experts to the trainer "
                         "(router replay); pass --no-router-replay (the trainer's routers route every token), "
                         "or sample with our engine (--rollout-backend engine)")


class VLLMInferenceWorker:
    """One vLLM server behind the inference worker's calls (module docstring)."""

    def __init__(self, model_config: dict, *, max_model_len: int, vllm: VLLMConfig, url: Optional[str] = None,
                 threads: int = 1):
        from ...convert.config import model_config_from_dict
        from ...inference.weight_sync import WeightSubscriber

        torch.set_num_threads(max(1, threads))
        self.model_cfg = model_config_from_dict(model_config)
        self.cfg = dataclasses.replace(vllm, url=url)
        self.max_model_len = self.cfg.max_model_len or max_model_len
        self.dtype = getattr(torch, self.cfg.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"))
        self.subscriber = WeightSubscriber()
        self.backend = None
        self.workdir: Optional[str] = None
        self.fatal: Optional[str] = None
        self._lock = threading.Lock()  # the stats below, from concurrent generate calls
        self._active, self._busy_since, self.busy_seconds, self.generated_tokens = 0, 0.0, 0.0, 0
        self.started = time.perf_counter()

    def pid(self) -> int:
        return os.getpid()

    def url(self) -> Optional[str]:
        return None if self.backend is None else self.backend.url

    def server_pid(self) -> Optional[int]:
        """The pid of the server this worker started (None for one given by URL)."""
        server = None if self.backend is None else self.backend.server
        return None if server is None else server.pid

    def version(self) -> Optional[int]:
        return None if self.backend is None else self.backend.version

    def update_weights(self, update) -> bool:
        """Push a published update into the server (starting the server on the first one); False when a
        delta does not follow this worker's version (the driver then sends a snapshot)."""
        if self.version() is not None and update.version <= self.version():
            return True  # already pushed (a snapshot overtook it)
        try:
            state = self.subscriber.apply(update)
        except ValueError:
            return False
        try:
            if self.backend is None:
                self._start(state, update.version)
            else:
                self.backend.update_weights(state, update.version)
        except Exception as error:  # noqa: BLE001 - the server is gone (or never came up): the run stops
            self.fatal = f"pushing weights version {update.version}: {type(error).__name__}: {error}"
            raise
        return True

    def _start(self, state: dict, version: int) -> None:
        from ..vllm_backend import VLLMBackend

        if self.cfg.url:
            self.backend = VLLMBackend.connect(self.model_cfg, self.cfg, dtype=self.dtype)
            self.backend.update_weights(state, version)
            return
        self.workdir = tempfile.mkdtemp(prefix="vllm-rollouts-")
        try:
            self.backend = VLLMBackend.launch(self.model_cfg, state, self.cfg, self.workdir,
                                              max_model_len=self.max_model_len, dtype=self.dtype, version=version)
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def generate(self, prompts: list, params) -> list:
        if self.backend is None:
            raise RuntimeError("this inference worker has no vLLM server yet (it started or restarted); the "
                               "runner sends a snapshot before it serves again")
        self._enter()
        try:
            out = self.backend.generate(prompts, params)
        except RuntimeError as error:  # the backend restarts a server of ours itself; this one is gone
            self.fatal = str(error)
            raise
        finally:
            self._leave()
        with self._lock:
            self.generated_tokens += sum(len(c.token_ids) for c in out)
        return out

    def failure(self) -> Optional[str]:
        """Why this worker's server cannot serve any more (None while it can)."""
        return self.fatal

    def _enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = time.perf_counter()
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self.busy_seconds += time.perf_counter() - self._busy_since

    def stats(self) -> dict:
        with self._lock:
            busy = self.busy_seconds + (time.perf_counter() - self._busy_since if self._active else 0.0)
            return {"busy seconds": busy, "wall seconds": time.perf_counter() - self.started,
                    "generated tokens": self.generated_tokens}

    def reset_stats(self) -> None:
        with self._lock:
            self.busy_seconds, self.generated_tokens = 0.0, 0
            self._busy_since = self.started = time.perf_counter()

    def close(self) -> None:
        """Stop the server this worker started (the driver calls it before killing the actor)."""
        if self.backend is not None:
            self.backend.close()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


# ---- the driver's side (`runner.AsyncRLRunner`) ----------------------------------------------
def start_workers(ray, rl, inference_workers: int, info: dict, options) -> list:
    """One `VLLMInferenceWorker` actor per --vllm-url, else `inference_workers` of them; each starts its
    server on the first snapshot the driver sends (`sync_all`, also after Ray restarted it); `options(i)`:
    worker i's placement."""
    from ...convert.config import model_config_from_dict

    check_router_replay(rl.algorithm.router_replay, model_config_from_dict(info["model_config"]).num_moe_layers)
    urls = vllm_urls(rl.vllm) or [None] * inference_workers
    worker = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(VLLMInferenceWorker)
    threads = max(1, (os.cpu_count() or 1) // (2 * len(urls)))
    return [worker.options(max_concurrency=4 * rl.rollout.group_size * rl.rollout.prompts_per_step + 8,
                           **options(i)).remote(info["model_config"], max_model_len=info["seq_length"],
                                                vllm=rl.vllm, url=url, threads=threads)
            for i, url in enumerate(urls)]


def check_servers(ray, workers: list) -> Optional[str]:
    """What the first worker whose server cannot serve any more (past --vllm-restarts, or a --vllm-url one
    that stopped answering) says, or None; a worker Ray is restarting counts as serving."""
    for i, w in enumerate(workers):
        try:
            failure = ray.get(w.failure.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue
        if failure:
            return f"inference worker {i} lost its vLLM server ({failure})"
    return None


def close_workers(ray, workers: list, log=print) -> None:
    """Stop the servers the workers started (in sessions of their own, they outlive a killed actor)."""
    try:
        ray.get([w.close.remote() for w in workers], timeout=120)
    except ray.exceptions.RayError as exc:
        log(f" stopping the vLLM servers: {type(exc).__name__}; a worker that died left its server running: "
            "its pid is in the worker's log (vllm-server.log, the 'vllm-rollouts-' directory)")
