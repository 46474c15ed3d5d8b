"""Coding knowledge: multiple-choice questions about the source's functions, ranked by log-likelihood.

Questions come from the Python files of the source (`ast`; top-level
functions and methods of top-level classes), deterministically in the
source and `seed`, alternating two kinds:

- signature: which definition line belongs to the function? The prompt is
  the file's path, the enclosing class and the docstring's first line as a
  comment; the options are `def NAME(PARAMS):` with the function's own
  parameters and those of other functions (methods for a method, plain
  functions for a function), under the same name;
- return: which return statement ends the function? The prompt is the
  function's source up to its last statement, a one-line `return EXPR`;
  the options are that line and the return statements of other functions,
  at the same indentation.

Every option ends in a newline and is scored as the sum of its tokens'
log-probabilities after the prompt (tokenized separately; the prompt ends in
a newline, where our tokenizer always splits): the option's likelihood, as
lm-evaluation-harness's `acc`. The highest wins (the first on a tie).
`accuracy_per_token` ranks by the mean instead (no preference for short
options). A prompt that does not fit the window with an option loses its
first tokens.
"""
from __future__ import annotations

import ast
import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from .sources import EvalSource

KINDS = ("signature", "return")
MAX_PARAMS_CHARS = 120


@dataclass(frozen=True)
class Question:
    kind: str  # KINDS
    key: str  # path:qualified name
    prompt: str
    options: tuple[str, ...]
    answer: int  # index of the correct option


@dataclass(frozen=True)
class FunctionFacts:
    key: str
    path: str
    owner: Optional[str]  # enclosing class
    name: str
    prefix: str  # "def" or "async def"
    params: str  # the signature after the name: "(a, b=1) -> int"
    docline: str
    indent: str
    body_before_return: Optional[str]  # source from the def line to the return line, exclusive
    return_line: Optional[str]  # the final `return EXPR`, stripped
    return_indent: str


def _functions(path: str, source: str) -> list[FunctionFacts]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = [(None, node) for node in tree.body]
    found += [(cls.name, node) for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body]
    facts = []
    for owner, node in found:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = f"({ast.unparse(node.args)})" + (f" -> {ast.unparse(node.returns)}" if node.returns else "")
        header = lines[node.lineno - 1]
        indent = header[:len(header) - len(header.lstrip())]
        last = node.body[-1]
        body = return_line = None
        ret = lines[last.lineno - 1]
        statements = node.body[1:] if ast.get_docstring(node) is not None else node.body
        if (isinstance(last, ast.Return) and last.value is not None and last.lineno == last.end_lineno
                and len(statements) >= 2 and ret.strip().startswith("return ")):
            body = "\n".join(lines[node.lineno - 1:last.lineno - 1]) + "\n"
            return_line = ret.strip()
        name = f"{owner}.{node.name}" if owner else node.name
        facts.append(FunctionFacts(f"{path}:{name}", path, owner, node.name,
                                   "async def" if isinstance(node, ast.AsyncFunctionDef) else "def", params,
                                   (ast.get_docstring(node) or "").strip().split("\n")[0].strip(), indent, body,
                                   return_line, ret[:len(ret) - len(ret.lstrip())]))
    return facts


def _header(f: FunctionFacts) -> str:
    return f"# {f.path}\n" + (f"class {f.owner}:\n" if f.owner else "")


def _signature_question(f: FunctionFacts, pool: list[FunctionFacts], options: int,
                        rng: random.Random) -> Optional[Question]:
    others = sorted({g.params for g in pool if (g.owner is None) == (f.owner is None) and g.params != f.params})
    if len(others) < options - 1:
        return None
    texts = [f"{f.indent}{f.prefix} {f.name}{p}:\n" for p in [f.params] + rng.sample(others, options - 1)]
    comment = f"{f.indent}# {f.docline}\n" if f.docline else ""
    return _question("signature", f, _header(f) + comment, texts, rng)


def _return_question(f: FunctionFacts, pool: list[FunctionFacts], options: int,
                     rng: random.Random) -> Optional[Question]:
    others = sorted({g.return_line for g in pool if g.return_line != f.return_line})
    if len(others) < options - 1:
        return None
    texts = [f"{f.return_indent}{line}\n" for line in [f.return_line] + rng.sample(others, options - 1)]
    return _question("return", f, _header(f) + f.body_before_return, texts, rng)


def _question(kind: str, f: FunctionFacts, prompt: str, texts: list[str], rng: random.Random) -> Question:
    """The correct option is texts[0]; shuffled."""
    order = list(range(len(texts)))
    rng.shuffle(order)
    return Question(kind, f.key, prompt, tuple(texts[i] for i in order), order.index(0))


def build_questions(source: EvalSource, count: int, options: int = 4, seed: int = 0,
                    max_chars: int = 1500) -> list[Question]:
    """Up to `count` questions, signature and return alternating (see the module docstring)."""
    if options < 2:
        raise ValueError(f"knowledge questions need >= 2 options; got {options}")
    facts = [f for path, text in source.python_files for f in _functions(path, text)]
    signature_pool = [f for f in facts if len(f.params) <= MAX_PARAMS_CHARS]
    return_pool = [f for f in facts if f.return_line is not None and len(f.body_before_return) <= max_chars]
    rng = random.Random(f"knowledge:{seed}")
    queues = {"signature": rng.sample(signature_pool, len(signature_pool)),
              "return": rng.sample(return_pool, len(return_pool))}
    makers = {"signature": (_signature_question, signature_pool), "return": (_return_question, return_pool)}
    questions, turn = [], 0
    while len(questions) < count and any(queues.values()):
        kind = KINDS[turn % 2] if queues[KINDS[turn % 2]] else KINDS[(turn + 1) % 2]
        make, pool = makers[kind]
        question = make(queues[kind].pop(), pool, options, rng)
        if question is not None:
            questions.append(question)
            turn += 1
    return questions


def option_sequences(question: Question, tokenizer, window: int) -> list[tuple[list[int], int]]:
    """Per option: (prompt + option token ids, number of option tokens), the prompt cut from the left to fit."""
    prompt = tokenizer.encode(question.prompt)
    out = []
    for option in question.options:
        ids = tokenizer.encode(option)
        if len(ids) >= window:
            raise ValueError(f"an option of {question.key} has {len(ids)} tokens; the eval window "
                             f"{window} must be longer")
        out.append((prompt[-(window - len(ids)):] + ids, len(ids)))
    return out


def score_options(lm, sequences: Sequence[list[tuple[list[int], int]]]) -> list[list[tuple[float, int]]]:
    """Per question, per option: (sum of the option tokens' log-probs, their count)."""
    flat = [seq for question in sequences for seq in question]
    logprobs = iter(lm.logprobs([ids for ids, _ in flat]))
    return [[(float(next(logprobs)[-n:].sum()), n) for _, n in question] for question in sequences]


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def summarize_knowledge(questions: Sequence[Question], scores: Sequence[list[tuple[float, int]]]) -> dict:
    n = len(questions)
    hits = [_argmax([s for s, _ in row]) == q.answer for q, row in zip(questions, scores)]
    norm_hits = [_argmax([s / c for s, c in row]) == q.answer for q, row in zip(questions, scores)]
    by_kind = {}
    for kind in KINDS:
        mine = [h for q, h in zip(questions, hits) if q.kind == kind]
        if mine:
            by_kind[kind] = {"accuracy": sum(mine) / len(mine), "questions": len(mine)}
    return {"accuracy": sum(hits) / n if n else float("nan"),
            "accuracy_per_token": sum(norm_hits) / n if n else float("nan"),
            "correct": sum(hits), "questions": n,
            "options": len(questions[0].options) if n else 0,
            "chance": 1 / len(questions[0].options) if n else float("nan"), "by_kind": by_kind,
            "mean_correct_logprob": math.fsum(row[q.answer][0] for q, row in zip(questions, scores)) / n if n else float("nan")}
