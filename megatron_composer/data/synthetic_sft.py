"""A deterministic synthetic chat SFT set written from Python source, with only the stdlib.

Each documented function or method becomes "complete this body" and each
module with several documented definitions "what does it define": real code
as targets, no model or network needed, the same bytes on every machine.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

from megatron_composer.data.corpus import module_name


def _strip_indent(text: str, indent: str) -> str:
    return "".join(
        line[len(indent) :] if line.startswith(indent) else line for line in text.splitlines(keepends=True)
    )


def _first_line(docstring: str | None) -> str:
    return (docstring or "").strip().split("\n")[0].strip()


def sft_examples_from_source(source: str, module: str, max_chars: int = 1400) -> list[tuple[str, list[dict]]]:
    """Synthetic coding conversations from one module's source, keyed for stable selection.

    - per documented top-level function or method of a top-level class: the
      user gives the signature and docstring, the assistant writes the body;
    - per module with at least two documented top-level definitions: the
      user asks what it defines, the assistant lists them with signatures.

    Returns:
        [(key, messages)], empty when ``source`` does not parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    examples = []
    candidates = [(None, node) for node in tree.body]
    candidates += [
        (cls.name, node) for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body
    ]
    for owner, node in candidates:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        if ast.get_docstring(node) is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        indent = lines[start - 1][: len(lines[start - 1]) - len(lines[start - 1].lstrip())]
        header = _strip_indent("".join(lines[start - 1 : node.body[0].end_lineno]), indent)
        body = _strip_indent("".join(lines[node.body[0].end_lineno : node.end_lineno]), indent)
        if not body.strip() or len(header) + len(body) > max_chars:
            continue
        name = f"{owner}.{node.name}" if owner else node.name
        kind = "method" if owner else "function"
        user = f"Complete the {kind} `{name}` from module `{module}`:\n\n```python\n{header.rstrip()}\n```"
        assistant = f"```python\n{body.rstrip()}\n```"
        examples.append(
            (
                f"{module}:{name}",
                [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
            )
        )
    listing = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and ast.get_docstring(node):
            listing.append(f"- class `{node.name}`: {_first_line(ast.get_docstring(node))}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            listing.append(
                f"- function `{node.name}({ast.unparse(node.args)})`: {_first_line(ast.get_docstring(node))}"
            )
    answer = f"The module `{module}` defines:\n" + "\n".join(listing[:30])
    if len(listing) >= 2 and len(answer) <= max_chars:
        question = f"What does the module `{module}` define at the top level?"
        system = "You are an expert Python programmer. Answer concisely."
        examples.append(
            (
                f"{module}:__overview__",
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ],
            )
        )
    return examples


def build_sft_jsonl(
    path: str | Path, files: Sequence[str | Path], max_examples: int, root: Path | None = None
) -> int:
    """Write a deterministic synthetic chat SFT set built from Python source ``files``.

    Candidates from every file (``sft_examples_from_source``) are ordered by
    the sha1 of their ``module:name`` key and the first ``max_examples`` kept,
    so the set spreads over many modules and is the same on every machine.
    Written through a temporary name. Returns the number of examples.
    """
    candidates = []
    for file in files:
        try:
            source = Path(file).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        candidates += sft_examples_from_source(source, module_name(Path(file), root))
    candidates.sort(key=lambda item: hashlib.sha1(item[0].encode("utf-8")).hexdigest())
    chosen = candidates[:max_examples]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as stream:
            for _, messages in chosen:
                stream.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(chosen)
