"""What `tools/eval_base.py --load` accepts: our checkpoints, and Hugging Face ones through the converter.

- a megatron-composer checkpoint (a root with `latest_checkpointed_iteration.txt`
  or an `iter_XXXXXXX` directory; one converted from HF is the same) is
  loaded as training resumes it (`models.load_checkpoint_model`);
- a Hugging Face directory (`config.json` + `*.safetensors`) is first
  converted with `convert.hf_to_mcore` into a temporary directory (under
  `convert_dir`, removed once the weights are in memory): the same code as
  `tools/convert_checkpoint.py`, so the evals see exactly the checkpoint
  training would load. For a large model convert once with that tool and
  pass the result.

The window (context) is, unless given, the sequence length the checkpoint
was trained at (its meta.json), else the model's max_position_embeddings,
at most 4096 on CPU. The tokenizer is `--tokenizer-model` (a sentencepiece
`.model`, or a Hugging Face `tokenizer.json` read with the `tokenizers`
library), else an HF directory's own `tokenizer.json` (or Kimi's `tiktoken.model`,
`data.tiktoken_tokenizer`), else the sentencepiece
`tokenizer.model` the checkpoint carries (`checkpoint.checkpoint_tokenizer`:
ours saves it at its root, our HF export next to the weights), else the
embedded corpus's tokenizer in the data cache.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from .lm import EvalModel

OURS, HUGGING_FACE = "megatron-composer", "hugging-face"


def checkpoint_kind(path: str) -> str:
    """OURS or HUGGING_FACE; ValueError naming the path and what would fit otherwise."""
    from ..checkpoint import TRACKER

    fix = (f"give a checkpoint directory written by --save (it holds {TRACKER}), one of its iter_XXXXXXX "
           f"directories, or a Hugging Face directory (config.json + *.safetensors)")
    if not os.path.exists(path):
        raise ValueError(f"--load {path} does not exist; {fix}")
    if os.path.isfile(os.path.join(path, "config.json")) and glob.glob(os.path.join(path, "*.safetensors")):
        return HUGGING_FACE
    if os.path.isfile(os.path.join(path, TRACKER)) or os.path.isfile(os.path.join(path, "meta.json")):
        return OURS
    raise ValueError(f"--load {path} is not a checkpoint; {fix}")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` behind our Tokenizer's interface (encode, decode, eod, vocab_size)."""

    def __init__(self, path: str | Path, eod: int):
        try:
            from tokenizers import Tokenizer as _Fast
        except ImportError:
            raise ValueError(f"{path} needs the `tokenizers` library: pip install tokenizers") from None
        self.model_path = Path(path)
        self._tok = _Fast.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = int(eod)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.model_path)!r}, vocab_size={self.vocab_size})"


def _hf_eos(config_dir: str) -> int:
    with open(os.path.join(config_dir, "config.json")) as f:
        eos = json.load(f).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        raise ValueError(f"{config_dir}/config.json has no eos_token_id; the evals need an end-of-document id")
    return int(eos)


def resolve_tokenizer(tokenizer_model: Optional[str], data_cache_dir: str, load: Optional[str] = None):
    """The tokenizer of the module docstring's order; `load` is the checkpoint (ours or HF) or None."""
    from ..checkpoint import checkpoint_tokenizer
    from ..data import Tokenizer, default_cpt_data

    if tokenizer_model:
        if not os.path.isfile(tokenizer_model):
            raise ValueError(f"--tokenizer-model {tokenizer_model} does not exist; give the sentencepiece .model "
                             f"(or tokenizer.json) the checkpoint was trained with")
        if tokenizer_model.endswith(".json"):
            return HFTokenizer(tokenizer_model, _hf_eos(load or os.path.dirname(tokenizer_model)))
        return Tokenizer(tokenizer_model)
    if load is not None and os.path.isfile(os.path.join(load, "tokenizer.json")):
        return HFTokenizer(os.path.join(load, "tokenizer.json"), _hf_eos(load))
    if load is not None and os.path.isfile(os.path.join(load, "tiktoken.model")):  # Kimi K2.5's own
        return Tokenizer(os.path.join(load, "tiktoken.model"))
    carried = checkpoint_tokenizer(load) if load is not None else None
    if carried is not None:
        return Tokenizer(carried)
    return Tokenizer(default_cpt_data(data_cache_dir, progress=False).tokenizer_model)


def _default_window(meta: dict, max_positions: int) -> int:
    trained = (meta.get("training_config") or {}).get("seq_length")
    limit = max_positions if torch.cuda.is_available() else min(max_positions, 4096)
    return min(int(trained), max_positions) if trained else limit


def _load_ours(path: str, window: Optional[int], tokenizer, batch_size: int) -> tuple[EvalModel, dict]:
    from ..checkpoint import locate_checkpoint
    from ..models.loading import checkpoint_model_config, load_checkpoint_model

    where = locate_checkpoint(path)
    meta, it_dir = where.meta, where.dir
    cfg = checkpoint_model_config(path)
    window = window or _default_window(meta, cfg.max_position_embeddings)
    model, cfg = load_checkpoint_model(path, seq_length=window)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    info = {"iteration": int(meta.get("iteration", 0)), "stage": meta.get("stage"), "iter_dir": it_dir}
    return EvalModel(model, cfg, tokenizer, window, batch_size), info


def load_eval_model(path: str, tokenizer, window: Optional[int] = None, batch_size: int = 8,
                    convert_dir: Optional[str] = None) -> tuple[EvalModel, dict]:
    """(EvalModel, {"kind", "iteration", ...}) of a checkpoint (see the module docstring)."""
    kind = checkpoint_kind(path)
    if kind == OURS:
        lm, info = _load_ours(path, window, tokenizer, batch_size)
        return lm, dict(info, kind=kind)
    from ..convert import hf_to_mcore

    with tempfile.TemporaryDirectory(prefix="eval-hf-", dir=convert_dir) as tmp:
        print(f"[eval] converting the Hugging Face checkpoint {path} into {tmp}", file=sys.stderr, flush=True)
        converted = os.path.join(tmp, "checkpoint")
        hf_to_mcore(path, converted, progress=sys.stderr.isatty())
        lm, info = _load_ours(converted, window, tokenizer, batch_size)
    return lm, dict(info, kind=kind, iter_dir=None)
