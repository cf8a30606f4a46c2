"""Off-policy corrections for the train/inference discrepancy and for missing old logits.

The total ratio of a token sampled by the rollout engine (mu) is split ("Missing Old Logits
in Asynchronous Agentic RL: Semantic Mismatch and Repair Methods for Off-Policy Correction",
arXiv:2605.12070, sec. 2):

    pi / mu = (old / mu) * (pi / old)
              discrepancy    staleness

The discrepancy factor old/mu (same params version, different numerics) is corrected here
by truncation (TIS), masking (MIS) or band masking (icepop), per token or per sequence;
the staleness factor pi/old goes through the policy loss's own clip. `decoupled_loss`
composes the two. When `old` is unavailable: `ewma_update` keeps an EWMA of the params as
the proximal policy (PPO-EWMA), and `loglinear_old_logp` interpolates it from mu and pi.
Every correction reports the fraction of loss tokens it truncated or masked.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from agentrl_jax.losses.metrics import masked_mean, ratio_metrics
from agentrl_jax.losses.sequences import sequence_sums, sequence_to_tokens

Level = Literal["token", "sequence"]
# exp(50) is finite in float32; larger discrepancies are truncated/masked anyway.
_MAX_LOG_RATIO = 50.0


class Correction(NamedTuple):
    """IS weights (constant, 0 off the mask) and the loss mask after masking, [B, T] each."""

    weights: Float[Array, "B T"]
    loss_mask: Float[Array, "B T"]
    metrics: dict[str, Array]


def _discrepancy_log_ratio(old_logp, rollout_logp, loss_mask, level, sequence_ids, num_sequences):
    """log(old/mu) per token, or the sequence's summed log ratio on each of its tokens."""
    chex.assert_rank([old_logp, rollout_logp, loss_mask], 2)
    chex.assert_equal_shape([old_logp, rollout_logp, loss_mask])
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    mask = loss_mask > 0
    token_log_ratio = jax.lax.stop_gradient(jnp.where(mask, old_logp - rollout_logp, 0.0))
    if level == "token":
        return mask, token_log_ratio, token_log_ratio
    seq = sequence_sums(token_log_ratio, sequence_ids, num_sequences)
    return mask, token_log_ratio, sequence_to_tokens(seq, token_log_ratio, sequence_ids)


def _correction(name, mask, token_log_ratio, weights, keep, affected):
    metrics = {f"{name}_frac": masked_mean(affected.astype(jnp.float32), mask)}
    metrics.update(ratio_metrics(token_log_ratio, mask, prefix="mismatch_"))
    keep = keep & mask
    return Correction(jnp.where(keep, weights, 0.0), keep.astype(jnp.float32), metrics)


def truncated_is(
    old_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    cap: float = 2.0,
    level: Level = "token",
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Correction:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training", eq. 3; Espeholt et al. 2018 for truncation):

        w_t = min(old_t / mu_t, C)                     (token)
        w_t = min(prod_{t' in seq} old / mu, C)        (sequence)

    Returns: Correction with weights w, the mask unchanged, metrics tis_truncated_frac (share
    of loss tokens whose weight hit C) and mismatch_* ratio stats / approx KL.
    """
    mask, token_lr, log_ratio = _discrepancy_log_ratio(
        old_logp, rollout_logp, loss_mask, level, sequence_ids, num_sequences
    )
    ratio = jnp.exp(jnp.minimum(log_ratio, _MAX_LOG_RATIO))
    return _correction("tis_truncated", mask, token_lr, jnp.minimum(ratio, cap), mask, ratio > cap)


def masked_is(
    old_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    cap: float = 2.0,
    level: Level = "token",
    reweight: bool = True,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Correction:
    """Masked importance sampling (Liu et al. 2025, "When Speed Kills Stability", MIS):

        w_t = rho * 1[rho <= C]   (rho = old/mu of the token, or of the whole sequence)

    Tokens (or whole sequences) with rho > C leave the loss mask. With `reweight=False` the
    kept tokens get weight 1 (mask only).

    Returns: Correction; metrics mis_masked_frac and mismatch_* stats.
    """
    mask, token_lr, log_ratio = _discrepancy_log_ratio(
        old_logp, rollout_logp, loss_mask, level, sequence_ids, num_sequences
    )
    ratio = jnp.exp(jnp.minimum(log_ratio, _MAX_LOG_RATIO))
    keep = ratio <= cap
    weights = ratio if reweight else jnp.ones_like(ratio)
    return _correction("mis_masked", mask, token_lr, weights, keep, mask & ~keep)


def icepop(
    old_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    low: float = 0.5,
    high: float = 2.0,
    level: Level = "token",
    reweight: bool = True,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Correction:
    """IcePop band masking (Zhao et al. 2025, "Small Leak Can Sink a Great Ship", eq. 2):

        w_t = rho * 1[low <= rho <= high]

    Returns: Correction; metrics icepop_masked_frac and mismatch_* stats.
    """
    if not 0 <= low <= high:
        raise ValueError(f"icepop needs 0 <= low <= high, got low={low}, high={high}")
    mask, token_lr, log_ratio = _discrepancy_log_ratio(
        old_logp, rollout_logp, loss_mask, level, sequence_ids, num_sequences
    )
    ratio = jnp.exp(jnp.minimum(log_ratio, _MAX_LOG_RATIO))
    keep = (ratio >= low) & (ratio <= high)
    weights = ratio if reweight else jnp.ones_like(ratio)
    return _correction("icepop_masked", mask, token_lr, weights, keep, mask & ~keep)


CORRECTIONS: dict[str, Callable[..., Correction]] = {
    "tis": truncated_is,
    "mis": masked_is,
    "icepop": icepop,
}


def correct_discrepancy(method: str, old_logp, rollout_logp, loss_mask, **hparams) -> Correction:
    """Dispatch to `truncated_is` ("tis"), `masked_is` ("mis") or `icepop` by name."""
    if method not in CORRECTIONS:
        raise ValueError(f"unknown correction {method!r}; known corrections: {sorted(CORRECTIONS)}")
    return CORRECTIONS[method](old_logp, rollout_logp, loss_mask, **hparams)


def decoupled_loss(
    loss_fn: Callable[..., tuple[Array, dict[str, Array]]],
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    correction: str = "tis",
    correction_hparams: dict[str, Any] | None = None,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
    **loss_hparams: Any,
) -> tuple[Float[Array, "B T"], dict[str, Array], Float[Array, "B T"]]:
    """Decoupled off-policy loss (Hilton et al. 2022, "Batch Size-Invariance for Policy
    Optimization", eq. 2; arXiv:2605.12070 sec. 2): pi/mu = (old/mu) * (pi/old).

        l_t = sg(w_t) * loss_fn(pi/old)_t,     w = correction(old/mu)

    The discrepancy factor old/mu is corrected by `correction`; the staleness factor pi/old
    is clipped inside `loss_fn` (e.g. PPO). Tokens the correction masks leave the loss.

    Args:
      loss_fn: a registered PolicyLoss (e.g. `get_loss("ppo")`).
      logp, old_logp, rollout_logp, advantages, loss_mask: [B, T].
      correction: "tis", "mis" or "icepop"; correction_hparams go to it (cap, level, ...).
      loss_hparams: go to loss_fn (eps_low, ...).
    Returns:
      (per-token loss [B, T], metrics incl. the correction's, the corrected loss mask [B, T]
      to aggregate with).
    """
    corr = correct_discrepancy(
        correction, old_logp, rollout_logp, loss_mask, sequence_ids=sequence_ids,
        num_sequences=num_sequences, **(correction_hparams or {}),
    )
    per_token, metrics = loss_fn(
        logp, old_logp, advantages, corr.loss_mask, sequence_ids=sequence_ids,
        num_sequences=num_sequences, **loss_hparams,
    )
    return per_token * jax.lax.stop_gradient(corr.weights), {**metrics, **corr.metrics}, corr.loss_mask


def ewma_update(
    ewma_params: Any,
    params: Any,
    decay: float,
    step: Int[Array, ""] | int,
    reset_every: int = 0,
    reset: bool | Array = False,
) -> Any:
    """PPO-EWMA proximal policy (Hilton et al. 2022, sec. 4; arXiv:2605.12070 sec. 5 with auto reset):

        theta_ewma <- decay * theta_ewma + (1 - decay) * theta
        theta_ewma <- theta       if reset, or reset_every > 0 and step % reset_every == 0

    The EWMA params play `old`: their logprobs replace missing old logits. Pass
    `reset=should_reset_ewma(...)` for the automatic rule (reset when the train/infer mask
    keeps too few tokens). Pure and jittable; `step`/`reset` may be traced.

    Args:
      ewma_params, params: pytrees of the same structure.
      decay: in [0, 1) (checked when a Python float); larger means a longer memory.
      step: the current optimizer step.
      reset_every: periodic reset interval in steps (0: never).
      reset: extra reset condition (bool or bool scalar array).
    Returns: the new EWMA pytree (dtypes of ewma_params).
    """
    if isinstance(decay, (int, float)) and not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    if reset_every < 0:
        raise ValueError(f"reset_every must be >= 0, got {reset_every}")
    do_reset = jnp.asarray(reset, bool)
    if reset_every > 0:
        do_reset = do_reset | (jnp.asarray(step) % reset_every == 0)

    def one(ewma, theta):
        mixed = decay * ewma.astype(jnp.float32) + (1.0 - decay) * theta.astype(jnp.float32)
        return jnp.where(do_reset, theta.astype(jnp.float32), mixed).astype(ewma.dtype)

    return jax.tree.map(one, ewma_params, params)


def should_reset_ewma(kept_fraction: Float[Array, ""], min_kept_fraction: float) -> Array:
    """Automatic EWMA reset rule (arXiv:2605.12070, fig. 4): reset when the share of loss tokens the
    train/infer correction keeps (1 - masked fraction) drops below `min_kept_fraction`."""
    return jnp.asarray(kept_fraction) < min_kept_fraction


def loglinear_old_logp(
    rollout_logp: Float[Array, "B T"],
    logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    rollout_version: Int[Array, "B"] | Int[Array, "B T"],
    current_version: Int[Array, ""] | int,
) -> Float[Array, "B T"]:
    """Log-linear interpolation proxy for missing old logits (arXiv:2605.12070 appendix A,
    proposition 1; AReaL's "loglinear" proximal approximation):

        alpha_t      = clip((v_cur - 1 - v_t) / (v_cur - v_t), 0, 1)    (0 if v_t >= v_cur)
        log old_hat  = (1 - alpha_t) log mu_t + alpha_t sg(log pi_t)

    The proximal policy is the previous version v_cur - 1; a token sampled at version v_t
    sits alpha of the way (in versions) from mu to pi. alpha = 0 for tokens from v_cur - 1.

    Args:
      rollout_logp: [B, T] mu. logp: [B, T] current policy (used without gradient).
      loss_mask: [B, T]. rollout_version: [B] or [B, T] params version of each token.
      current_version: the version of the params being trained.
    Returns: old_hat [B, T] (no gradient), 0 off the loss tokens.
    """
    chex.assert_equal_shape([rollout_logp, logp, loss_mask])
    versions = jnp.asarray(rollout_version)
    if versions.ndim == 1:
        versions = jnp.broadcast_to(versions[:, None], loss_mask.shape)
    chex.assert_equal_shape([versions, loss_mask])
    versions = versions.astype(jnp.float32)
    current = jnp.asarray(current_version, jnp.float32)
    gap = current - versions
    alpha = jnp.where(gap > 0, jnp.clip((gap - 1.0) / jnp.where(gap > 0, gap, 1.0), 0.0, 1.0), 0.0)
    mask = loss_mask > 0
    mu = jnp.where(mask, rollout_logp, 0.0)
    pi = jax.lax.stop_gradient(jnp.where(mask, logp, 0.0))
    return jnp.where(mask, mu + alpha.astype(mu.dtype) * (pi - mu), 0.0)
