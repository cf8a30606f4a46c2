"""Advantage estimators: group baselines (GRPO, Dr.GRPO, RLOO), REINFORCE++, GAE (a critic), OPD.

Sequence-level estimators take one outcome reward per trajectory, `rewards [B]`, and the
prompt group of each trajectory, `group_ids [B]` (arbitrary non-negative ints < num_groups,
in any order), and return `[B]`. `sequence_to_token_advantages` puts them on the loss
tokens. Groups whose rewards are all equal (including singletons) get exactly 0, never NaN.

The registered adapters at the bottom follow `registry.AdvantageEstimator` and return
[B, T] token advantages.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from agentrl_jax.losses.registry import register_advantage
from agentrl_jax.losses.sequences import sequence_to_tokens


class _GroupStats:
    """count, mean, unbiased std and an all-equal flag per group, gathered back to [B]."""

    def __init__(self, rewards: Array, group_ids: Array, num_groups: int):
        chex.assert_rank([rewards, group_ids], 1)
        chex.assert_equal_shape([rewards, group_ids])
        seg = lambda x: jax.ops.segment_sum(x, group_ids, num_segments=num_groups)  # noqa: E731
        count = seg(jnp.ones_like(rewards))
        mean = seg(rewards) / jnp.maximum(count, 1.0)
        centered = rewards - mean[group_ids]
        var = seg(centered**2) / jnp.maximum(count - 1.0, 1.0)
        hi = jax.ops.segment_max(rewards, group_ids, num_segments=num_groups)
        lo = jax.ops.segment_min(rewards, group_ids, num_segments=num_groups)
        self.count = count[group_ids]
        self.total = seg(rewards)[group_ids]
        self.centered = centered
        self.std = jnp.sqrt(var)[group_ids]
        self.all_equal = (hi == lo)[group_ids]


def grpo_advantages(
    rewards: Float[Array, "B"],
    group_ids: Int[Array, "B"],
    *,
    num_groups: int,
    eps: float = 1e-6,
) -> Float[Array, "B"]:
    """GRPO group-normalized advantage (Shao et al. 2024, DeepSeekMath, eq. in sec. 4.1.2).

        A_i = (r_i - mean_{j in g(i)} r_j) / (std_{j in g(i)} r_j + eps)

    std is the unbiased (n-1) sample std, as in verl/TRL. Groups with equal rewards give 0.

    Args:
      rewards: [B] outcome reward per trajectory.
      group_ids: [B] int prompt-group id per trajectory, < num_groups, any order.
      num_groups: static number of segments (> max group id).
      eps: added to the std.
    Returns:
      [B] advantages.
    """
    stats = _GroupStats(rewards, group_ids, num_groups)
    return jnp.where(stats.all_equal, 0.0, stats.centered / (stats.std + eps))


def drgrpo_advantages(
    rewards: Float[Array, "B"], group_ids: Int[Array, "B"], *, num_groups: int
) -> Float[Array, "B"]:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 3).

        A_i = r_i - mean_{j in g(i)} r_j          (no division by the std)

    Args/Returns as `grpo_advantages`.
    """
    stats = _GroupStats(rewards, group_ids, num_groups)
    return jnp.where(stats.all_equal, 0.0, stats.centered)


def rloo_advantages(
    rewards: Float[Array, "B"], group_ids: Int[Array, "B"], *, num_groups: int
) -> Float[Array, "B"]:
    """RLOO leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics", eq. 7).

        A_i = r_i - 1/(n_g - 1) * sum_{j in g(i), j != i} r_j

    Singleton groups (no other sample to form a baseline) give 0.

    Args/Returns as `grpo_advantages`.
    """
    stats = _GroupStats(rewards, group_ids, num_groups)
    baseline = (stats.total - rewards) / jnp.maximum(stats.count - 1.0, 1.0)
    return jnp.where(stats.all_equal | (stats.count < 2), 0.0, rewards - baseline)


def reinforce_pp_advantages(
    rewards: Float[Array, "B"],
    group_ids: Int[Array, "B"],
    *,
    num_groups: int,
    eps: float = 1e-6,
    group_baseline: bool = False,
) -> Float[Array, "B"]:
    """REINFORCE++ batch-normalized advantage (Hu 2025, "REINFORCE++", eq. 7).

        A_i = (x_i - mean_batch x) / (std_batch x + eps),   x_i = r_i
        (x_i = r_i - mean_{g(i)} r with `group_baseline`: the "REINFORCE++-baseline" variant)

    Normalization is over the whole batch of trajectories passed in (one value per
    trajectory; population std). Outcome-only rewards with gamma = 1 make every token's
    return equal to r_i, so this is the paper's estimator at sequence granularity.

    Args/Returns as `grpo_advantages`.
    """
    chex.assert_rank(rewards, 1)
    x = _GroupStats(rewards, group_ids, num_groups).centered if group_baseline else rewards
    centered = x - jnp.mean(x)
    all_equal = jnp.max(x) == jnp.min(x)
    return jnp.where(all_equal, 0.0, centered / (jnp.std(x) + eps))


def sequence_to_token_advantages(
    advantages: Float[Array, "S"],
    loss_mask: Float[Array, "B T"],
    sequence_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
    """Broadcast per-sequence advantages [S] onto loss tokens: A[b, t] = A_seq * loss_mask."""
    chex.assert_rank(loss_mask, 2)
    mask = loss_mask.astype(advantages.dtype)
    return sequence_to_tokens(advantages, mask, sequence_ids) * mask


def outcome_token_rewards(
    rewards: Float[Array, "B"], loss_mask: Float[Array, "B T"]
) -> Float[Array, "B T"]:
    """Place each trajectory's outcome reward on its last loss token: [B, T]."""
    chex.assert_rank(loss_mask, 2)
    positions = jnp.arange(loss_mask.shape[1])
    last = jnp.max(jnp.where(loss_mask > 0, positions, -1), axis=1)
    return jnp.where(positions[None, :] == last[:, None], rewards[:, None], 0.0)


def gae_advantages(
    token_rewards: Float[Array, "B T"],
    values: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    turn_level: bool = False,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """GAE over agent tokens only (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation", eq. 16).

        delta_k = r_k + gamma * V_{k+1} - V_k          (V after the last step = 0)
        A_k     = delta_k + gamma * lam * A_{k+1}

    where k runs over the steps of a row in order. Token level (default): a step is an agent
    token (loss_mask 1). Observation tokens inside a response are skipped, not time steps:
    the value of the first agent token after an observation bootstraps the agent token
    before it. A reward sitting on an observation token is credited to the agent token that
    precedes it (the action that caused the observation); a reward before the first agent
    token has no action and is ignored.

    ``turn_level``: a step is a turn (a maximal run of agent tokens), valued at its last
    agent token; the rewards of its tokens and of the observation after it are summed onto
    it, and every agent token of the turn gets the turn's advantage (the turn-level option
    of agentic PPO: one critic estimate per action, not per token). One row is one
    trajectory (compute advantages before packing).

    Args:
      token_rewards: [B, T] per-token rewards (outcome on the last agent token, KL penalties).
      values: [B, T] critic values at each token (read at the steps' value positions only).
      loss_mask: [B, T] 1 on agent tokens.
      gamma, lam: discount and GAE lambda.
      turn_level: one step per turn instead of per agent token.
    Returns:
      (advantages [B, T], 0 off the agent tokens; returns [B, T] = advantages + values at
      the value positions (`value_positions`), 0 elsewhere).
    """
    chex.assert_rank([token_rewards, values, loss_mask], 2)
    chex.assert_equal_shape([token_rewards, values, loss_mask])
    batch, seq_len = loss_mask.shape
    is_agent = loss_mask > 0
    dtype = jnp.result_type(token_rewards, values)
    valued = value_positions(loss_mask, turn_level=turn_level)
    starts = valued if not turn_level else is_agent & ~jnp.pad(is_agent, ((0, 0), (1, 0)))[:, :-1]
    step = jnp.cumsum(starts, axis=1) - 1  # the step a token belongs to (-1: before the first)
    rows = jnp.arange(batch)[:, None]
    # Out-of-range index `seq_len` + mode="drop" discards prompt rewards / unvalued positions.
    reward_slot = jnp.where(step >= 0, step, seq_len)
    value_slot = jnp.where(valued, step, seq_len)
    step_rewards = jnp.zeros((batch, seq_len), dtype).at[rows, reward_slot].add(
        token_rewards.astype(dtype), mode="drop"
    )
    step_values = jnp.zeros((batch, seq_len), dtype).at[rows, value_slot].set(
        values.astype(dtype), mode="drop"
    )
    num_steps = jnp.sum(valued, axis=1)
    has_next = (jnp.arange(seq_len)[None, :] + 1) < num_steps[:, None]
    next_values = jnp.concatenate([step_values[:, 1:], jnp.zeros((batch, 1), dtype)], axis=1)
    deltas = step_rewards + gamma * next_values * has_next - step_values

    def backward(carry, xs):
        delta, cont = xs
        adv = delta + gamma * lam * cont * carry
        return adv, adv

    _, step_adv = jax.lax.scan(
        backward, jnp.zeros((batch,), dtype), (deltas.T, has_next.T.astype(dtype)), reverse=True
    )
    step_adv = step_adv.T
    advantages = jnp.where(is_agent, jnp.take_along_axis(step_adv, jnp.maximum(step, 0), 1), 0.0)
    returns = jnp.where(valued, advantages + values.astype(dtype), 0.0)
    return advantages, returns


def value_positions(loss_mask: Float[Array, "B T"], *, turn_level: bool = False) -> Bool[Array, "B T"]:
    """Where `gae_advantages` reads the critic (and where the value loss trains it): every
    agent token, or with ``turn_level`` the last agent token of each turn."""
    is_agent = loss_mask > 0
    if not turn_level:
        return is_agent
    return is_agent & ~jnp.pad(is_agent, ((0, 0), (0, 1)))[:, 1:]


def whiten_advantages(
    advantages: Float[Array, "B T"], loss_mask: Float[Array, "B T"], *, eps: float = 1e-8
) -> Float[Array, "B T"]:
    """(A - mean) / (std + eps) over the loss tokens of the whole batch (population std), 0
    elsewhere: PPO's advantage normalization ("Implementation Matters in Deep Policy
    Gradients", arXiv:2005.12729). A batch without loss tokens stays 0."""
    chex.assert_equal_shape([advantages, loss_mask])
    mask = (loss_mask > 0).astype(advantages.dtype)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    mean = jnp.sum(advantages * mask) / count
    var = jnp.sum(jnp.square(advantages - mean) * mask) / count
    return (advantages - mean) / (jnp.sqrt(var) + eps) * mask


def opd_advantages(
    teacher_logp: Float[Array, "B T"], logp: Float[Array, "B T"], loss_mask: Float[Array, "B T"]
) -> Float[Array, "B T"]:
    """On-policy distillation per-token advantage (Agarwal et al. 2024, GKD; Thinking Machines
    2025 "On-Policy Distillation"): a one-sample estimate of the negative reverse KL,

        A_t = log pi_teacher(y_t) - stop_gradient(log pi(y_t))

    Args: teacher_logp, logp, loss_mask all [B, T]. Returns [B, T], 0 off the loss tokens.
    """
    chex.assert_equal_shape([teacher_logp, logp, loss_mask])
    return jnp.where(loss_mask > 0, teacher_logp - jax.lax.stop_gradient(logp), 0.0)


def hybrid_advantages(
    group_advantages: Float[Array, "B T"],
    teacher_logp: Float[Array, "B T"],
    logp: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    has_teacher: Bool[Array, "B"],
    *,
    lam: float = 1.0,
) -> Float[Array, "B T"]:
    """Hybrid group + OPD advantage (hindsight OPD, the Retool-RL recipe of
    "Agentic RL (Part III): Architecture Analysis of Verl and SkyRL to Retool-RL Case Practice"):

        A_t = A_group + lam * has_teacher * (log pi_teacher(y_t) - sg(log pi(y_t)))

    Args:
      group_advantages: [B, T] token advantages from a group estimator.
      teacher_logp, logp, loss_mask: [B, T].
      has_teacher: [B] bool, True where a teacher signal (a hint) exists for the trajectory.
      lam: weight of the OPD term.
    Returns: [B, T], 0 off the loss tokens.
    """
    chex.assert_rank(has_teacher, 1)
    opd = opd_advantages(teacher_logp, logp, loss_mask)
    mixed = group_advantages + lam * jnp.where(has_teacher[:, None], opd, 0.0)
    return jnp.where(loss_mask > 0, mixed, 0.0)


# Registered adapters: registry.AdvantageEstimator signature, [B, T] output.


def _sequence_estimator(estimator):
    def adapter(rewards, group_ids, loss_mask, *, num_groups, sequence_ids=None, **hparams):
        per_sequence = estimator(rewards, group_ids, num_groups=num_groups, **hparams)
        return sequence_to_token_advantages(per_sequence, loss_mask, sequence_ids)

    adapter.__doc__ = f"[B, T] adapter of `{estimator.__name__}`:\n{estimator.__doc__}"
    adapter.__name__ = estimator.__name__ + "_tokens"
    return adapter


register_advantage("grpo", min_group_size=2)(_sequence_estimator(grpo_advantages))
register_advantage("drgrpo", min_group_size=2)(_sequence_estimator(drgrpo_advantages))
register_advantage("rloo", min_group_size=2)(_sequence_estimator(rloo_advantages))
register_advantage("reinforce_pp")(_sequence_estimator(reinforce_pp_advantages))


_TEACHER_NOTE = (
    "is a token-level estimator over teacher logprobs, which the trainer mixes in through hybrid.mode, not "
    "through algorithm.advantage: set hybrid.mode to 'opd' or 'hybrid' and keep algorithm.advantage a "
    "sequence estimator (grpo, drgrpo, rloo or reinforce_pp)"
)


@register_advantage("gae", needs_critic=True)
def gae_token_advantages(
    rewards, group_ids, loss_mask, *, num_groups, values, token_rewards=None, gamma=1.0, lam=1.0,
    turn_level=False,
):
    """`gae_advantages` with the outcome reward [B] on the last agent token, plus optional
    per-token rewards [B, T] (e.g. a KL penalty). group_ids/num_groups are unused (a critic
    is the baseline). The RL trainer passes `values` from its critic and gamma, lam,
    turn_level from the critic section. Returns advantages [B, T] (not whitened)."""
    del group_ids, num_groups
    step_rewards = outcome_token_rewards(rewards, loss_mask)
    if token_rewards is not None:
        step_rewards = step_rewards + token_rewards
    advantages, _ = gae_advantages(step_rewards, values, loss_mask, gamma=gamma, lam=lam, turn_level=turn_level)
    return advantages


@register_advantage("opd", note=_TEACHER_NOTE)
def opd_token_advantages(rewards, group_ids, loss_mask, *, num_groups, teacher_logp, logp):
    """`opd_advantages` in the estimator signature (rewards and groups are unused)."""
    del rewards, group_ids, num_groups
    return opd_advantages(teacher_logp, logp, loss_mask)


@register_advantage("hybrid", note=_TEACHER_NOTE)
def hybrid_token_advantages(
    rewards,
    group_ids,
    loss_mask,
    *,
    num_groups,
    teacher_logp,
    logp,
    has_teacher,
    lam=1.0,
    base="grpo",
    sequence_ids=None,
    **base_hparams,
):
    """`hybrid_advantages` with A_group from the registered sequence estimator `base`."""
    from agentrl_jax.losses.registry import get_advantage

    group = get_advantage(base)(
        rewards, group_ids, loss_mask, num_groups=num_groups, sequence_ids=sequence_ids,
        **base_hparams,
    )
    return hybrid_advantages(group, teacher_logp, logp, loss_mask, has_teacher, lam=lam)
