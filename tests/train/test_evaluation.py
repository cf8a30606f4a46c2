"""pass@k: hand cases and the combinatorial definition."""

import itertools
import math

import numpy as np
import pytest

from agentrl_jax.train.evaluation import pass_at_k, summarize


def _reference(n, c, k):
    # Probability that a random k-subset of the n samples contains a correct one.
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_hand_cases():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - math.comb(3, 3) / math.comb(5, 3))


@pytest.mark.parametrize("n,c,k", [(6, 2, 2), (7, 3, 4), (8, 1, 3), (5, 4, 2)])
def test_matches_enumeration(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_reference(n, c, k), abs=1e-12)


def test_errors():
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(3, 1, 5)


def test_summarize():
    res = {
        "a": [{"correct": True, "tool_calls": 1, "num_sampled_tokens": 10}, {"correct": False, "tool_calls": 0,
                                                                               "num_sampled_tokens": 4}],
        "b": [{"correct": False, "tool_calls": 0, "num_sampled_tokens": 6}] * 2,
    }
    s = summarize(res, ks=(1, 2))
    assert s["pass_at_1"] == pytest.approx(0.25)
    assert s["pass_at_2"] == pytest.approx(0.5)
    assert s["avg_at_2"] == pytest.approx(0.25)
    assert s["tool_use_rate"] == pytest.approx(0.25)
    assert s["mean_response_tokens"] == pytest.approx(6.5)
    assert np.isclose(s["num_tasks"], 2)


def test_results_table():
    from agentrl_jax.train.evaluation import results_table

    text = results_table({"start": {"pass_at_1": 0.25}, "end": {"pass_at_1": 0.5}}, ["pass_at_1", "tool_use_rate"])
    assert text.splitlines() == ["| stage | pass_at_1 | tool_use_rate |", "|---|---|---|",
                                 "| start | 0.250 | nan |", "| end | 0.500 | nan |"]


def test_summarize_tool_errors_and_recovery():
    """Calls per episode, the rate of episodes with a failed call, and the share of those answered right."""
    sample = lambda correct, calls, errors: {"correct": correct, "tool_calls": calls, "tool_errors": errors}  # noqa: E731
    res = {
        "a": [sample(True, 2, 1), sample(False, 1, 1), sample(True, 1, 0), sample(False, 0, 0)],
        "b": [sample(True, 3, 2), sample(False, 2, 2), sample(False, 2, 1), sample(True, 1, 0)],
    }
    s = summarize(res, ks=(1,))
    assert s["calls_per_episode"] == pytest.approx(12 / 8)
    assert s["tool_error_rate"] == pytest.approx(5 / 8)
    assert s["error_recovery_rate"] == pytest.approx(2 / 5)
    clean = summarize({"a": [sample(True, 1, 0), sample(False, 0, 0)]})
    assert clean["tool_error_rate"] == 0.0 and "error_recovery_rate" not in clean  # no failed call: nothing to recover
    assert "tool_error_rate" not in summarize({"a": [{"correct": True}]})  # samples that do not count errors
