"""Bridge-thought hygiene: the leakage guard and the placebo control (docs/hybrid.md).

Self-distillation with privileged context (SDPO, OPSD, RLSD) has one failure mode named in
every report: the privileged text gives the answer away, the teacher then prefers the
right final tokens for a reason the student can never see, and the OPD term teaches the
student to "guess" the answer. A bridge thought must say *how* to fix the attempt, never
*what* the answer is, so

- ``hint_leaks_answer`` refuses a hint that states the gold answer after the verifier's
  normalization (``rewards.math_equiv``): the normalized gold as a standalone span of the
  normalized hint, or a number / boxed span of the hint that ``quick_equal`` finds equal
  to the gold (``1{,}000`` for 1000, ``0.5`` for ``\\frac{1}{2}``). The check is lexical
  and conservative: a hint that mentions the answer's value for another reason (an
  operand equal to the answer) is refused too, and an equivalent form that only
  ``math_equal`` would recognise (``\\sqrt{3}/2`` for ``\\frac{\\sqrt{3}}{2}``) passes. It
  never runs the unbounded-time path of the verifier.
- ``placebo_hints`` is the control arm of the ablation: every hinted trajectory gets the
  hint of another task, of the same token length where the batch allows it, so whatever
  the placebo arm does comes from "some text in the context", not from what the hint says.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

from agentrl_jax.rewards.boxed import find_boxed_spans
from agentrl_jax.rewards.math_equiv import normalize_answer, quick_equal

# integers with thousands separators, decimals, a/b and \frac{a}{b}: the forms quick_equal decides
_NUMBER = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:(?:,|\{,\})\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![\w])"
    r"|\\[dt]?frac\{-?\d+\}\{\d+\}"
)


def _standalone(needle: str, haystack: str) -> bool:
    """needle occurs in haystack, whitespace inside it ignored (``x^2 + 1`` for ``x^2+1``),
    not glued to a longer word or number on either side."""
    body = r"\s*".join(re.escape(char) for char in re.sub(r"\s+", "", needle))
    pattern = rf"(?<![A-Za-z0-9.]){body}(?![A-Za-z0-9]|\.\d)"
    return re.search(pattern, haystack) is not None


def hint_leaks_answer(hint: str, answer: str) -> bool:
    """Whether a bridge thought gives away the gold answer (module docstring).

    Args:
      hint: the judge's bridge thought.
      answer: the task's gold answer (as the verifier receives it).
    Returns:
      True when the hint states the answer; False for an empty gold (nothing to leak).
    """
    gold = normalize_answer(str(answer))
    if not gold:
        return False
    if _standalone(gold, normalize_answer(hint)):
        return True
    candidates = [m.group(0) for m in _NUMBER.finditer(hint)] + [content for _, _, content in find_boxed_spans(hint)]
    return any(quick_equal(candidate, str(answer)) is True for candidate in candidates)


@dataclasses.dataclass(frozen=True)
class PlaceboStats:
    """What ``placebo_hints`` managed.

    Attributes:
      hinted: trajectories that had a hint.
      same_length: of those, how many got another task's hint of exactly their length.
      other_length: how many got another task's hint of a different length.
      unmatched: how many got no placebo (every other hint is from the same task); they
        carry no hint in the placebo arm.
    """

    hinted: int
    same_length: int
    other_length: int
    unmatched: int


def _derange(indices: list[int], keys: Sequence[Hashable], rng: np.random.Generator) -> dict[int, int]:
    """A map i -> j over ``indices`` with keys[j] != keys[i] for as many i as possible.

    Shuffle, sort by key (stable), then give each position the one ``m`` places ahead,
    m = the size of the largest key class: when that class is at most half of the
    indices, every receiver gets a donor of another key (the classic multiset rotation);
    otherwise the receivers whose donor shares their key are left out.
    """
    if len(indices) < 2:
        return {}
    order = [indices[k] for k in rng.permutation(len(indices))]
    order.sort(key=lambda i: str(keys[i]))
    counts: dict[Hashable, int] = defaultdict(int)
    for i in order:
        counts[keys[i]] += 1
    shift = max(counts.values())
    n = len(order)
    out = {}
    for pos, receiver in enumerate(order):
        donor = order[(pos + shift) % n]
        if keys[donor] != keys[receiver]:
            out[receiver] = donor
    return out


def placebo_hints(
    hints: Sequence[str | None],
    hint_lengths: Sequence[int],
    task_keys: Sequence[Hashable],
    rng: np.random.Generator,
) -> tuple[list[str | None], PlaceboStats]:
    """Each hinted trajectory gets another task's hint, of the same token length if possible.

    Hints are first exchanged inside groups of equal token length (between different
    tasks: the trajectories of one GRPO group share a task, and often a hint); the ones
    left over are exchanged among themselves across lengths; a trajectory that still has
    no donor of another task gets no hint. Trajectories without a hint stay without.

    Args:
      hints: per trajectory the judge's hint or None.
      hint_lengths: per trajectory the hint's token count (ignored where hint is None).
      task_keys: per trajectory the task it solves (e.g. the prompt or the group id).
      rng: drives the shuffle.
    Returns:
      (placebo hints, one per trajectory; ``PlaceboStats``).
    """
    if not len(hints) == len(hint_lengths) == len(task_keys):
        raise ValueError(f"placebo_hints: hints, hint_lengths and task_keys differ in length "
                         f"({len(hints)}, {len(hint_lengths)}, {len(task_keys)})")
    hinted = [i for i, h in enumerate(hints) if h is not None]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i in hinted:
        by_length[int(hint_lengths[i])].append(i)
    donors: dict[int, int] = {}
    for length in sorted(by_length):
        donors.update(_derange(by_length[length], task_keys, rng))
    leftover = [i for i in hinted if i not in donors]
    cross = _derange(leftover, task_keys, rng)
    pairs = {**donors, **cross}
    out: list[str | None] = [None] * len(hints)
    for receiver, donor in pairs.items():
        out[receiver] = hints[donor]
    same = sum(int(hint_lengths[r]) == int(hint_lengths[d]) for r, d in pairs.items())
    stats = PlaceboStats(hinted=len(hinted), same_length=same, other_length=len(pairs) - same,
                         unmatched=len(hinted) - len(pairs))
    return out, stats


__all__ = ["PlaceboStats", "hint_leaks_answer", "placebo_hints"]
