"""Math answer equivalence: LaTeX-ish strings normalized, then compared with sympy.

`math_equal` can take unbounded time on adversarial input (`9^{9^{9^9}}`), so the
trainer never calls it directly: `verifier.MathVerifier` runs it in a worker process
under a hard timeout. `quick_equal` is the bounded in-process fast path (string and
plain-number comparison) that decides most cases without the worker.

Names reaching sympy's parser are whitelisted (math functions and one-letter
symbols), so a model's answer cannot evaluate arbitrary Python.
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNIT_WORDS = (
    "degrees?|cm|mm|km|m|meters?|inches|inch|feet|foot|ft|miles?|units?|square|sq|cubic|dollars?|cents?"
    "|hours?|minutes?|seconds?|days?|years?|kg|g|grams?|pounds?|lbs?|mph|percent")
_ALLOWED_NAMES = {"sqrt", "log", "ln", "exp", "sin", "cos", "tan", "pi", "oo", "E", "I", "Rational"}
_FUNCTIONS = ("sin", "cos", "tan", "ln", "log", "exp")
_PLAIN_NUMBER = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)([eE]-?\d{1,3})?(/\d+)?$")


def _replace_braced_command(text: str, command: str, arity: int, render) -> str:
    """Rewrites `\\command{a}{b}` (nested braces) with `render(a, b)`; bare `\\frac12` too."""
    while (start := text.find(command)) != -1:
        index = start + len(command)
        args = []
        for _ in range(arity):
            while index < len(text) and text[index] == " ":
                index += 1
            if index < len(text) and text[index] == "{":
                depth, end = 0, index
                for end in range(index, len(text)):
                    depth += {"{": 1, "}": -1}.get(text[end], 0)
                    if depth == 0:
                        break
                if depth != 0:
                    return text.replace(command, "", 1)
                args.append(text[index + 1:end])
                index = end + 1
            elif index < len(text):
                args.append(text[index])
                index += 1
            else:
                return text[:start]
        text = text[:start] + render(*args) + text[index:]
    return text


def normalize_answer(answer: str) -> str:
    """Strips markup, units and spacing; `\\dfrac{1}{2}` -> `(1)/(2)`, `50\\%` -> `50%`."""
    text = str(answer).strip()
    text = re.sub(r"\\text(bf|rm|it)?\{([^{}]*)\}|\\mathrm\{([^{}]*)\}|\\mbox\{([^{}]*)\}",
                  lambda m: m.group(2) or m.group(3) or m.group(4) or "", text)
    text = text.replace("\\$", "")
    for token in ("\\displaystyle", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "$",
                  "\\(", "\\)", "\\[", "\\]"):
        text = text.replace(token, "")
    text = text.replace("~", " ").replace("\\%", "%")
    text = re.sub(r"\^\s*\{?\\circ\}?|°", "", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"^[a-zA-Z]\s*=\s*", "", text)  # "x = 5" -> "5"
    text = re.sub(rf"(?<=[\d}}).])\s*(({_UNIT_WORDS})\b\s*)+(\^?\d)?$", "", text)
    text = re.sub(r"^(\d{1,3}(,\d{3})+)(\.\d+)?$", lambda m: m.group(0).replace(",", ""), text)
    text = text.rstrip(".").strip()
    return re.sub(r"\s+", " ", text)


def to_sympy_source(text: str) -> str:
    """LaTeX subset -> Python/sympy source; raises ValueError on names outside the whitelist."""
    text = _replace_braced_command(text, "\\frac", 2, lambda a, b: f"(({a})/({b}))")
    text = re.sub(r"\\sqrt\s*\[([^\]]*)\]", r"\\rootof{\1}", text)
    text = _replace_braced_command(text, "\\rootof", 2, lambda n, a: f"(({a})**(1/({n})))")
    text = _replace_braced_command(text, "\\sqrt", 1, lambda a: f"sqrt({a})")
    replacements = {"\\pi": " pi ", "\\infty": " oo ", "\\cdot": "*", "\\times": "*", "\\div": "/", "^": "**",
                    "{": "(", "}": ")", "\\ln": " log ", "\\log": " log ", "\\exp": " exp "}
    for old, new in replacements.items():
        text = text.replace(old, new)
    for name in _FUNCTIONS:
        text = text.replace("\\" + name, " " + name + " ")
    if "\\" in text or "__" in text or re.search(r"[^\w\s+\-*/().,%]", text):
        raise ValueError(f"unsupported markup in answer: {text!r}")
    for name in re.findall(r"[A-Za-z_]\w*", text):
        if name not in _ALLOWED_NAMES and not re.fullmatch(r"[A-Za-z]", name):
            raise ValueError(f"name {name!r} not allowed in an answer")
    return text.replace("ln", "log")


def split_top_level(text: str) -> tuple[str, list[str], str]:
    """`(1, 2]` -> ('(', ['1', '2'], ']'); a scalar -> ('', [text], '')."""
    opener, closer = "", ""
    if len(text) >= 2 and text[0] in "([{" and text[-1] in ")]}":
        depth = 0
        for index, char in enumerate(text):
            depth += (char in "([{") - (char in ")]}")
            if depth == 0 and index < len(text) - 1:
                break
        else:
            opener, closer, text = text[0], text[-1], text[1:-1]
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return opener, parts, closer


def _plain_number(text: str) -> Fraction | None:
    text = text.replace(" ", "")
    if not _PLAIN_NUMBER.match(text) or len(text) > 60:
        return None
    numerator, _, denominator = text.partition("/")
    value = Fraction(numerator)
    return value / int(denominator) if denominator and int(denominator) else (None if denominator else value)


def quick_equal(prediction: str, reference: str) -> bool | None:
    """Bounded-time decision when possible: True/False, or None (needs sympy)."""
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if pred == ref:
        return True
    if not pred:
        return False
    pred_number, ref_number = _plain_number(pred.rstrip("%")), _plain_number(ref.rstrip("%"))
    if pred_number is not None and ref_number is not None:
        candidates = {pred_number} | ({pred_number / 100} if pred.endswith("%") else set())
        references = {ref_number} | ({ref_number / 100} if ref.endswith("%") else set())
        return bool(candidates & references)
    return None


def _sympy_value(text: str):
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application,
                                            parse_expr, standard_transformations)

    percent = text.endswith("%")
    source = to_sympy_source(text.rstrip("%").strip())
    names = {n: sympy.Symbol(n) for n in set(re.findall(r"\b[A-Za-z]\b", source)) if n not in ("E", "I")}
    expr = parse_expr(source, local_dict=names, evaluate=True,
                      transformations=standard_transformations + (implicit_multiplication_application, convert_xor))
    return [expr, expr / 100] if percent else [expr]


def _scalar_equal(prediction: str, reference: str, tolerance: float) -> bool:
    import sympy

    quick = quick_equal(prediction, reference)
    if quick is not None:
        return quick
    try:
        preds, refs = _sympy_value(normalize_answer(prediction)), _sympy_value(normalize_answer(reference))
    except Exception:  # unparseable: only an exact string match (already checked) counts
        return False
    for pred in preds:
        for ref in refs:
            if pred.is_number and ref.is_number:
                difference = complex(sympy.N(pred - ref))
                if abs(difference) <= tolerance * max(1.0, abs(complex(sympy.N(ref)))):
                    return True
            elif sympy.simplify(pred - ref) == 0:
                return True
    return False


def math_equal(prediction: str, reference: str, tolerance: float = 1e-6) -> bool:
    """Whether two final answers denote the same value, tuple or interval.

    Integers, decimals, fractions (`\\frac`, `\\dfrac`, `a/b`), roots, `\\pi`,
    percentages (`50\\%` matches 50 and 0.5), units and `\\text{}` stripped, `x = 5`.
    Tuples and intervals compare element-wise, with bracket types when both have them.
    """
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if pred == ref:
        return True
    pred_open, pred_parts, pred_close = split_top_level(pred)
    ref_open, ref_parts, ref_close = split_top_level(ref)
    if len(pred_parts) != len(ref_parts):
        return False
    if len(ref_parts) > 1 and pred_open and ref_open and (pred_open, pred_close) != (ref_open, ref_close):
        return False
    if len(ref_parts) == 1 and (pred_open or ref_open):
        pred_parts, ref_parts = [pred], [ref]
    return all(_scalar_equal(p, r, tolerance) for p, r in zip(pred_parts, ref_parts))
