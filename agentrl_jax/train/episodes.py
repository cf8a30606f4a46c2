"""Finished episodes -> training inputs and rollout metrics.

The rules for episodes that did not end in a graded answer live here
(docs/algorithms.md, "Truncated and failed episodes"): which trajectories train
(``Trajectory.masked``), which enter the advantage estimator's group statistics, and how
every ending is counted in the step metrics. The RL step's stages (``train/rl/``) go
through these functions, synchronous or asynchronous.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from agentrl_jax.config import Config
from agentrl_jax.envs.base import FINISH_REASONS, Trajectory
from agentrl_jax.losses import get_advantage, needs_critic
from agentrl_jax.train.batch import TokenRecord


def truncation_rule(config: Config) -> str:
    """``algorithm.truncated_episodes`` resolved: "mask" or "penalize" (docs/algorithms.md).

    "auto" masks when a wrong answer scores below the 0 an unscored episode used to get
    (``environment.outcome_scheme='pm1'``: -1, so running out of context would pay) and
    penalizes otherwise (``'binary'``: a wrong answer scores 0, the same as before).
    """
    rule = config.algorithm.truncated_episodes
    if rule != "auto":
        return rule
    return "mask" if config.environment.outcome_scheme == "pm1" else "penalize"


def trajectory_record(t: Trajectory) -> TokenRecord:
    """The trajectory's tokens for the batch; a masked episode keeps its tokens but trains none."""
    loss_mask = np.zeros_like(t.loss_mask) if t.masked else t.loss_mask
    return TokenRecord(
        t.token_ids.tolist(), loss_mask.tolist(), t.rollout_logprobs.tolist(), t.params_versions.tolist()
    )


def compute_advantages(config: Config, batch, rewards: np.ndarray, group_ids: np.ndarray,
                       trained: np.ndarray | None = None, values: np.ndarray | None = None) -> np.ndarray:
    """Per-token advantages [R, T] of a padded batch (one trajectory per row).

    Only the ``trained`` trajectories (default: all) enter the estimator: a masked episode
    (truncated under 'mask', or an environment error) has no score of its own, so it is
    left out of its group's mean/std (GRPO, RLOO, ...) and of REINFORCE++'s batch
    statistics, like the batch's padding rows; its advantage is 0.

    ``values``: the critic's values [R, T], for an estimator that needs a critic
    (``losses.needs_critic``: GAE), which also gets the critic section's gamma, lambda and
    turn level.
    """
    rows = batch.shape[0]
    n = len(rewards)
    trained = np.ones(n, bool) if trained is None else np.asarray(trained, bool)
    keep = np.flatnonzero(trained)
    adv = np.zeros(batch.loss_mask.shape, np.float32)
    if not len(keep):
        return adv
    assert rows >= n, "compute_advantages: one row per trajectory"
    estimator = get_advantage(config.algorithm.advantage)
    critic_inputs = {}
    if needs_critic(config.algorithm.advantage):
        if values is None:
            raise ValueError(f"compute_advantages: {config.algorithm.advantage!r} needs the critic's values")
        c = config.critic
        critic_inputs = dict(values=jnp.asarray(values[keep], jnp.float32), gamma=c.gamma, lam=c.lam,
                             turn_level=c.turn_level)
    kept = estimator(
        jnp.asarray(rewards[keep], jnp.float32), jnp.asarray(group_ids[keep], jnp.int32),
        jnp.asarray(batch.loss_mask[keep]), num_groups=int(group_ids[keep].max()) + 1, **critic_inputs,
    )
    adv[keep] = np.asarray(kept, np.float32)
    return adv * batch.loss_mask


def group_trajectories(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
    """The trajectories by group id, in order of first appearance."""
    by_id: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        by_id.setdefault(t.group_id, []).append(t)
    return list(by_id.values())


def informative(group: list[Trajectory]) -> bool:
    """Rewards differ among the group's trained (unmasked) episodes: a non-zero advantage."""
    return len({t.reward for t in group if not t.masked}) > 1


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Reward, its components, lengths and tool statistics, averaged over trajectories; how
    episodes ended: ``rollout/finish/<reason>`` fractions, and counts of truncated episodes,
    environment errors and masked (untrained) episodes."""
    out: dict[str, float] = {}
    rewards = np.asarray([t.reward for t in trajectories], np.float64)
    out["reward/mean"] = float(rewards.mean())
    out["reward/std"] = float(rewards.std())
    components: dict[str, list[float]] = {}
    for t in trajectories:
        for k, v in t.reward_components.items():
            if isinstance(v, (int, float, bool)):
                components.setdefault(k, []).append(float(v))
    for k, vals in components.items():
        out[f"reward/{k}"] = float(np.mean(vals))
    out["rollout/trajectories"] = float(len(trajectories))
    out["rollout/sampled_tokens"] = float(sum(t.num_sampled_tokens for t in trajectories))
    out["rollout/response_length"] = float(np.mean([t.num_sampled_tokens for t in trajectories]))
    out["rollout/turns"] = float(np.mean([len([x for x in t.turns if x.get("role") == "assistant"])
                                          for t in trajectories]))
    out["tools/calls_per_episode"] = float(np.mean([t.tool_stats.calls for t in trajectories]))
    out["tools/use_rate"] = float(np.mean([t.tool_stats.calls > 0 for t in trajectories]))
    out["tools/errors"] = float(sum(t.tool_stats.errors for t in trajectories))
    out["tools/timeouts"] = float(sum(t.tool_stats.timeouts for t in trajectories))
    out["tools/malformed"] = float(sum(t.tool_stats.malformed for t in trajectories))  # native layout: bad calls
    # Recovery: of the episodes with a failed tool call (traceback, timeout), the fraction that
    # still ended with a correct answer (evaluation.summarize's error_recovery_rate).
    failed = [t for t in trajectories if t.tool_stats.errors + t.tool_stats.timeouts > 0]
    out["tools/error_episode_rate"] = len(failed) / len(trajectories)
    if failed:
        out["tools/error_recovery_rate"] = float(np.mean([
            bool(t.reward_components.get("correct", t.reward > 0)) and not t.truncated for t in failed]))
    groups: dict[int, list[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t.reward)
    out["rollout/all_equal_groups"] = float(np.mean([len(set(v)) == 1 for v in groups.values()]))
    # Every known finish reason is logged (0 when absent) so its curve is continuous.
    reasons = dict.fromkeys(FINISH_REASONS, 0)
    for t in trajectories:
        reason = t.finish_reason or "unknown"
        reasons[reason] = reasons.get(reason, 0) + 1
    for k, v in reasons.items():
        out[f"rollout/finish/{k}"] = v / len(trajectories)
    out["rollout/truncated"] = float(sum(t.truncated for t in trajectories))
    out["rollout/env_errors"] = float(reasons["env_error"])
    out["rollout/masked_episodes"] = float(sum(t.masked for t in trajectories))
    return out
