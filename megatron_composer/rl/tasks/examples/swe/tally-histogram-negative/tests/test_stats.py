import pytest

from tally import histogram, mean, median, variance


def test_mean():
    assert mean([1, 2, 3, 6]) == 3
    with pytest.raises(ValueError):
        mean([])


def test_median_odd_count():
    assert median([5, 1, 3]) == 3
    assert median([7]) == 7


def test_median_even_count():
    assert median([4, 1, 3, 2]) == 2.5
    assert median([10, 20]) == 15


def test_variance():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9]) == 4


def test_histogram_positive_values():
    assert histogram([0.5, 1.5, 1.7, 3.0], 1) == {0: 1, 1: 2, 3: 1}
    assert histogram([0, 9, 10, 25], 10) == {0: 2, 1: 1, 2: 1}


def test_histogram_negative_values():
    assert histogram([-0.5, -1.5, 0.5], 1) == {-1: 1, -2: 1, 0: 1}
    assert histogram([-10, -9], 10) == {-1: 2}
