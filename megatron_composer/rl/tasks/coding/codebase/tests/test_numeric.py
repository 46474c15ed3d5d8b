import pytest

from minikit.numeric import collatz_steps, digits, gcd, is_prime, lcm, median, primes_below, to_base


def test_gcd():
    assert gcd(12, 18) == 6
    assert gcd(-4, 6) == 2
    assert gcd(0, 5) == 5
    assert gcd(0, 0) == 0


def test_lcm():
    assert lcm(4, 6) == 12
    assert lcm(-3, 5) == 15
    assert lcm(0, 7) == 0


def test_is_prime():
    assert [n for n in range(-3, 30) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
    assert not is_prime(49)


def test_primes_below():
    assert primes_below(20) == [2, 3, 5, 7, 11, 13, 17, 19]
    assert primes_below(2) == []


def test_digits():
    assert digits(-305) == [3, 0, 5]
    assert digits(0) == [0]
    assert digits(7) == [7]


def test_median():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5


def test_to_base():
    assert to_base(255, 16) == "ff"
    assert to_base(5, 2) == "101"
    assert to_base(-35, 36) == "-z"
    assert to_base(0, 7) == "0"


def test_to_base_rejects_bad_base():
    with pytest.raises(ValueError):
        to_base(10, 1)
    with pytest.raises(ValueError):
        to_base(10, 37)


def test_collatz_steps():
    assert collatz_steps(1) == 0
    assert collatz_steps(6) == 8
    assert collatz_steps(27) == 111


def test_collatz_steps_rejects_non_positive():
    with pytest.raises(ValueError):
        collatz_steps(0)
