"""The Slurm recipes' training commands parse with the entry script's own parser (no drift)."""
import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(text: str, script: str) -> list[str]:
    """The argv after `script` in a recipe: continuation lines joined, ${VAR:-default} -> default,
    other variables -> a placeholder path, up to the trailing `&`."""
    joined = text.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if script in ln and not ln.lstrip().startswith("#"))
    line = line.split(script, 1)[1].split(" &", 1)[0]
    line = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), line)
    line = re.sub(r"\$\{?(\w+)\}?", "/placeholder", line)
    return shlex.split(line)


def test_every_ray_recipe_flag_is_one_train_rl_knows():
    from megatron_composer.rl.arguments import parse_rl_args

    recipes = glob.glob(os.path.join(ROOT, "examples", "slurm", "*.sbatch"))
    rl = [p for p in recipes if "train_rl.py" in open(p).read()]
    assert rl, "examples/slurm has no recipe running train_rl.py"
    for path in rl:
        argv = _command(open(path).read(), "train_rl.py\"")
        args, cfg, rl_cfg = parse_rl_args(argv)  # an unknown flag or a bad value exits / raises here
        assert args.async_rl and args.ray_address == "/placeholder:/placeholder", path
        assert rl_cfg.env == "agentic-coding" and cfg.checkpoint.save == "/placeholder"
