"""Write the fp32 logits of a megatron-composer checkpoint for one token sequence.

    python tools/logits.py --load ckpt/ds3 --tokens 1,2,3,4 --out logits.pt
    python tools/logits.py --load ckpt/ds3 --tokens 1,2,3,4 --out logits.pt --mtp

Writes a tensor [seq, vocab] (with --mtp: [1 + mtp_layers, seq, vocab]) with
`torch.save`; compare it with another implementation's logits for a parity
check. Runs as one process on CPU or one GPU.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_composer.convert import checkpoint_logits  # noqa: E402


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: write comma-separated ids, e.g. 1,2,3") from None
    if not tokens:
        raise argparse.ArgumentTypeError("--tokens is empty")
    return tokens


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint root or iter_XXXXXXX directory")
    p.add_argument("--tokens", required=True, type=parse_tokens, help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output .pt file")
    p.add_argument("--mtp", action="store_true", help="also write the MTP heads' logits")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logits = checkpoint_logits(args.load, args.tokens, include_mtp=args.mtp)
    torch.save(logits, args.out)
    print(f"wrote {args.out}: {tuple(logits.shape)} float32", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
