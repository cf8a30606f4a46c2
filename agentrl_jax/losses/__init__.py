"""Losses as jitted pure functions over arrays: logprobs, advantages, policy losses, KL,
off-policy corrections, aggregation, and the registry for custom losses."""

from agentrl_jax.losses.advantages import (
    drgrpo_advantages,
    gae_advantages,
    grpo_advantages,
    hybrid_advantages,
    opd_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_token_advantages,
)
from agentrl_jax.losses.aggregation import AGGREGATIONS, aggregate, global_normalizer
from agentrl_jax.losses.compute import compute_policy_loss
from agentrl_jax.losses.corrections import (
    Correction,
    correct_discrepancy,
    decoupled_loss,
    ewma_update,
    icepop,
    loglinear_old_logp,
    masked_is,
    should_reset_ewma,
    truncated_is,
)
from agentrl_jax.losses.kl import entropy_bonus, kl_estimate, kl_loss, kl_reward_penalty
from agentrl_jax.losses.logprobs import token_logprobs
from agentrl_jax.losses.metrics import masked_max, masked_mean, masked_min
from agentrl_jax.losses.policy import (
    cispo_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    reinforce_loss,
)
from agentrl_jax.losses.registry import (
    AdvantageEstimator,
    PolicyLoss,
    get_advantage,
    get_loss,
    known_advantages,
    known_losses,
    register_advantage,
    register_loss,
)
from agentrl_jax.losses.sequences import sequence_sums, sequence_to_tokens

__all__ = [
    "AGGREGATIONS",
    "AdvantageEstimator",
    "Correction",
    "PolicyLoss",
    "aggregate",
    "cispo_loss",
    "compute_policy_loss",
    "correct_discrepancy",
    "decoupled_loss",
    "drgrpo_advantages",
    "entropy_bonus",
    "ewma_update",
    "gae_advantages",
    "get_advantage",
    "get_loss",
    "global_normalizer",
    "grpo_advantages",
    "gspo_loss",
    "gspo_token_loss",
    "hybrid_advantages",
    "icepop",
    "kl_estimate",
    "kl_loss",
    "kl_reward_penalty",
    "known_advantages",
    "known_losses",
    "loglinear_old_logp",
    "masked_is",
    "masked_max",
    "masked_mean",
    "masked_min",
    "opd_advantages",
    "outcome_token_rewards",
    "ppo_clip_loss",
    "register_advantage",
    "register_loss",
    "reinforce_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_sums",
    "sequence_to_token_advantages",
    "sequence_to_tokens",
    "should_reset_ewma",
    "token_logprobs",
    "truncated_is",
]
