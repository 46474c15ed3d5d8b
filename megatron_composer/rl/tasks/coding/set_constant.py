"""set-constant: change one named constant so that a visible test passes.

A module (`config.py`, `settings.py`, ...) defines three integer constants
and `capped(value)`, which clips by the target constant; the visible test
expects the target at a new value, `capped` to follow it, and the other two
constants unchanged (so the unsolved state scores 1/3, not 0). The new value
is only in the test, so an expert reads the test, then the module.
"""
from __future__ import annotations

import random

from .task import CodingTask, Edit

FAMILY = "set-constant"
DESCRIPTION = "change a named constant in a small module so that its visible test passes"
MODULES = ("config", "settings", "limits", "defaults", "options")
NAMES = ("LIMIT", "MAX_RETRIES", "TIMEOUT_SECONDS", "BATCH_SIZE", "PORT_OFFSET", "WORKERS", "PAGE_SIZE",
         "MAX_DEPTH", "BUFFER_KB", "THRESHOLD")
VARIANTS = 8  # (old, new) value pairs per module and constant

MODULE_TEMPLATE = '''"""Settings of the service."""

{a} = {a_value}
{target} = {old}
{b} = {b_value}


def capped(value):
    """`value`, at most {target}."""
    return min(value, {target})
'''

TEST_TEMPLATE = '''from {module} import {a}, {b}, {target}, capped


def test_{target_lower}():
    assert {target} == {new}


def test_capped_follows_{target_lower}():
    assert capped(10_000) == {new}
    assert capped(1) == 1


def test_other_settings_unchanged():
    assert ({a}, {b}) == ({a_value}, {b_value})
'''


def make_task(module: str, target: str, variant: int) -> CodingTask:
    rng = random.Random(f"{FAMILY}/{module}/{target}/{variant}")
    a, b = rng.sample([n for n in NAMES if n != target], 2)
    old, new = rng.sample(range(5, 100), 2)
    fields = dict(module=module, target=target, target_lower=target.lower(), a=a, b=b, old=old, new=new,
                  a_value=rng.randrange(2, 100), b_value=rng.randrange(2, 100))
    path, test_path = f"{module}.py", f"tests/test_{module}.py"
    source, test = MODULE_TEMPLATE.format(**fields), TEST_TEMPLATE.format(**fields)
    search = f"{target} = {old}\n"
    if source.count(search) != 1:
        raise ValueError(f"{FAMILY}: {search!r} is not unique in {path}")
    return CodingTask(
        key=f"{FAMILY}/{module}/{target}/{old}-{new}", family=FAMILY,
        instruction=f"Change {target} in {path} so that the tests in {test_path} pass.",
        files={path: source, test_path: test}, tests={test_path: test},
        solution=(Edit(path, search, f"{target} = {new}\n"),), reads=(test_path, path), test_timeout_s=10.0)


def generate() -> list[CodingTask]:
    """Every module x constant x variant, keys deduplicated (399 of the 400 are distinct)."""
    tasks = {}
    for module in MODULES:
        for target in NAMES:
            for variant in range(VARIANTS):
                task = make_task(module, target, variant)
                tasks.setdefault(task.key, task)
    return list(tasks.values())
