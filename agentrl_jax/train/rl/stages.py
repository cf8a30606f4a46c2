"""The stages of one RL step after ``collect`` (``collect.py``), each with explicit inputs and outputs.

    build_step_batch  trajectories -> TrainBatch with advantages (host; None: nothing trains)
    score             batch, policy params, version -> device arrays with old / reference
                      logprobs and (OPD / hybrid) the teacher's advantages
    update            train state, arrays -> train state (jitted minibatch updates)
    push_weights      params, version -> version + 1 (the engine decodes with them)
    finish_step       metrics, periodic evaluation, checkpoint

``loop.py`` calls them in this order.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from agentrl_jax.config import to_dict
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.losses import global_normalizer
from agentrl_jax.train.batch import build_batch
from agentrl_jax.train.episodes import (
    compute_advantages,
    rollout_metrics,
    trajectory_record,
)
from agentrl_jax.train.guidance.hindsight import Verdict
from agentrl_jax.train.guidance.teacher import teacher_signal
from agentrl_jax.train.multihost import to_host
from agentrl_jax.train.packing import packing_stats, plan_minibatch
from agentrl_jax.train.rl.collect import evaluate
from agentrl_jax.train.rl.roles import RL
from agentrl_jax.train.sft import batch_arrays
from agentrl_jax.train.step import TrainState

logger = logging.getLogger(__name__)
FORWARD_INPUTS = ("input_ids", "positions", "segment_ids", "targets")


def build_step_batch(rl: RL, trajectories: list[Trajectory]):
    """One padded row per trajectory, with advantages; None when no episode trains a token."""
    a = rl.config.algorithm
    records = [trajectory_record(t) for t in trajectories]
    rows_needed = a.minibatches * max(a.micro_batch_size, 1)
    if a.dynamic_sampling:
        # A step may keep fewer groups: pad to the full row count so the update compiles once.
        rows_needed = rl.config.data.prompts_per_step * a.group_size
    batch = build_batch(records, row_multiple=rows_needed, pad_token_id=rl.tokenizer.pad_token_id)
    if not batch.loss_mask.any():
        return None
    rewards = np.asarray([t.reward for t in trajectories], np.float32)
    group_ids = np.asarray([t.group_id for t in trajectories], np.int32)
    trained = np.asarray([not t.masked for t in trajectories], bool)
    return batch.replace(advantages=compute_advantages(rl.config, batch, rewards, group_ids, trained))


def micro_rows(rl: RL, rows: int) -> int:
    a = rl.config.algorithm
    return a.micro_batch_size or rows // a.minibatches


def old_from_update(rl: RL, batch, version: int) -> bool:
    """Whether this step's update takes the old logprobs from its own forward: on-policy, one
    epoch, one minibatch, ``old_logprobs=recompute``, no teacher reading them first
    (``guidance.old_policy.OldPolicy.from_update``). Then ``score`` runs no old-logprob pass."""
    a = rl.config.algorithm
    return rl.old_policy.from_update(
        epochs=a.ppo_epochs, minibatches=a.minibatches, needs_old_before_update=rl.config.hybrid.mode != "none",
        token_versions=batch.params_versions, loss_mask=batch.loss_mask, version=version)


def score(rl: RL, batch, params: Any, version: int, trajectories: list[Trajectory],
          verdicts: list[Verdict] | None, step: int, *, old_from_update: bool = False
          ) -> tuple[dict[str, jax.Array], dict[str, float]]:
    """The batch on device with the logprobs the update needs: old (``guidance.old_policy``;
    none with ``old_from_update``), reference (KL term) and, with ``hybrid.mode``, advantages
    that mix in the teacher's signal (``guidance.teacher.teacher_signal``; ``step`` sets
    lambda's schedule and the placebo draw).

    Returns (arrays, metrics); ``arrays['old_logprobs']`` etc. stay on the training mesh.
    """
    host = batch_arrays(batch, device=False)
    inputs = {k: host[k] for k in FORWARD_INPUTS}
    micro = micro_rows(rl, batch.shape[0])
    arrays = {k: rl.steps.put(v) for k, v in host.items()}
    metrics = {"old_policy/from_update": float(old_from_update)}
    if not old_from_update:
        arrays["old_logprobs"] = rl.steps.put(rl.old_policy.logprobs(
            lambda p, x, m: rl.steps.logprobs(rl.roles.policy, p, x, m), params, version, inputs,
            batch.params_versions, batch.loss_mask, micro))
        metrics.update(_gap_metrics(batch, to_host(arrays["old_logprobs"]), version))
    if rl.config.algorithm.kl_coef > 0:
        arrays["ref_logprobs"] = rl.steps.logprobs(rl.roles.policy, rl.roles.reference, inputs, micro)
    if rl.config.hybrid.mode != "none":
        old_host = to_host(arrays["old_logprobs"])
        advantages, teacher_metrics = teacher_signal(
            rl.config.hybrid, trajectories, verdicts, batch, old_host, step=step, seed=rl.config.seed,
            tokenizer=rl.tokenizer, row_multiple=micro,
            logprob_fn=lambda arrays: to_host(rl.steps.logprobs(
                rl.roles.teacher.graphdef, rl.roles.teacher.params_for(params), arrays, micro)))
        arrays["advantages"] = rl.steps.put(advantages)
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


def update(rl: RL, state: TrainState, arrays: dict[str, jax.Array], loss_mask: np.ndarray,
           step: int, *, old_from_update: bool = False) -> tuple[TrainState, dict[str, float]]:
    """``ppo_epochs`` x ``minibatches`` jitted updates; minibatch order from ``fold_in(rng, step)``.

    ``loss_mask``: the batch's [R, T] mask on the host (which minibatches have a loss token).
    A minibatch of only masked / padding rows is skipped (counted): an optimizer step on zero
    gradients would still move the params (Adam's momentum, weight decay). With
    ``algorithm.pack_rows`` each minibatch is packed into token-budget rows on device.
    """
    a = rl.config.algorithm
    rows = loss_mask.shape[0]
    per_minibatch = rows // a.minibatches
    max_response = int(loss_mask.sum(axis=1).max()) or 1
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
    if a.pack_rows:  # one plan (and row count) per minibatch, below
        segment_ids = to_host(arrays["segment_ids"])
    else:
        micro_batches = per_minibatch // micro_rows(rl, rows)
    collected, pack_metrics, empty_minibatches = [], [], 0
    for epoch in range(a.ppo_epochs):
        order = to_host(jax.random.permutation(jax.random.fold_in(key, epoch), rows))
        for mb in range(a.minibatches):
            idx = order[mb * per_minibatch: (mb + 1) * per_minibatch]
            if not loss_mask[idx].any():
                empty_minibatches += 1
                continue
            normalizer = rl.steps.put(global_normalizer(loss_mask[idx], a.aggregation,
                                                  max_response_length=int(a.loss_normalizer) or max_response))
            if a.pack_rows:
                plan = plan_minibatch(segment_ids, idx, row_tokens=a.pack_row_tokens,
                                      micro_batch_tokens=a.micro_batch_tokens)
                state, metrics = rl.steps.update(
                    state, arrays, rl.steps.put(plan.gather_index().astype(np.int32)),
                    rl.steps.put(plan.segment_ids()), normalizer, plan.num_micro_batches, old_from_update, rows,
                    plan.segment_bound)
                pack_metrics.append(packing_stats(plan))
            else:
                state, metrics = rl.steps.update(state, arrays, rl.steps.put(idx.astype(np.int32)), normalizer,
                                                 micro_batches, old_from_update)
            collected.append(metrics)
    collected = [{k: float(to_host(v)) for k, v in m.items()} for m in collected]
    out = {k: float(np.mean([m[k] for m in collected])) for k in collected[0]} if collected else {}
    out["skipped_updates"] = float(sum(m["skipped"] for m in collected) + empty_minibatches)
    out["learning_rate"] = float(rl.schedule(int(to_host(state.step))))
    out["train_tokens"] = float(loss_mask.sum())
    out.update({k: float(np.mean([m[k] for m in pack_metrics])) for k in (pack_metrics[0] if pack_metrics else ())})
    if old_from_update and "logprob_gap_abs" in out:
        # the update's forward was the old policy's: its gap to the engine is the same metric
        out["logprob_gap_train_infer"] = out["logprob_gap_abs"]
    return state, out


def empty_step(rl: RL, state: TrainState, step: int, num_trajectories: int) -> dict[str, float]:
    """No episode trains a token (all masked, e.g. every one ran out of context): no update, counted."""
    a = rl.config.algorithm
    logger.warning("step %d: all %d episodes are masked (truncated or environment errors); no update",
                   step, num_trajectories)
    return {"skipped_updates": float(a.ppo_epochs * a.minibatches), "train/empty_batch": 1.0,
            "train_tokens": 0.0, "learning_rate": float(rl.schedule(int(to_host(state.step))))}


async def push_weights(rl: RL, params: Any, version: int) -> int:
    """Push ``params`` to the engine as version ``version + 1``; returns the new version.

    The engine re-lays them out into its own buffers (``Engine.load_params`` never aliases
    the caller's arrays), so the next update may donate the train state while decoding goes
    on with these (async rollouts).
    """
    await rl.driver.update_params(rl.engine_params(params), version + 1)
    return version + 1


async def finish_step(rl: RL, state: TrainState, version: int, step: int, trajectories: list[Trajectory],
                      metrics: dict[str, float], *, data_state: Any, token_staleness: np.ndarray | None,
                      checkpoint_extra: dict[str, Any]) -> bool:
    """Metrics, periodic evaluation and checkpoint after ``step``; True when preempted (saved).

    ``data_state``: the data position before the first prompts not trained yet.
    """
    c = rl.config
    metrics.update(rollout_metrics(trajectories))
    # Engine counters since the driver started (slot occupancy, KV pool use, prefix-cache hits).
    metrics.update({f"rollout/engine/{k}": float(v) for k, v in rl.driver.stats().items()})
    metrics["throughput/trajectories_per_s"] = len(trajectories) / max(metrics.get("time/step", 0.0), 1e-9)
    if step % max(c.logging.log_every, 1) == 0:
        rl.writer.write(step + 1, metrics)
        if c.async_rl.enabled and token_staleness is not None and len(token_staleness):
            rl.writer.write_histograms(step + 1, {"async/token_staleness": token_staleness})
        if c.logging.sample_trajectories:
            rl.writer.write_text(step + 1, {
                f"sample_{i}": rl.tokenizer.decode(t.token_ids.tolist())
                for i, t in enumerate(trajectories[: c.logging.sample_trajectories])
            })
    if c.eval.every_steps and (step + 1) % c.eval.every_steps == 0 and step + 1 < c.total_steps:
        ev = await evaluate(rl, rl.eval_tasks, label=f"step {step + 1}")
        rl.writer.write(step + 1, {f"eval/{k}": v for k, v in ev.items()})
    # The last step is saved once, by train() after the final evaluation (with the results).
    if rl.checkpointer is None or step + 1 >= c.total_steps:
        return False
    stop = rl.checkpointer.should_stop()
    if stop or (c.checkpoint.every_steps and (step + 1) % c.checkpoint.every_steps == 0):
        save(rl, state, version, step + 1, data_state=data_state, extra=checkpoint_extra)
    if stop:
        logger.warning("preemption requested: saved step %d, stopping", step + 1)
    return stop


def save(rl: RL, state: TrainState, version: int, step: int, *, data_state: Any = None,
         extra: dict[str, Any] | None = None) -> None:
    """Checkpoint the train state, the data position, the params version and a lagged
    teacher's params at ``step``."""
    if rl.checkpointer is None:
        return
    data_state = rl.data.get_state() if data_state is None else data_state
    trees = rl.roles.teacher.checkpoint_trees() if rl.roles.teacher is not None else {}
    rl.checkpointer.save(step, state, data_state=data_state, config_dict=to_dict(rl.config),
                         extra={"version": version, **(extra or {})}, trees=trees, force=True)


def place_optimizer_state(state: TrainState, memory_kind: str | None) -> TrainState:
    """The train state with its optimizer state moved to ``memory_kind`` (None: device memory)."""

    def move(x):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return x
        kind = memory_kind or next(iter(sharding.device_set)).default_memory().kind
        return x if sharding.memory_kind == kind else jax.device_put(x, sharding.with_memory_kind(kind))

    return state.replace(opt_state=jax.tree.map(move, state.opt_state))
