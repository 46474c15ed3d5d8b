"""The Slurm recipes of examples/slurm/ against the code they launch, so that they cannot drift.

Each recipe runs under bash with `srun`, `scontrol` and the interpreter replaced by stubs that
record their command lines and run nothing, so every check reads the argv that sbatch would hand to
the entry script: bash itself expands the quoting, the `${VAR:-default}` defaults, the resume
logic and the arguments after the script, exactly as on a cluster.

* every flag of a recipe's command must be an option string of its entry script's own parser
  (exact names: argparse would accept an abbreviation), and torchrun's flags of torchrun's parser;
  then the whole command must parse with the entry script's validation;
* each recipe's command runs at tiny scale on CPU: the stage, data, checkpoint and stage-specific
  flags stay as the recipe wrote them; the preset becomes `tiny`, the sizes shrink (`TINY`),
  parallel sizes become 1, and the launcher (srun + torchrun, or the Ray driver) becomes this
  process, calling the entry script's main(argv) (one interpreter start instead of five). It must
  return 0 and write a checkpoint;
* the resume and requeue logic (`common.sh`) runs with the stubs.
"""
import argparse
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "examples" / "slurm"
RECIPES = sorted(p.name for p in SLURM.glob("*.sbatch"))
TRAINING = ("cpt_32k.sbatch", "cpt_256k.sbatch", "sft.sbatch", "rl.sbatch")
ENTRY = {"cpt_32k.sbatch": "pretrain_cpt.py", "cpt_256k.sbatch": "pretrain_cpt.py", "sft.sbatch": "pretrain_cpt.py",
         "rl.sbatch": "train_rl.py", "convert.sbatch": "convert_checkpoint.py"}
JOB_ID = "4242"

# one file per call, renamed into place once written (a reader never sees half a command line)
_RECORD = ('f=$(mktemp -p "$STUB_CALLS" .call.XXXXXXXX)\n'
           'printf "%s\\0" "$(basename "$0")" "$@" > "$f" && mv "$f" "${f/.call./call.}"\n')
STUBS = {
    # a job step: recorded; `hostname` answers; a step of an entry script sleeps when asked to
    "srun": _RECORD + 'for a in "$@"; do\n'
                      '  case "$a" in hostname) echo 127.0.0.1; exit 0;;\n'
                      '    *.py) [ -n "${STUB_STEP_SECONDS:-}" ] && exec sleep "$STUB_STEP_SECONDS";;\n'
                      '  esac\ndone\nexit 0\n',
    "scontrol": _RECORD + '[ "$1" = show ] && printf "%s\\n" $STUB_NODES\nexit 0\n',
    "python": _RECORD + "exit 0\n",
    "ray": _RECORD + "exit 0\n",
}


# ---- running a recipe with the stubs ---------------------------------------------------------------
def _stub_env(tmp: Path, **env) -> dict:
    bin_dir, calls = tmp / "stubs", tmp / "calls"
    calls.mkdir(parents=True, exist_ok=True)
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, body in STUBS.items():
            (bin_dir / name).write_text("#!/bin/bash\n" + body)
            (bin_dir / name).chmod(0o755)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp), "REPO": str(ROOT), "PY": str(bin_dir / "python"),
            "CKPT": str(tmp / "ckpt"), "STUB_CALLS": str(calls), "STUB_NODES": "node1 node2",
            "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": "composer", "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "16",
            "DATA": str(tmp / "data" / "train"), "TOKENIZER": str(tmp / "data" / "tok.model")}
    return {**base, **{k: str(v) for k, v in env.items()}}


def _calls(tmp: Path) -> list[list[str]]:
    """The recorded command lines, oldest first."""
    files = sorted((tmp / "calls").glob("call.*"), key=lambda p: p.stat().st_mtime_ns)
    return [p.read_bytes().decode().split("\0")[:-1] for p in files]


def run_recipe(recipe, tmp: Path, *args, **env):
    """(bash's CompletedProcess, every stubbed command line) of `recipe` (a name or a path)."""
    path = recipe if isinstance(recipe, Path) else SLURM / recipe
    out = subprocess.run(["bash", str(path), *args], env=_stub_env(tmp, **env), cwd=tmp, capture_output=True,
                         text=True, timeout=60)
    return out, _calls(tmp)


def split_command(calls, entry: str) -> tuple[list[str], list[str]]:
    """(launcher argv, entry script argv) of the one recorded call that runs `entry`."""
    found = [c for c in calls if any(a.endswith("/" + entry) for a in c)]
    assert len(found) == 1, (entry, calls)
    at = next(i for i, a in enumerate(found[0]) if a.endswith("/" + entry))
    return found[0][:at], found[0][at + 1:]


def recipe_command(recipe, tmp: Path, *args, **env) -> tuple[list[str], list[str]]:
    out, calls = run_recipe(recipe, tmp, *args, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    return split_command(calls, ENTRY[Path(recipe).name if isinstance(recipe, Path) else recipe])


# ---- the parsers ------------------------------------------------------------------------------------
def entry_module(entry: str):
    """The entry script as a module (its main(argv) returns the exit code)."""
    import importlib.util

    path = ROOT / ("tools" if entry == "convert_checkpoint.py" else "") / entry
    spec = importlib.util.spec_from_file_location("recipe_" + entry[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _captured_parser(parse) -> argparse.ArgumentParser:
    """The parser a function builds inside itself (tools/convert_checkpoint.py's parse_args)."""
    seen = []

    def capture(self, *a, **k):
        seen.append(self)
        raise LookupError

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(LookupError):
            parse([])
    return seen[0]


def entry_parser(entry: str):
    if entry == "pretrain_cpt.py":
        from megatron_composer.training.arguments import build_parser

        return build_parser()
    if entry == "train_rl.py":
        from megatron_composer.rl.arguments import build_rl_parser

        return build_rl_parser()
    return _captured_parser(entry_module(entry).parse_args)


def unknown_flags(argv: list[str], parser) -> list[str]:
    """The `--flags` of argv that are not, spelled exactly, option strings of parser."""
    known = {s for action in parser._actions for s in action.option_strings}
    return [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]


def _torchrun_flags(launcher: list[str]) -> list[str]:
    at = next(i for i, a in enumerate(launcher) if a.endswith("torchrun"))
    return launcher[at + 1:]


# ---- 1. the recipes parse --------------------------------------------------------------------------
@pytest.mark.parametrize("name", RECIPES + ["common.sh"])
def test_recipe_is_valid_bash(name):
    out = subprocess.run(["bash", "-n", str(SLURM / name)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", RECIPES)
def test_sbatch_header(name):
    header = [ln.split(None, 1)[1].strip() for ln in (SLURM / name).read_text().splitlines()
              if ln.startswith("#SBATCH")]
    for line in ("--ntasks-per-node=1", "--exclusive", "--requeue", "--output=logs/%x-%j.out", "--open-mode=append"):
        assert line in header, (name, line)
    if name in TRAINING:
        assert "--gpus-per-node=8" in header and "--signal=B:USR1@300" in header, name


def test_every_recipe_is_checked():
    assert set(RECIPES) == set(ENTRY), "a new recipe needs its entry script in ENTRY"


# ---- 2. every flag exists in the entry script's parser ----------------------------------------------
@pytest.mark.parametrize("name", RECIPES)
def test_every_flag_is_one_the_entry_script_defines(name, tmp_path):
    env = {"VALID_DATA": tmp_path / "data" / "valid", "LOAD": tmp_path / "init"}
    if name == "convert.sbatch":
        env = {"LOAD": tmp_path / "hf"}
    launcher, argv = recipe_command(name, tmp_path, **env)
    assert argv, name
    assert unknown_flags(argv, entry_parser(ENTRY[name])) == [], name
    if name == "rl.sbatch":
        from megatron_composer.rl.arguments import parse_rl_args

        from megatron_composer.rl.tasks.coding import FAMILIES

        run = parse_rl_args(argv)  # a bad value raises or exits here
        rl = run.rl
        assert run.async_rl.enabled and run.async_rl.ray_address == "127.0.0.1:6379" and rl.environment.name == "agentic-coding"
        assert set(rl.environment.task_families.split(",")) <= set(FAMILIES)  # the tiny run trains on write-file only
    elif name == "convert.sbatch":
        args = entry_module(ENTRY[name]).parse_args(argv)
        assert (args.direction, args.save) == ("hf-to-mcore", str(tmp_path / "ckpt" / "base"))
    else:
        from torch.distributed.run import get_args_parser

        from megatron_composer.config import STAGES
        from megatron_composer.training.arguments import parse_args

        assert unknown_flags(_torchrun_flags(launcher), get_args_parser()) == [], name
        args = parse_args(argv)
        assert args.model_preset == "kimi-k2.5" and args.load == str(tmp_path / "init") and args.finetune
        if args.stage == "cpt-256k":  # the stage table's context-parallel size for 256K
            assert args.context_parallel_size == STAGES["cpt-256k"].context_parallel_size


def test_a_flag_the_parser_lacks_is_caught(tmp_path):
    """A made-up flag, and an abbreviation argparse itself would accept, inserted into a recipe."""
    text = (SLURM / "cpt_32k.sbatch").read_text()
    assert "    --stage cpt-32k\n" in text
    bad = tmp_path / "edited" / "cpt_32k.sbatch"
    bad.parent.mkdir()
    bad.write_text(text.replace("    --stage cpt-32k\n", "    --stage cpt-32k --made-up-flag 3 --save-int 5\n"))
    _, argv = recipe_command(bad, tmp_path, LOAD="")
    assert unknown_flags(argv, entry_parser("pretrain_cpt.py")) == ["--made-up-flag", "--save-int"]
    from megatron_composer.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)


# ---- 3. resume and requeue ---------------------------------------------------------------------------
def _load_flags(argv: list[str]) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        if a == "--load":
            out += [a, argv[i + 1]]
        elif a == "--finetune":
            out.append(a)
    return out


def test_resume_prefers_the_jobs_own_checkpoint(tmp_path):
    from megatron_composer.checkpoint.tracker import TRACKER

    save, init = tmp_path / "save", tmp_path / "cpt_32k"
    _, first = recipe_command("cpt_256k.sbatch", tmp_path, SAVE=save, LOAD=init)
    assert _load_flags(first) == ["--load", str(init), "--finetune"]
    (save / TRACKER).write_text("100")  # what a save leaves: the requeued job resumes everything
    _, again = recipe_command("cpt_256k.sbatch", tmp_path / "again", SAVE=save, LOAD=init)
    assert _load_flags(again) == ["--load", str(save)]
    _, scratch = recipe_command("cpt_32k.sbatch", tmp_path / "scratch", SAVE=tmp_path / "s2", LOAD="")
    assert _load_flags(scratch) == []


@pytest.mark.parametrize("restarts, requeued", [(0, True), (20, False)])
def test_usr1_requeues_the_job_and_stops_its_step(tmp_path, restarts, requeued):
    env = _stub_env(tmp_path, LOAD="", STUB_STEP_SECONDS=120, SLURM_RESTART_COUNT=restarts)
    proc = subprocess.Popen(["bash", str(SLURM / "cpt_32k.sbatch")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 30
        while not any("srun" == c[0] for c in _calls(tmp_path)) and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=30)  # the 120 s step was stopped
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    requeues = [c for c in _calls(tmp_path) if c[:2] == ["scontrol", "requeue"]]
    assert requeues == ([["scontrol", "requeue", JOB_ID]] if requeued else []), out
    assert ("requeueing job " + JOB_ID in out) == requeued and "USR1" in out


def test_ray_nodes_start_before_the_driver(tmp_path):
    out, calls = run_recipe("rl.sbatch", tmp_path, STUB_NODES="node1 node2 node3")
    assert out.returncode == 0, out.stdout + out.stderr
    starts = [c for c in calls if c[0] == "srun" and "start" in c]
    assert sorted("--head" in c for c in starts) == [False, False, True]
    assert {c[c.index("-w") + 1] for c in starts} == {"node1", "node2", "node3"}
    assert all("--address=127.0.0.1:6379" in c for c in starts if "--head" not in c)
    waiter = [i for i, c in enumerate(calls) if c[:2] == ["python", "-"]]
    driver = [i for i, c in enumerate(calls) if c[0] == "python" and c[1].endswith("/train_rl.py")]
    assert len(waiter) == len(driver) == 1 and waiter[0] < driver[0], calls
    assert calls[waiter[0]][2:] == ["127.0.0.1:6379", "3"]  # waits for all three nodes


# ---- 4. each recipe's command at tiny scale on CPU ---------------------------------------------------
# The values of these flags, where a recipe has them; the rest of its command stays as written.
TINY = {"--model-preset": "tiny", "--micro-batch-size": "2", "--global-batch-size": "2", "--train-iters": "1",
        "--lr-warmup-iters": "0", "--save-interval": "1", "--eval-iters": "1", "--context-parallel-size": "1",
        "--expert-model-parallel-size": "1", "--dense-shard-size": "1", "--distributed-timeout-minutes": "2",
        "--seq-length": "512", "--rl-micro-batch-tokens": "1024", "--prompts-per-step": "1", "--group-size": "2",
        "--max-turns": "1", "--max-new-tokens": "8", "--eval-tasks": "0", "--task-families": "write-file",
        "--trainer-ranks": "1", "--inference-workers": "1", "--env-workers": "1", "--max-inflight-groups": "2"}
RAY_ONLY = ("--ray-address",)  # without it the same flags run the synchronous loop, no Ray cluster


def tiny(argv: list[str], *extra: str, drop=()) -> list[str]:
    """argv with the TINY values for the flags it has, `drop` removed, and `extra` appended."""
    out, i = [], 0
    while i < len(argv):
        flag, j = argv[i], i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        if flag in TINY:
            out += [flag, TINY[flag]]
        elif flag not in drop:
            out += argv[i:j]
        i = j
    return out + list(extra)


def run_entry(entry: str, argv: list[str]) -> None:
    """The recipe's launcher replaced by this process: the entry script's main(argv), which must return 0."""
    assert entry_module(entry).main(argv) == 0, (entry, argv)


def _tracked_iteration(save: Path) -> str:
    from megatron_composer.checkpoint.tracker import TRACKER

    return (save / TRACKER).read_text().strip()


PRETRAIN_TINY = ("--seq-length", "64")  # the stage's tiny length (512, 4096) is more than a check needs


@pytest.fixture(scope="module")
def cpt_32k(data_dir, tmp_path_factory):
    """cpt_32k.sbatch's command at tiny scale, from scratch (LOAD=): its checkpoint starts the others."""
    tmp = tmp_path_factory.mktemp("cpt_32k")
    _, argv = recipe_command("cpt_32k.sbatch", tmp, LOAD="", DATA=data_dir / "stdlib_train",
                             VALID_DATA=data_dir / "stdlib_valid", TOKENIZER=data_dir / "tokenizer.model")
    run_entry("pretrain_cpt.py", tiny(argv, *PRETRAIN_TINY))
    return tmp / "ckpt" / "cpt_32k"


def test_cpt_32k_recipe_runs_at_tiny_scale(cpt_32k):
    assert _tracked_iteration(cpt_32k) == "1" and (cpt_32k / "iter_0000001").is_dir()


def test_cpt_256k_recipe_runs_at_tiny_scale(cpt_32k, data_dir, tmp_path, capsys):
    _, argv = recipe_command("cpt_256k.sbatch", tmp_path, LOAD=cpt_32k, DATA=data_dir / "stdlib_train",
                             TOKENIZER=data_dir / "tokenizer.model")
    run_entry("pretrain_cpt.py", tiny(argv, *PRETRAIN_TINY))
    assert f"loaded checkpoint from {cpt_32k} at iteration 1 (weights only" in capsys.readouterr().out
    assert _tracked_iteration(tmp_path / "ckpt" / "cpt_256k") == "1"


def test_sft_recipe_runs_at_tiny_scale(cpt_32k, data_dir, tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Write a function returning {i}."},
        {"role": "assistant", "content": f"def f():\n    return {i}\n"}]}) + "\n" for i in range(8)))
    _, argv = recipe_command("sft.sbatch", tmp_path, LOAD=cpt_32k, DATA=chat, TOKENIZER=data_dir / "tokenizer.model")
    run_entry("pretrain_cpt.py", tiny(argv, *PRETRAIN_TINY))
    assert f"loaded checkpoint from {cpt_32k} at iteration 1 (weights only" in capsys.readouterr().out
    assert _tracked_iteration(tmp_path / "ckpt" / "sft") == "1"


def test_rl_recipe_runs_at_tiny_scale(cpt_32k, data_dir, tmp_path, capsys):
    """The recipe's train_rl.py flags without --ray-address: the synchronous loop in one process (the
    async services would start a Ray instance, too slow here; tests/test_async_rl.py runs those)."""
    _, argv = recipe_command("rl.sbatch", tmp_path, LOAD=cpt_32k)
    run_entry("train_rl.py", tiny(argv, "--tokenizer-model", str(data_dir / "tokenizer.model"),
                                  "--data-cache-dir", str(data_dir), drop=RAY_ONLY))
    assert f"loaded checkpoint from {cpt_32k} at iteration 1 (weights only" in capsys.readouterr().out
    assert _tracked_iteration(tmp_path / "ckpt" / "rl") == "1"


def test_convert_recipe_runs_at_tiny_scale(cpt_32k, tmp_path):
    """hf-to-mcore of the tiny CPT checkpoint exported to the Hugging Face layout; a second job finds
    its output complete and does nothing."""
    from megatron_composer.convert import mcore_to_hf

    mcore_to_hf(str(cpt_32k), str(tmp_path / "hf"), progress=False)
    _, argv = recipe_command("convert.sbatch", tmp_path, LOAD=tmp_path / "hf")
    run_entry("convert_checkpoint.py", argv)
    assert _tracked_iteration(tmp_path / "ckpt" / "base") == "0"
    out, calls = run_recipe("convert.sbatch", tmp_path / "again", LOAD=tmp_path / "hf", CKPT=tmp_path / "ckpt")
    assert out.returncode == 0 and "already converted" in out.stdout and not [c for c in calls if c[0] == "srun"]


def test_convert_recipe_converts_a_kimi_k25_directory(tmp_path):
    """The recipe on Kimi-K2.5's published layout (wrapper config, language_model.* tensors, INT4 routed
    experts, vision tower, tiktoken tokenizer): in, then out with INT4=1 (the serving format)."""
    pytest.importorskip("compressed_tensors")
    pytest.importorskip("transformers")
    from tests.test_convert_kimi import read_all, write_kimi

    write_kimi(tmp_path / "k25")
    launcher, argv = recipe_command("convert.sbatch", tmp_path, LOAD=tmp_path / "k25", WORKERS=1)
    assert argv[argv.index("--workers") + 1] == "1" and "--export-int4" not in argv
    run_entry("convert_checkpoint.py", argv)
    base = tmp_path / "ckpt" / "base"
    assert _tracked_iteration(base) == "0"
    assert (base / "hf_multimodal" / "manifest.json").exists() and (base / "hf_assets" / "tiktoken.model").exists()
    _, argv = recipe_command("convert.sbatch", tmp_path / "out", DIRECTION="mcore-to-hf", LOAD=base,
                             SAVE=tmp_path / "export", INT4=1, WORKERS=1)
    assert "--export-int4" in argv
    run_entry("convert_checkpoint.py", argv)
    exported = read_all(tmp_path / "export")
    assert any(k.endswith(".mlp.experts.0.gate_proj.weight_packed") for k in exported)
    assert any(k.startswith("vision_tower.") for k in exported)
    _, default = recipe_command("convert.sbatch", tmp_path / "cpus", LOAD=tmp_path / "k25")  # 16 CPUs / 4
    assert default[default.index("--workers") + 1] == "4"


# ---- 5. the RL recipe's layout fits the planner ------------------------------------------------------
def _sbatch_option(name: str, option: str) -> int:
    """An integer `#SBATCH --option=N` of a recipe."""
    for line in (SLURM / name).read_text().splitlines():
        if line.startswith(f"#SBATCH --{option}="):
            return int(line.split("=", 1)[1])
    raise AssertionError(f"{name} has no #SBATCH --{option}")


def _rl_recipe_plan(tmp_path, **env):
    from megatron_composer.planner.rl import make_rl_plan
    from megatron_composer.rl.arguments import parse_rl_args

    _, argv = recipe_command("rl.sbatch", tmp_path, **env)
    run = parse_rl_args(argv)
    setup = entry_module("tools/plan.py").rl_setup_from_run(
        run, nodes=_sbatch_option("rl.sbatch", "nodes"), gpus_per_node=_sbatch_option("rl.sbatch", "gpus-per-node"),
        gpu="h200")
    return run, make_rl_plan(setup)


def test_rl_recipe_layout_fits_the_planner(tmp_path):
    """tools/plan.py --stage rl on rl.sbatch's own command (its defaults, its #SBATCH nodes, H200): the
    trainer ranks and the inference workers fit, on the GPUs the job asks for."""
    from megatron_composer.planner.report import format_rl_text

    run, plan = _rl_recipe_plan(tmp_path)
    assert plan.setup.inference_workers == run.async_rl.inference_workers >= 1
    assert plan.setup.trainer_world == run.async_rl.trainer_ranks and plan.trainer.setup.cp == 8
    assert plan.fits, format_rl_text(plan)


def test_kimi_in_the_rl_recipe_is_refused_by_the_planner(tmp_path):
    """MODEL_PRESET=kimi-k2.5: a whole model per inference GPU cannot fit; the plan says why with numbers."""
    _, plan = _rl_recipe_plan(tmp_path, MODEL_PRESET="kimi-k2.5")
    assert not plan.inference_fits and not plan.fits
    assert any("1911.8 GiB" in line and "inference worker" in line for line in plan.advice), plan.advice
