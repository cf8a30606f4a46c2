"""One call from arrays to a scalar loss: any registered policy loss + KL + entropy, aggregated."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from agentrl_jax.losses.aggregation import Aggregation, aggregate, global_normalizer
from agentrl_jax.losses.kl import KLKind, entropy_bonus, kl_loss
from agentrl_jax.losses.registry import get_loss


def compute_policy_loss(
    name: str,
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    aggregation: Aggregation = "token-mean",
    normalizer: Float[Array, ""] | None = None,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
    max_response_length: int | None = None,
    ref_logp: Float[Array, "B T"] | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    entropy: Float[Array, "B T"] | None = None,
    entropy_coef: float = 0.0,
    **hparams: Any,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Scalar loss = aggregate(policy_loss + kl_coef * KL - entropy_coef * H) and metrics.

    Args:
      name: a registered loss ("ppo", "gspo", "gspo_token", "cispo", "reinforce", or yours).
      logp, old_logp, advantages, loss_mask: [B, T], see registry.PolicyLoss.
      aggregation: one of aggregation.AGGREGATIONS.
      normalizer: Z of the whole minibatch from `global_normalizer`. REQUIRED for exact
        micro-batch accumulation; None computes it from this batch alone.
      sequence_ids, num_sequences: packed layout, passed to the loss and the aggregation.
      max_response_length: Dr.GRPO constant, used only when normalizer is None.
      ref_logp, kl_coef, kl_kind: KL-to-reference loss term (skipped when ref_logp is None).
      entropy, entropy_coef: entropy [B, T]; reported as a metric, bonus when coef != 0.
      hparams: the loss's own hyper-parameters (eps_low=..., ...).
    Returns:
      (scalar loss, metrics dict with "loss", "policy_loss" and the loss's metrics).
    """
    loss_fn = get_loss(name)
    per_token, metrics = loss_fn(
        logp, old_logp, advantages, loss_mask, sequence_ids=sequence_ids,
        num_sequences=num_sequences, **hparams,
    )
    if normalizer is None:
        normalizer = global_normalizer(
            loss_mask, aggregation, sequence_ids=sequence_ids, num_sequences=num_sequences,
            max_response_length=max_response_length,
        )
    reduce = lambda x: aggregate(  # noqa: E731
        x, loss_mask, aggregation, normalizer, sequence_ids=sequence_ids, num_sequences=num_sequences
    )
    metrics = dict(metrics)
    metrics["policy_loss"] = reduce(per_token)
    total = per_token
    if ref_logp is not None:
        kl_term, kl_metrics = kl_loss(logp, ref_logp, loss_mask, coef=kl_coef, kind=kl_kind)
        total = total + kl_term
        metrics.update(kl_metrics)
    if entropy is not None:
        bonus, entropy_metrics = entropy_bonus(entropy, loss_mask, coef=entropy_coef)
        total = total + bonus
        metrics.update(entropy_metrics)
    loss = reduce(total)
    metrics["loss"] = loss
    return loss, {k: jnp.asarray(v) for k, v in metrics.items()}
