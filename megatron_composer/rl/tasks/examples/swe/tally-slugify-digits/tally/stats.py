"""Summary statistics of lists of numbers."""


def mean(values):
    """The arithmetic mean; ValueError for an empty list."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    """The middle value of the sorted values (the mean of the two middle ones for an even count)."""
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def variance(values):
    """The population variance: the mean squared distance from the mean."""
    centre = mean(values)
    return sum((v - centre) ** 2 for v in values) / len(values)


def histogram(values, width):
    """Counts per bucket: bucket k holds the values in [k * width, (k + 1) * width)."""
    if width <= 0:
        raise ValueError(f"bucket width {width} must be positive")
    counts = {}
    for v in values:
        bucket = int(v // width)
        counts[bucket] = counts.get(bucket, 0) + 1
    return counts
