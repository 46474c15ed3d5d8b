"""fix-bug: undo a one-token bug that a named, visible test catches.

Each module below holds a few short functions and a test per function
(`test_<function>`). A task plants ONE bug (an operator swap, an off-by-one
constant, a flipped comparison: a `(correct, buggy)` fragment pair that occurs
once in the module) and names the test that now fails. The reference solution
replaces the buggy line by the correct one.
"""
from __future__ import annotations

from .task import CodingTask, Edit

FAMILY = "fix-bug"
DESCRIPTION = "fix a one-token bug in a short function; the instruction names the failing visible test"

SCORING = '''"""Scores: clamping, averages and running totals."""


def clamp(value, low, high):
    """`value` limited to the closed range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    """The arithmetic mean of a non-empty list of numbers."""
    return sum(values) / len(values)


def count_above(values, threshold):
    """How many of `values` are strictly greater than `threshold`."""
    return sum(1 for v in values if v > threshold)


def running_total(values):
    """The prefix sums of `values`: [v0, v0 + v1, ...]."""
    total = 0
    out = []
    for v in values:
        total += v
        out.append(total)
    return out
'''

SCORING_TESTS = '''from scoring import clamp, count_above, mean, running_total


def test_clamp():
    assert clamp(5, 0, 10) == 5
    assert clamp(-3, 0, 10) == 0
    assert clamp(42, 0, 10) == 10


def test_mean():
    assert mean([1, 2]) == 1.5
    assert mean([4]) == 4


def test_count_above():
    assert count_above([1, 5, 7, 5, 9], 5) == 2
    assert count_above([], 0) == 0


def test_running_total():
    assert running_total([1, 2, 3]) == [1, 3, 6]
    assert running_total([]) == []
'''

RANGES = '''"""Integer ranges and intervals."""


def inclusive_range(start, stop):
    """The integers from `start` to `stop`, both included."""
    return list(range(start, stop + 1))


def overlaps(a_start, a_end, b_start, b_end):
    """Whether the half-open intervals [a_start, a_end) and [b_start, b_end) share a point."""
    return a_start < b_end and b_start < a_end


def chunk_count(length, size):
    """How many chunks of `size` items hold `length` items."""
    return (length + size - 1) // size


def last_index(items, target):
    """The index of the last occurrence of `target` in `items`, or -1."""
    for i in range(len(items) - 1, -1, -1):
        if items[i] == target:
            return i
    return -1
'''

RANGES_TESTS = '''from ranges import chunk_count, inclusive_range, last_index, overlaps


def test_inclusive_range():
    assert inclusive_range(2, 5) == [2, 3, 4, 5]
    assert inclusive_range(3, 3) == [3]


def test_overlaps():
    assert overlaps(0, 5, 3, 8)
    assert not overlaps(0, 2, 2, 4)
    assert not overlaps(6, 9, 0, 3)
    assert not overlaps(4, 6, 1, 4)


def test_chunk_count():
    assert chunk_count(10, 3) == 4
    assert chunk_count(9, 3) == 3
    assert chunk_count(0, 4) == 0
    assert isinstance(chunk_count(7, 2), int)


def test_last_index():
    assert last_index([1, 2, 1, 3], 1) == 2
    assert last_index([7, 8], 7) == 0
    assert last_index([], 7) == -1
'''

TEXTOPS = '''"""Small string operations."""


def initials(name):
    """The upper-case first letters of the words of `name`: "ada lovelace" -> "AL"."""
    return "".join(word[0].upper() for word in name.split())


def truncate(text, width):
    """`text` cut to at most `width` characters, ending in "..." when it was cut."""
    if len(text) <= width:
        return text
    return text[: width - 3] + "..."


def count_vowels(text):
    """How many characters of `text` are vowels (a, e, i, o, u, in either case)."""
    return sum(1 for ch in text.lower() if ch in "aeiou")


def is_palindrome(text):
    """Whether `text` reads the same backwards, ignoring case and non-letters."""
    letters = [ch.lower() for ch in text if ch.isalpha()]
    return letters == letters[::-1]
'''

TEXTOPS_TESTS = '''from textops import count_vowels, initials, is_palindrome, truncate


def test_initials():
    assert initials("ada lovelace") == "AL"
    assert initials("Grace Brewster Hopper") == "GBH"


def test_truncate():
    assert truncate("hello", 5) == "hello"
    assert truncate("hello world", 8) == "hello..."
    assert len(truncate("abcdefghij", 6)) == 6


def test_count_vowels():
    assert count_vowels("Education") == 5
    assert count_vowels("rhythm") == 0


def test_is_palindrome():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("palindrome")
'''

GRID = '''"""Points and neighbours on a grid."""


def neighbors(row, col, rows, cols):
    """The in-bounds up, down, left and right neighbours of (row, col) on a rows x cols grid."""
    found = []
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        r, c = row + dr, col + dc
        if 0 <= r < rows and 0 <= c < cols:
            found.append((r, c))
    return found


def manhattan(a, b):
    """The Manhattan distance between the points `a` and `b` (tuples of equal length)."""
    return sum(abs(x - y) for x, y in zip(a, b))


def cell_index(row, col, cols):
    """The row-major index of (row, col) on a grid with `cols` columns."""
    return row * cols + col
'''

GRID_TESTS = '''from grid import cell_index, manhattan, neighbors


def test_neighbors():
    assert sorted(neighbors(0, 0, 3, 3)) == [(0, 1), (1, 0)]
    assert sorted(neighbors(2, 2, 3, 3)) == [(1, 2), (2, 1)]
    assert len(neighbors(1, 1, 3, 3)) == 4


def test_manhattan():
    assert manhattan((1, 2), (4, 6)) == 7
    assert manhattan((0, 0, 0), (0, 0, 0)) == 0


def test_cell_index():
    assert cell_index(0, 0, 4) == 0
    assert cell_index(2, 3, 4) == 11
    assert cell_index(1, 0, 5) == 5
'''

# module name -> (source, visible tests, [(function, correct fragment, buggy fragment)])
MODULES = {
    "scoring": (SCORING, SCORING_TESTS, [
        ("clamp", "value > high", "value < high"),
        ("clamp", "value < low", "value > low"),
        ("mean", "sum(values) / len(values)", "sum(values) // len(values)"),
        ("count_above", "v > threshold", "v >= threshold"),
        ("count_above", "v > threshold", "v < threshold"),
        ("running_total", "total += v", "total -= v"),
        ("running_total", "total = 0", "total = 1"),
    ]),
    "ranges": (RANGES, RANGES_TESTS, [
        ("inclusive_range", "stop + 1", "stop - 1"),
        ("inclusive_range", "stop + 1", "stop"),
        ("overlaps", "a_start < b_end", "a_start <= b_end"),
        ("overlaps", "b_end and b_start", "b_end or b_start"),
        ("chunk_count", "size - 1", "size + 1"),
        ("chunk_count", "// size", "/ size"),
        ("last_index", "- 1, -1, -1)", "- 1, 0, -1)"),
        ("last_index", "items[i] == target", "items[i] != target"),
    ]),
    "textops": (TEXTOPS, TEXTOPS_TESTS, [
        ("initials", "word[0]", "word[1]"),
        ("truncate", "len(text) <= width", "len(text) < width"),
        ("truncate", "width - 3", "width - 2"),
        ("count_vowels", 'ch in "aeiou"', 'ch not in "aeiou"'),
        ("is_palindrome", "letters == letters", "letters != letters"),
        ("is_palindrome", "ch.isalpha()", "not ch.isalpha()"),
    ]),
    "grid": (GRID, GRID_TESTS, [
        ("neighbors", "r < rows", "r <= rows"),
        ("neighbors", "0 <= c", "0 < c"),
        ("manhattan", "abs(x - y)", "abs(x + y)"),
        ("cell_index", "row * cols + col", "row * cols - col"),
        ("cell_index", "row * cols + col", "row + cols + col"),
    ]),
}


def _line_with(source: str, fragment: str) -> str:
    """The one whole line (newline included) of `source` that holds `fragment`."""
    lines = [line for line in source.splitlines(keepends=True) if fragment in line]
    if len(lines) != 1 or source.count(fragment) != 1:
        raise ValueError(f"{FAMILY}: fragment {fragment!r} must occur once, on one line")
    return lines[0]


def make_task(module: str, function: str, correct: str, buggy: str, variant: int) -> CodingTask:
    source, tests = MODULES[module][:2]
    path, test_path = f"{module}.py", f"tests/test_{module}.py"
    good_line = _line_with(source, correct)
    bad_line = good_line.replace(correct, buggy)
    bad_source = source.replace(good_line, bad_line)
    _line_with(bad_source, bad_line.strip())  # the solution's search text is unique
    return CodingTask(
        key=f"{FAMILY}/{module}.{function}/{variant}", family=FAMILY,
        instruction=f"The test test_{function} in {test_path} fails. Fix the bug in {path}.",
        files={path: bad_source, test_path: tests}, tests={test_path: tests},
        solution=(Edit(path, bad_line, good_line),), reads=(test_path, path), test_timeout_s=10.0)


def generate() -> list[CodingTask]:
    """One task per planted bug; a bug's key is its function and its index among that function's bugs."""
    tasks = []
    for module, (_, _, bugs) in MODULES.items():
        for i, (function, correct, buggy) in enumerate(bugs):
            variant = sum(f == function for f, _, _ in bugs[:i])
            tasks.append(make_task(module, function, correct, buggy, variant))
    return tasks
