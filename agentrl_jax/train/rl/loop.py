"""The RL loop: the stages of one step, in order (docs/architecture.md, "The loop").

    collect        G episodes per prompt through the agent loop        collect.py
                   (when it may start: the scheduler's admission rule)  scheduler.py
    judge          optional PRM judge: hints, PRM reward                collect.py
    build batch    one row per trajectory, advantages                   stages.py
    score          old / reference / teacher logprobs, on device        stages.py
    update         jitted minibatch updates, rng = fold_in(rng, step)   stages.py
    push weights   the engine decodes the new params (version + 1)      stages.py
    finish         metrics, periodic evaluation, checkpoint             stages.py

Everything the step uses is built once, up front (``RL`` and ``Roles``, by
``train/build.py``); what changes from step to step, the policy's ``TrainState`` and its
params version, is passed through the stages explicitly and returned at the end.
Synchronous RL is the scheduler with ``max_staleness = 0``; asynchronous RL the same step
body with later steps' rollouts admitted while this one trains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from agentrl_jax.envs.base import Trajectory
from agentrl_jax.train.guidance.old_policy import staleness_stats
from agentrl_jax.train.multihost import is_multihost
from agentrl_jax.train.rl import stages
from agentrl_jax.train.rl.collect import collect, exchange, judge, rollout_fn
from agentrl_jax.train.rl.roles import RL
from agentrl_jax.train.rl.scheduler import Scheduler
from agentrl_jax.train.step import TrainState

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoopResult:
    """The policy after the loop: its train state, its params version, and whether a
    preemption request ended the loop early (a checkpoint was saved)."""

    state: TrainState
    version: int
    preempted: bool


async def run_rl(rl: RL, state: TrainState, version: int, start_step: int = 0, *,
                 checkpoint_extra: dict[str, Any] | None = None) -> LoopResult:
    """RL steps ``start_step .. total_steps`` from the policy ``state`` at params ``version``.

    Args:
      rl: what the steps use (built once).
      state, version: the policy's train state and the params version the engine holds.
      checkpoint_extra: JSON merged into every checkpoint's extra (the start evaluation).
    """
    c = rl.config
    rl.roles.check(c)
    a = c.async_rl
    max_staleness = a.max_staleness if a.enabled else 0
    scheduler = Scheduler(lambda step, tasks: collect(c, rollout_fn(rl, step), tasks, lambda: next(rl.data)),
                          rl.data, start_step, c.total_steps, max_staleness)
    rl.old_policy.on_version(version, state.params)
    last, idle_mark, violations = time.perf_counter(), rl.driver.idle_seconds, 0
    async with scheduler:
        for step in range(start_step, c.total_steps):
            if a.offload_optimizer:  # host memory while the rollouts hold the KV cache
                state = stages.place_optimizer_state(state, "pinned_host")
            t0 = time.perf_counter()
            trajectories, metrics, t_rollout = await scheduler.batch(step)  # collect
            t_wait = time.perf_counter() - t0
            if is_multihost():
                trajectories = exchange(c, trajectories)
            violations += _staleness_violation(trajectories, version, max_staleness, step)
            t1 = time.perf_counter()
            verdicts = None
            if rl.roles.judge is not None:
                verdicts, judge_stats = await judge(rl, trajectories, step, (rl.engine_params(state.params), version))
                metrics.update(judge_stats)
            if a.release_kv_cache and not a.enabled:
                rl.driver.release_cache()
            if a.offload_optimizer:
                state = stages.place_optimizer_state(state, None)
            t2 = time.perf_counter()
            # build batch -> score -> update, in a worker thread: the event loop keeps serving the
            # rollouts admitted meanwhile and their tool calls
            state, train_metrics, token_staleness = await asyncio.to_thread(
                train_step, rl, state, version, step, trajectories, verdicts)
            t3 = time.perf_counter()
            version = await stages.push_weights(rl, state.params, version)
            rl.old_policy.on_version(version, state.params)
            now = time.perf_counter()
            metrics.update(train_metrics)
            metrics.update({"time/rollout": t_rollout, "time/judge": t2 - t1, "time/update": t3 - t2,
                            "time/sync": now - t3, "time/step": now - last,
                            "throughput/sampled_tokens_per_s": (
                                sum(t.num_sampled_tokens for t in trajectories) / max(t_rollout, 1e-9))})
            if a.enabled:
                metrics.update(_async_metrics(rl, scheduler, step, t_wait, idle_mark, violations))
            preempted = await stages.finish_step(  # log / evaluate / checkpoint
                rl, state, version, step, trajectories, metrics, data_state=scheduler.data_state(step + 1),
                token_staleness=token_staleness, checkpoint_extra=checkpoint_extra or {})
            await scheduler.finish(step)
            last, idle_mark = time.perf_counter(), rl.driver.idle_seconds
            if preempted:
                return LoopResult(state, version, True)
    return LoopResult(state, version, False)


def train_step(rl: RL, state: TrainState, version: int, step: int, trajectories: list[Trajectory],
               verdicts) -> tuple[TrainState, dict[str, float], np.ndarray | None]:
    """build batch -> score -> update on finished trajectories; (state, metrics, token staleness).

    ``version``: the params version of ``state.params`` (the one the engine holds).
    """
    batch = stages.build_step_batch(rl, trajectories)  # advantages
    if batch is None:
        return state, stages.empty_step(rl, state, step, len(trajectories)), None
    old_from_update = stages.old_from_update(rl, batch, version)  # on-policy: no separate old pass
    arrays, score_metrics = stages.score(rl, batch, state.params, version, trajectories, verdicts, step,
                                         old_from_update=old_from_update)
    state, metrics = stages.update(rl, state, arrays, batch.loss_mask, step, old_from_update=old_from_update)
    jax.block_until_ready(state.params)
    if rl.roles.teacher is not None:  # a lagged teacher follows the policy
        rl.roles.teacher.observe(state.params, step + 1)
    metrics.update(score_metrics)
    masked = [metrics[k] for k in ("mis_masked_frac", "icepop_masked_frac") if k in metrics]
    metrics.update(rl.old_policy.after_update(state.params, step, 1.0 - masked[0] if masked else None))
    version_stats, token_staleness = staleness_stats(batch.params_versions, batch.loss_mask, version,
                                                     len(trajectories))
    metrics.update(version_stats)
    return state, metrics, token_staleness


def _async_metrics(rl: RL, scheduler: Scheduler, step: int, t_wait: float, idle_mark: float,
                   violations: int) -> dict[str, float]:
    """How the pipeline overlapped: idle time on either side, admission waits, steps in flight."""
    return {"time/trainer_idle": t_wait, "time/rollout_idle": rl.driver.idle_seconds - idle_mark,
            "time/admission_wait": scheduler.admission_wait.pop(step, 0.0),
            "async/steps_in_flight": float(scheduler.in_flight), "async/staleness_violations": float(violations)}


def _staleness_violation(trajectories: list[Trajectory], version: int, max_staleness: int, step: int) -> int:
    """1 when a trained token lags more than ``max_staleness`` versions (the admission rule makes
    this impossible; counted and logged, never silent)."""
    oldest = min((int(t.params_versions[t.loss_mask > 0].min()) for t in trajectories
                  if (t.loss_mask > 0).any()), default=version)
    if version - oldest <= max_staleness:
        return 0
    logger.error("step %d trains version %d on tokens of version %d (max_staleness %d)",
                 step, version, oldest, max_staleness)
    return 1
