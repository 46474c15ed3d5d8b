"""The three base evals prepared once, run on a model, spread over ranks; their table and scalars.

`BaseEvals(source, tokenizer, window, EvalConfig)` builds every input that
does not depend on the weights (the token stream and its windows, the
state-tracking tasks and prompts, the questions and their option tokens);
`run(lm)` scores a model. Under torch.distributed every rank holds a whole
replica (DP, CP; the eval model's limits) and scores items i with
i % world == rank; the per-item results are all-gathered and summed in item
order, so every rank returns the same figures and they do not depend on
the number of ranks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch.distributed as dist
from tqdm import tqdm

from .knowledge import build_questions, option_sequences, score_options, summarize_knowledge
from .perplexity import codebase_tokens, rolling_windows, scored_bytes, summarize_nll, window_nlls
from .sources import EvalSource
from .state_tracking import build_state_tasks, score_answer, state_request, summarize_state, STOP

EVALS = ("codebase-ppl", "state-tracking", "knowledge")


def parse_evals(text: str | Sequence[str]) -> tuple[str, ...]:
    """'codebase-ppl,knowledge' -> ("codebase-ppl", "knowledge"); ValueError naming an unknown one."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = [n for n in names if n not in EVALS]
    if unknown or not names:
        raise ValueError(f"unknown eval {unknown[0] if unknown else '(none given)'!r}; choose from "
                         f"{', '.join(EVALS)} (comma-separated)")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class EvalConfig:
    """Sizes of the evals. None: the whole corpus (codebase-ppl) or a size derived from the window."""

    evals: tuple[str, ...] = EVALS
    stride: Optional[int] = None  # rolling-window stride; default window // 2
    ppl_windows: Optional[int] = None  # score only the first windows of the concatenation
    state_tasks: int = 32
    state_edits: int = 3  # per synthetic task
    state_file_chars: Optional[int] = None  # default min(4000, window / 2): room for edits and answer
    knowledge_questions: int = 64
    knowledge_options: int = 4
    seed: int = 0

    @classmethod
    def bounded(cls, samples: int, **fields) -> "EvalConfig":
        """At most `samples` windows, tasks and questions (the evals during training)."""
        if samples < 1:
            raise ValueError(f"eval samples must be >= 1, got {samples}")
        return cls(ppl_windows=samples, state_tasks=samples, knowledge_questions=samples, **fields)


class BaseEvals:
    """The evals of `cfg.evals` over `source`, prepared for `tokenizer` and a `window`-token context."""

    def __init__(self, source: EvalSource, tokenizer, window: int, cfg: EvalConfig = EvalConfig()):
        self.source, self.tokenizer, self.window, self.cfg = source, tokenizer, window, cfg
        self.stride = cfg.stride or window // 2
        self.file_chars = cfg.state_file_chars or min(4000, window // 2)
        if "codebase-ppl" in cfg.evals:
            self.tokens = codebase_tokens(source.files, tokenizer)
            self.windows = rolling_windows(len(self.tokens), window, self.stride)[:cfg.ppl_windows]
        if "state-tracking" in cfg.evals:
            self.tasks = build_state_tasks(source, cfg.state_tasks, cfg.state_edits, self.file_chars, cfg.seed)
            if not self.tasks:
                raise ValueError(f"no state-tracking task fits {self.file_chars} characters in {source.name}; "
                                 f"give files with shorter lines or a larger window")
            self.requests = [state_request(t, tokenizer, window) for t in self.tasks]
        if "knowledge" in cfg.evals:
            self.questions = build_questions(source, cfg.knowledge_questions, cfg.knowledge_options, cfg.seed)
            if not self.questions:
                raise ValueError(f"{source.name} has too few Python functions for knowledge questions "
                                 f"(need {cfg.knowledge_options} distinct signatures or returns)")
            self.option_ids = [option_sequences(q, tokenizer, window) for q in self.questions]

    def config(self) -> dict:
        out = {"data": self.source.describe(), "window": self.window, "evals": list(self.cfg.evals),
               "seed": self.cfg.seed, **{k: v for k, v in asdict(self.cfg).items() if k not in ("evals", "seed")}}
        out["stride"], out["state_file_chars"] = self.stride, self.file_chars
        return out

    def run(self, lm, rank: int = 0, world: int = 1, progress: bool = False) -> dict[str, dict]:
        """{eval name: figures} for the eval model `lm` (see `lm.EvalModel`); identical on every rank."""
        if lm.window != self.window:
            raise ValueError(f"these evals were prepared for a {self.window}-token window; the model's is {lm.window}")
        results = {}
        show = progress and rank == 0
        if "codebase-ppl" in self.cfg.evals:
            parts = _sharded(lambda ws: window_nlls(lm, self.tokens, ws), self.windows, rank, world,
                             lm.batch_size, "codebase-ppl windows", show)
            results["codebase-ppl"] = dict(
                summarize_nll(parts, scored_bytes(self.tokens, self.windows, self.tokenizer)),
                window=self.window, stride=self.stride, windows=len(self.windows), files=len(self.source.files))
        if "state-tracking" in self.cfg.evals:
            def replay(items):
                answers = lm.generate([r.prompt for _, r in items], [r.max_tokens for _, r in items], STOP)
                return [score_answer(task, answer) for (task, _), answer in zip(items, answers)]

            scores = _sharded(replay, list(zip(self.tasks, self.requests)), rank, world, lm.batch_size,
                              "state-tracking tasks", show)
            results["state-tracking"] = summarize_state(self.tasks, scores, self.requests)
        if "knowledge" in self.cfg.evals:
            scores = _sharded(lambda seqs: score_options(lm, seqs), self.option_ids, rank, world,
                              max(1, lm.batch_size // self.cfg.knowledge_options), "knowledge questions", show)
            results["knowledge"] = summarize_knowledge(self.questions, scores)
        return results


def _sharded(fn: Callable[[list], list], items: Sequence, rank: int, world: int, chunk: int, desc: str,
             progress: bool) -> list:
    """fn over this rank's items (i % world == rank) in chunks, gathered into item order on every rank."""
    mine = list(range(rank, len(items), world))
    done: dict[int, object] = {}
    with tqdm(total=len(items), desc=desc, disable=not progress, leave=False) as bar:
        for start in range(0, len(mine), chunk):
            indices = mine[start:start + chunk]
            done.update(zip(indices, fn([items[i] for i in indices])))
            bar.update(len(indices) * world)
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, done)
        done = {i: r for part in gathered for i, r in part.items()}
    return [done[i] for i in range(len(items))]


# ---- reporting ------------------------------------------------------------------------------------

SCALARS = {  # TensorBoard / wandb name -> (eval, figure)
    "base-eval/codebase-nll-per-token": ("codebase-ppl", "nll_per_token"),
    "base-eval/codebase-total-nll": ("codebase-ppl", "total_nll"),
    "base-eval/state-tracking-edit-distance": ("state-tracking", "normalized_edit_distance"),
    "base-eval/state-tracking-edit-distance-raw": ("state-tracking", "edit_distance"),
    "base-eval/knowledge-accuracy": ("knowledge", "accuracy"),
}


def scalars(results: dict[str, dict]) -> dict[str, float]:
    """The logged figures of `BaseEvals.run`'s results."""
    return {name: float(results[e][k]) for name, (e, k) in SCALARS.items() if e in results}


def _cell(results: dict, name: str) -> str:
    r = results.get(name)
    if r is None:
        return ""
    if name == "codebase-ppl":
        return f"{r['nll_per_token']:.4f} (total {r['total_nll']:.1f} over {r['tokens']} tokens)"
    if name == "state-tracking":
        return f"{r['normalized_edit_distance']:.4f} (raw {r['edit_distance']:.1f} chars, {r['tasks']} tasks)"
    return f"{r['accuracy']:.4f} ({r['correct']}/{r['questions']}, chance {r['chance']:.2f})"


def format_table(rows: Sequence[tuple[str, dict]], config: dict) -> str:
    """Markdown: one row per checkpoint, one column per eval (the report's table shape)."""
    header = ("| checkpoint | codebase NLL / token ↓ | state tracking: normalized edit distance ↓ | "
              "knowledge accuracy ↑ |\n|---|---|---|---|\n")
    body = "".join(f"| {name} | {_cell(r, 'codebase-ppl')} | {_cell(r, 'state-tracking')} | "
                   f"{_cell(r, 'knowledge')} |\n" for name, r in rows)
    data = config["data"]
    note = (f"data: {data['name']} ({data['files']} files); window {config['window']}, stride {config['stride']}"
            f"; state tracking from {'git history' if data['git'] else 'synthetic edit scripts'}\n")
    return header + body + note

