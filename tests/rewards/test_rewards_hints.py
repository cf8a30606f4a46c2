"""Leakage guard and placebo shuffle for bridge thoughts (docs/hybrid.md)."""

from collections import Counter

import numpy as np
import pytest

from agentrl_jax.rewards import hint_leaks_answer, placebo_hints


@pytest.mark.parametrize("hint, answer, leaks", [
    ("The interpreter printed 4517277; I should copy it into the answer.", "4517277", True),
    ("I should call the interpreter: <code>print(4821*937)</code>", "4517277", False),
    ("So the total is 1,000 apples.", "1000", True),
    ("So the total is 1{,}000.", "1000", True),
    ("Half of it, 0.5, is what I need.", "\\frac{1}{2}", True),
    ("I should get \\dfrac{1}{2} here.", "0.5", True),
    ("I should write \\boxed{42} at the end.", "42", True),
    ("I should print exactly 123*4.", "12", False),          # 12 only inside a longer number
    ("I should print exactly 12*34.", "12", True),           # conservative: an operand equal to the answer
    ("I should keep 3.55 digits.", "3.5", False),
    ("The answer should be 3.5.", "3.5", True),
    ("I should set x = 3 first.", "-3", False),
    ("The value is \\frac{\\sqrt{3}}{2}.", "\\frac{\\sqrt{3}}{2}", True),
    ("I should expand it to x^2 + 1 first.", "x^2+1", True),
    ("I should expand (x+1)^2 before adding.", "x^2+1", False),
    ("I should define x with symbols('x') before the sum.", "", False),
    ("I should apply modulo 1000 after each multiplication.", "\\boxed{1000}", True),
])
def test_hint_leaks_answer(hint, answer, leaks):
    assert hint_leaks_answer(hint, answer) is leaks


def check_placebo(hints, lengths, keys, placebo):
    """Invariants of any placebo: hint positions kept, donors of other tasks, each donor used once."""
    by_text = {}
    for i, h in enumerate(hints):
        if h is not None:
            by_text.setdefault(h, []).append(i)
    for i, p in enumerate(placebo):
        if hints[i] is None:
            assert p is None
        elif p is not None:
            assert all(keys[j] != keys[i] for j in by_text[p])
    used = Counter(p for p in placebo if p is not None)
    available = Counter(h for h in hints if h is not None)
    assert all(used[t] <= available[t] for t in used)


def test_placebo_keeps_every_hint_length_when_the_batch_allows():
    rng = np.random.default_rng(0)
    hints, lengths, keys = [], [], []
    for group in range(8):  # GRPO groups of 4 sharing a task; hint length depends on the task
        length = 10 + group % 2  # two lengths, four tasks each, 2-4 hints per task: always matchable
        for k in range(4):
            has = rng.random() < 0.5 or k < 2
            hints.append(f"hint of task {group} variant {k}" if has else None)
            lengths.append(length if has else 0)
            keys.append(group)
    placebo, stats = placebo_hints(hints, lengths, keys, np.random.default_rng(1))
    check_placebo(hints, lengths, keys, placebo)
    hinted = [i for i, h in enumerate(hints) if h is not None]
    assert stats.hinted == len(hinted) and stats.unmatched == 0 and stats.other_length == 0
    assert stats.same_length == len(hinted)
    length_of = {h: lengths[i] for i, h in enumerate(hints) if h is not None}
    assert all(length_of[placebo[i]] == lengths[i] for i in hinted)
    assert sorted(placebo[i] for i in hinted) == sorted(hints[i] for i in hinted)  # a permutation of the hints
    assert all(placebo[i] != hints[i] for i in hinted)


def test_placebo_falls_back_across_lengths_and_counts_what_it_cannot_match():
    hints = ["a" * 5, "b" * 5, "c" * 7, "d" * 9, None, "e" * 9]
    lengths = [5, 5, 7, 9, 0, 9]
    keys = [0, 1, 2, 3, 4, 3]  # the two 9-token hints are of one task: no same-length donor for them
    placebo, stats = placebo_hints(hints, lengths, keys, np.random.default_rng(0))
    check_placebo(hints, lengths, keys, placebo)
    assert placebo[0] == "b" * 5 and placebo[1] == "a" * 5 and placebo[4] is None
    assert stats.same_length == 2 and stats.other_length + stats.unmatched == 3
    one_task, one_stats = placebo_hints(["x", "y"], [1, 1], [7, 7], np.random.default_rng(0))
    assert one_task == [None, None] and one_stats.unmatched == 2
    with pytest.raises(ValueError, match="differ in length"):
        placebo_hints(["x"], [1, 2], [0], np.random.default_rng(0))
