"""Text helpers for report titles and paragraphs."""


def slugify(title):
    """The lower-case words of `title` joined by '-', other characters dropped: "Hello, World!" -> "hello-world"."""
    cleaned = "".join(ch if ch.isalnum() else " " for ch in title.lower())
    return "-".join(cleaned.split())


def wrap(text, width):
    """Greedy word wrap into lines of at most `width` characters (a longer word gets a line of its own)."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) >= width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
