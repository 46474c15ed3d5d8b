"""write-file: create one file with a given content (the simplest family).

"Create the file `data/lamp.txt` containing exactly `red river`." The
workspace starts empty and the tests are hidden. Two tests: the file exists,
and its content is the requested text, allowing ONE trailing newline (editors
and models often end a file with one; nothing else is tolerated). Paths and
contents come from small word lists so a tiny model can learn the family.
"""
from __future__ import annotations

import random

from .task import CodingTask, Edit

FAMILY = "write-file"
DESCRIPTION = "create one file holding an exact short text (empty workspace, hidden tests)"
POOL_SIZE = 4096
TEST_PATH = "tests/test_write_file.py"

WORDS = ("alpha", "amber", "apple", "bird", "blue", "cloud", "copper", "delta", "echo", "fern", "gold",
         "green", "hello", "honey", "lamp", "lemon", "maple", "moon", "north", "ocean", "pixel", "quartz",
         "red", "river", "silver", "stone", "sun", "tiger", "vector", "world")
DIRS = ("", "data/", "docs/", "notes/", "out/")
EXTENSIONS = ("txt", "md", "csv")

TEST_TEMPLATE = '''from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = {path!r}
CONTENT = {content!r}


def test_file_exists():
    assert (ROOT / PATH).is_file(), f"{{PATH}} does not exist"


def test_file_content():
    text = (ROOT / PATH).read_text(encoding="utf-8")
    assert text in (CONTENT, CONTENT + "\\n"), f"{{PATH}} holds {{text!r}}, not {{CONTENT!r}}"
'''


def make_task(path: str, content: str) -> CodingTask:
    return CodingTask(
        key=f"{FAMILY}/{path}:{content.replace(' ', '_')}", family=FAMILY,
        instruction=f"Create the file `{path}` containing exactly `{content}`.",
        files={}, tests={TEST_PATH: TEST_TEMPLATE.format(path=path, content=content)},
        solution=(Edit(path, None, content),), test_timeout_s=10.0)


def generate() -> list[CodingTask]:
    """POOL_SIZE distinct (path, content) tasks drawn with a fixed seed."""
    rng, seen, tasks = random.Random(f"{FAMILY}/v1"), set(), []
    while len(tasks) < POOL_SIZE:
        path = f"{rng.choice(DIRS)}{rng.choice(WORDS)}.{rng.choice(EXTENSIONS)}"
        content = " ".join(rng.sample(WORDS, rng.choice((1, 2, 2, 3))))
        if (path, content) not in seen:
            seen.add((path, content))
            tasks.append(make_task(path, content))
    return tasks
