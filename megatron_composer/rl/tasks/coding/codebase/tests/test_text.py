from minikit.text import camel_to_snake, count_words, is_anagram, slugify, snake_to_camel, title_case, words, wrap


def test_slugify():
    assert slugify("Hello, World!") == "hello-world"
    assert slugify("  Rust & Python 3  ") == "rust-python-3"


def test_slugify_empty():
    assert slugify("!!!") == ""


def test_words():
    assert words("It's a fine day, isn't it?") == ["It's", "a", "fine", "day", "isn't", "it"]
    assert words("") == []


def test_title_case():
    assert title_case("the lord of the rings") == "The Lord of the Rings"
    assert title_case("AN apple AND a PEAR") == "An Apple and a Pear"


def test_snake_to_camel():
    assert snake_to_camel("max_retry_count") == "maxRetryCount"
    assert snake_to_camel("Name") == "name"
    assert snake_to_camel("__a__b") == "aB"
    assert snake_to_camel("") == ""


def test_camel_to_snake():
    assert camel_to_snake("maxRetryCount") == "max_retry_count"
    assert camel_to_snake("version2Name") == "version2_name"
    assert camel_to_snake("plain") == "plain"


def test_wrap():
    assert wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]
    assert wrap("a b c", 5) == ["a b c"]


def test_wrap_long_word():
    assert wrap("tiny enormousword x", 6) == ["tiny", "enormousword", "x"]
    assert wrap("   ", 4) == []


def test_count_words():
    assert count_words("The cat and the hat") == {"the": 2, "cat": 1, "and": 1, "hat": 1}
    assert count_words("") == {}


def test_is_anagram():
    assert is_anagram("Listen", "Silent")
    assert is_anagram("Dormitory", "dirty room!")
    assert not is_anagram("apple", "paple!x")
