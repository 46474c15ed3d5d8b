"""Tokenize source files or JSONL into a megatron-core indexed dataset (.bin/.idx).

    python tools/preprocess_data.py --input src/ --tokenizer-model data/tokenizer.model --output-prefix data/code
    python tools/preprocess_data.py --input docs.jsonl --json-key text --tokenizer-model ... --output-prefix ...
    python tools/preprocess_data.py --stdlib-split valid --tokenizer-model ... --output-prefix data/stdlib_valid

One document per file or JSONL line, each ending in the tokenizer's EOD id.
The dataset is written under temporary names and renamed at the end, so an
interrupted run never leaves a half-written dataset under PREFIX.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.data.corpus import count_texts, expand_inputs, iter_texts, stdlib_corpus  # noqa: E402
from megatron_composer.data.indexed import build_indexed_dataset  # noqa: E402
from megatron_composer.data.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="files, directories or JSONL files")
    source.add_argument("--stdlib-split", choices=["train", "valid"], help="the embedded stdlib corpus split")
    parser.add_argument(
        "--extensions", nargs="+", default=[".py"], help="suffixes searched for in input directories"
    )
    parser.add_argument("--json-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--tokenizer-model", required=True,
                        help="from tools/train_tokenizer.py, or Kimi K2.5's tiktoken.model "
                             "(with its tokenizer_config.json beside it)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer threads")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    files = expand_inputs(args.input, args.extensions) if args.input else stdlib_corpus(args.stdlib_split)
    tokenizer = Tokenizer(args.tokenizer_model)
    started = time.perf_counter()
    stats = build_indexed_dataset(
        iter_texts(files, args.json_key),
        tokenizer,
        args.output_prefix,
        workers=args.workers,
        total=count_texts(files),
    )
    print(
        f"wrote {stats['prefix']}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens "
        f"in {time.perf_counter() - started:.1f}s"
    )


if __name__ == "__main__":
    main()
