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

- ``held_out_range``: a training variant with larger parameters (more digits, longer
  ranges, larger n) than any training task.
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
    program starts with ``import math`` (what the missing-import bug removes).
    """

    question: str
    program: str
    answer: int
    uses_math: bool = False


def _program(expression: str, uses_math: bool = False) -> str:
    return ("import math\n" if uses_math else "") + f"answer = {expression}\nprint(answer)"


def _problem(question: str, expression: str, answer: int, uses_math: bool = False) -> Problem:
    return Problem(question, _program(expression, uses_math), int(answer), uses_math)


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """A uniform integer in [low, high]."""
    return int(rng.integers(low, high + 1))


def _digits(rng: np.random.Generator, n: int) -> int:
    return _int(rng, 10 ** (n - 1), 10**n - 1)


# -------------------------------------------------------------------- families
# Each draw function takes (rng, variant, large) and returns a Problem; `large` selects the
# held-out parameter range, which starts where the training range ends.


def _bignum(rng, variant, large):
    width = _int(rng, 5, 6) if large else _int(rng, 2, 4)
    a, b, c = _digits(rng, width), _digits(rng, width), _digits(rng, max(width - 1, 1))
    expression, answer = {
        "mul_add": (f"{a}*{b} + {c}", a * b + c),
        "mul_sub": (f"{a}*{b} - {c}", a * b - c),
        "mul_paren": (f"{a}*({b} + {c})", a * (b + c)),
        "mul3": (f"{a}*{b}*{c}", a * b * c),
    }[variant]
    return _problem(f"Compute {expression}.", expression, answer)


def _seqsum(rng, variant, large):
    power, parity = int(variant[1]), variant[3:]
    a = _int(rng, 1, 99) if not large else _int(rng, 100, 999)
    b = a + (_int(rng, 10, 200) if not large else _int(rng, 300, 2000))
    which = {"all": "", "odd": " odd", "even": " even"}[parity]
    condition = {"all": "", "odd": " if k % 2 == 1", "even": " if k % 2 == 0"}[parity]
    ks = [k for k in range(a, b + 1) if parity == "all" or k % 2 == (parity == "odd")]
    term = "k" if power == 1 else f"k**{power}"
    question = f"Find the sum of {term} over the{which} integers k from {a} to {b}."
    return _problem(question, f"sum({term} for k in range({a}, {b + 1}){condition})", sum(k**power for k in ks))


def _gcdlcm(rng, variant, large):
    op, arity = variant[:3], int(variant[3])
    base = _int(rng, 2, 30) if not large else _int(rng, 31, 300)
    cofactor = (2, 60) if not large else (61, 900)
    numbers = [base * _int(rng, *cofactor) for _ in range(arity)]
    answer = math.gcd(*numbers) if op == "gcd" else math.lcm(*numbers)
    listed = ", ".join(map(str, numbers))
    words = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    name = "greatest common divisor" if op == "gcd" else "least common multiple"
    return _problem(f"Find the {name} of {words}.", f"math.{op}({listed})", answer, uses_math=True)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _primes(rng, variant, large):
    test = "k > 1 and all(k % d for d in range(2, math.isqrt(k) + 1))"
    if variant == "below":
        n = _int(rng, 20, 2000) if not large else _int(rng, 2001, 20000)
        question = f"How many prime numbers are less than {n}?"
        return _problem(question, f"sum(1 for k in range({n}) if {test})", sum(map(_is_prime, range(n))), True)
    a = _int(rng, 2, 1000) if not large else _int(rng, 1001, 10000)
    b = a + (_int(rng, 50, 1000) if not large else _int(rng, 1001, 10000))
    question = f"How many prime numbers are there between {a} and {b}, inclusive?"
    expression = f"sum(1 for k in range({a}, {b + 1}) if {test})"
    return _problem(question, expression, sum(map(_is_prime, range(a, b + 1))), True)


def _digit_sum(n: int) -> int:
    return sum(int(d) for d in str(n))


def _digits_family(rng, variant, large):
    if variant == "pow":
        a, b = _int(rng, 2, 99), (_int(rng, 10, 150) if not large else _int(rng, 151, 600))
        question = f"What is the sum of the digits of {a}**{b}?"
        return _problem(question, f"sum(int(d) for d in str({a}**{b}))", _digit_sum(a**b))
    n = _int(rng, 10, 150) if not large else _int(rng, 151, 600)
    question = f"What is the sum of the digits of {n}! ({n} factorial)?"
    return _problem(question, f"sum(int(d) for d in str(math.factorial({n})))", _digit_sum(math.factorial(n)), True)


def _lineq(rng, variant, large):
    x = _int(rng, -99, 99) if not large else _int(rng, 100, 9999) * (1 if rng.random() < 0.5 else -1)
    top = 99 if not large else 999
    if variant == "two_sided":
        a, c = _int(rng, 2, top), _int(rng, 2, top)
        if a == c:
            c += 1
        b = _int(rng, -top * 10, top * 10)
        d = (a - c) * x + b
        question = f"Solve {a}*x + {b} = {c}*x + {d} for x."
        return _problem(question.replace("+ -", "- "), f"({d} - ({b})) // ({a} - {c})", x)
    a, b = _int(rng, 2, top), _int(rng, -top * 10, top * 10)
    c = a * (x + b)
    question = f"Solve {a}*(x + {b}) = {c} for x."
    return _problem(question.replace("+ -", "- "), f"{c} // {a} - ({b})", x)


def _binom(rng, variant, large):
    n = _int(rng, 10, 60) if not large else _int(rng, 61, 200)
    k = _int(rng, 2, n - 2)
    if variant == "choose":
        return _problem(f"What is the binomial coefficient C({n}, {k})?", f"math.comb({n}, {k})", math.comb(n, k), True)
    question = f"What is C({n}, {k}) + C({n}, {k + 1})?"
    return _problem(question, f"math.comb({n}, {k}) + math.comb({n}, {k + 1})",
                    math.comb(n, k) + math.comb(n, k + 1), True)


def _modpow(rng, variant, large):
    del variant
    a, m = _digits(rng, _int(rng, 2, 3)), _int(rng, 7, 999) if not large else _int(rng, 1000, 99999)
    b = _int(rng, 10, 999) if not large else _int(rng, 1000, 99999)
    return _problem(f"What is {a}**{b} mod {m}?", f"pow({a}, {b}, {m})", pow(a, b, m))


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
                      "uses_math": problem.uses_math, "family": family, "variant": variant, "split": split})
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
    held_out = (_draw(families, "held_out_range", num_eval - num_combo, seed)
                + _draw(families, "held_out_combo", num_combo, seed))
    train = _draw(families, "train", num_train, seed, exclude=frozenset(t["question"] for t in held_out))
    return tuple(train), tuple(held_out)


__all__ = ["FAMILIES", "Family", "Problem", "SPLITS", "make_tasks"]
