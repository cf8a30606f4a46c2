"""Reward components and their weighted composite (per-component values kept for logging).

outcome   ReTool (Feng et al., 2025): +1 correct / -1 wrong, or 1/0.
format    1 when the response ends in exactly one final boxed answer and its tags balance.
tool      a small bonus per successful tool call, capped so that it can never flip the
          sign of the outcome margin (checked by `RewardWeights`).
overlong  DAPO (Yu et al., 2025, eq. 13), counted in tokens:
              R(y) = 0                              if |y| <= L_max - L_cache
                   = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                   = -1                             if |y| > L_max
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from agentrl_jax.rewards.boxed import find_boxed_spans


def outcome_reward(correct: bool, scheme: str = "pm1") -> float:
    """+1/-1 (`pm1`, ReTool) or 1/0 (`binary`)."""
    if scheme == "pm1":
        return 1.0 if correct else -1.0
    if scheme == "binary":
        return 1.0 if correct else 0.0
    raise ValueError(f"outcome scheme must be 'pm1' or 'binary', got {scheme!r}")


def format_reward(response: str, open_tag: str = "<code>", close_tag: str = "</code>") -> float:
    """1.0 if the response has balanced tool tags and exactly one boxed answer, at its end."""
    spans = find_boxed_spans(response)
    if len(spans) != 1:
        return 0.0
    if response.count(open_tag) != response.count(close_tag):
        return 0.0
    trailing = response[spans[0][1]:]
    return 1.0 if re.fullmatch(r"[\s$.}\]\\)]*", trailing) else 0.0


def tool_call_reward(successful_calls: int, per_call: float = 0.1, cap: float = 0.3) -> float:
    """`min(cap, per_call * successful_calls)`; failed or timed-out calls earn nothing."""
    if successful_calls < 0:
        raise ValueError(f"successful_calls must be >= 0, got {successful_calls}")
    return float(min(cap, per_call * successful_calls))


def overlong_penalty(length_tokens, max_tokens: int, cache_tokens: int):
    """DAPO soft overlong punishment; works on an int or an integer array of lengths."""
    if not 0 < cache_tokens <= max_tokens:
        raise ValueError(f"need 0 < cache_tokens <= max_tokens, got {cache_tokens}, {max_tokens}")
    length = np.asarray(length_tokens, dtype=np.float64)
    soft_start = max_tokens - cache_tokens
    penalty = np.where(length <= soft_start, 0.0, (soft_start - length) / cache_tokens)
    penalty = np.where(length > max_tokens, -1.0, penalty)
    return float(penalty) if penalty.ndim == 0 else penalty


@dataclasses.dataclass(frozen=True)
class RewardWeights:
    """Weights of the composite; validated so shaping cannot outweigh the outcome."""

    outcome: float = 1.0
    format: float = 0.0
    tool: float = 0.0
    overlong: float = 0.0
    outcome_scheme: str = "pm1"
    tool_per_call: float = 0.1
    tool_cap: float = 0.3
    max_tokens: int | None = None  # overlong shaping is off when None
    overlong_cache_tokens: int = 512

    def __post_init__(self):
        outcome_reward(True, self.outcome_scheme)  # validates the scheme name
        for name in ("outcome", "format", "tool", "overlong", "tool_per_call", "tool_cap"):
            if getattr(self, name) < 0:
                raise ValueError(f"RewardWeights.{name} must be >= 0, got {getattr(self, name)}")
        margin = self.outcome * (outcome_reward(True, self.outcome_scheme)
                                 - outcome_reward(False, self.outcome_scheme))
        if self.tool * self.tool_cap >= margin and self.tool > 0:
            raise ValueError(f"RewardWeights.tool * tool_cap = {self.tool * self.tool_cap} must be below "
                             f"the outcome margin {margin}, or tool use could outweigh correctness")


def composite_reward(correct: bool, response: str, *, num_tokens: int = 0, successful_tool_calls: int = 0,
                     weights: RewardWeights = RewardWeights()) -> tuple[float, dict[str, float]]:
    """Weighted sum of the components; returns (total, {component: unweighted value})."""
    components = {"outcome": outcome_reward(correct, weights.outcome_scheme)}
    if weights.format:
        components["format"] = format_reward(response)
    if weights.tool:
        components["tool"] = tool_call_reward(successful_tool_calls, weights.tool_per_call, weights.tool_cap)
    if weights.overlong and weights.max_tokens is not None:
        components["overlong"] = overlong_penalty(num_tokens, weights.max_tokens, weights.overlong_cache_tokens)
    total = sum(getattr(weights, name) * value for name, value in components.items())
    return float(total), components
