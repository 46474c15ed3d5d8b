"""Rewards: the length penalty's properties and its q -> 1 limit, effort, the reward-term registry (pure)."""
import dataclasses
import math
import sys
from types import SimpleNamespace

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_composer.rl.rewards import (
    EFFORT_WEIGHT_KEYS,
    REWARD_TERMS,
    EffortCounts,
    EffortWeights,
    LengthPenaltyConfig,
    combine_rewards,
    effort,
    import_reward_terms,
    length_penalty,
    length_term,
    parse_effort_weights,
    parse_reward_weights,
    register_reward_term,
    score,
)


def reference(x, k, q):
    """C(x) at 50 significant digits with mpmath: the closed form, or ln(1 + kx)/k at q = 1."""
    mpmath.mp.dps = 50
    x, k, q = mpmath.mpf(x), mpmath.mpf(k), mpmath.mpf(q)
    if q == 1:
        return float(mpmath.log1p(k * x) / k)
    return float(mpmath.expm1((1 - q) * mpmath.log1p(k * x)) / (k * (1 - q)))


def test_q_zero_is_linear_and_q_one_is_logarithmic():
    for x in (0.0, 1.0, 37.0, 1e4):
        assert length_penalty(x, 1e-3, 0.0) == pytest.approx(x, rel=1e-13)
        assert length_penalty(x, 1e-3, 1.0) == pytest.approx(math.log1p(1e-3 * x) / 1e-3, rel=1e-15)
    # q = 0.5, k = 1, x = 3: ((1 + 3)^0.5 - 1) / 0.5 = 2; q = 2: (4^-1 - 1) / -1 = 0.75
    assert length_penalty(3.0, 1.0, 0.5) == pytest.approx(2.0, rel=1e-15)
    assert length_penalty(3.0, 1.0, 2.0) == pytest.approx(0.75, rel=1e-15)


def test_q_to_one_from_both_sides_is_continuous_and_accurate():
    x, k = 5000.0, 1e-3
    limit = math.log1p(k * x) / k
    previous = None
    for exponent in range(2, 16):
        eps = 10.0 ** -exponent
        below, above = length_penalty(x, k, 1 - eps), length_penalty(x, k, 1 + eps)
        assert below == pytest.approx(reference(x, k, 1 - eps), rel=1e-12)
        assert above == pytest.approx(reference(x, k, 1 + eps), rel=1e-12)
        assert below > limit > above or below == limit == above  # C decreases in q
        gap = below - above
        assert previous is None or gap <= previous  # the two sides close in on the limit
        previous = gap
    assert abs(length_penalty(x, k, 1 - 1e-15) / limit - 1) < 1e-14
    assert abs(length_penalty(x, k, 1 + 1e-15) / limit - 1) < 1e-14


@pytest.mark.parametrize("q", [0.0, 0.3, 1 - 1e-9, 1.0, 1 + 1e-9, 1.7])
def test_matches_high_precision_reference_on_tensors(q):
    x = torch.tensor([0.0, 1e-6, 0.5, 3.0, 1e3, 1e6], dtype=torch.float64)
    got = length_penalty(x, 0.01, q)
    assert got.shape == x.shape and got.dtype == torch.float64
    for xi, ci in zip(x.tolist(), got.tolist()):
        assert ci == pytest.approx(reference(xi, 0.01, q), rel=1e-12, abs=1e-300)


def test_q_above_one_is_bounded_by_one_over_k_q_minus_one():
    k, q = 0.01, 1.5
    bound = 1 / (k * (q - 1))  # 200
    values = [length_penalty(x, k, q) for x in (1.0, 1e3, 1e6, 1e12)]
    assert all(v < bound for v in values)
    assert values == sorted(values)
    assert values[-1] == pytest.approx(bound, rel=1e-4)  # (1 + kx)^(-0.5) ~ 1e-5 of the way short


@pytest.mark.parametrize("k,q", [(1e-3, 0.0), (0.1, 0.5), (1.0, 1.0), (1.0, 1 - 1e-10), (1.0, 1 + 1e-10), (2.0, 3.0)])
def test_zero_at_zero_with_unit_slope(k, q):
    assert length_penalty(0.0, k, q) == 0.0
    x = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    length_penalty(x, k, q).sum().backward()
    assert x.grad.item() == pytest.approx(1.0, rel=1e-12)


def test_slope_is_one_over_one_plus_kx_to_the_q():
    x = torch.tensor([0.0, 2.0, 50.0], dtype=torch.float64, requires_grad=True)
    k, q = 0.1, 0.7
    length_penalty(x, k, q).sum().backward()
    torch.testing.assert_close(x.grad, (1 + k * x.detach()) ** -q, rtol=1e-12, atol=0)


@settings(max_examples=150, deadline=None)
@given(x1=st.floats(0, 1e6), x2=st.floats(0, 1e6), k=st.floats(1e-4, 10), q=st.floats(1e-3, 5))
def test_concave_and_increasing_for_positive_q(x1, x2, k, q):
    lo, hi = min(x1, x2), max(x1, x2)
    c_lo, c_hi, c_mid = (length_penalty(v, k, q) for v in (lo, hi, (lo + hi) / 2))
    tol = 1e-12 * max(1.0, abs(c_hi))
    assert c_lo <= c_hi + tol
    assert c_mid >= (c_lo + c_hi) / 2 - tol
    assert c_hi <= hi * (1 + 1e-12) + 1e-300  # concave with C(0) = 0 and C'(0) = 1: C(x) <= x


def test_float_in_float_out_and_integer_tensors():
    assert isinstance(length_penalty(4, 0.5, 0.0), float)
    assert length_penalty(torch.tensor([0, 2]), 1.0, 0.0).dtype == torch.get_default_dtype()


def test_length_penalty_errors_name_the_value():
    with pytest.raises(ValueError, match=r"k 0 must be a finite number > 0"):
        length_penalty(1.0, 0, 0.5)
    with pytest.raises(ValueError, match=r"k -1.0 must"):
        length_penalty(1.0, -1.0, 0.5)
    with pytest.raises(ValueError, match=r"q inf must be a finite number"):
        length_penalty(1.0, 1.0, float("inf"))
    with pytest.raises(ValueError, match=r"effort x -2.0 must be >= 0"):
        length_penalty(-2.0, 1.0, 0.5)
    with pytest.raises(ValueError, match=r"effort x -3.0 must be >= 0"):
        length_penalty(torch.tensor([1.0, -3.0]), 1.0, 0.5)
    with pytest.raises(ValueError, match=r"effort x nan"):
        length_penalty(torch.tensor([float("nan")]), 1.0, 0.5)


def test_effort_is_the_weighted_sum_of_the_six_counts():
    counts = EffortCounts(thinking_tokens=100, tool_call_tokens=20, tool_output_tokens=300,
                          final_message_tokens=40, tool_calls=3, turns=2)
    weights = EffortWeights(thinking_tokens=1.0, tool_call_tokens=2.0, tool_output_tokens=0.1,
                            final_message_tokens=0.5, tool_calls=10.0, turns=5.0)
    assert effort(counts, weights) == pytest.approx(100 + 40 + 30 + 20 + 30 + 10)
    assert effort(counts, EffortWeights()) == 460  # defaults: every token once, calls and turns free
    with pytest.raises(ValueError, match=r"EffortCounts.turns = -1 must be >= 0"):
        EffortCounts(turns=-1)
    with pytest.raises(ValueError, match=r"EffortWeights.tool_calls = -0.5 must be a finite number >= 0"):
        EffortWeights(tool_calls=-0.5)
    with pytest.raises(ValueError, match=r"k 0.0 must be a finite number > 0"):
        LengthPenaltyConfig(k=0.0)


def test_parse_reward_weights():
    assert parse_reward_weights("correctness=1.0,length=0.001") == {"correctness": 1.0, "length": 0.001}
    assert parse_reward_weights(" correctness = 1 , length=-2e-3 ") == {"correctness": 1.0, "length": -0.002}
    assert parse_reward_weights("style=0.1", known=["style"]) == {"style": 0.1}


@pytest.mark.parametrize("spec,message", [
    ("brevity=0.1", r"unknown reward term 'brevity' .* known terms: \['all_pass', 'communication', "
                    r"'correctness', 'length', 'parallel_tool_calls', 'style', 'tool_efficiency', "
                    r"'tool_misuse'\]"),
    ("correctness", r"item 'correctness' in 'correctness' is not name=weight"),
    ("correctness=1.0,", r"item '' in 'correctness=1.0,' is not name=weight"),
    ("=1.0", r"item '=1.0' .* is not name=weight"),
    ("correctness=", r"is not name=weight"),
    ("correctness=high", r"reward weight 'high' of 'correctness' is not a number"),
    ("correctness=nan", r"reward weight of 'correctness' is nan; weights must be finite"),
    ("length=inf", r"reward weight of 'length' is inf"),
    ("correctness=1,correctness=2", r"'correctness' appears twice"),
])
def test_parse_reward_weights_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_reward_weights(spec)


def test_register_reward_term():
    registry = dict(REWARD_TERMS)
    register_reward_term("brevity", lambda s: s.brevity, registry=registry)
    assert "brevity" in registry and "brevity" not in REWARD_TERMS
    with pytest.raises(ValueError, match="'brevity' is already registered; pass replace=True"):
        register_reward_term("brevity", lambda s: 0.0, registry=registry)
    register_reward_term("brevity", lambda s: 0.0, registry=registry, replace=True)
    with pytest.raises(ValueError, match="without ',', '=' or spaces"):
        register_reward_term("a=b", lambda s: 0.0, registry=registry)
    with pytest.raises(ValueError, match="is not callable"):
        register_reward_term("x", 3.0, registry=registry)


def test_combine_rewards():
    assert combine_rewards({"correctness": 1.0, "length": -200.0, "style": 5.0},
                           {"correctness": 1.0, "length": 0.001}) == pytest.approx(0.8)
    with pytest.raises(ValueError, match=r"no value for reward terms \['length'\]"):
        combine_rewards({"correctness": 1.0}, {"correctness": 1.0, "length": 0.001})
    with pytest.raises(ValueError, match=r"'correctness' returned nan"):
        combine_rewards({"correctness": float("nan")}, {"correctness": 1.0})


def test_score_keeps_every_term_per_sample():
    samples = [
        SimpleNamespace(correctness=1.0, effort_counts=EffortCounts(thinking_tokens=3)),
        SimpleNamespace(correctness=0.0, effort_counts=EffortCounts(final_message_tokens=8)),
    ]
    # k = 1, q = 0.5: C(3) = (2 - 1) / 0.5 = 2, C(8) = (3 - 1) / 0.5 = 4
    terms = {**REWARD_TERMS, "length": length_term(LengthPenaltyConfig(k=1.0, q=0.5))}
    total, per_term = score(samples, {"correctness": 1.0, "length": 0.1}, terms)
    torch.testing.assert_close(per_term["correctness"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(per_term["length"], torch.tensor([-2.0, -4.0]))
    torch.testing.assert_close(total, torch.tensor([0.8, -0.4]))
    total, per_term = score(samples, {"correctness": 1.0})  # only the weighted terms are evaluated
    assert list(per_term) == ["correctness"] and total.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"reward terms \['brevity'\] are not registered"):
        score(samples, {"brevity": 1.0})


def test_parse_effort_weights_maps_the_flag_keys_to_the_fields():
    weights = parse_effort_weights("thinking=1,tool_call=2,tool_output=0.1,final=0.5,tool_calls=10,turns=5")
    assert weights == EffortWeights(thinking_tokens=1.0, tool_call_tokens=2.0, tool_output_tokens=0.1,
                                    final_message_tokens=0.5, tool_calls=10.0, turns=5.0)
    counts = EffortCounts(thinking_tokens=100, tool_call_tokens=20, tool_output_tokens=300,
                          final_message_tokens=40, tool_calls=3, turns=2)
    assert effort(counts, weights) == pytest.approx(100 + 40 + 30 + 20 + 30 + 10)
    assert parse_effort_weights("thinking=1,tool_call=1,tool_output=1,final=1,tool_calls=0,turns=0") == \
        EffortWeights() == parse_effort_weights("")
    assert parse_effort_weights(" turns = 2 ") == EffortWeights(turns=2.0)  # the others keep their defaults
    assert set(EFFORT_WEIGHT_KEYS.values()) == {f.name for f in dataclasses.fields(EffortWeights)}


@pytest.mark.parametrize("spec,message", [
    ("thinking=1,tokens=2", r"unknown key 'tokens' .* use thinking, tool_call, tool_output, final, tool_calls, turns"),
    ("thinking_tokens=1", r"unknown key 'thinking_tokens'"),
    ("thinking", r"item 'thinking' in 'thinking' is not key=weight"),
    ("thinking=1,", r"item '' in 'thinking=1,' is not key=weight"),
    ("final=lots", r"weight 'lots' of 'final' is not a number"),
    ("turns=-1", r"weight of 'turns' is -1.0; weights are finite numbers >= 0"),
    ("turns=nan", r"weight of 'turns' is nan"),
    ("turns=1,turns=2", r"'turns' appears twice"),
])
def test_parse_effort_weights_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_effort_weights(spec)


USER_MODULE = '''
from megatron_composer.rl.rewards import register_reward_term

def brevity(sample):
    return -float(len(sample.text))

def shouting(sample):
    return float(sample.text.isupper())

register_reward_term("brevity", brevity)
NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`user_rewards` on sys.path; REWARD_TERMS and sys.modules restored afterwards."""
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('no config file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(REWARD_TERMS)
    yield "user_rewards"
    for name in ("user_rewards", "broken_rewards"):
        sys.modules.pop(name, None)
    REWARD_TERMS.clear()
    REWARD_TERMS.update(saved)


def test_a_reward_module_registers_its_terms_when_imported(user_module):
    assert "brevity" not in REWARD_TERMS
    assert import_reward_terms("user_rewards") == ["brevity"]
    assert import_reward_terms("user_rewards") == []  # once per process: a second call changes nothing
    assert parse_reward_weights("correctness=1,brevity=0.01") == {"correctness": 1.0, "brevity": 0.01}
    total, _ = score([SimpleNamespace(correctness=1.0, text="abcd")], {"correctness": 1.0, "brevity": 0.01})
    torch.testing.assert_close(total, torch.tensor([0.96]))


def test_function_terms_resolve_by_name_in_any_process(user_module):
    # --reward names the term; parsing it imports and registers it, as each Ray actor's parse does
    weights = parse_reward_weights("correctness=1,user_rewards:shouting=0.5")
    assert weights == {"correctness": 1.0, "user_rewards:shouting": 0.5}
    total, per_term = score([SimpleNamespace(correctness=0.0, text="HI"), SimpleNamespace(correctness=1.0, text="hi")],
                            weights)
    assert per_term["user_rewards:shouting"].tolist() == [1.0, 0.0] and total.tolist() == [0.5, 1.0]
    # a process that never saw the driver's code: nothing imported, an empty registry, the same spec
    sys.modules.pop("user_rewards")
    del REWARD_TERMS["brevity"], REWARD_TERMS["user_rewards:shouting"]
    fresh = {}
    # importing the module registers its own term too
    assert import_reward_terms("user_rewards:shouting", registry=fresh) == ["brevity", "user_rewards:shouting"]
    assert fresh["user_rewards:shouting"](SimpleNamespace(text="OK")) == 1.0
    assert import_reward_terms("user_rewards:shouting", registry=fresh) == []


@pytest.mark.parametrize("spec,message", [
    ("no_such_rewards", r"reward module 'no_such_rewards' .* cannot be imported .* put its folder on PYTHONPATH"),
    ("no_such_rewards:f", r"reward module 'no_such_rewards' \(from 'no_such_rewards:f'\) cannot be imported"),
    ("user_rewards:missing", r"'user_rewards:missing': module 'user_rewards' has no attribute 'missing'"),
    ("user_rewards:NOT_A_FUNCTION", r"has int 'NOT_A_FUNCTION', not a function"),
    ("user_rewards:", r"has no attribute ''"),
    ("user-rewards", r"'user-rewards' is not package.module or package.module:function"),
    ("broken_rewards", r"reward module 'broken_rewards' .* raised while importing: RuntimeError\('no config file'\)"),
])
def test_reward_module_errors_name_the_entry(user_module, spec, message):
    with pytest.raises(ValueError, match=message):
        import_reward_terms(spec)
