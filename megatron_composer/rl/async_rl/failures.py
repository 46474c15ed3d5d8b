"""How an asynchronous RL job ends when a trainer rank dies.

Ray restarts the inference, environment and evaluator workers (they hold no
state of their own that a full weights snapshot cannot restore). A trainer
rank is not restarted: the ranks form one torch.distributed group, and a
rank that comes back cannot rejoin it mid-run. The job ends instead, with
`TrainerDied` raised from the driver and turned by train_rl.py into one line
(what died, the last complete checkpoint, the command that resumes) and exit
code 1, after the driver has killed every actor and shut down the Ray
instance it started.

Nothing here imports Ray: train_rl.py catches `TrainerDied` without paying
for Ray's import on synchronous runs.
"""
from __future__ import annotations

import re
import shlex
from typing import Optional, Sequence

from ...checkpoint import iteration_dir, latest_iteration

# flags that would keep a resume from restoring the dead run as it was: --overwrite-save would move its
# checkpoints aside, --finetune and --no-load-optim would load its weights only
_DROPPED_ON_RESUME = ("--overwrite-save", "--finetune", "--no-load-optim")


class TrainerDied(RuntimeError):
    """A trainer rank died; the job cannot go on (module docstring)."""

    def __init__(self, ranks: dict, *, step: int, train_iters: int, save: Optional[str]):
        """`ranks`: {dead rank: why, in words}; `step`: the steps completed; `save`: --save (None: unset)."""
        self.ranks, self.step, self.train_iters, self.save = dict(sorted(ranks.items())), step, train_iters, save
        done = latest_iteration(save) if save else None
        self.checkpoint = iteration_dir(save, done) if done is not None else None
        if len(self.ranks) == 1:
            what = "trainer rank {} died ({})".format(*next(iter(self.ranks.items())))
        else:
            what = (f"trainer ranks {', '.join(map(str, self.ranks))} died ("
                    + "; ".join(f"rank {r}: {why}" for r, why in self.ranks.items()) + ")")
        kept = self.checkpoint or ("none (no --save)" if not save else "none")
        super().__init__(f"{what} after step {step} of {train_iters}; last complete checkpoint: {kept}")

    def resume_argv(self, argv: Sequence[str]) -> list[str]:
        """train_rl.py's `argv` that continues the run: `--load <save>` when --save holds a complete
        checkpoint (replacing any --load; without --overwrite-save, --finetune, --no-load-optim), else
        `argv` itself, which starts it again."""
        return resume_argv(argv, self.save) if self.checkpoint else list(argv)

    def line(self, command: Sequence[str], argv: Sequence[str]) -> str:
        """The one line train_rl.py prints: this error and the whole command that resumes
        (`command`: how train_rl.py was started, e.g. [sys.executable, sys.argv[0]])."""
        verb = "resume with" if self.checkpoint else "start again with"
        return f"async RL: {self}; {verb}: {shlex.join([*command, *self.resume_argv(argv)])}"


def resume_argv(argv: Sequence[str], save: str) -> list[str]:
    """`argv` with `--load save` in place of any --load (`--load X` or `--load=X`) and without the flags
    that would load the checkpoint only in part or move it aside (`_DROPPED_ON_RESUME`)."""
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--load":
            next(args, None)
        elif arg.startswith("--load=") or arg.split("=", 1)[0] in _DROPPED_ON_RESUME:
            continue
        else:
            out.append(arg)
    return out + ["--load", save]


def death_reason(error) -> str:
    """A few words on why an actor died, from Ray's `ActorDiedError` (whose message is a page)."""
    text = str(getattr(error, "error_msg", "") or error)
    pid = re.search(r"\bpid: (\d+)", text)
    where = f"pid {pid.group(1)} " if pid else ""
    if getattr(error, "actor_init_failed", False):
        return f"{where}failed to start".strip()
    if "SYSTEM_ERROR" in text:  # the process ended without exiting: a signal, the OOM killer, a crash
        return f"{where}ended unexpectedly: killed, out of memory or crashed"
    detail = re.search(r"Worker exit detail: ([^.]*)", text)
    return f"{where}exited: {detail.group(1)}" if detail else (where + "died").strip()
