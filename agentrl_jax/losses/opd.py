"""Shaping of the hindsight OPD term: centering, clipping, the lambda schedule, diagnostics.

The hybrid advantage of the Retool-RL recipe
("Agentic RL (Part III): Architecture Analysis of Verl and SkyRL to Retool-RL Case Practice",
sec. 4.5) adds a per-token
on-policy-distillation term to the group advantage,

    d_t   = log pi_teacher(y_t | prompt + hint) - sg(log pi_old(y_t | prompt))
    A_t   = A_group + lambda_s * has_teacher * shape(d)_t

and docs/hybrid.md shows how the raw d collapses training when the hint is out of the
teacher's distribution: every d_t of a hinted trajectory is about -1.2, a uniform push
down on the whole trajectory. The pieces here change only how d enters the advantage:

- ``center_per_sequence``: d_t - mean_{t' in seq} d_t' over the trajectory's loss tokens.
  The per-trajectory offset (a hint that lowers the teacher's logprob of everything, and
  with a frozen teacher the KL-to-the-start term log pi_ref - log pi_old) cancels; what is
  left says which tokens the teacher likes less than the others. The trajectory-level
  push then comes from A_group alone.
- ``clip_per_token``: d_t clipped to [-c, c], so one token the hint makes very unlikely
  cannot outweigh the group advantage of the whole trajectory.
- ``opd_lambda``: lambda as a function of the step (constant, linear warmup, linear or
  cosine decay), jittable with a traced step so a changing lambda never recompiles.
- ``opd_term_diagnostics``: what the term looks like on the taught tokens (mean, the
  most negative token per trajectory, the share of tokens near zero). A teacher that
  reads the hint gives a clearly negative minimum and most tokens near zero; a placebo
  hint gives a minimum near zero.

Every array is [B, T] with a loss mask; a row is one trajectory, or several packed ones
named by ``sequence_ids`` (``losses/sequences.py``), and ``has_teacher`` is per sequence.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from agentrl_jax.losses.sequences import sequence_sums, sequence_to_tokens

SCHEDULES: tuple[str, ...] = ("constant", "linear_warmup", "linear_decay", "cosine_decay")


def _num_sequences(values: Array, sequence_ids: Array | None, num_sequences: int | None) -> int:
    return values.shape[0] if sequence_ids is None else num_sequences


def center_per_sequence(
    values: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Float[Array, "B T"]:
    """values_t - (masked mean of values over the loss tokens of t's sequence); 0 off the mask.

    Args:
      values: [B, T] per-token values (the OPD log-ratio).
      loss_mask: [B, T], 1 on sampled tokens.
      sequence_ids: [B, T] sequence of each token for packed rows, or None (row = sequence).
      num_sequences: static S when ``sequence_ids`` is given.
    Returns:
      [B, T]; a sequence without loss tokens stays all 0.
    """
    chex.assert_rank([values, loss_mask], 2)
    chex.assert_equal_shape([values, loss_mask])
    mask = (loss_mask > 0).astype(values.dtype)
    masked = jnp.where(mask > 0, values, 0.0)
    counts = sequence_sums(mask, sequence_ids, num_sequences)
    means = sequence_sums(masked, sequence_ids, num_sequences) / jnp.maximum(counts, 1.0)
    return jnp.where(mask > 0, values - sequence_to_tokens(means, values, sequence_ids), 0.0)


def clip_per_token(
    values: Float[Array, "B T"], loss_mask: Float[Array, "B T"], *, bound: float
) -> Float[Array, "B T"]:
    """values clipped to [-bound, bound] on the loss tokens, 0 elsewhere (bound > 0)."""
    chex.assert_equal_shape([values, loss_mask])
    if not bound > 0:
        raise ValueError(f"clip_per_token: bound must be > 0, got {bound}")
    return jnp.where(loss_mask > 0, jnp.clip(values, -bound, bound), 0.0)


def shaped_opd_term(
    teacher_logp: Float[Array, "B T"],
    logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    has_teacher: Bool[Array, "S"],
    *,
    center: bool = False,
    clip: float = 0.0,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Float[Array, "B T"]:
    """shape(d)_t on taught sequences, 0 elsewhere; d_t = tea_t - sg(logp_t) (module docstring).

    Centering runs first (it removes the offset), then the clip bounds what is left, so
    ``|result| <= clip`` holds exactly when clipping is on.

    Args:
      teacher_logp, logp, loss_mask: [B, T]; ``logp`` is the old policy's (no gradient).
      has_teacher: [S] bool, True for sequences with a teacher signal (a hint).
      center: subtract the per-sequence mean of d over its loss tokens.
      clip: bound c of the per-token clip; 0 turns clipping off.
      sequence_ids, num_sequences: packed layout (``center_per_sequence``).
    Returns:
      [B, T] float, 0 off the loss tokens and on sequences without a teacher.
    """
    chex.assert_equal_shape([teacher_logp, logp, loss_mask])
    chex.assert_rank(has_teacher, 1)
    if clip < 0:
        raise ValueError(f"shaped_opd_term: clip must be >= 0 (0: off), got {clip}")
    taught = sequence_to_tokens(has_teacher.astype(loss_mask.dtype), loss_mask, sequence_ids)
    mask = jnp.where(taught > 0, loss_mask, 0.0)
    term = jnp.where(mask > 0, teacher_logp - jax.lax.stop_gradient(logp), 0.0)
    if center:
        term = center_per_sequence(term, mask, sequence_ids, num_sequences)
    if clip > 0:
        term = clip_per_token(term, mask, bound=clip)
    return term


def hindsight_advantages(
    group_advantages: Float[Array, "B T"],
    teacher_logp: Float[Array, "B T"],
    logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    has_teacher: Bool[Array, "S"],
    *,
    lam: float | Array,
    center: bool = False,
    clip: float = 0.0,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Float[Array, "B T"]:
    """A_t = A_group_t + lam * shaped_opd_term_t (hindsight OPD, the Retool-RL recipe, sec. 4.5).

    With ``center=False, clip=0`` this is ``losses.hybrid_advantages`` exactly.

    Args:
      group_advantages: [B, T] token advantages of a group estimator.
      lam: lambda, a float or a traced scalar (``opd_lambda``).
      Others as ``shaped_opd_term``.
    Returns:
      [B, T], 0 off the loss tokens.
    """
    chex.assert_equal_shape([group_advantages, loss_mask])
    term = shaped_opd_term(teacher_logp, logp, loss_mask, has_teacher, center=center, clip=clip,
                           sequence_ids=sequence_ids, num_sequences=num_sequences)
    return jnp.where(loss_mask > 0, group_advantages + lam * term, 0.0)


def opd_lambda(
    step: Int[Array, ""] | int,
    *,
    lam: float,
    schedule: str = "constant",
    warmup_steps: int = 0,
    decay_steps: int = 0,
    final_lam: float = 0.0,
) -> Float[Array, ""]:
    """lambda at a 0-based RL step, with ``s = min(step / steps, 1)``:

        constant       lam
        linear_warmup  lam * s                                  (steps = warmup_steps; 0 at step 0)
        linear_decay   lam + (final_lam - lam) * s              (steps = decay_steps)
        cosine_decay   final_lam + (lam - final_lam) * (1 + cos(pi * s)) / 2

    Args:
      step: the RL step (python int or a traced int scalar).
      lam: the peak (warmup) or starting (decay) lambda.
      schedule: one of ``SCHEDULES``.
      warmup_steps, decay_steps: length of the ramp (>= 1 for the schedules that use it).
      final_lam: lambda at the end of a decay.
    Returns:
      float32 scalar.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"opd_lambda: schedule must be one of {SCHEDULES}, got {schedule!r}")
    length = {"linear_warmup": warmup_steps, "linear_decay": decay_steps, "cosine_decay": decay_steps}.get(schedule)
    if length is not None and length < 1:
        raise ValueError(f"opd_lambda: schedule {schedule!r} needs its ramp length >= 1, got {length}")
    lam_f = jnp.float32(lam)
    if schedule == "constant":
        return lam_f
    s = jnp.minimum(jnp.asarray(step, jnp.float32) / length, 1.0)
    if schedule == "linear_warmup":
        return lam_f * s
    if schedule == "linear_decay":
        return lam_f + (final_lam - lam_f) * s
    return final_lam + (lam_f - final_lam) * 0.5 * (1.0 + jnp.cos(jnp.pi * s))


def opd_term_diagnostics(
    term: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    has_teacher: Bool[Array, "S"],
    *,
    near_zero: float = 0.25,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> dict[str, Array]:
    """What the OPD term looks like on the taught tokens (the step-0 diagnostic of docs/hybrid.md).

    Returns scalars over sequences with a teacher signal and at least one loss token:
      mean: mean of the term over their loss tokens;
      min_token: mean over those sequences of their most negative token's term (a teacher
        that read the hint marks the token where the trajectory went wrong);
      near_zero_fraction: share of their loss tokens with |term| < ``near_zero``;
      sequences: how many sequences entered.
    All are 0 when no sequence qualifies.
    """
    chex.assert_equal_shape([term, loss_mask])
    taught = sequence_to_tokens(has_teacher.astype(jnp.float32), term, sequence_ids)
    mask = jnp.where((taught > 0) & (loss_mask > 0), 1.0, 0.0)
    n_tokens = jnp.sum(mask)
    mean = jnp.sum(jnp.where(mask > 0, term, 0.0)) / jnp.maximum(n_tokens, 1.0)
    near = jnp.sum(jnp.where((mask > 0) & (jnp.abs(term) < near_zero), 1.0, 0.0)) / jnp.maximum(n_tokens, 1.0)
    s = _num_sequences(term, sequence_ids, num_sequences)
    flat_ids = (jnp.broadcast_to(jnp.arange(term.shape[0])[:, None], term.shape) if sequence_ids is None
                else sequence_ids).reshape(-1)
    masked = jnp.where(mask > 0, term, jnp.inf).reshape(-1)
    seq_min = jax.ops.segment_min(masked, flat_ids, num_segments=s)
    has_tokens = jnp.isfinite(seq_min)
    n_seq = jnp.sum(has_tokens.astype(jnp.float32))
    min_token = jnp.sum(jnp.where(has_tokens, seq_min, 0.0)) / jnp.maximum(n_seq, 1.0)
    return {"mean": mean, "min_token": min_token, "near_zero_fraction": near, "sequences": n_seq}
