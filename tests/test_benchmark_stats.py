"""The paired t-test of benchmarks/rl_learns.py against closed forms (Student's t at 2 degrees of freedom:
P(|T| >= t) = 1 - t / sqrt(2 + t^2); at many degrees of freedom the normal's 1.96 -> 0.05)."""
import importlib.util
import math
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def rl_learns():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("rl_learns", BENCHMARKS / "rl_learns.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_paired_t_matches_hand_computation(rl_learns):
    t, p = rl_learns.paired_t([0.20, 0.25, 0.15])  # mean 0.2, sd 0.05, n 3
    assert t == pytest.approx(0.2 / (0.05 / math.sqrt(3)), rel=1e-12)
    assert p == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-9)
    for t in (0.3, 1.0, 4.303):
        assert rl_learns.student_t_two_sided(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-9)
    assert rl_learns.student_t_two_sided(1.959964, 10**6) == pytest.approx(0.05, abs=1e-4)
    assert rl_learns.student_t_two_sided(0.0, 4) == pytest.approx(1.0)


def test_paired_t_without_spread(rl_learns):
    assert rl_learns.paired_t([0.1, 0.1, 0.1]) == (math.inf, 0.0)
    assert rl_learns.paired_t([0.0, 0.0]) == (0.0, 1.0)
    t, p = rl_learns.paired_t([-0.2, -0.25, -0.15])
    assert t < 0 and p == pytest.approx(rl_learns.paired_t([0.2, 0.25, 0.15])[1])
