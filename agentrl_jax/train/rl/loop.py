"""The RL loop: the stages of one step, in order (docs/architecture.md, "The loop").

    collect           G episodes per prompt through the agent loop        collect.py
                      (when it may start: the admission rule)              admission.py
    judge             optional PRM judge: hints, PRM reward                collect.py
    build batch       one row per trajectory, advantages                   stages.py
    compute logprobs  old / reference / teacher logprobs, on device        stages.py
    update            jitted minibatch updates, rng = fold_in(rng, step)   update below, step.py
    push weights      the engine decodes the new params (version + 1)      stages.py
    finish            metrics, periodic evaluation, checkpoint             stages.py, collect.py

Everything the step uses is built once, up front (``RL``, ``Roles`` and the jitted
``StepFunctions``, by ``train/build.py``); the loop hands each stage what it uses, and what
changes from step to step, the policy's ``TrainState`` and its params version, is passed
explicitly and returned at the end. The update calls the jitted update of
``train/step.py`` directly. Synchronous RL is the admission rule with ``max_staleness =
0``; asynchronous RL the same step body with later steps' rollouts admitted while this
one trains. With ``async_rl.mode='stream'`` the rollouts are a stream of groups instead
(``stream.py``): groups start one by one, each step takes the next finished ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from agentrl_jax.config import AlgorithmConfig
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.losses import global_normalizer
from agentrl_jax.train.critic import Critic, critic_targets
from agentrl_jax.train.guidance.old_policy import staleness_stats
from agentrl_jax.train.multihost import is_multihost, to_host
from agentrl_jax.train.packing import packing_stats, plan_minibatch
from agentrl_jax.train.rl import stages
from agentrl_jax.train.rl.admission import StepAdmission
from agentrl_jax.train.rl.collect import collect, evaluate, exchange, judge, rollout_fn
from agentrl_jax.train.rl.roles import RL, StepFunctions
from agentrl_jax.train.rl.stream import GroupStream, stream_rollout
from agentrl_jax.train.sft import batch_arrays
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
    async_rl = c.async_rl
    max_staleness = async_rl.max_staleness if async_rl.enabled else 0
    admission = _admission(rl, start_step, max_staleness)
    rl.old_policy.on_version(version, state.params)
    last, idle_mark, violations = time.perf_counter(), rl.driver.idle_seconds, 0
    async with admission:
        for step in range(start_step, c.total_steps):
            if async_rl.offload_optimizer:  # host memory while the rollouts hold the KV cache
                state = stages.place_optimizer_state(state, "pinned_host")
            t0 = time.perf_counter()
            trajectories, metrics, t_rollout = await admission.batch(step)  # collect
            t_wait = time.perf_counter() - t0
            if is_multihost():
                trajectories = exchange(trajectories)
            violations += _staleness_violation(trajectories, version, max_staleness, step)
            t1 = time.perf_counter()
            verdicts = None
            if rl.roles.judge is not None:
                verdicts, judge_stats = await judge(c, rl.roles.judge, rl.writer, rl.tokenizer, trajectories, step,
                                                    (rl.engine_params(state.params), version))
                metrics.update(judge_stats)
            if async_rl.release_kv_cache and not async_rl.enabled:
                rl.driver.release_cache()
            if async_rl.offload_optimizer:
                state = stages.place_optimizer_state(state, None)
            t2 = time.perf_counter()
            # build batch -> logprobs -> update, in a worker thread: the event loop keeps serving the
            # rollouts admitted meanwhile and their tool calls
            state, train_metrics, token_staleness = await asyncio.to_thread(
                train_step, rl, state, version, step, trajectories, verdicts)
            t3 = time.perf_counter()
            version = await stages.push_weights(rl.driver, rl.engine_params, state.params, version)
            rl.old_policy.on_version(version, state.params)
            now = time.perf_counter()
            metrics.update(train_metrics)
            metrics.update({"time/rollout": t_rollout, "time/judge": t2 - t1, "time/update": t3 - t2,
                            "time/sync": now - t3, "time/step": now - last,
                            "throughput/sampled_tokens_per_s": (
                                sum(t.num_sampled_tokens for t in trajectories) / max(t_rollout, 1e-9))})
            if async_rl.enabled:
                metrics.update(_async_metrics(rl, admission, step, t_wait, idle_mark, violations))
            if isinstance(admission, GroupStream):
                metrics.update(admission.metrics())
                metrics.update(_last_token_staleness(trajectories, version - 1))  # the version trained (pushed +1)
            preempted = await _finish_step(  # log / evaluate / checkpoint
                rl, state, version, step, trajectories, metrics, data_state=admission.data_state(step + 1),
                token_staleness=token_staleness, checkpoint_extra=checkpoint_extra or {})
            await admission.finish(step)
            last, idle_mark = time.perf_counter(), rl.driver.idle_seconds
            if preempted:
                return LoopResult(state, version, True)
    return LoopResult(state, version, False)


def _admission(rl: RL, start_step: int, max_staleness: int) -> StepAdmission | GroupStream:
    """When rollouts start: a step's batch at once (``StepAdmission``), or groups one by one
    (``GroupStream``, ``async_rl.mode='stream'``)."""
    c = rl.config
    if not (c.async_rl.enabled and c.async_rl.mode == "stream"):
        return StepAdmission(
            lambda step, tasks: collect(c, rollout_fn(c, rl.agent_loop, rl.env_factory, step), tasks,
                                        lambda: next(rl.data)),
            rl.data, start_step, c.total_steps, max_staleness)
    r, G = c.rollout, c.algorithm.group_size
    pool: list[int] = []

    def kv_groups() -> int:
        """The KV pool over a group at full length (0 before the pool exists); read once: the
        async pipeline keeps its pool, and the stream asks at every group's start."""
        if not pool:
            tokens = int(rl.driver.stats().get("kv_pool_tokens", 0))
            if not tokens:
                return 0
            pool.append(tokens // (G * r.max_sequence_length))
        return pool[0]

    return GroupStream(
        stream_rollout(c, rl.agent_loop, rl.env_factory), rl.data, start_step, c.total_steps, max_staleness,
        c.data.prompts_per_step // jax.process_count(), first_draw=getattr(rl.data, "batches_served", start_step),
        dynamic_sampling=c.algorithm.dynamic_sampling, max_sampling_rounds=c.algorithm.max_sampling_rounds,
        max_groups=c.async_rl.stream_max_groups, decode_lanes=r.decode_batch or r.max_concurrent,
        kv_groups=kv_groups, group_size=G)


def train_step(rl: RL, state: TrainState, version: int, step: int, trajectories: list[Trajectory],
               verdicts) -> tuple[TrainState, dict[str, float], np.ndarray | None]:
    """build batch -> logprobs -> update on finished trajectories; (state, metrics, token staleness).

    ``version``: the params version of ``state.params`` (the one the engine holds).
    """
    c = rl.config
    batch = stages.build_step_batch(c, trajectories, pad_token_id=rl.tokenizer.pad_token_id)  # advantages
    if batch is None:
        return state, stages.empty_step(c.algorithm, rl.schedule, state, step, len(trajectories)), None
    critic, critic_arrays, critic_metrics = rl.roles.critic, {}, {}
    if critic is not None:  # GAE: advantages from the critic's values, before either model moves
        host = batch_arrays(batch, device=False)
        advantages, critic_arrays, critic_metrics = critic_targets(
            c, critic, batch, {k: host[k] for k in stages.FORWARD_INPUTS}, *stages.episode_outcomes(trajectories),
            stages.micro_rows(c.algorithm, batch.shape[0]))
        batch = batch.replace(advantages=advantages)
    old_from_update = stages.old_from_update(c, rl.old_policy, batch, version)  # on-policy: no separate old pass
    arrays, logprob_metrics = stages.compute_logprobs(
        c, rl.roles, rl.old_policy, rl.steps, rl.tokenizer, batch, state.params, version, trajectories, verdicts,
        step, old_from_update=old_from_update)
    if critic is not None and step < c.critic.warmup_steps:  # the policy waits for its baseline
        metrics = {"critic/policy_frozen": 1.0, "learning_rate": float(rl.schedule(int(to_host(state.step))))}
    else:
        state, metrics = update(c.algorithm, rl.steps, rl.schedule, state, arrays, batch.loss_mask, step,
                                old_from_update=old_from_update)
    if critic is not None:
        critic_arrays = {k: rl.steps.put(v) for k, v in critic_arrays.items()}
        metrics.update(critic_metrics)
        metrics.update(update_critic(c.algorithm, critic, rl.steps, arrays | critic_arrays, step))
    jax.block_until_ready(state.params)
    if rl.roles.teacher is not None:  # a lagged teacher follows the policy
        rl.roles.teacher.observe(state.params, step + 1)
    metrics.update(logprob_metrics)
    masked = [metrics[k] for k in ("mis_masked_frac", "icepop_masked_frac") if k in metrics]
    metrics.update(rl.old_policy.after_update(state.params, step, 1.0 - masked[0] if masked else None))
    version_stats, token_staleness = staleness_stats(batch.params_versions, batch.loss_mask, version,
                                                     len(trajectories))
    metrics.update(version_stats)
    return state, metrics, token_staleness


def update(algorithm: AlgorithmConfig, steps: StepFunctions, schedule: Callable[[int], Any], state: TrainState,
           arrays: dict[str, jax.Array], loss_mask: np.ndarray, step: int, *,
           old_from_update: bool = False) -> tuple[TrainState, dict[str, float]]:
    """``ppo_epochs`` x ``minibatches`` calls of the jitted update (``steps.update``); minibatch
    order from ``fold_in(rng, step)``.

    ``loss_mask``: the batch's [R, T] mask on the host (which minibatches have a loss token).
    A minibatch of only masked / padding rows is skipped (counted): an optimizer step on zero
    gradients would still move the params (Adam's momentum, weight decay). With
    ``algorithm.pack_rows`` each minibatch is packed into token-budget rows on device.
    """
    rows = loss_mask.shape[0]
    per_minibatch = rows // algorithm.minibatches
    max_response = int(loss_mask.sum(axis=1).max()) or 1
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
    if algorithm.pack_rows:  # one plan (and row count) per minibatch, below
        segment_ids = to_host(arrays["segment_ids"])
    else:
        micro_batches = per_minibatch // stages.micro_rows(algorithm, rows)
    collected, pack_metrics, empty_minibatches = [], [], 0
    for epoch in range(algorithm.ppo_epochs):
        order = to_host(jax.random.permutation(jax.random.fold_in(key, epoch), rows))
        for mb in range(algorithm.minibatches):
            idx = order[mb * per_minibatch: (mb + 1) * per_minibatch]
            if not loss_mask[idx].any():
                empty_minibatches += 1
                continue
            normalizer = steps.put(global_normalizer(
                loss_mask[idx], algorithm.aggregation,
                max_response_length=int(algorithm.loss_normalizer) or max_response))
            if algorithm.pack_rows:
                plan = plan_minibatch(segment_ids, idx, row_tokens=algorithm.pack_row_tokens,
                                      micro_batch_tokens=algorithm.micro_batch_tokens)
                state, metrics = steps.update(
                    state, arrays, steps.put(plan.gather_index().astype(np.int32)), steps.put(plan.segment_ids()),
                    normalizer, plan.num_micro_batches, old_from_update, rows, plan.segment_bound)
                pack_metrics.append(packing_stats(plan))
            else:
                state, metrics = steps.update(state, arrays, steps.put(idx.astype(np.int32)), normalizer,
                                              micro_batches, old_from_update)
            collected.append(metrics)
    collected = [{k: float(to_host(v)) for k, v in m.items()} for m in collected]
    out = {k: float(np.mean([m[k] for m in collected])) for k in collected[0]} if collected else {}
    out["skipped_updates"] = float(sum(m["skipped"] for m in collected) + empty_minibatches)
    out["learning_rate"] = float(schedule(int(to_host(state.step))))
    out["train_tokens"] = float(loss_mask.sum())
    out.update({k: float(np.mean([m[k] for m in pack_metrics])) for k in (pack_metrics[0] if pack_metrics else ())})
    if old_from_update and "logprob_gap_abs" in out:
        # the update's forward was the old policy's: its gap to the engine is the same metric
        out["logprob_gap_train_infer"] = out["logprob_gap_abs"]
    return state, out


def update_critic(algorithm: AlgorithmConfig, critic: Critic, steps: StepFunctions, arrays: dict[str, jax.Array],
                  step: int) -> dict[str, float]:
    """The critic's ``ppo_epochs`` x ``minibatches`` updates of the clipped value loss (``update``
    with the critic's jitted update and state), averaged over its valued tokens; metrics
    ``critic/...``."""
    value_mask = to_host(arrays["value_mask"])
    critic.state, metrics = update(dataclasses.replace(algorithm, aggregation="token-mean"),
                                   steps._replace(update=critic.update), critic.schedule, critic.state, arrays,
                                   value_mask, step)
    names = {"loss": "value_loss", "train_tokens": "valued_tokens"}
    return {f"critic/{names.get(k, k)}": v for k, v in metrics.items() if k != "logprob_gap_abs"}


async def _finish_step(rl: RL, state: TrainState, version: int, step: int, trajectories: list[Trajectory],
                       metrics: dict[str, float], *, data_state: Any, token_staleness: np.ndarray | None,
                       checkpoint_extra: dict[str, Any]) -> bool:
    """Metrics, periodic evaluation and checkpoint after ``step``; True when preempted (saved).

    ``data_state``: the data position before the first prompts not trained yet.
    """
    c = rl.config
    stages.log_step(c, rl.writer, rl.tokenizer, rl.driver.stats(), step, trajectories, metrics, token_staleness)
    if c.eval.every_steps and (step + 1) % c.eval.every_steps == 0 and step + 1 < c.total_steps:
        ev = await evaluate(c.eval, rl.agent_loop, rl.env_factory, rl.eval_tasks, label=f"step {step + 1}")
        rl.writer.write(step + 1, {f"eval/{k}": v for k, v in ev.items()})
    # The last step is saved once, by train() after the final evaluation (with the results).
    if rl.checkpointer is None or step + 1 >= c.total_steps:
        return False
    stop = rl.checkpointer.should_stop()
    if stop or (c.checkpoint.every_steps and (step + 1) % c.checkpoint.every_steps == 0):
        stages.save(rl.checkpointer, c, rl.roles, state, version, step + 1, data_state=data_state,
                    extra=checkpoint_extra)
    if stop:
        logger.warning("preemption requested: saved step %d, stopping", step + 1)
    return stop


def _async_metrics(rl: RL, admission: StepAdmission, step: int, t_wait: float, idle_mark: float,
                   violations: int) -> dict[str, float]:
    """How the pipeline overlapped: idle time on either side, admission waits, steps in flight."""
    return {"time/trainer_idle": t_wait, "time/rollout_idle": rl.driver.idle_seconds - idle_mark,
            "time/admission_wait": admission.admission_wait.pop(step, 0.0),
            "async/steps_in_flight": float(admission.in_flight), "async/staleness_violations": float(violations)}


def _last_token_staleness(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """Versions between a trajectory's last sampled token and ``version``, the one that trained it."""
    lags = [version - int(t.params_versions[t.loss_mask > 0].max()) for t in trajectories if (t.loss_mask > 0).any()]
    return {"stream/last_token_staleness_mean": float(np.mean(lags)) if lags else 0.0,
            "stream/last_token_staleness_max": float(max(lags, default=0))}


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
