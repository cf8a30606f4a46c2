"""Synthetic math problems that need a program, for the one-GPU ReTool recipe (configs/retool_small.py).

Each family draws parameters, states the problem in words, and carries the scripted
solver's program for it (always ``[import math]`` + ``answer = <expression>`` +
``print(answer)``: one shape a small model can learn to write) together with an answer
computed independently of that program (tests run every program in the real sandbox and
compare). The families and their variants:

    bignum   a*b+c, a*b-c, a*(b+c), a*b*c       big-number arithmetic
    seqsum   k**p over k from a to b, p in 1..3, all / odd / even k
    gcdlcm   gcd or lcm of two or three numbers
    primes   count of primes below n, or between a and b
    digits   digit sum of a**b, or of n!
    lineq    a*x + b = c*x + d, or a*(x + b) = c, solved for x
    binom    C(n, k), or C(n, k) + C(n, k + 1)
    modpow   a**b mod m

Two kinds of held-out tasks, never seen in training (``make_tasks``):

- ``held_out_range``: a training variant whose banded parameter (the leading digits of the
  first operand, the length of the summed range, the common factor, the prime bound, the
  exponent, |x|, n) lies in the top 20% of its range, where no training task's does.
- ``held_out_combo``: a combination of parts each seen in training but never together:
  cubes over odd k (cubes and odd-k filters are both trained), squares over even k, the
  gcd of three numbers (gcd of two and lcm of three are trained), a*b*c, and the sum of
  two binomials C(n, k) + C(n, k + 1) (written with parts of the trained C(n, k)).

Training tasks are drawn from the training ranges of the non-held-out variants only, and
a question that also occurs in an evaluation split is redrawn, so the splits are disjoint
by construction (tests check it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import numpy as np

Split = Literal["train", "held_out_range", "held_out_combo"]
SPLITS: tuple[str, ...] = ("train", "held_out_range", "held_out_combo")


class Problem(NamedTuple):
    """One drawn problem: the question, the scripted solver's program, and the answer.

    ``answer`` is computed without running ``program``; ``uses_math`` says whether the
    program starts with ``import math`` (what the missing-import bug removes); ``param`` is
    the parameter whose range is split between training and ``held_out_range``.
    """

    question: str
    program: str
    answer: int
    param: int
    uses_math: bool = False


def _problem(question: str, expression: str, answer: int, param: int, uses_math: bool = False) -> Problem:
    program = ("import math\n" if uses_math else "") + f"answer = {expression}\nprint(answer)"
    return Problem(question, program, int(answer), param, uses_math)


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """A uniform integer in [low, high]."""
    return int(rng.integers(low, high + 1))


def _band(rng: np.random.Generator, low: int, high: int, held_out: bool) -> int:
    """A uniform integer from the training part of [low, high] (its lower 80%) or, with
    ``held_out``, from the rest: values no training task has, written with as many digits as
    training values (a model trained from scratch does not copy numbers longer than any it
    has seen, and that is not what the held-out range tests)."""
    cut = low + math.ceil(0.8 * (high - low + 1))
    return _int(rng, cut, high) if held_out else _int(rng, low, cut - 1)


# -------------------------------------------------------------------- families
# Each draw function takes (rng, variant, held_out) and returns a Problem; `held_out` draws
# the family's banded parameter (`param`) from the held-out part of its range.


def _bignum(rng, variant, held_out):
    width = _int(rng, 2, 4)
    a = _band(rng, 10 ** (width - 1), 10**width - 1, held_out)
    b, c = _int(rng, 10 ** (width - 1), 10**width - 1), _int(rng, 1, 10**max(width - 1, 1) - 1)
    expression, answer = {
        "mul_add": (f"{a}*{b} + {c}", a * b + c),
        "mul_sub": (f"{a}*{b} - {c}", a * b - c),
        "mul_paren": (f"{a}*({b} + {c})", a * (b + c)),
        "mul3": (f"{a}*{b}*{c}", a * b * c),
    }[variant]
    return _problem(f"Compute {expression}.", expression, answer, 10 * a // 10 ** (width - 1))  # leading 2 digits


def _seqsum(rng, variant, held_out):
    power, parity = int(variant[1]), variant[3:]
    a = _int(rng, 1, 99)
    b = a + _band(rng, 10, 299, held_out)
    which = {"all": "", "odd": " odd", "even": " even"}[parity]
    condition = {"all": "", "odd": " if k % 2 == 1", "even": " if k % 2 == 0"}[parity]
    ks = [k for k in range(a, b + 1) if parity == "all" or k % 2 == (parity == "odd")]
    term = "k" if power == 1 else f"k**{power}"
    question = f"Find the sum of {term} over the{which} integers k from {a} to {b}."
    return _problem(question, f"sum({term} for k in range({a}, {b + 1}){condition})",
                    sum(k**power for k in ks), b - a)


def _gcdlcm(rng, variant, held_out):
    op, arity = variant[:3], int(variant[3])
    base = _band(rng, 2, 40, held_out)
    numbers = [base * _int(rng, 2, 60) for _ in range(arity)]
    answer = math.gcd(*numbers) if op == "gcd" else math.lcm(*numbers)
    listed = ", ".join(map(str, numbers))
    words = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    name = "greatest common divisor" if op == "gcd" else "least common multiple"
    return _problem(f"Find the {name} of {words}.", f"math.{op}({listed})", answer, base, uses_math=True)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _primes(rng, variant, held_out):
    test = "k > 1 and all(k % d for d in range(2, math.isqrt(k) + 1))"
    if variant == "below":
        n = _band(rng, 20, 2999, held_out)
        question = f"How many prime numbers are less than {n}?"
        return _problem(question, f"sum(1 for k in range({n}) if {test})", sum(map(_is_prime, range(n))), n, True)
    a = _band(rng, 2, 1999, held_out)
    b = a + _int(rng, 50, 999)
    question = f"How many prime numbers are there between {a} and {b}, inclusive?"
    expression = f"sum(1 for k in range({a}, {b + 1}) if {test})"
    return _problem(question, expression, sum(map(_is_prime, range(a, b + 1))), a, True)


def _digit_sum(n: int) -> int:
    return sum(int(d) for d in str(n))


def _digits_family(rng, variant, held_out):
    if variant == "pow":
        a, b = _int(rng, 2, 99), _band(rng, 10, 199, held_out)
        question = f"What is the sum of the digits of {a}**{b}?"
        return _problem(question, f"sum(int(d) for d in str({a}**{b}))", _digit_sum(a**b), b)
    n = _band(rng, 10, 199, held_out)
    question = f"What is the sum of the digits of {n}! ({n} factorial)?"
    return _problem(question, f"sum(int(d) for d in str(math.factorial({n})))", _digit_sum(math.factorial(n)), n,
                    True)


def _lineq(rng, variant, held_out):
    x = _band(rng, 1, 99, held_out) * (1 if rng.random() < 0.5 else -1)
    if variant == "two_sided":
        a, c = _int(rng, 2, 99), _int(rng, 2, 99)
        if a == c:
            c += 1
        b = _int(rng, -990, 990)
        d = (a - c) * x + b
        question = f"Solve {a}*x + {b} = {c}*x + {d} for x."
        return _problem(question.replace("+ -", "- "), f"({d} - ({b})) // ({a} - {c})", x, abs(x))
    a, b = _int(rng, 2, 99), _int(rng, -990, 990)
    c = a * (x + b)
    question = f"Solve {a}*(x + {b}) = {c} for x."
    return _problem(question.replace("+ -", "- "), f"{c} // {a} - ({b})", x, abs(x))


def _binom(rng, variant, held_out):
    n = _band(rng, 10, 79, held_out)
    k = _int(rng, 2, n - 2)
    if variant == "choose":
        return _problem(f"What is the binomial coefficient C({n}, {k})?", f"math.comb({n}, {k})", math.comb(n, k), n,
                        True)
    question = f"What is C({n}, {k}) + C({n}, {k + 1})?"
    return _problem(question, f"math.comb({n}, {k}) + math.comb({n}, {k + 1})",
                    math.comb(n, k) + math.comb(n, k + 1), n, True)


def _modpow(rng, variant, held_out):
    del variant
    a, m, b = _int(rng, 10, 999), _int(rng, 7, 999), _band(rng, 100, 999, held_out)
    return _problem(f"What is {a}**{b} mod {m}?", f"pow({a}, {b}, {m})", pow(a, b, m), b)


class Family(NamedTuple):
    draw: Callable[[np.random.Generator, str, bool], Problem]
    variants: tuple[str, ...]
    held_out_variants: tuple[str, ...] = ()  # the held_out_combo split's variants


FAMILIES: dict[str, Family] = {
    "bignum": Family(_bignum, ("mul_add", "mul_sub", "mul_paren", "mul3"), ("mul3",)),
    "seqsum": Family(_seqsum, tuple(f"p{p}_{q}" for p in (1, 2, 3) for q in ("all", "odd", "even")),
                     ("p3_odd", "p2_even")),
    "gcdlcm": Family(_gcdlcm, ("gcd2", "lcm2", "gcd3", "lcm3"), ("gcd3",)),
    "primes": Family(_primes, ("below", "between")),
    "digits": Family(_digits_family, ("pow", "fact")),
    "lineq": Family(_lineq, ("two_sided", "factored")),
    "binom": Family(_binom, ("choose", "choose_sum"), ("choose_sum",)),
    "modpow": Family(_modpow, ("pow",)),
}


def _variants(family: str, split: Split) -> tuple[str, ...]:
    spec = FAMILIES[family]
    if split == "held_out_combo":
        return spec.held_out_variants
    return tuple(v for v in spec.variants if v not in spec.held_out_variants)


def _draw(families: tuple[str, ...], split: Split, count: int, seed: int,
          exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """``count`` distinct tasks of ``split``: the families that have variants in it in turn
    (evaluation, so each is scored about equally) or at random (training), a random variant."""
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    pool = [f for f in families if _variants(f, split)]
    if not pool:
        return []
    tasks, seen, attempts = [], set(exclude), 0
    while len(tasks) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"cannot draw {count} distinct {split} tasks from families {families}")
        family = pool[len(tasks) % len(pool)] if split != "train" else pool[int(rng.integers(len(pool)))]
        variants = _variants(family, split)
        variant = variants[int(rng.integers(len(variants)))]
        problem = FAMILIES[family].draw(rng, variant, split == "held_out_range")
        if problem.question in seen:
            continue
        seen.add(problem.question)
        tasks.append({"question": problem.question, "answer": str(problem.answer), "program": problem.program,
                      "uses_math": problem.uses_math, "param": problem.param, "family": family, "variant": variant, "split": split})
    return tasks


def make_tasks(num_train: int, num_eval: int, *, seed: int, families: tuple[str, ...] = tuple(FAMILIES),
               combo_fraction: float = 0.5) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) task dicts; eval is ``combo_fraction`` held_out_combo, the rest held_out_range.

    Every task has ``question``, ``answer`` (a decimal integer string), the solver's
    ``program``, ``uses_math``, ``family``, ``variant`` and ``split``. The two splits share no
    question, no (variant, parameter range) and no held-out combination.

    Raises:
      ValueError: an unknown family, or too few distinct tasks to draw.
    """
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        raise ValueError(f"unknown problem families {unknown or families}; known: {', '.join(FAMILIES)}")
    train, held_out = _make_tasks(num_train, num_eval, seed, tuple(families), combo_fraction)
    return [dict(t) for t in train], [dict(t) for t in held_out]


@functools.lru_cache(maxsize=4)  # a run asks once per split; drawing 20k tasks takes seconds
def _make_tasks(num_train: int, num_eval: int, seed: int, families: tuple[str, ...],
                combo_fraction: float) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]:
    has_combo = any(FAMILIES[f].held_out_variants for f in families)
    num_combo = round(num_eval * combo_fraction) if has_combo else 0
    parts = [_draw(families, "held_out_range", num_eval - num_combo, seed),
             _draw(families, "held_out_combo", num_combo, seed)]
    # Interleaved, so a prefix (eval.num_tasks below the total) holds both splits in proportion.
    ordered = sorted(((i + 0.5) / len(part), p, i) for p, part in enumerate(parts) for i in range(len(part)))
    held_out = [parts[p][i] for _, p, i in ordered]
    train = _draw(families, "train", num_train, seed, exclude=frozenset(t["question"] for t in held_out))
    return tuple(train), tuple(held_out)


__all__ = ["FAMILIES", "Family", "Problem", "SPLITS", "make_tasks"]
