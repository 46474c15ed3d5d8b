import pytest

from tally import slugify, wrap


@pytest.mark.parametrize("title, slug", [("Hello, World!", "hello-world"), ("  Many   spaces ", "many-spaces")])
def test_slugify_words(title, slug):
    assert slugify(title) == slug


def test_slugify_keeps_digits():
    assert slugify("Top 10 results of 2024") == "top-10-results-of-2024"


class TestWrap:
    def test_short_text_is_one_line(self):
        assert wrap("a few words", 40) == ["a few words"]

    def test_breaks_between_words(self):
        assert wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]

    def test_long_word_gets_its_own_line(self):
        assert wrap("a extraordinarily b", 5) == ["a", "extraordinarily", "b"]

    def test_line_of_exactly_the_width(self):
        assert wrap("abc de fgh", 6) == ["abc de", "fgh"]
