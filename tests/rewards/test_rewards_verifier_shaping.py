"""Verifier worker timeouts and recovery; reward shaping components and composite."""

import time

import numpy as np
import pytest

from agentrl_jax.rewards import (MathVerifier, RewardWeights, composite_reward, format_reward, outcome_reward,
                                 overlong_penalty, tool_call_reward)


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(num_workers=1, timeout_s=2.0) as v:
        yield v


def test_verifier_fast_and_sympy_paths(verifier):
    assert verifier.verify("0.5", "\\frac{1}{2}").correct
    assert verifier.verify_response("so \\boxed{\\dfrac{\\sqrt{8}}{2}}", "\\sqrt{2}").correct
    assert not verifier.verify_response("\\boxed{3}", "4").correct
    assert not verifier.verify(None, "4").correct
    assert verifier.stats["fast_path"] >= 1


def test_pathological_input_hits_timeout_and_worker_is_replaced(verifier):
    start = time.monotonic()
    result = verifier.verify("9^{9^{9^{9}}}", "x+1")
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.correct
    assert elapsed < 2.0 + 1.0
    assert verifier.stats["worker_restarts"] >= 1
    assert verifier.verify("2\\sqrt{2}", "\\sqrt{8}").correct  # the replacement works


def test_worker_compares_integers_exactly(verifier):
    """Old main accepted these (relative 1e-6 once sympy was involved): a reward for a wrong answer."""
    assert not verifier.verify("1048577", "2^{20}").correct
    assert not verifier.verify("10^6+1", "1000000").correct
    assert verifier.verify("2^{20}", "1048576").correct
    assert verifier.stats["errors"] == 0


def test_last_box_of_the_response_against_a_boxed_gold(verifier):
    gold = "\\boxed{\\frac{1}{2}}"
    assert verifier.verify_response("try \\boxed{1}; no: \\boxed{\\dfrac{2}{4}}", gold).correct
    assert not verifier.verify_response("\\boxed{\\frac{1}{2}} wait, \\boxed{\\frac{1}{3}}", gold).correct
    assert verifier.verify_response("\\boxed{\\left\\{ \\frac{1}{2}, 3 \\right\\}}", "\\{3, 0.5\\}").correct


@pytest.mark.parametrize("answer", ["(10^{10})!", "9^{9^{9}}"])
def test_huge_values_time_out_and_are_counted(verifier, answer):
    assert verifier.verify("\\sqrt{4}", "2").correct  # a ready worker, so only the comparison is timed
    timeouts = verifier.stats["timeouts"]
    start = time.monotonic()
    result = verifier.verify(answer, "5")
    assert time.monotonic() - start < 2.0 + 1.0
    assert result.timed_out and not result.correct
    assert verifier.stats["timeouts"] == timeouts + 1


def test_long_answers_are_bounded_by_the_timeout(verifier):
    """The in-process path must not run non-linear regexes on long answers; the worker's timeout bounds them."""
    for answer in ("1" * 20000 + ".\\overline{3}", "\\boxed{" * 3000 + "1" + "}" * 3000):
        start = time.monotonic()
        assert not verifier.verify(answer, "5").correct
        assert time.monotonic() - start < 2.0 + 1.0 + 5.0  # timeout + slack + a replacement worker's start


def test_outcome_and_tool_and_format():
    assert outcome_reward(True) == 1.0 and outcome_reward(False) == -1.0
    assert outcome_reward(False, "binary") == 0.0
    with pytest.raises(ValueError, match="scheme"):
        outcome_reward(True, "bogus")
    assert tool_call_reward(0) == 0.0 and tool_call_reward(2) == pytest.approx(0.2) and tool_call_reward(50) == 0.3
    assert format_reward("work <code>x</code> ... \\boxed{3}") == 1.0
    assert format_reward("\\boxed{3} and then more words") == 0.0
    assert format_reward("\\boxed{3} \\boxed{4}") == 0.0
    assert format_reward("<code>x \\boxed{3}") == 0.0
    assert format_reward("no answer") == 0.0


def test_overlong_penalty_matches_dapo_definition():
    lengths = np.arange(0, 1200)
    penalty = overlong_penalty(lengths, max_tokens=1000, cache_tokens=200)
    reference = np.array([0.0 if n <= 800 else (-1.0 if n > 1000 else (800 - n) / 200) for n in lengths])
    np.testing.assert_allclose(penalty, reference)
    assert overlong_penalty(900, 1000, 200) == pytest.approx(-0.5)
    assert overlong_penalty(1000, 1000, 200) == pytest.approx(-1.0)


def test_composite_weights_and_components():
    weights = RewardWeights(outcome=1.0, format=0.2, tool=1.0, overlong=1.0, tool_cap=0.3, max_tokens=100,
                            overlong_cache_tokens=20)
    total, components = composite_reward(True, "<code>a</code> \\boxed{1}", num_tokens=90,
                                         successful_tool_calls=5, weights=weights)
    assert components == {"outcome": 1.0, "format": 1.0, "tool": 0.3, "overlong": -0.5}
    assert total == pytest.approx(1.0 + 0.2 + 0.3 - 0.5)
    # Shaping never lets a wrong answer beat a right one with the same shape.
    wrong, _ = composite_reward(False, "<code>a</code> \\boxed{2}", num_tokens=10, successful_tool_calls=99,
                                weights=weights)
    right, _ = composite_reward(True, "\\boxed{1}", num_tokens=10, successful_tool_calls=0, weights=weights)
    assert right > wrong


def test_tool_shaping_that_could_outweigh_outcome_is_rejected():
    with pytest.raises(ValueError, match="tool"):
        RewardWeights(outcome=1.0, tool=10.0, tool_cap=0.3)
    with pytest.raises(ValueError, match="format"):
        RewardWeights(format=-1.0)
