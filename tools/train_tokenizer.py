"""Train the code BPE tokenizer (SentencePiece) used by every stage.

    python tools/train_tokenizer.py --output-prefix data/tokenizer            # stdlib train split
    python tools/train_tokenizer.py --input src/ more.jsonl --vocab-size 32000 --output-prefix data/tok

Writes ``{prefix}.model`` and ``{prefix}.vocab``. Settings and special tokens
are documented in ``megatron_composer/data/tokenizer.py``.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.data.corpus import expand_inputs, stdlib_corpus  # noqa: E402
from megatron_composer.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--input", nargs="+", help="files, directories or JSONL files (default: the stdlib train split)"
    )
    parser.add_argument(
        "--extensions", nargs="+", default=[".py"], help="suffixes searched for in input directories"
    )
    parser.add_argument("--json-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument(
        "--max-sentences", type=int, default=300_000, help="lines sampled for training (caps time)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the line sampling")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    files = expand_inputs(args.input, args.extensions) if args.input else stdlib_corpus("train")
    started = time.perf_counter()
    model = train_tokenizer(
        files,
        args.vocab_size,
        args.output_prefix,
        json_key=args.json_key,
        max_sentences=args.max_sentences,
        seed=args.seed,
    )
    tokenizer = Tokenizer(model)
    print(
        f"wrote {model} ({tokenizer.vocab_size} pieces, eod={tokenizer.eod}, pad={tokenizer.pad}, "
        f"chat={tokenizer.chat}) from {len(files)} files in {time.perf_counter() - started:.1f}s"
    )


if __name__ == "__main__":
    main()
