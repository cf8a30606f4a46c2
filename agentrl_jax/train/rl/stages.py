"""The stages of one RL step after ``collect`` (``collect.py``), each taking what it uses as arguments.

    build_step_batch  trajectories -> TrainBatch with advantages (host; None: nothing trains)
    compute_logprobs  batch, policy params, version -> device arrays with old / reference
                      logprobs and (OPD / hybrid) the teacher's advantages
    push_weights      params, version -> version + 1 (the engine decodes with them)
    log_step          metrics, histograms and sample texts of the step
    save              checkpoint: train state, data position, params version, lagged teacher,
                      critic

``loop.py`` calls them in this order, with the minibatch updates (``loop.update``) between
``compute_logprobs`` and ``push_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from agentrl_jax.config import AlgorithmConfig, Config, to_dict
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.losses import needs_critic
from agentrl_jax.models.lora import base_fingerprint, without_base
from agentrl_jax.train.batch import build_batch
from agentrl_jax.train.episodes import compute_advantages, rollout_metrics, trajectory_record
from agentrl_jax.train.guidance.hindsight import Verdict
from agentrl_jax.train.guidance.old_policy import OldPolicy
from agentrl_jax.train.guidance.teacher import Teacher, teacher_signal
from agentrl_jax.train.multihost import to_host
from agentrl_jax.train.rl.roles import Roles, StepFunctions
from agentrl_jax.train.sft import batch_arrays
from agentrl_jax.train.step import TrainState

logger = logging.getLogger(__name__)
FORWARD_INPUTS = ("input_ids", "positions", "segment_ids", "targets")


def build_step_batch(config: Config, trajectories: list[Trajectory], *, pad_token_id: int):
    """One padded row per trajectory, with advantages; None when no episode trains a token.

    An estimator that needs a critic gets its advantages later, from the critic's values
    (``train.critic.critic_targets``).
    """
    algorithm = config.algorithm
    records = [trajectory_record(t) for t in trajectories]
    rows_needed = algorithm.minibatches * max(algorithm.micro_batch_size, 1)
    if algorithm.dynamic_sampling:
        # A step may keep fewer groups: pad to the full row count so the update compiles once.
        rows_needed = config.data.prompts_per_step * algorithm.group_size
    batch = build_batch(records, row_multiple=rows_needed, pad_token_id=pad_token_id)
    if not batch.loss_mask.any():
        return None
    if needs_critic(algorithm.advantage):
        return batch
    return batch.replace(advantages=compute_advantages(config, batch, *episode_outcomes(trajectories)))


def episode_outcomes(trajectories: list[Trajectory]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rewards, group ids, trained) per trajectory: what the advantage estimators read."""
    return (np.asarray([t.reward for t in trajectories], np.float32),
            np.asarray([t.group_id for t in trajectories], np.int32),
            np.asarray([not t.masked for t in trajectories], bool))


def micro_rows(algorithm: AlgorithmConfig, rows: int) -> int:
    """Rows per micro-batch of a forward or update over ``rows`` rows."""
    return algorithm.micro_batch_size or rows // algorithm.minibatches


def old_from_update(config: Config, old_policy: OldPolicy, batch, version: int) -> bool:
    """Whether this step's update takes the old logprobs from its own forward: on-policy, one
    epoch, one minibatch, ``old_logprobs=recompute``, no teacher reading them first
    (``guidance.old_policy.OldPolicy.from_update``). Then ``compute_logprobs`` runs no
    old-logprob pass."""
    algorithm = config.algorithm
    return old_policy.from_update(
        epochs=algorithm.ppo_epochs, minibatches=algorithm.minibatches,
        needs_old_before_update=config.hybrid.mode != "none", token_versions=batch.params_versions,
        loss_mask=batch.loss_mask, version=version)


def compute_logprobs(config: Config, roles: Roles, old_policy: OldPolicy, steps: StepFunctions, tokenizer: Any,
                     batch, params: Any, version: int, trajectories: list[Trajectory],
                     verdicts: list[Verdict] | None, step: int, *, old_from_update: bool = False
                     ) -> tuple[dict[str, jax.Array], dict[str, float]]:
    """The batch on device with the logprobs the update needs: old (``old_policy``; none with
    ``old_from_update``), reference (``roles.reference``, KL term) and, with ``hybrid.mode``,
    advantages that mix in the teacher's signal (``guidance.teacher.teacher_signal``; ``step``
    sets lambda's schedule and the placebo draw).

    Args:
      params, version: the policy's params before the update and their params version.
      tokenizer: builds the teacher's contexts (``hybrid.mode``).

    Returns (arrays, metrics); ``arrays['old_logprobs']`` etc. stay on the training mesh.
    """
    host = batch_arrays(batch, device=False)
    inputs = {k: host[k] for k in FORWARD_INPUTS}
    micro = micro_rows(config.algorithm, batch.shape[0])
    arrays = {k: steps.put(v) for k, v in host.items()}
    metrics = {"old_policy/from_update": float(old_from_update)}
    if not old_from_update:
        arrays["old_logprobs"] = steps.put(old_policy.logprobs(
            lambda p, x, m: steps.logprobs(roles.policy, p, x, m), params, version, inputs,
            batch.params_versions, batch.loss_mask, micro))
        metrics.update(_gap_metrics(batch, to_host(arrays["old_logprobs"]), version))
    if config.algorithm.kl_coef > 0:
        arrays["ref_logprobs"] = steps.logprobs(roles.policy, roles.reference, inputs, micro)
    if config.hybrid.mode != "none":
        teacher: Teacher = roles.teacher
        advantages, teacher_metrics = teacher_signal(
            config.hybrid, trajectories, verdicts, batch, to_host(arrays["old_logprobs"]), step=step,
            seed=config.seed, tokenizer=tokenizer, row_multiple=micro,
            logprob_fn=lambda arrays: to_host(steps.logprobs(teacher.graphdef, teacher.params_for(params), arrays,
                                                             micro)))
        arrays["advantages"] = steps.put(advantages)
        metrics.update(teacher_metrics)
    return arrays, metrics


def _gap_metrics(batch, old_logprobs: np.ndarray, version: int) -> dict[str, float]:
    """Train/infer logprob gap; over rows sampled entirely by one older version it is ~0 when the
    old logprobs are exact (old_logprobs='snapshot'), the staleness otherwise."""
    mismatch = np.abs(old_logprobs - batch.rollout_logprobs) * batch.loss_mask
    out = {"logprob_gap_train_infer": float(mismatch.sum() / max(batch.loss_mask.sum(), 1))}
    stale = np.asarray([_single_stale_version(v, m, version) for v, m in
                        zip(batch.params_versions, batch.loss_mask)], bool)
    if stale.any():
        out["old_policy/gap_stale_rows"] = float(mismatch[stale].sum() / batch.loss_mask[stale].sum())
    return out


def _single_stale_version(versions: np.ndarray, mask: np.ndarray, current: int) -> bool:
    """A row whose sampled tokens all come from one params version older than ``current``."""
    sampled = versions[mask > 0]
    return bool(len(sampled)) and sampled.min() == sampled.max() < current


def empty_step(algorithm: AlgorithmConfig, schedule: Callable[[int], Any], state: TrainState, step: int,
               num_trajectories: int) -> dict[str, float]:
    """No episode trains a token (all masked, e.g. every one ran out of context): no update, counted."""
    logger.warning("step %d: all %d episodes are masked (truncated or environment errors); no update",
                   step, num_trajectories)
    return {"skipped_updates": float(algorithm.ppo_epochs * algorithm.minibatches), "train/empty_batch": 1.0,
            "train_tokens": 0.0, "learning_rate": float(schedule(int(to_host(state.step))))}


async def push_weights(driver: Any, engine_params: Callable[[Any], Any], params: Any, version: int) -> int:
    """Push ``params`` (in the engine's layout, ``engine_params``) to the driver as version
    ``version + 1``; returns the new version.

    The engine re-lays them out into its own buffers (``Engine.load_params`` never aliases
    the caller's arrays), so the next update may donate the train state while decoding goes
    on with these (async rollouts).
    """
    await driver.update_params(engine_params(params), version + 1)
    return version + 1


def log_step(config: Config, writer: Any, tokenizer: Any, engine_stats: dict[str, Any], step: int,
             trajectories: list[Trajectory], metrics: dict[str, float], token_staleness: np.ndarray | None) -> None:
    """The step's metrics (with the rollouts' and the engine's), the staleness histogram of an
    async run and sample texts, every ``logging.log_every`` steps.

    ``engine_stats``: the engine's counters since the driver started (slot occupancy, KV pool
    use, prefix-cache hits).
    """
    metrics.update(rollout_metrics(trajectories))
    metrics.update({f"rollout/engine/{k}": float(v) for k, v in engine_stats.items()})
    metrics["throughput/trajectories_per_s"] = len(trajectories) / max(metrics.get("time/step", 0.0), 1e-9)
    if step % max(config.logging.log_every, 1):
        return
    writer.write(step + 1, metrics)
    if config.async_rl.enabled and token_staleness is not None and len(token_staleness):
        writer.write_histograms(step + 1, {"async/token_staleness": token_staleness})
    if config.logging.sample_trajectories:
        writer.write_text(step + 1, {
            f"sample_{i}": tokenizer.decode(t.token_ids.tolist())
            for i, t in enumerate(trajectories[: config.logging.sample_trajectories])
        })


def save(checkpointer: Any, config: Config, roles: Roles | None, state: TrainState, version: int, step: int, *,
         data_state: Any, extra: dict[str, Any] | None = None) -> None:
    """Checkpoint the train state, the data position (``data_state``), the params version and
    what the roles keep between steps (a lagged teacher's params, the critic's train state) at
    ``step``."""
    trees = roles.checkpoint_trees() if roles is not None else {}
    base, trained = without_base(state)  # LoRA: the adapters and their optimizer state; the base is named
    named = {} if base is None else {"lora_base": base_fingerprint(base)}
    checkpointer.save(step, trained, data_state=data_state, config_dict=to_dict(config),
                      extra={"version": version, **named, **(extra or {})}, trees=trees, force=True)


def place_optimizer_state(state: TrainState, memory_kind: str | None) -> TrainState:
    """The train state with its optimizer state moved to ``memory_kind`` (None: device memory)."""

    def move(x):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return x
        kind = memory_kind or next(iter(sharding.device_set)).default_memory().kind
        return x if sharding.memory_kind == kind else jax.device_put(x, sharding.with_memory_kind(kind))

    return state.replace(opt_state=jax.tree.map(move, state.opt_state))
