"""Codebase perplexity: NLL of a repository's files concatenated in path order, over a rolling window.

The token stream is EOD, then each file's tokens followed by EOD, files in
alphabetical order of path (`EvalSource`): the documents of a packed CPT
sample. The leading EOD is context only, so every token of every file (and
each file's closing EOD) is scored.

Rolling window (`rolling_windows`): the model sees at most `window` tokens.
The first window is tokens [0, window); each next one ends `stride` tokens
further (the last one at the end of the stream) and starts `window` tokens
before its end. A window scores only the tokens past the previous window's
end, so every token is scored exactly once, and every token outside the
first window is scored with at least `window - stride` tokens of context.
The default stride is window / 2: each token costs two positions of forward
compute on average and sees between half a window and a whole window.

Reported: total NLL (nats, summed over scored tokens), NLL per token,
perplexity = exp(NLL per token), and bits per UTF-8 byte of the files
(comparable across tokenizers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) go through the model; targets [first, end) are scored (first > begin)."""

    begin: int
    end: int
    first: int


def rolling_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows that score tokens 1 .. num_tokens - 1 exactly once (token 0 is context only)."""
    if window < 2 or not 1 <= stride <= window - 1:
        raise ValueError(f"rolling window {window} with stride {stride}: need window >= 2 and "
                         f"1 <= stride <= window - 1 (e.g. stride = window // 2 = {window // 2})")
    if num_tokens < 2:
        return []
    windows, end = [Window(0, min(window, num_tokens), 1)], min(window, num_tokens)
    while end < num_tokens:
        new_end = min(end + stride, num_tokens)
        windows.append(Window(max(0, new_end - window), new_end, end))
        end = new_end
    return windows


def codebase_tokens(files: Sequence[tuple[str, str]], tokenizer) -> list[int]:
    """EOD + each file's tokens + EOD, in the given (path) order."""
    tokens = [tokenizer.eod]
    for _, text in files:
        tokens += tokenizer.encode(text)
        tokens.append(tokenizer.eod)
    return tokens


def window_nlls(lm, tokens: Sequence[int], windows: Sequence[Window]) -> list[tuple[float, int]]:
    """(NLL summed over the window's scored targets, their count) per window, float64 sums."""
    sequences = [list(tokens[w.begin:w.end]) for w in windows]
    out = []
    for w, logprobs in zip(windows, lm.logprobs(sequences)):
        scored = logprobs[w.first - w.begin - 1:]  # logprobs[j] is of token begin + j + 1
        out.append((-float(scored.double().sum()), int(scored.numel())))
    return out


def summarize_nll(parts: Sequence[tuple[float, int]], num_bytes: int) -> dict:
    """Totals of `window_nlls` parts; `num_bytes`: UTF-8 bytes of the scored text."""
    total = math.fsum(nll for nll, _ in parts)
    tokens = sum(n for _, n in parts)
    per_token = total / tokens if tokens else float("nan")
    return {"total_nll": total, "tokens": tokens, "nll_per_token": per_token,
            "perplexity": math.exp(per_token) if tokens else float("nan"),
            "bits_per_byte": total / math.log(2) / num_bytes if num_bytes else float("nan")}


def scored_bytes(tokens: Sequence[int], windows: Sequence[Window], tokenizer) -> int:
    """UTF-8 bytes of the text the windows score (EOD decodes to nothing)."""
    if not windows:
        return 0
    return len(tokenizer.decode(list(tokens[1:windows[-1].end])).encode("utf-8"))


def codebase_perplexity(lm, tokens: Sequence[int], stride: Optional[int] = None,
                        max_windows: Optional[int] = None) -> dict:
    """Rolling-window NLL of `tokens` under `lm` (an `EvalModel`) in one process; `max_windows`
    scores only the first windows (a bounded eval during training)."""
    stride = stride or lm.window // 2
    windows = rolling_windows(len(tokens), lm.window, stride)[:max_windows]
    result = summarize_nll(window_nlls(lm, tokens, windows), scored_bytes(tokens, windows, lm.tokenizer))
    return dict(result, window=lm.window, stride=stride, windows=len(windows))
