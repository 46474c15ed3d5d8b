"""tally: small statistics and text helpers for report scripts."""
from .stats import histogram, mean, median, variance
from .text import slugify, wrap

__all__ = ["histogram", "mean", "median", "slugify", "variance", "wrap"]
