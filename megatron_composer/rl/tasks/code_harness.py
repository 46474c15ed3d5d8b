"""Run a code task's tests against a program one test unit at a time (inside the sandbox).

This file is standard-library only: `code_tests.run_code_tests` sends its
source to the sandbox's `python3 -c` and the task as JSON on stdin
(`{"nonce", "program", "tests", "entry_point"}`); the host imports it too, to
count the units of a task's tests the same way (`test_plan`).

The units of a tests source, by its shape:

    functions  top-level `def test*()`: each call is one unit (pytest style)
    check      a top-level `def check(candidate)` (HumanEval): each statement
               of its body that asserts (an `assert`, or a loop or block with
               one inside) is a unit, `candidate` bound to the entry point
    asserts    otherwise (MBPP's test_list): each top-level statement that
               asserts is a unit

Statements run in order in one namespace with the program's. A unit that
fails or raises fails alone; any other statement (setup) that raises fails
every unit after it. A program that raises, or lacks a callable entry point,
fails every unit.

Each unit's verdict is written as `<nonce> <index> pass|fail` on a copy of
stdout taken before the program runs; the program's own stdout and stderr go
to /dev/null, so it can neither flood the pipe nor print a verdict without
the nonce (read from stdin before the program runs). Units never reported
(the program exited or hung) count as failed. Limit: the program runs in this
process, so code written to search the interpreter's memory for the nonce is
not stopped here (the same limit as the agentic tests' pytest run).
"""
import ast
import json
import os
import sys

CHECK = "check"


def test_plan(tests: str):
    """(kind, prelude statements, steps) of a tests source; steps are (statement, counted as a unit).
    SyntaxError where it does not parse."""
    module = ast.parse(tests)
    tests_fns = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    if tests_fns:
        calls = [ast.Expr(ast.Call(ast.Name(f.name, ast.Load()), [], [])) for f in tests_fns]
        return "functions", module.body, [(c, True) for c in calls]
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == CHECK]
    if checks:
        prelude = [n for n in module.body if n is not checks[-1]]
        return "check", prelude, [(s, _asserts(s)) for s in checks[-1].body]
    return "asserts", [], [(s, _asserts(s)) for s in module.body]


def _asserts(statement) -> bool:
    """Whether a statement is an assert or holds one (a loop of asserts is one unit)."""
    return any(isinstance(node, ast.Assert) for node in ast.walk(statement))


def unit_count(tests: str) -> int:
    """How many units `tests` has (module docstring)."""
    return sum(counted for _, counted in test_plan(tests)[2])


def _compile(statements):
    module = ast.fix_missing_locations(ast.Module(body=list(statements), type_ignores=[]))
    return compile(module, "<tests>", "exec")


def run(spec: dict, report) -> None:
    """Run `spec`'s tests against its program, calling report(index, passed) once per unit."""
    kind, prelude, steps = test_plan(spec["tests"])
    total = sum(counted for _, counted in steps)
    namespace = {"__name__": "__solution__"}
    try:
        exec(compile(spec["program"], "<solution>", "exec"), namespace)
        entry = namespace.get(spec["entry_point"])
        if not callable(entry):
            raise NameError(f"no function {spec['entry_point']!r}")
        if kind == "check":
            namespace["candidate"] = entry  # check's parameter, as a name its statements see
        exec(_compile(prelude), namespace)
    except BaseException:
        for index in range(total):
            report(index, False)
        return
    index = 0
    for statement, counted in steps:
        try:
            exec(_compile([statement]), namespace)
            ok = True
        except BaseException:
            ok = False
        if counted:
            report(index, ok)
            index += 1
        elif not ok:
            for rest in range(index, total):
                report(rest, False)
            return


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    nonce = spec.pop("nonce")
    out = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)

    def report(index, passed):
        os.write(out, f"{nonce} {index} {'pass' if passed else 'fail'}\n".encode())

    run(spec, report)
    os._exit(0)  # no atexit hooks or finalizers of the program


if __name__ == "__main__":
    main()
