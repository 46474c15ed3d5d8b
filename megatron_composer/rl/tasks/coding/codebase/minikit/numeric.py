"""Number helpers: divisibility, primes, digits and bases."""


def gcd(a, b):
    """The greatest common divisor of integers `a` and `b` (non-negative; gcd(0, 0) == 0)."""
    a, b = abs(a), abs(b)
    while b:
        a, b = b, a % b
    return a


def lcm(a, b):
    """The least common multiple of integers `a` and `b` (non-negative; 0 when either is 0)."""
    if a == 0 or b == 0:
        return 0
    return abs(a * b) // gcd(a, b)


def is_prime(n):
    """Whether the integer `n` is a prime number."""
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def primes_below(n):
    """The primes smaller than `n`, in increasing order."""
    return [k for k in range(2, n) if is_prime(k)]


def digits(n):
    """The decimal digits of abs(`n`), most significant first: digits(-305) == [3, 0, 5]."""
    return [int(ch) for ch in str(abs(n))]


def median(values):
    """The median of a non-empty sequence of numbers (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def to_base(n, base):
    """The integer `n` written in `base` (2 to 36) with digits 0-9 then a-z, with a leading "-" when negative."""
    if not 2 <= base <= 36:
        raise ValueError(f"base {base} is outside 2..36")
    symbols = "0123456789abcdefghijklmnopqrstuvwxyz"
    if n == 0:
        return "0"
    sign, n = ("-", -n) if n < 0 else ("", n)
    out = []
    while n:
        n, r = divmod(n, base)
        out.append(symbols[r])
    return sign + "".join(reversed(out))


def collatz_steps(n):
    """How many Collatz steps (n/2 when even, 3n+1 when odd) take the positive integer `n` to 1."""
    if n < 1:
        raise ValueError(f"collatz_steps needs a positive integer, got {n}")
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps
