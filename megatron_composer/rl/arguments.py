"""Command line of `train_rl.py`: `pretrain_cpt.py`'s flags (Megatron-LM names) plus the RL groups.

`parse_rl_args(argv)` is the only place the argparse Namespace exists: it
returns an `RLRunConfig` of typed, picklable sections (training, RL, model
source, parallel sizes, logging, the asynchronous services), which the
drivers and the Ray actors take as it is.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import TrainingConfig
from ..training.arguments import LoggingConfig, ModelSource, ParallelSizes, build_parser, parse_args
from .algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from .config import KL_PLACEMENTS, ROLLOUT_BACKENDS, AsyncConfig, RLConfig
from .sglang_backend import DTYPES as SGLANG_DTYPES, WEIGHT_TRANSPORTS as SGLANG_TRANSPORTS
from .vllm_server import DTYPES as VLLM_DTYPES
from .environments import ENVIRONMENTS
from .tasks import TASKS


@dataclasses.dataclass(frozen=True)
class RLRunConfig:
    """Everything `train_rl.py`'s flags say, parsed once."""

    training: TrainingConfig
    rl: RLConfig
    model: ModelSource
    parallel: ParallelSizes
    logging: LoggingConfig
    async_rl: AsyncConfig
    tokenizer_model: Optional[str]
    data_cache_dir: str
    distributed_timeout_minutes: int


class _FlatDefaults:
    """RLConfig's defaults under the flags' names (`d.group_size`, `d.feedback_rules`)."""

    def __init__(self):
        rl = RLConfig()
        for dest, (section, name) in RLConfig.flag_names().items():
            setattr(self, dest, getattr(getattr(rl, section), name))


def build_rl_parser():
    p = build_parser()
    p.prog = "train_rl.py"
    p.description = ("Composer RL on megatron-core: groups sampled by the colocated engine, Dr.GRPO, "
                     "router replay, balanced packing.")
    d = _FlatDefaults()
    g = p.add_argument_group("reinforcement learning")
    g.add_argument("--task", choices=sorted(TASKS), default=None,
                   help=f"the single-turn task (default: code-tests with --task-file, else {d.task})")
    g.add_argument("--task-file", default=d.task_file,
                   help="single-turn code tasks from a JSONL or parquet file, or a directory of shards "
                        "(rl/tasks/task_files.py); implies --task code-tests")
    g.add_argument("--task-format", choices=("jsonl", "humaneval", "mbpp"), default=d.task_format,
                   help="the records' fields: jsonl (id, prompt, tests, entry_point), humaneval, mbpp")
    g.add_argument("--eval-task-file", default=d.eval_task_file,
                   help="held-out tasks, evaluated before the first step, every --eval-interval steps and at the "
                        "end: pass@1 greedy, pass@k of --eval-pass-k samples (--eval-tasks N: the first N); "
                        "single-turn: code tasks (a file or directory in --task-format), --env agentic-coding: "
                        "SWE instances (a JSONL file in the --swe-task-file format)")
    g.add_argument("--eval-pass-k", type=int, default=d.eval_pass_k,
                   help="samples per held-out task for pass@k at --temperature (0: pass@1 only)")
    g.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt")
    g.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step, help="groups per step")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--advantage", choices=sorted(ADVANTAGE_ESTIMATORS), default=d.advantage)
    g.add_argument("--kl-coef", type=float, default=d.kl_coef, help="0: no KL, no reference model")
    g.add_argument("--kl-kind", choices=sorted(KL_ESTIMATORS), default=d.kl_kind)
    g.add_argument("--kl-placement", choices=KL_PLACEMENTS, default=d.kl_placement)
    g.add_argument("--reference-offload", action="store_true", default=d.reference_offload,
                   help="keep the reference model's weights in host memory (pinned under CUDA) and copy them "
                        "to the device only for the step's reference forwards")
    g.add_argument("--policy-loss", default=d.policy_loss,
                   help="the policy loss (rl/policy_losses.py registry): dr_grpo, ppo_clip, decoupled_ppo")
    g.add_argument("--ppo-mini-batches", type=int, default=d.ppo_mini_batches,
                   help="optimizer updates per RL step, each on prompts-per-step / N whole groups; the old "
                        "log-probs are computed once before the first")
    g.add_argument("--clip-eps-low", type=float, default=d.clip_eps_low,
                   help="PPO ratio clipping (ppo_clip, decoupled_ppo; ratio against the old log-probs)")
    g.add_argument("--clip-eps-high", type=float, default=d.clip_eps_high)
    g.add_argument("--tis-cap", type=float, default=d.tis_cap,
                   help="truncated importance sampling cap on exp(logp_train - logp_sampler)")
    g.add_argument("--no-tis", dest="tis_cap", action="store_const", const=None, help="no importance weights")
    g.add_argument("--reward", default=d.reward, help="weighted reward terms, e.g. correctness=1.0,length=0.1")
    g.add_argument("--length-penalty-k", type=float, default=d.length_penalty_k)
    g.add_argument("--length-penalty-q", type=float, default=d.length_penalty_q)
    g.add_argument("--length-penalty-weights", default=d.length_penalty_weights,
                   help="the effort x of the length penalty: weights of thinking, tool_call, tool_output and "
                        "final tokens, tool_calls and turns, e.g. thinking=1,tool_call=1,tool_output=1,final=1,"
                        "tool_calls=0,turns=0 (unnamed ones keep these defaults)")
    g.add_argument("--reward-module", default=d.reward_module,
                   help="comma list of modules imported (in every process, Ray actors included) before "
                        "--reward is read: they register reward terms with rewards.register_reward_term")
    g.add_argument("--no-router-replay", dest="router_replay", action="store_false",
                   help="let the training routers route instead of replaying the engine's experts")
    g.add_argument("--replay-plausibility-threshold", type=float, default=d.replay_plausibility_threshold,
                   help="replace replayed experts whose gate is below this fraction of the router's k-th gate")
    g.add_argument("--rl-micro-batch-tokens", dest="micro_batch_tokens", type=int, default=d.micro_batch_tokens,
                   help="packed tokens per training micro-batch")
    g.add_argument("--rollout-batch-size", type=int, default=d.rollout_batch_size, help="engine cache slots")
    g.add_argument("--drop-zero-signal-groups", action="store_true", default=d.drop_zero_signal_groups,
                   help="leave groups whose samples all got the same reward (zero advantage) out of packing "
                        "and the forward/backward (rl/task_selection.py); they are counted every step either way")
    g.add_argument("--task-selection", choices=("cycle", "solve-rate"), default=d.task_selection,
                   help="cycle: the tasks in order; solve-rate: only tasks whose solve-rate estimate lies within "
                        "--task-solve-rate-bounds (rl/task_selection.py; synchronous loop)")
    g.add_argument("--task-solve-rate-bounds", default=d.task_solve_rate_bounds,
                   help="LOW,HIGH of --task-selection solve-rate, e.g. 0.1,0.9")

    g = p.add_argument_group("rollouts through vLLM (--rollout-backend vllm)")
    g.add_argument("--rollout-backend", choices=ROLLOUT_BACKENDS, default=d.rollout_backend,
                   help="engine: our engine colocated with the trainer; vllm: a vLLM server (started here in "
                        "vLLM's own venv, or --vllm-url); sglang: SGLang servers (--sglang-url); weights pushed "
                        "after every step")
    g.add_argument("--vllm-url", default=d.vllm_url,
                   help="a running vLLM server (VLLM_SERVER_DEV_MODE=1, --worker-extension-cls "
                        "megatron_composer.rl.vllm_worker.WeightSwapExtension, --logprobs-mode processed_logprobs)")
    g.add_argument("--vllm-python", default=d.vllm_python,
                   help="the python of vLLM's venv (default: $VLLM_PYTHON, else the venv of make vllm-env)")
    g.add_argument("--vllm-tensor-parallel-size", type=int, default=d.vllm_tensor_parallel_size)
    g.add_argument("--vllm-expert-parallel-size", type=int, default=d.vllm_expert_parallel_size,
                   help="vLLM's experts over this many ranks (--enable-expert-parallel, data parallel size "
                        "this / --vllm-tensor-parallel-size)")
    g.add_argument("--vllm-dtype", choices=VLLM_DTYPES, default=d.vllm_dtype,
                   help="default: bfloat16 with --bf16, else float32 (the weights are pushed in it)")
    g.add_argument("--vllm-max-model-len", type=int, default=d.vllm_max_model_len,
                   help="default: --seq-length")
    g.add_argument("--vllm-gpu-memory-utilization", type=float, default=d.vllm_gpu_memory_utilization)
    g.add_argument("--vllm-kv-cache-gib", type=int, default=d.vllm_kv_cache_gib,
                   help="KV cache of vLLM's CPU build (VLLM_CPU_KVCACHE_SPACE)")
    g.add_argument("--vllm-mtp", type=int, default=d.vllm_mtp,
                   help="speculative decoding with the checkpoint's MTP layers (deepseek_mtp): draft tokens "
                        "per step; 0: off")
    g.add_argument("--vllm-startup-timeout-s", type=float, default=d.vllm_startup_timeout_s)
    g.add_argument("--vllm-restarts", type=int, default=d.vllm_restarts,
                   help="times a vLLM server of this run that died is started again")
    g.add_argument("--vllm-chunk-tokens", type=int, default=d.vllm_chunk_tokens,
                   help="generate in requests of this many tokens, each continuing the sequence so far, so a "
                        "weights push lands between two chunks of a sequence in flight and every token carries "
                        "the version that sampled it (PipelineRL style); 0: one request per completion, a push "
                        "waits for it")
    g.add_argument("--vllm-extra-args", default=d.vllm_extra_args, help="more vLLM server flags, space-separated")

    g = p.add_argument_group("rollouts through SGLang (--rollout-backend sglang)")
    g.add_argument("--sglang-url", default=d.sglang_url,
                   help="running SGLang servers, URL[,URL...] (python -m sglang.launch_server --model-path HF_DIR "
                        "--skip-tokenizer-init [--enable-return-routed-experts]); prompts are spread over them")
    g.add_argument("--sglang-weight-transport", choices=SGLANG_TRANSPORTS, default=d.sglang_weight_transport,
                   help="tensor: /update_weights_from_tensor (shared memory: a server on this host); disk: "
                        "/update_weights_from_disk of a Hugging Face directory written to --sglang-weight-dir")
    g.add_argument("--sglang-weight-dir", default=d.sglang_weight_dir,
                   help="--sglang-weight-transport disk: the directory written every step (a path the servers "
                        "read; default: a temporary one)")
    g.add_argument("--sglang-dtype", choices=SGLANG_DTYPES, default=d.sglang_dtype,
                   help="default: bfloat16 with --bf16, else float32 (the weights are pushed in it)")

    g = p.add_argument_group("agentic environment (--env agentic-coding)")
    g.add_argument("--env", choices=sorted(ENVIRONMENTS), default=d.env,
                   help="single-turn: one completion scored by --task; agentic-coding: tool use in a sandbox")
    g.add_argument("--task-families", default=None,
                   help="comma list of coding task families (rl/tasks/coding), e.g. write-file,fix-bug "
                        f"(default: swe with --swe-task-file, else {d.task_families})")
    g.add_argument("--swe-task-file", default=d.swe_task_file,
                   help="SWE-bench style instances (JSONL: instance_id, repo_dir, base_commit, problem_statement, "
                        "FAIL_TO_PASS, PASS_TO_PASS, test_cmd) for the swe family (rl/tasks/coding/swe.py); "
                        "implies --task-families swe")
    g.add_argument("--max-turns", type=int, default=d.max_turns, help="model turns per trajectory")
    g.add_argument("--token-budget", type=int, default=d.token_budget,
                   help="generated tokens per trajectory (default: max-turns x max-new-tokens)")
    g.add_argument("--max-observation-tokens", type=int, default=d.max_observation_tokens,
                   help="a tool's output is cut to this many tokens")
    g.add_argument("--summary-trigger-tokens", type=int, default=d.summary_trigger_tokens,
                   help="self-summarize when a segment's context reaches this many tokens (default: never)")
    g.add_argument("--max-summaries", type=int, default=d.max_summaries)
    g.add_argument("--summary-max-tokens", type=int, default=d.summary_max_tokens)
    g.add_argument("--episode-workers", type=int, default=d.episode_workers, help="trajectories run at once")
    g.add_argument("--sandbox-timeout-s", type=float, default=d.sandbox_timeout_s,
                   help="wall-time limit of each sandboxed command")
    g.add_argument("--eval-tasks", type=int, default=d.eval_tasks,
                   help="held-out tasks solved greedily before the first step, every --eval-interval steps "
                        "and at the end")

    g = p.add_argument_group("textual feedback (--feedback-rules; agentic environment)")
    g.add_argument("--feedback-rules", default=d.feedback_rules,
                   help="comma list of hint rules (rl/feedback.py: unknown_tool, malformed_call, failing_test, "
                        "unfinished_todo, thinking_in_comments, long_thought, judge) or package.module:function; "
                        "default: no feedback")
    g.add_argument("--feedback-coef", type=float, default=d.feedback_coef,
                   help="weight of the feedback KL beside the policy loss (0: only count the rules' hints)")
    g.add_argument("--feedback-kl", choices=("forward", "reverse"), default=d.feedback_kl,
                   help="KL(teacher || student) or KL(student || teacher) on the hinted message's tokens")
    g.add_argument("--feedback-kl-topk", type=int, default=d.feedback_kl_topk,
                   help="compare the teacher's top K tokens and the rest of its mass (0: full vocabulary)")
    g.add_argument("--feedback-teacher", choices=("current", "lagged"), default=d.feedback_teacher,
                   help="the teacher's weights: the current policy, or a copy refreshed every "
                        "--feedback-teacher-lag steps")
    g.add_argument("--feedback-teacher-lag", type=int, default=d.feedback_teacher_lag)
    g.add_argument("--feedback-hint-role", choices=("user", "system"), default=d.feedback_hint_role,
                   help="the inserted note's chat role")
    g.add_argument("--feedback-judge-url", default=d.feedback_judge_url,
                   help="the rule judge asks this server of ours to write hints (default: the policy's engine)")
    g.add_argument("--feedback-long-thought-tokens", type=int, default=d.feedback_long_thought_tokens,
                   help="long_thought fires on a message with more tokens of prose than this before its call")

    g = p.add_argument_group("asynchronous RL on Ray (--async-rl)")
    g.add_argument("--async-rl", action="store_true",
                   help="run trainer, inference, environment and evaluation as Ray services (rl/async_rl)")
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster ('auto', or host:port of `ray start --head`); implies "
                        "--async-rl; default: a Ray instance of this job on this machine")
    g.add_argument("--max-inflight-groups", type=int, default=None,
                   help="groups being sampled at once (default: 2 x --prompts-per-step)")
    g.add_argument("--max-policy-lag", type=int, default=2,
                   help="drop and resample a group whose oldest generated token is this many versions behind")
    g.add_argument("--synchronous-rollouts", action="store_true",
                   help="the baseline: sample one step's groups only while the trainer waits")
    g.add_argument("--trainer-ranks", type=int, default=1,
                   help="trainer actors, one torch.distributed rank each (data parallel)")
    g.add_argument("--inference-workers", type=int, default=1)
    g.add_argument("--rollout-server", default=None,
                   help="sample from this running server of ours (python -m megatron_composer.inference.server) "
                        "instead of inference workers; each step's weights are pushed to it in flight")
    g.add_argument("--env-workers", type=int, default=1)
    g.add_argument("--group-timeout-s", type=float, default=600.0,
                   help="a group's rollouts taking longer are abandoned and the group relaunched")
    g.add_argument("--weight-sync-dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="the dtype weights are published in (what the inference workers run)")
    g.add_argument("--rollout-long-tail", type=float, default=None,
                   help="single-turn only (benchmarks): Pareto shape of per-sample lengths, stop tokens off")
    return p


def parse_rl_args(argv: Optional[list[str]] = None) -> RLRunConfig:
    """train_rl.py's flags as an `RLRunConfig`; ValueError names a bad flag."""
    args = parse_args(argv, build_rl_parser())
    args.stage = "rl"
    if args.task is None:
        args.task = "code-tests" if args.task_file else _FlatDefaults().task
    if args.task_families is None:
        args.task_families = "swe" if args.swe_task_file else _FlatDefaults().task_families
    for flag in ("max_inflight_groups", "trainer_ranks", "inference_workers", "env_workers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 1")
    if args.max_policy_lag < 0 or args.group_timeout_s <= 0:
        raise ValueError(f"--max-policy-lag {args.max_policy_lag} must be >= 0 and --group-timeout-s "
                         f"{args.group_timeout_s} > 0")
    if args.task_selection != "cycle" and (args.async_rl or args.ray_address is not None):
        raise ValueError(f"--task-selection {args.task_selection} runs in the synchronous loop (its estimates "
                         "follow each step's gathered groups); drop --async-rl, or use --task-selection cycle")
    if args.eval_task_file and (args.async_rl or args.ray_address is not None):
        raise ValueError("--eval-task-file is evaluated by the synchronous loop; drop --async-rl, or evaluate "
                         "its checkpoints in a synchronous run with --train-iters at their iteration")
    if getattr(args, "eval_base_interval", 0):
        raise ValueError(f"--eval-base-interval {args.eval_base_interval} is a pretrain_cpt.py flag: RL measures "
                         "itself with --eval-tasks / --eval-interval; evaluate RL checkpoints with "
                         "tools/eval_base.py --load <checkpoint>")
    cfg = TrainingConfig.from_args(args)
    values = {f: getattr(args, f) for f in RLConfig.flag_names()}
    values["eval_interval"] = args.eval_interval or 0  # the shared --eval-interval
    rl = RLConfig.from_flat(**values)
    if rl.algorithm.micro_batch_tokens < args.seq_length:
        raise ValueError(f"--rl-micro-batch-tokens {rl.algorithm.micro_batch_tokens} is below --seq-length "
                         f"{args.seq_length}: a sample of full length would fit no micro-batch")
    if rl.rollout.backend == "sglang":
        if args.async_rl or args.ray_address is not None:
            raise ValueError("--rollout-backend sglang runs in the synchronous loop (train_rl.py without --async-rl "
                             "/ --ray-address); the asynchronous loop drives our engine or vLLM "
                             "(--rollout-backend vllm)")
        if args.rollout_server:
            raise ValueError(f"--rollout-backend sglang with --rollout-server {args.rollout_server}: the SGLang "
                             "servers are given by --sglang-url; drop --rollout-server")
        if not rl.sglang.urls:
            raise ValueError("--rollout-backend sglang needs --sglang-url URL[,URL...] (a running SGLang server; "
                             "README: Rollouts through vLLM (and SGLang))")
    if rl.rollout.backend == "vllm" and args.rollout_server:
        raise ValueError(f"--rollout-backend vllm with --rollout-server {args.rollout_server}: the vLLM servers "
                         "are the inference workers' (their own, or --vllm-url URL[,URL...]); drop one of the two")
    async_rl = AsyncConfig(**{f: getattr(args, f) for f in AsyncConfig.__dataclass_fields__ if f != "enabled"},
                           enabled=args.async_rl or args.ray_address is not None)
    return RLRunConfig(training=cfg, rl=rl, model=ModelSource.from_args(args), parallel=ParallelSizes.from_args(args),
                       logging=LoggingConfig.from_args(args), async_rl=async_rl, tokenizer_model=args.tokenizer_model,
                       data_cache_dir=args.data_cache_dir, distributed_timeout_minutes=args.distributed_timeout_minutes)
