"""Policy-gradient losses: PPO-clip (clip-higher, dual-clip), GSPO, GSPO-token, CISPO, REINFORCE.

Every loss follows `registry.PolicyLoss`: it returns a per-token loss [B, T] (0 where
loss_mask is 0, gradient exactly 0 there too) and a dict of masked scalar metrics; the
caller reduces it with `aggregation.aggregate`. Inputs at masked positions may hold any
value (even inf/NaN from padding); they are replaced before any arithmetic.
"""

from __future__ import annotations

import functools
import logging

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from agentrl_jax.losses.metrics import masked_mean, ratio_metrics, token_count
from agentrl_jax.losses.registry import register_loss
from agentrl_jax.losses.sequences import sequence_sums, sequence_to_tokens

sg = jax.lax.stop_gradient
logger = logging.getLogger(__name__)


def _masked_inputs(logp, old_logp, advantages, loss_mask):
    """Shape checks; returns (mask bool, log_ratio, advantages) with 0 at masked tokens."""
    chex.assert_rank([logp, old_logp, advantages, loss_mask], 2)
    chex.assert_equal_shape([logp, old_logp, advantages, loss_mask])
    mask = loss_mask > 0
    log_ratio = jnp.where(mask, logp - sg(old_logp), 0.0)
    return mask, log_ratio, jnp.where(mask, sg(advantages), 0.0)


def _check_eps(eps_low: float, eps_high: float) -> None:
    if not (0.0 <= eps_low < 1.0):
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")


def _check_sequence_eps(name: str, eps_low: float, eps_high: float) -> None:
    """`_check_eps`, and a warning (once per range, at trace time) for a PPO-sized range."""
    _check_eps(eps_low, eps_high)
    if eps_high > 0.01:
        _warn_ppo_sized_range(name, float(eps_low), float(eps_high))


@functools.cache
def _warn_ppo_sized_range(name: str, eps_low: float, eps_high: float) -> None:
    logger.warning(
        "loss %s with eps_low/eps_high=%s/%s: GSPO clips a length-normalized sequence ratio, and its "
        "paper uses 3e-4/4e-4; PPO-sized ranges clip almost nothing (set algorithm.eps_low/eps_high)",
        name, eps_low, eps_high,
    )


def _clipped_surrogate(ratio, advantages, eps_low, eps_high):
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and the low/high clip indicators."""
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_low)
    return jnp.maximum(unclipped, clipped), clipped_low, clipped_high


def _metrics(mask, log_ratio, clipped_low, clipped_high, **extra):
    metrics = {
        "clip_frac_low": masked_mean(clipped_low.astype(jnp.float32), mask),
        "clip_frac_high": masked_mean(clipped_high.astype(jnp.float32), mask),
        "num_loss_tokens": token_count(mask),
        **ratio_metrics(log_ratio, mask),
    }
    metrics.update({k: masked_mean(v.astype(jnp.float32), mask) for k, v in extra.items()})
    return metrics


# The config fields each built-in loss reads (see register_loss); algorithm.loss_hparams
# overrides any of them.
_CLIP = {"eps_low": "algorithm.eps_low", "eps_high": "algorithm.eps_high"}


@register_loss("ppo", hparams={**_CLIP, "dual_clip": lambda c: c.algorithm.dual_clip or None})
def ppo_clip_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """PPO clipped surrogate per token (Schulman et al. 2017, eq. 7), with clip-higher
    (DAPO, Yu et al. 2025, eq. 10: eps_high > eps_low) and dual-clip (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games", eq. 5).

        r_t    = exp(logp_t - old_t)
        l_t    = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
        l_t    = min(l_t, -c A_t)            if dual_clip c is set and A_t < 0

    Args:
      logp, old_logp, advantages, loss_mask: [B, T] (see registry.PolicyLoss).
      sequence_ids, num_sequences: unused (token-local loss), accepted for the uniform call.
      eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high].
      dual_clip: c > 1 bounding the loss of negative-advantage tokens, or None.
    Returns:
      per-token loss [B, T]; metrics clip_frac_low/high, dual_clip_frac, ratio_mean/max/min,
      approx_kl, num_loss_tokens.
    """
    del sequence_ids, num_sequences
    _check_eps(eps_low, eps_high)
    mask, log_ratio, adv = _masked_inputs(logp, old_logp, advantages, loss_mask)
    ratio = jnp.exp(log_ratio)
    loss, clipped_low, clipped_high = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    dual_clipped = jnp.zeros_like(mask)
    if dual_clip is not None:
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        dual_clipped = (adv < 0) & (loss > -dual_clip * adv)
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    loss = jnp.where(mask, loss, 0.0)
    return loss, _metrics(mask, log_ratio, clipped_low, clipped_high, dual_clip_frac=dual_clipped)


def _sequence_log_ratio_and_advantage(log_ratio, adv, mask, sequence_ids, num_sequences):
    """Length-normalized sequence log-ratio and mean advantage, broadcast to tokens."""
    counts = jnp.maximum(sequence_sums(mask.astype(log_ratio.dtype), sequence_ids, num_sequences), 1.0)
    seq_log_ratio = sequence_sums(log_ratio, sequence_ids, num_sequences) / counts
    seq_adv = sequence_sums(adv, sequence_ids, num_sequences) / counts
    return (
        sequence_to_tokens(seq_log_ratio, log_ratio, sequence_ids),
        sequence_to_tokens(seq_adv, adv, sequence_ids),
    )


@register_loss("gspo", hparams=_CLIP)
def gspo_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """GSPO sequence-level clipped objective (Zheng et al. 2025, "Group Sequence Policy
    Optimization", eqs. 5-7).

        s_i = exp( 1/|y_i| sum_t m_t (logp_t - old_t) )      (length-normalized)
        l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))

    A_i is the mean token advantage of sequence i. l_i is written on every loss token of
    sequence i, so seq-mean-token-mean aggregation gives the paper's (1/G) sum_i l_i.
    Defaults are the paper's clip range (3e-4, 4e-4).

    Args: as `ppo_clip_loss`; sequence_ids/num_sequences give the packed layout.
    Returns: per-token loss [B, T] and metrics (ratio stats are of s_i, per token).
    """
    _check_sequence_eps("gspo", eps_low, eps_high)
    mask, log_ratio, adv = _masked_inputs(logp, old_logp, advantages, loss_mask)
    seq_log_ratio, seq_adv = _sequence_log_ratio_and_advantage(
        log_ratio, adv, mask, sequence_ids, num_sequences
    )
    seq_ratio = jnp.exp(seq_log_ratio)
    loss, clipped_low, clipped_high = _clipped_surrogate(seq_ratio, seq_adv, eps_low, eps_high)
    loss = jnp.where(mask, loss, 0.0)
    return loss, _metrics(mask, seq_log_ratio, clipped_low, clipped_high)


@register_loss("gspo_token", hparams=_CLIP)
def gspo_token_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """GSPO-token (Zheng et al. 2025, eqs. 13-14): the sequence ratio with per-token
    advantages and a per-token gradient path.

        s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t))      (value s_i, d s_{i,t}/d logp_t = s_i)
        l_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

    With A_{i,t} = A_i it has the same value and gradient as `gspo_loss` under
    seq-mean-token-mean aggregation.

    Args/Returns: as `gspo_loss`.
    """
    _check_sequence_eps("gspo_token", eps_low, eps_high)
    mask, log_ratio, adv = _masked_inputs(logp, old_logp, advantages, loss_mask)
    seq_log_ratio, _ = _sequence_log_ratio_and_advantage(
        log_ratio, adv, mask, sequence_ids, num_sequences
    )
    token_log_ratio = sg(seq_log_ratio) + log_ratio - sg(log_ratio)
    ratio = jnp.exp(token_log_ratio)
    loss, clipped_low, clipped_high = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    loss = jnp.where(mask, loss, 0.0)
    return loss, _metrics(mask, seq_log_ratio, clipped_low, clipped_high)


# CISPO truncates the IS weight at 1 + eps_high (MiniMax-M1, eq. 4).
@register_loss("cispo", hparams={"eps_max": lambda c: 1.0 + c.algorithm.eps_high})
def cispo_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
    eps_max: float = 4.0,
    eps_min: float | None = None,
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """CISPO: clipped IS-weight policy optimization (MiniMax-M1, Chen et al. 2025, eqs. 4-5;
    the min(rho, eps_max) form is ScaleRL's, Khatri et al. 2025).

        rho_t = exp(logp_t - old_t)
        l_t   = -sg( clip(rho_t, eps_min, eps_max) ) * A_t * logp_t

    Unlike PPO no token loses its gradient: the IS weight is truncated, not the update.

    Args:
      logp, old_logp, advantages, loss_mask: [B, T].
      eps_max: upper truncation of the IS weight (> 0).
      eps_min: optional lower truncation (None: no lower bound).
    Returns:
      per-token loss [B, T]; metrics clip_frac_high (rho > eps_max), clip_frac_low
      (rho < eps_min), ratio stats, approx_kl, num_loss_tokens.
    """
    del sequence_ids, num_sequences
    if not eps_max > 0:
        raise ValueError(f"eps_max must be > 0, got {eps_max}")
    if eps_min is not None and not 0 <= eps_min < eps_max:
        raise ValueError(f"eps_min must be in [0, eps_max), got {eps_min}")
    mask, log_ratio, adv = _masked_inputs(logp, old_logp, advantages, loss_mask)
    rho = sg(jnp.exp(log_ratio))
    weight = jnp.minimum(rho, eps_max)
    clipped_low = jnp.zeros_like(mask)
    if eps_min is not None:
        weight = jnp.maximum(weight, eps_min)
        clipped_low = rho < eps_min
    loss = jnp.where(mask, -weight * adv * jnp.where(mask, logp, 0.0), 0.0)
    return loss, _metrics(mask, log_ratio, clipped_low, rho > eps_max)


@register_loss("reinforce")
def reinforce_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """Plain REINFORCE (Williams 1992): l_t = -A_t * logp_t, on-policy, no ratio.

    old_logp only feeds the ratio metrics (to watch how off-policy the batch is).

    Args: as `ppo_clip_loss`. Returns: per-token loss [B, T] and metrics.
    """
    del sequence_ids, num_sequences
    mask, log_ratio, adv = _masked_inputs(logp, old_logp, advantages, loss_mask)
    loss = jnp.where(mask, -adv * jnp.where(mask, logp, 0.0), 0.0)
    no_clip = jnp.zeros_like(mask)
    return loss, _metrics(mask, log_ratio, no_clip, no_clip)
