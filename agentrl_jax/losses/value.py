"""The critic's loss and diagnostics: clipped value regression on agent tokens.

Pure functions over arrays, like the policy losses; the value model's forward pass belongs
to the train step (``train/critic.py``).
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
from jaxtyping import Array, Float


def clipped_value_loss(
    values: Float[Array, "B T"],
    old_values: Float[Array, "B T"],
    returns: Float[Array, "B T"],
    value_mask: Float[Array, "B T"],
    *,
    clip: float,
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """PPO's clipped value loss (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms", the value-clipping variant of the OpenAI baselines; arXiv:1707.06347):

        V_clip = V_old + clip(V - V_old, -c, c)
        L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

    with ``clip`` c <= 0 meaning unclipped: L_t = 0.5 (V - R)^2.

    Args:
      values: [B, T] the critic's current values.
      old_values: [B, T] its values when the returns were computed (before any update).
      returns: [B, T] GAE returns (the regression targets).
      value_mask: [B, T] 1 where the critic is trained (agent tokens, or turn ends).
      clip: c.
    Returns:
      (per-token loss [B, T], 0 off the mask; metrics: value_clip_frac, the fraction of
      masked tokens where the clipped term is the larger one).
    """
    chex.assert_rank([values, old_values, returns, value_mask], 2)
    chex.assert_equal_shape([values, old_values, returns, value_mask])
    mask = value_mask > 0
    unclipped = jnp.square(values - returns)
    if clip > 0:
        clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
        clipped = jnp.square(clipped_values - returns)
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        clip_frac = jnp.sum(mask & (clipped > unclipped)) / jnp.maximum(jnp.sum(mask), 1)
    else:
        per_token = 0.5 * unclipped
        clip_frac = jnp.zeros((), jnp.float32)
    return jnp.where(mask, per_token, 0.0), {"value_clip_frac": clip_frac}


# Returns R = A + V of a batch whose rewards are all equal are constant only up to float32
# rounding (Var ~ 1e-15), which would make the ratio below astronomically negative.
_CONSTANT_VARIANCE = 1e-8


def explained_variance(
    values: Float[Array, "N"], returns: Float[Array, "N"]
) -> Float[Array, ""]:
    """1 - Var[R - V] / Var[R] over the given tokens: 1 for a perfect critic, 0 for a
    constant one, negative for one worse than a constant. 0 when the returns are constant
    (variance below 1e-8)."""
    chex.assert_rank([values, returns], 1)
    var_returns = jnp.var(returns)
    constant = var_returns < _CONSTANT_VARIANCE
    return jnp.where(constant, 0.0, 1.0 - jnp.var(returns - values) / jnp.where(constant, 1.0, var_returns))
