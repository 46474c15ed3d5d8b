"""Evaluate base checkpoints: codebase perplexity, state tracking, coding knowledge.

    python tools/eval_base.py --load runs/demo/cpt_32k
    python tools/eval_base.py --load ckpt/a --load ckpt/b --evals codebase-ppl,knowledge --out results.json
    python tools/eval_base.py --load DeepSeek-V3/ --tokenizer-model DeepSeek-V3/tokenizer.json --data my_repo/

--load: a megatron-composer checkpoint (root or iter_XXXXXXX) or a Hugging
Face directory (config.json + *.safetensors, converted on the fly). Every
--load is one row of the printed table; --out writes every figure and the
settings as JSON. Data: the held-out split of the embedded standard-library
corpus, or --data DIR (its git history drives state tracking when it is a
repository). Configuration errors exit with status 2 and one line.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.eval import EVALS, BaseEvals, EvalConfig, format_table, parse_evals  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", action="append", required=True, help="checkpoint to evaluate (repeat for rows)")
    p.add_argument("--evals", default=",".join(EVALS), help=f"comma-separated, from {', '.join(EVALS)}")
    p.add_argument("--data", default=None, help="source directory (default: the embedded corpus's held-out split)")
    p.add_argument("--extensions", default=".py", help="with --data: file endings to read, comma-separated")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model or tokenizer.json (default: the tokenizer.model our checkpoint "
                        "carries, an HF directory's tokenizer.json, else the embedded corpus's tokenizer in "
                        "--data-cache-dir)")
    p.add_argument("--data-cache-dir", default="data", help="where the embedded corpus's tokenizer is cached")
    p.add_argument("--seq-length", type=int, default=None,
                   help="the window (default: the checkpoint's training sequence length)")
    p.add_argument("--stride", type=int, default=None, help="rolling-window stride (default: window / 2)")
    p.add_argument("--samples", type=int, default=None,
                   help="at most this many perplexity windows, state-tracking tasks and knowledge questions "
                        "(default: the whole corpus, 32 tasks, 64 questions)")
    p.add_argument("--state-edits", type=int, default=3, help="edits per synthetic state-tracking task")
    p.add_argument("--options", type=int, default=4, help="options per knowledge question")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward / generation slots")
    p.add_argument("--seed", type=int, default=0, help="selects the tasks and questions")
    p.add_argument("--convert-dir", default=None, help="where Hugging Face checkpoints are converted (temporary)")
    return p.parse_args(argv)


def _config(args) -> EvalConfig:
    fields = dict(evals=parse_evals(args.evals), stride=args.stride, state_edits=args.state_edits,
                  knowledge_options=args.options, seed=args.seed)
    return EvalConfig.bounded(args.samples, **fields) if args.samples is not None else EvalConfig(**fields)


def _source(args):
    from megatron_composer.eval.sources import directory_source, held_out_source

    return directory_source(args.data, args.extensions.split(",")) if args.data else held_out_source()


def evaluate(args) -> dict:
    from megatron_composer.eval.loading import checkpoint_kind, load_eval_model, resolve_tokenizer

    cfg = _config(args)
    for path in args.load:  # every path checked before any work
        checkpoint_kind(path)
    source = _source(args)
    rows, prepared, config = [], {}, None
    for path in args.load:
        started = time.perf_counter()
        tokenizer = resolve_tokenizer(args.tokenizer_model, args.data_cache_dir, path)
        lm, info = load_eval_model(path, tokenizer, args.seq_length, args.batch_size, args.convert_dir)
        key = (str(tokenizer.model_path), lm.window)
        if key not in prepared:
            prepared[key] = BaseEvals(source, tokenizer, lm.window, cfg)
        evals = prepared[key]
        print(f"[eval] {path}: {info['kind']} checkpoint, iteration {info['iteration']}, window {lm.window}",
              file=sys.stderr, flush=True)
        results = evals.run(lm, progress=True)
        rows.append({"checkpoint": path, **info, "tokenizer": str(tokenizer.model_path), "results": results,
                     "seconds": time.perf_counter() - started})
        config = evals.config()
    return {"config": config, "rows": rows}


def main(argv=None) -> int:
    from megatron_composer.checkpoint import CheckpointError

    args = parse_args(argv)
    try:
        if args.samples is not None and args.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {args.samples}")
        report = evaluate(args)
    except (ValueError, CheckpointError) as exc:
        print(f"eval_base.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(format_table([(row["checkpoint"], row["results"]) for row in report["rows"]], report["config"]),
          end="", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
