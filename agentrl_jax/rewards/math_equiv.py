"""Math answer equivalence: a bounded fast path, then math-verify with an exact rule.

`quick_equal` decides plain strings, plain numbers and lists of them in process, in
bounded time (exact fractions: `042` == `42`, `0.25` == `\\frac14`, `1{,}000` == `1000`,
`\\{2, 1\\}` == `1, 2`). Everything else
goes to `math_equal`, which parses both answers with math-verify (HuggingFace's
verifier, the one TRL, open-r1 and verl use: sets, intervals, `\\pm`, mixed numbers,
factorials, binomials, log bases, matrices, equations) and then compares them under
one exactness rule:

- Exact gold (no decimal literal in it): a numeric answer must equal it exactly.
  Integers and rationals compare as rationals (`2^{20}` != 1048577), a decimal in the
  prediction is the rational it spells (`0.25` == `\\frac14`, `0.333333` != `\\frac13`),
  irrational values (radicals, pi, logs) compare at 50 significant digits.
- Gold written with a decimal literal (`0.333333`, `1.5\\%`): the gold is itself an
  approximation, so a prediction within relative `tolerance` (1e-6) of it matches
  (`0.3333333333` == `\\frac13`; `3.14` != `\\pi` and `2.5` != `2.47`, as a
  "to the nearest hundredth" gold asks for that rounding). Inside tuples, sets and
  intervals math-verify's rounding to 6 decimals applies.

`math_equal` can take unbounded time on adversarial input (`9^{9^{9^9}}`), so the
trainer never calls it directly: `verifier.MathVerifier` runs it in a worker process
under a hard timeout. Answers are parsed by math-verify's LaTeX grammar only, never by
`eval`-based parsers, so a model's answer cannot run Python.
"""

from __future__ import annotations

import cmath
import re
from fractions import Fraction

_UNIT_WORDS = (
    "degrees?|cm|mm|km|m|meters?|inches|inch|feet|foot|ft|miles?|units?|square|sq|cubic|dollars?|cents?"
    "|hours?|minutes?|seconds?|days?|years?|kg|g|grams?|pounds?|lbs?|mph|percent")
_PLAIN_NUMBER = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)([eE]-?\d{1,3})?(/\d+)?$")
_LATEX_FRACTION = re.compile(r"^(-?)(\d+)?\\frac(?:\{(-?\d+)\}\{(\d+)\}|(\d)(\d))$")  # -2\frac{1}{2}, \frac34
_REPEATING = re.compile(r"(?<![\d.])(\d*)\.(\d*)\\overline\s*(?:\{(\d+)\}|(\d))")  # one try per digit run
_QUICK_MAX_CHARS = 500  # longer answers skip the in-process path: unboxing is quadratic in the nesting depth
_BOXED = re.compile(r"^\\(?:boxed|fbox)\s*\{(.*)\}$", re.DOTALL)
_EXACT_DIGITS = 50  # working precision for exact irrational comparisons
_EXACT_RELATIVE = 10.0 ** -40  # what 50 digits can certify; no competition near-miss is closer


def _repeating_value(match: re.Match) -> Fraction:
    """`0.1\\overline{6}` -> 1/6: integer part, fixed digits, then the repeating block (a sign stays outside)."""
    whole, fixed, block = match.group(1) or "0", match.group(2), match.group(3) or match.group(4)
    return int(whole) + (Fraction(int(fixed or "0")) + Fraction(int(block), 10 ** len(block) - 1)) / 10 ** len(fixed)


def _unwrap_boxed(text: str) -> str:
    """`\\boxed{\\boxed{5}}` -> `5`: a gold answer stored with its box still on."""
    while (match := _BOXED.match(text.strip())) is not None:
        inner = match.group(1)
        depth = 0
        for char in inner:  # `\boxed{a} + \boxed{b}` is not one box around everything
            depth += (char == "{") - (char == "}")
            if depth < 0:
                return text.strip()
        text = inner
    return text.strip()


def normalize_answer(answer: str) -> str:
    """Strips markup, units and spacing; `\\dfrac{1}{2}` -> `\\frac{1}{2}`, `50\\%` -> `50%`."""
    text = _unwrap_boxed(str(answer))
    text = re.sub(r"\\text(bf|rm|it)?\{([^{}]*)\}|\\mathrm\{([^{}]*)\}|\\mbox\{([^{}]*)\}",
                  lambda m: m.group(2) or m.group(3) or m.group(4) or "", text)
    text = text.replace("\\$", "").replace("{,}", ",")
    for token in ("\\displaystyle", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "$",
                  "\\(", "\\)", "\\[", "\\]"):
        text = text.replace(token, "")
    text = text.replace("~", " ").replace("\\%", "%")
    text = re.sub(r"\^\s*\{?\\circ\}?|°", "", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = _REPEATING.sub(lambda m: str(_repeating_value(m)), text)
    text = re.sub(r"^[a-zA-Z]\s*=\s*", "", text)  # "x = 5" -> "5"
    text = re.sub(rf"(?<=[\d}}).])\s*(({_UNIT_WORDS})\b\s*)+(\^?\d)?$", "", text)
    text = re.sub(r"^-?(\d{1,3}(,\d{3})+)(\.\d+)?$", lambda m: m.group(0).replace(",", ""), text)
    text = text.rstrip(".").strip()
    return re.sub(r"\s+", " ", text)


def _plain_number(text: str) -> Fraction | None:
    """The exact value of an integer, decimal, `a/b`, `\\frac{a}{b}` or mixed number; else None."""
    text = text.replace(" ", "")
    if len(text) > 60:
        return None
    if (fraction := _LATEX_FRACTION.match(text)) is not None:
        sign, whole, numerator, denominator = fraction.group(1), fraction.group(2), *(
            fraction.group(3, 4) if fraction.group(3) else fraction.group(5, 6))
        if int(denominator) == 0 or (whole and numerator.startswith("-")):
            return None
        value = int(whole or 0) + Fraction(int(numerator), int(denominator))  # 2\frac{1}{2} is 5/2, as in MATH
        return -value if sign else value
    if not _PLAIN_NUMBER.match(text):
        return None
    numerator, _, denominator = text.partition("/")
    value = Fraction(numerator)
    return value / int(denominator) if denominator and int(denominator) else (None if denominator else value)


def _split_top_level(text: str) -> list[str]:
    """`1, (2, 3), 4` -> ['1', '(2, 3)', '4']: commas outside brackets and braces."""
    parts, depth, current = [], 0, []
    for char in text:
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    return [*parts, "".join(current).strip()]


def _plain_elements(text: str) -> tuple[str, list] | None:
    """A list of plain numbers with its brackets: `[1, \\infty)` -> ("[)", [1, "oo"]).

    Bare lists and `\\{...\\}` are sets (kind "set"); `(..)` / `[..]` keep their
    brackets, as tuples and intervals compare in order. None when any element is not a
    plain number (or +-infinity), or for a single number.
    """
    kind = "set"
    if text.startswith("\\{") and text.endswith("\\}"):
        text = text[2:-2]
    elif text[:1] in "([" and text[-1:] in ")]":
        kind, text = text[0] + text[-1], text[1:-1]
    parts = _split_top_level(text)
    if len(parts) < 2:
        return None
    values = []
    for part in parts:
        if part.replace(" ", "") in ("\\infty", "+\\infty", "-\\infty"):
            values.append("-oo" if part.lstrip().startswith("-") else "oo")
        elif (value := _plain_number(part)) is not None:
            values.append(value)
        else:
            return None
    return kind, values


def quick_equal(prediction: str, reference: str) -> bool | None:
    """Bounded-time decision when possible: True/False, or None (needs `math_equal`).

    Plain numbers (integers, decimals, `a/b`, `\\frac{a}{b}`, mixed numbers) compare as
    exact fractions; a percentage also matches its value / 100. Lists of plain numbers
    compare as sets (bare or `\\{..\\}`) or in order with equal brackets (tuples,
    intervals). A reference with a decimal that differs exactly is left to `math_equal`,
    whose tolerance rule covers approximate golds, as are answers over `_QUICK_MAX_CHARS`.
    """
    if len(str(prediction)) > _QUICK_MAX_CHARS or len(str(reference)) > _QUICK_MAX_CHARS:
        return None
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if pred == ref:
        return True
    if not pred:
        return False
    undecided_if_unequal = None if re.search(r"\.\d|[eE]", ref) else False
    pred_list, ref_list = _plain_elements(pred), _plain_elements(ref)
    if pred_list is not None and ref_list is not None:
        (pred_kind, pred_values), (ref_kind, ref_values) = pred_list, ref_list
        if pred_kind == ref_kind == "set":
            return set(pred_values) == set(ref_values) or undecided_if_unequal
        if "set" not in (pred_kind, ref_kind):  # `[2, 5]` is not `[2, 5)`, nor `(2, 5)`
            return (pred_kind == ref_kind and pred_values == ref_values) or undecided_if_unequal
        return None
    pred_number, ref_number = _plain_number(pred.rstrip("%")), _plain_number(ref.rstrip("%"))
    if pred_number is None or ref_number is None:
        return None
    candidates = {pred_number} | ({pred_number / 100} if pred.endswith("%") else set())
    references = {ref_number} | ({ref_number / 100} if ref.endswith("%") else set())
    return bool(candidates & references) or undecided_if_unequal


def _choice(text: str) -> tuple[str, str] | None:
    """An AMC answer: `\\textbf{(C)}\\ 12` -> ("C", "12"), `(C)` / `C` -> ("C", ""); else None."""
    match = re.fullmatch(r"\(?([A-E])\)?(?:(?<=\))(?:\\ |\s)*(.*))?", normalize_answer(text), re.DOTALL)
    return (match.group(1), (match.group(2) or "").strip()) if match else None


def _container_kind(text: str) -> str | None:
    """`set` for `\\{1,2\\}`, `sequence` for `(1,2)` / `[1,2)`, None for anything else."""
    if text.startswith("\\{") and text.endswith("\\}"):
        return "set"
    if text[:1] in "([" and text[-1:] in ")]" and "," in text:
        return "sequence"
    return None


def _prepare_latex(answer: str) -> str:
    """What math-verify gets: the box and `$` removed, repeating decimals as fractions,
    `1.5e30` as `1.5 \\times 10^{30}` (in LaTeX `e` is Euler's number)."""
    text = _unwrap_boxed(str(answer)).replace("\\$", "").replace("$", "")
    text = re.sub(r"^(-?(?:\d+\.?\d*|\.\d+))[eE]([-+]?\d{1,3})$", r"\1 \\times 10^{\2}", text)

    def as_latex(match: re.Match) -> str:
        value = _repeating_value(match)
        return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"

    return _REPEATING.sub(as_latex, text)


def parse_answer(answer: str):
    """math-verify's parse of one bare answer (LaTeX grammar only): [sympy object, string] or []."""
    from math_verify import LatexExtractionConfig, parse

    return parse(f"${_prepare_latex(answer)}$", extraction_config=[LatexExtractionConfig()],
                 parsing_timeout=None)


def _percent_values(expr) -> list:
    """`50\\%` parses as 50 * (1/100); it may mean 0.5 or 50, as in `quick_equal`."""
    from math_verify.grader import get_pct_val

    inner = get_pct_val(expr)
    return [expr.doit(), inner] if inner is not None else [expr]


def _rationalize(expr):
    """Decimal literals as the exact rationals they spell: 0.25 -> 1/4."""
    import sympy

    return expr.xreplace({f: sympy.Rational(str(f)) for f in expr.atoms(sympy.Float)})


def _numbers_equal(gold, pred, gold_is_float: bool, tolerance: float) -> bool:
    """One scalar pair under the exactness rule of the module docstring."""
    import sympy

    gold, pred = gold.doit(), pred.doit()
    if not gold_is_float and gold.is_Rational and pred.is_Rational:
        return bool(gold == pred)
    gold_value, pred_value = complex(sympy.N(gold, _EXACT_DIGITS)), complex(sympy.N(pred, _EXACT_DIGITS))
    if not (cmath.isfinite(gold_value) and cmath.isfinite(pred_value)):
        return bool(gold == pred)  # oo - oo is no difference to measure: -oo is not oo
    difference = abs(complex(sympy.N(gold - pred, _EXACT_DIGITS)))
    bound = tolerance if gold_is_float else _EXACT_RELATIVE
    return difference == 0 or difference <= bound * abs(gold_value)


def math_equal(prediction: str, reference: str, tolerance: float = 1e-6) -> bool:
    """Whether `prediction` denotes the same answer as the gold `reference`.

    Args:
      prediction: the model's final answer (the content of its last `\\boxed{}`).
      reference: the gold answer; may itself be boxed.
      tolerance: relative tolerance, used only when the gold contains a decimal literal.
    Returns:
      True when equal under the exactness rule of the module docstring.
    """
    import sympy
    from math_verify import verify

    quick = quick_equal(prediction, reference)
    if quick is not None:
        return quick
    gold_choice = _choice(reference)
    if gold_choice is not None and gold_choice[1]:  # a letter with its value: either one answers
        pred_choice = _choice(prediction)
        if pred_choice is not None:
            return pred_choice[0] == gold_choice[0]
        return math_equal(prediction, gold_choice[1], tolerance)
    pred_kind, ref_kind = _container_kind(normalize_answer(prediction)), _container_kind(normalize_answer(reference))
    if pred_kind and ref_kind and pred_kind != ref_kind:  # an ordered pair is not a set
        return False
    gold_parsed, pred_parsed = parse_answer(reference), parse_answer(prediction)
    if not gold_parsed or not pred_parsed or isinstance(gold_parsed[0], str) or isinstance(pred_parsed[0], str):
        return False  # unparseable: only the exact string match of `quick_equal` counts
    gold, pred = gold_parsed[0], pred_parsed[0]
    gold_is_float = bool(gold.atoms(sympy.Float))
    if not gold_is_float:
        pred = _rationalize(pred)
    if isinstance(gold, sympy.Expr) and isinstance(pred, sympy.Expr) and gold.is_number and pred.is_number:
        return any(_numbers_equal(g, p, gold_is_float, tolerance)
                   for g in _percent_values(gold) for p in _percent_values(pred))
    return bool(verify(gold, pred, float_rounding=6, numeric_precision=_EXACT_DIGITS, strict=True,
                       timeout_seconds=None))
