"""Small data structures: a stack, a least-recently-used cache, and list helpers."""
from collections import OrderedDict


class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self._items = []

    def __len__(self):
        return len(self._items)

    def push(self, item):
        """Put `item` on top of the stack."""
        self._items.append(item)

    def pop(self):
        """Remove and return the top item; IndexError when the stack is empty."""
        if not self._items:
            raise IndexError("pop from an empty Stack")
        return self._items.pop()

    def peek(self):
        """The top item, left in place; IndexError when the stack is empty."""
        if not self._items:
            raise IndexError("peek at an empty Stack")
        return self._items[-1]

    def is_empty(self):
        """Whether the stack holds no items."""
        return not self._items


class LRUCache:
    """A mapping of at most `capacity` entries that evicts the least recently used one."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries = OrderedDict()

    def __len__(self):
        return len(self._entries)

    def get(self, key, default=None):
        """The value for `key` (which becomes the most recently used), or `default` when absent."""
        if key not in self._entries:
            return default
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key, value):
        """Set `key` to `value` as the most recently used entry, evicting the least recently used beyond capacity."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


def flatten(nested):
    """The non-list items of arbitrarily nested lists, in order: flatten([1, [2, [3]]]) == [1, 2, 3]."""
    out = []
    for item in nested:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out


def chunked(items, size):
    """`items` split into consecutive lists of `size` (the last may be shorter); ValueError when size < 1."""
    if size < 1:
        raise ValueError(f"chunk size must be at least 1, got {size}")
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def group_by(items, key):
    """{key(item): [items with that key, in order]}, keys in order of first appearance."""
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups
