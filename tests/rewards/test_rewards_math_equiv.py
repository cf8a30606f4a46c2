"""Boxed extraction and math equivalence: hand-written true and false cases."""

import pytest

from agentrl_jax.rewards import extract_boxed, math_equal, normalize_answer, quick_equal

EQUIVALENT = [
    ("42", "42"), ("42.0", "42"), ("042", "42"), ("-7", "-7"), ("1/2", "0.5"), (".5", "0.5"),
    ("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "\\frac12"), ("\\tfrac{3}{4}", "0.75"), ("\\frac{6}{8}", "3/4"),
    ("\\frac{-1}{3}", "-\\frac{1}{3}"), ("2\\sqrt{2}", "\\sqrt{8}"), ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"),
    ("\\sqrt[3]{27}", "3"), ("\\pi", "3.14159265358979"), ("2\\pi", "\\pi \\cdot 2"), ("\\frac{\\pi}{4}", "\\pi/4"),
    ("50\\%", "50"), ("50\\%", "0.5"), ("12.5%", "0.125"), ("10 cm", "10"), ("5 \\text{ dollars}", "5"),
    ("\\text{5}", "5"), ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("x = 3", "3"), ("y=\\frac{1}{2}", "0.5"),
    ("1,000", "1000"), ("1,234,567", "1234567"), ("$7$", "7"), ("\\$7", "7"), ("\\left(1, 2\\right)", "(1,2)"),
    ("(1, 2)", "(1,2)"), ("(\\frac{1}{2}, 3)", "(0.5, 3)"), ("[0, 1)", "[0,1)"), ("(-\\infty, 2]", "(-\\infty,2]"),
    ("2x+2", "2(x+1)"), ("x^2-1", "(x-1)(x+1)"), ("3 \\times 4", "12"), ("2^{10}", "1024"), ("e^0", "1"),
    ("\\displaystyle \\frac{2}{3}", "2/3"), ("\\frac{1}{3}", "0.333333333"), ("1e3", "1000"), ("3.", "3"),
]

NOT_EQUIVALENT = [
    ("41", "42"), ("-42", "42"), ("0.5", "0.55"), ("\\frac{1}{3}", "0.33"), ("\\sqrt{2}", "1.41"),
    ("\\pi", "3.14"), ("(1, 2)", "(2, 1)"), ("(1, 2)", "(1, 2, 3)"), ("[0, 1)", "(0, 1)"), ("[0,1]", "[0,1)"),
    ("2x+2", "2x+1"), ("x^2", "x^3"), ("", "1"), ("abc", "1"), ("12", "1,2"), ("1000", "1,001"),
    ("\\frac{2}{3}", "3/2"), ("50\\%", "5"),
    ("0.333333333", "\\frac{1}{3}"),  # an exact reference wants the exact value, not a decimal approximation
]


@pytest.mark.parametrize("prediction,reference", EQUIVALENT)
def test_equivalent(prediction, reference):
    assert math_equal(prediction, reference), (prediction, reference, normalize_answer(prediction))


@pytest.mark.parametrize("prediction,reference", NOT_EQUIVALENT)
def test_not_equivalent(prediction, reference):
    assert not math_equal(prediction, reference)


def test_case_count():
    assert len(EQUIVALENT) + len(NOT_EQUIVALENT) >= 60


def test_code_in_answer_is_not_evaluated():
    assert not math_equal("__import__('os').getpid()", "1")
    assert not math_equal("open('/etc/passwd')", "1")


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # last box wins
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{\\boxed{3}}", "\\boxed{3}"),  # a box inside a box belongs to the outer one
    ("\\boxed{a{b{c}}d} and \\boxed{x", "a{b{c}}d"),  # unclosed last box is ignored
    ("\\boxed 7 is it", "7"),
    ("\\fbox{9}", "9"),
    ("no box here", None),
    ("\\boxed{}", ""),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("prediction,reference,expected", [
    ("\\dfrac{6}{8}", "\\frac34", True), ("2\\frac{1}{2}", "2.5", True), ("-\\frac{1}{3}", "\\frac{-1}{3}", True),
    ("(2,1)", "(1,2)", False), ("3, 2, 1", "\\{1,2,3\\}", True), ("[2,5]", "[2,5)", False),
    ("(-\\infty, 3]", "(-\\infty,3]", True), ("1048577", "1048576", False),
    ("\\sqrt{2}", "1.414", None), ("(1,2)", "\\{1,2\\}", None), ("0.3334", "0.333333", None), ("1" * 600, "1", None),
])
def test_quick_path_decides_plain_numbers_and_lists_in_process(prediction, reference, expected):
    """The in-process path (no worker round trip) covers integers, fractions and lists of them; the rest is None."""
    assert quick_equal(prediction, reference) is expected
