"""KL to the reference policy (k1, k2, k3) as a loss term or a reward penalty; entropy bonus.

Estimators of KL(pi || pi_ref) from tokens sampled by pi (Schulman 2020, "Approximating
KL Divergence"), with d_t = ref_t - logp_t:

    k1 = -d                         unbiased, high variance, can be negative
    k2 = d^2 / 2                    biased, low variance
    k3 = exp(d) - d - 1             unbiased, >= 0 (GRPO's KL term, DeepSeekMath eq. 4)
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from agentrl_jax.losses.metrics import masked_mean

KLKind = Literal["k1", "k2", "k3"]
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    kind: KLKind = "k3",
) -> Float[Array, "B T"]:
    """Per-token KL estimate k1/k2/k3 (module docstring); 0 where loss_mask is 0.

    Gradients flow into `logp` (and `ref_logp` if the caller differentiates it).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {list(KL_KINDS)}")
    chex.assert_rank([logp, ref_logp, loss_mask], 2)
    chex.assert_equal_shape([logp, ref_logp, loss_mask])
    mask = loss_mask > 0
    d = jnp.where(mask, ref_logp - logp, 0.0)
    if kind == "k1":
        k = -d
    elif kind == "k2":
        k = 0.5 * d**2
    else:
        k = jnp.exp(d) - d - 1.0
    return jnp.where(mask, k, 0.0)


def kl_loss(
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    coef: float,
    kind: KLKind = "k3",
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """KL-to-reference loss term, per token: coef * k(logp, ref). GRPO (DeepSeekMath eq. 3)
    adds beta * k3 to the per-token objective; aggregate it like the policy loss.

    Returns: per-token term [B, T] (reference is held constant) and {"kl_<kind>": masked mean}.
    """
    k = kl_estimate(logp, jax.lax.stop_gradient(ref_logp), loss_mask, kind=kind)
    return coef * k, {f"kl_{kind}": masked_mean(jax.lax.stop_gradient(k), loss_mask)}


def kl_reward_penalty(
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    coef: float,
    kind: KLKind = "k1",
) -> Float[Array, "B T"]:
    """KL folded into the reward (Ouyang et al. 2022, InstructGPT eq. 2; REINFORCE++):

        r_t <- r_t - coef * sg(k_t)

    Returns the penalty term -coef * sg(k) [B, T] to add to per-token rewards (no gradient).
    """
    k = kl_estimate(jax.lax.stop_gradient(logp), jax.lax.stop_gradient(ref_logp), loss_mask, kind=kind)
    return -coef * k


def entropy_bonus(
    entropy: Float[Array, "B T"], loss_mask: Float[Array, "B T"], *, coef: float
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """Entropy bonus as a loss term (Mnih et al. 2016, A3C eq. in sec. 4): l_t = -coef * H_t.

    Args: entropy [B, T] from `token_logprobs(..., return_entropy=True)`, loss_mask [B, T].
    Returns: per-token term [B, T] and {"entropy": masked mean entropy}.
    """
    chex.assert_equal_shape([entropy, loss_mask])
    mask = loss_mask > 0
    term = jnp.where(mask, -coef * jnp.where(mask, entropy, 0.0), 0.0)
    return term, {"entropy": masked_mean(jax.lax.stop_gradient(entropy), mask)}
