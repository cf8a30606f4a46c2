"""Verifiable rewards: boxed-answer extraction, math equivalence under a timeout, shaping."""

from agentrl_jax.rewards.boxed import extract_boxed, find_boxed_spans
from agentrl_jax.rewards.hints import PlaceboStats, hint_leaks_answer, placebo_hints
from agentrl_jax.rewards.math_equiv import math_equal, normalize_answer, quick_equal
from agentrl_jax.rewards.shaping import (RewardWeights, composite_reward, format_reward, outcome_reward,
                                         overlong_penalty, tool_call_reward)
from agentrl_jax.rewards.verifier import MathVerifier, VerifyResult

__all__ = [
    "MathVerifier", "PlaceboStats", "RewardWeights", "VerifyResult", "composite_reward", "extract_boxed",
    "find_boxed_spans", "format_reward", "hint_leaks_answer", "math_equal", "normalize_answer", "outcome_reward",
    "overlong_penalty", "placebo_hints", "quick_equal", "tool_call_reward",
]
