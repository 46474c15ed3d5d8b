"""gather: read k files (3 to 6), then write their words, in order, to one file.

"Each of the files `a.txt`, `b.txt`, `c.txt` holds one word. Create
`answer.txt` containing those words in that order, joined by commas."
The workspace holds the k files (named by the first k letters, so the
tasks differ only in what the files hold), each one word that only reading
it tells, so the answer needs every file read; no read depends on another, so an
agent can make all k reads in one message (a list of calls) or one per
message. This is the family `benchmarks/parallel_tools.py` trains on: the
number of turns an episode takes measures how the agent batches its reads.
Two hidden tests: the answer file exists, and it holds exactly the words
joined by commas, `day,float,left` (one trailing newline allowed).

The word of each file comes from that file's own list of six (`LISTS`:
`a.txt` a unit of time, `b.txt` a type name, `c.txt` a direction, ...),
every word one token of the embedded tokenizer, in the tool response and
after a comma alike, and none of them a word of the agent's prompt. So the
answer's i-th word can be found by what it is (the one word of list i among
the tool responses), not by counting responses or matching keys. With one
shared list the tiny model (2.4M parameters, whose short CPT forms no
induction heads) wrote one constant word everywhere after 1000 SFT steps;
with these lists it writes a word of the right list in each place after
1600, but mostly not the one it read (README, "Measurements on the gather
and write-file families").
Guessing without reading solves a task with probability 6^-k <= 1/216.
"""
from __future__ import annotations

import random

from .task import CodingTask, Edit

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
LISTS = {  # the words file `<letter>.txt` may hold
    "a": ("day", "hour", "week", "month", "year", "second"),
    "b": ("int", "float", "bytes", "dict", "tuple", "char"),
    "c": ("left", "right", "top", "down", "back", "forward"),
    "d": ("open", "close", "seek", "flush", "fork", "wait"),
    "e": ("true", "null", "zero", "yes", "empty", "full"),
    "f": ("tree", "queue", "stack", "heap", "table", "block"),
}


def make_task(words: tuple[str, ...]) -> CodingTask:
    """The task over files `a.txt`, `b.txt`, ... holding `words`, in that order."""
    names = tuple(NAMES[:len(words)])
    paths = tuple(f"{n}.txt" for n in names)
    listed = ", ".join(f"`{p}`" for p in paths)
    content = ",".join(words)
    return CodingTask(
        key=f"{FAMILY}/{'+'.join(names)}:{'_'.join(words)}", family=FAMILY,
        instruction=(f"Each of the files {listed} holds one word. Create `{ANSWER}` containing those words "
                     f"in that order, joined by commas."),
        files={p: w + "\n" for p, w in zip(paths, words)},
        tests={TEST_PATH: TEST_TEMPLATE.format(path=ANSWER, content=content)},
        solution=(Edit(ANSWER, None, content),), reads=paths, test_timeout_s=10.0)


def generate() -> list[CodingTask]:
    """POOL_SIZE distinct tasks drawn with a fixed seed: k of READS, then file i's word from LISTS[i]."""
    rng, seen, tasks = random.Random(f"{FAMILY}/v3"), set(), []
    while len(tasks) < POOL_SIZE:
        words = tuple(rng.choice(LISTS[n]) for n in NAMES[:rng.choice(READS)])
        if words not in seen:
            seen.add(words)
            tasks.append(make_task(words))
    return tasks
