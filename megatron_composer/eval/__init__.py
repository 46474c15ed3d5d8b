"""Base-model evals: codebase perplexity, state tracking, coding knowledge (the report's three).

    python tools/eval_base.py --load CKPT --evals codebase-ppl,state-tracking,knowledge --out results.json
    python pretrain_cpt.py ... --eval-base-interval 100      # the same evals during training

How one run goes:

1. the source (`sources.py`): the held-out split of the embedded corpus, or
   any directory (with its git history when it is a repository), files in
   alphabetical order of path;
2. inputs that do not depend on the weights, built once (`suite.BaseEvals`):
   the token stream and its rolling windows (`perplexity.py`), the
   state-tracking tasks and prompts (`state_tracking.py`, `edits.py`), the
   multiple-choice questions and their options' tokens (`knowledge.py`);
3. the model (`lm.EvalModel`: the inference engine's forward and greedy
   generation) scores windows and options and writes final files, every rank
   its share of the items;
4. figures (`suite.scalars` for TensorBoard / wandb, `suite.format_table`,
   JSON from `tools/eval_base.py`).

`loading.py` turns a `--load` path (ours, or Hugging Face through the
converter) and a tokenizer into an `EvalModel`.
"""
from .suite import EVALS, BaseEvals, EvalConfig, format_table, parse_evals, scalars

__all__ = ["EVALS", "BaseEvals", "EvalConfig", "format_table", "parse_evals", "scalars"]
