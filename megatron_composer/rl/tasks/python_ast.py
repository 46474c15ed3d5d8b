"""`ast.parse` that is safe to call from many threads at once.

CPython 3.11 converts a parse tree into `ast` objects with one recursion
counter per interpreter, not per thread. When a thread switch happens inside
that conversion (a garbage collection running a finalizer or a `gc.callbacks`
hook releases the GIL) and another thread parses meanwhile, the counter no
longer balances and the parse raises `SystemError: AST constructor recursion
depth mismatch` (CPython gh-106905, fixed in 3.12.1+ / 3.13). Episodes are
scored in threads (`agentic.AgenticCodingEnv.episodes`, the synchronous
driver's groups), so every parse of reward and verification code goes through
`parse_python`, which holds one process-wide lock; so does anything else
that parses in such a thread, such as logging an exception's traceback
(3.11's traceback module parses the source lines for its `^^^` markers).
Parsing is fast (about a
millisecond for a test file) next to an episode's sandboxed test run, so the
lock costs no measurable throughput.
"""
from __future__ import annotations

import ast
import threading
import warnings

# Re-entrant: code that calls a parser itself (pyflakes parses string annotations) holds it around that
# call and its own `parse_python`.
PARSE_LOCK = threading.RLock()


def parse_python(source: str, filename: str = "<unknown>", *, quiet: bool = False) -> ast.Module:
    """`ast.parse(source, filename)` under the process-wide lock (module docstring). `quiet`: drop the
    SyntaxWarnings a parse may emit (invalid escapes in code the model wrote); the warning filters are
    process state too, so they are changed under the same lock."""
    with PARSE_LOCK:
        if not quiet:
            return ast.parse(source, filename=filename)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(source, filename=filename)
