"""Masked statistics reported by every loss: means, extremes and fractions over loss tokens.

All are plain scalars, computed only over tokens with loss_mask 1, and defined (0) for an
all-padding micro-batch instead of NaN or +-inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def masked_mean(values: Float[Array, "..."], mask: Float[Array, "..."]) -> Float[Array, ""]:
    """sum(mask * values) / max(sum(mask), 1); 0 when the mask is empty."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask > 0, values, 0.0) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_max(values: Float[Array, "..."], mask: Float[Array, "..."]) -> Float[Array, ""]:
    """max over masked entries; 0 when the mask is empty."""
    any_valid = jnp.any(mask > 0)
    return jnp.where(any_valid, jnp.max(jnp.where(mask > 0, values, -jnp.inf)), 0.0)


def masked_min(values: Float[Array, "..."], mask: Float[Array, "..."]) -> Float[Array, ""]:
    """min over masked entries; 0 when the mask is empty."""
    any_valid = jnp.any(mask > 0)
    return jnp.where(any_valid, jnp.min(jnp.where(mask > 0, values, jnp.inf)), 0.0)


def ratio_metrics(
    log_ratio: Float[Array, "B T"], loss_mask: Float[Array, "B T"], prefix: str = ""
) -> dict[str, Array]:
    """Stats of r = exp(log_ratio) over loss tokens, and approx KL(old || new).

    approx_kl is the k3 estimator on samples from the old policy (Schulman 2020,
    "Approximating KL Divergence"): E_old[(r - 1) - log r], always >= 0.
    """
    log_ratio = jax.lax.stop_gradient(jnp.where(loss_mask > 0, log_ratio, 0.0))
    ratio = jnp.exp(log_ratio)
    return {
        f"{prefix}ratio_mean": masked_mean(ratio, loss_mask),
        f"{prefix}ratio_max": masked_max(ratio, loss_mask),
        f"{prefix}ratio_min": masked_min(ratio, loss_mask),
        f"{prefix}approx_kl": masked_mean(ratio - 1.0 - log_ratio, loss_mask),
    }


def token_count(loss_mask: Float[Array, "B T"]) -> Float[Array, ""]:
    """Number of loss tokens, as float32 (sums exactly across micro-batches)."""
    return jnp.sum((loss_mask > 0).astype(jnp.float32))
