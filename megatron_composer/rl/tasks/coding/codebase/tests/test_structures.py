import pytest

from minikit.structures import LRUCache, Stack, chunked, flatten, group_by


def test_stack_push():
    s = Stack()
    s.push(1)
    s.push("two")
    assert len(s) == 2


def test_stack_pop():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.pop() == 2
    assert s.pop() == 1
    with pytest.raises(IndexError):
        s.pop()


def test_stack_peek():
    s = Stack()
    with pytest.raises(IndexError):
        s.peek()
    s.push("x")
    assert s.peek() == "x"
    assert len(s) == 1


def test_stack_is_empty():
    s = Stack()
    assert s.is_empty()
    s.push(0)
    assert not s.is_empty()


def test_lrucache_get():
    c = LRUCache(2)
    assert c.get("missing") is None
    assert c.get("missing", 5) == 5
    c.put("a", 1)
    assert c.get("a") == 1


def test_lrucache_get_refreshes():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.get("a")
    c.put("c", 3)
    assert c.get("b") is None
    assert c.get("a") == 1


def test_lrucache_put():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.put("a", 10)
    c.put("c", 3)
    assert len(c) == 2
    assert c.get("a") == 10
    assert c.get("b") is None
    assert c.get("c") == 3


def test_flatten():
    assert flatten([1, [2, [3, [4]]], 5]) == [1, 2, 3, 4, 5]
    assert flatten([[], [[]]]) == []
    assert flatten([(1, 2), "ab"]) == [(1, 2), "ab"]


def test_chunked():
    assert chunked([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert chunked([], 3) == []
    with pytest.raises(ValueError):
        chunked([1], 0)


def test_group_by():
    assert group_by(["apple", "bee", "avocado", "cat"], lambda w: w[0]) == {
        "a": ["apple", "avocado"], "b": ["bee"], "c": ["cat"]}
    assert list(group_by([3, 1, 2, 5], lambda n: n % 2)) == [1, 0]
