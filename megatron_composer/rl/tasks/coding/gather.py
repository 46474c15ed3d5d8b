"""gather: read k files (3 to 6), then write their words, in order, to one file.

"Each of the files `a.txt`, `b.txt`, `c.txt` holds one word. Create
`answer.txt` containing those words in that order, separated by spaces."
The workspace holds the k files (named by the first k letters, so the
tasks differ only in what the files hold), each one word that only reading
it tells, so the answer needs every file read; no read depends on another, so an
agent can make all k reads in one message (a list of calls) or one per
message. This is the family `benchmarks/parallel_tools.py` trains on: the
number of turns an episode takes measures how the agent batches its reads.
Two hidden tests: the answer file exists, and it holds exactly the words
(one trailing newline allowed). The words come from write-file's word list
and the names are letters so that a tiny model can learn the family: what it
must copy is the words it read.
"""
from __future__ import annotations

import random

from .task import CodingTask, Edit
from .write_file import WORDS

FAMILY = "gather"
DESCRIPTION = "read k = 3-6 files of one word each, then write their words in order to answer.txt"
POOL_SIZE = 4096
READS = (3, 4, 5, 6)  # k, the independent reads each task needs
ANSWER = "answer.txt"
TEST_PATH = "tests/test_gather.py"

TEST_TEMPLATE = '''from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = {path!r}
CONTENT = {content!r}


def test_answer_exists():
    assert (ROOT / PATH).is_file(), f"{{PATH}} does not exist"


def test_answer_content():
    text = (ROOT / PATH).read_text(encoding="utf-8")
    assert text in (CONTENT, CONTENT + "\\n"), f"{{PATH}} holds {{text!r}}, not {{CONTENT!r}}"
'''


NAMES = "abcdef"  # the files of a task with k reads: the first k letters


def make_task(words: tuple[str, ...]) -> CodingTask:
    """The task over files `a.txt`, `b.txt`, ... holding `words`, in that order."""
    names = tuple(NAMES[:len(words)])
    paths = tuple(f"{n}.txt" for n in names)
    listed = ", ".join(f"`{p}`" for p in paths)
    content = " ".join(words)
    return CodingTask(
        key=f"{FAMILY}/{'+'.join(names)}:{'_'.join(words)}", family=FAMILY,
        instruction=(f"Each of the files {listed} holds one word. Create `{ANSWER}` containing those words "
                     f"in that order, separated by spaces."),
        files={p: w + "\n" for p, w in zip(paths, words)},
        tests={TEST_PATH: TEST_TEMPLATE.format(path=ANSWER, content=content)},
        solution=(Edit(ANSWER, None, content),), reads=paths, test_timeout_s=10.0)


def generate() -> list[CodingTask]:
    """POOL_SIZE distinct tasks drawn with a fixed seed: k of READS, then k words (repeats allowed)."""
    rng, seen, tasks = random.Random(f"{FAMILY}/v2"), set(), []
    while len(tasks) < POOL_SIZE:
        words = tuple(rng.choice(WORDS) for _ in range(rng.choice(READS)))
        if words not in seen:
            seen.add(words)
            tasks.append(make_task(words))
    return tasks
