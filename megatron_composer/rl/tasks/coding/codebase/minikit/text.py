"""Text helpers: slugs, words, case conversion and wrapping."""
import re

SMALL_WORDS = frozenset({"a", "an", "and", "in", "of", "on", "or", "the", "to"})


def slugify(text):
    """Lower-case `text` and join its runs of letters and digits with "-": "Hello, World!" -> "hello-world"."""
    return "-".join(re.findall(r"[a-z0-9]+", text.lower()))


def words(text):
    """The words of `text`: runs of letters, digits and apostrophes, in order."""
    return re.findall(r"[A-Za-z0-9']+", text)


def title_case(text):
    """`text`'s words capitalized and joined by spaces, except SMALL_WORDS after the first word."""
    out = []
    for i, word in enumerate(words(text)):
        lower = word.lower()
        out.append(lower if i > 0 and lower in SMALL_WORDS else lower.capitalize())
    return " ".join(out)


def snake_to_camel(name):
    """"max_retry_count" -> "maxRetryCount"; empty parts (from doubled underscores) are dropped."""
    parts = [p for p in name.split("_") if p]
    if not parts:
        return ""
    return parts[0].lower() + "".join(p.capitalize() for p in parts[1:])


def camel_to_snake(name):
    """"maxRetryCount" -> "max_retry_count": an underscore before each upper-case letter that follows a lower-case letter or digit."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def wrap(text, width):
    """Greedily wrap `text`'s space-separated words into lines of at most `width` characters.

    A word longer than `width` gets a line of its own.
    """
    lines, current = [], ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def count_words(text):
    """How often each word of `text` occurs, case-insensitively: {lower-case word: count}."""
    counts = {}
    for word in words(text):
        counts[word.lower()] = counts.get(word.lower(), 0) + 1
    return counts


def is_anagram(a, b):
    """Whether `a` and `b` use the same letters, ignoring case, spaces and punctuation."""
    def letters(s):
        return sorted(ch.lower() for ch in s if ch.isalnum())
    return letters(a) == letters(b)
