"""The RL trainer: agent rollouts -> rewards -> advantages -> jitted updates -> weight sync.

One step (DESIGN.md section 1):

    prompts (checkpointable iterator)
      -> G trajectories per prompt through the rollout driver and the environment,
         all in flight at once (continuous batching, tool calls in the sandbox pool)
      -> rewards from the environment's verifier (+ shaping)
      -> advantages from the registry (config algorithm.advantage)
      -> TrainBatch (token ids exactly as sampled) -> old / reference logprobs on the mesh
      -> ppo_epochs x minibatches of jitted updates (micro-batch accumulation)
      -> weight sync to the engine (device_put, a new params version)
      -> metrics, evaluation, checkpoint

``train(config)`` runs the whole job: the optional SFT cold start, an evaluation of the
starting policy, RL, a final evaluation, and a results table (start vs end).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.config import Config, ConfigError, to_dict
from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.losses import global_normalizer
from agentrl_jax.losses.registry import loss_hparams
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.train.batch import build_batch
from agentrl_jax.train.episodes import (
    compute_advantages,
    group_trajectories,
    informative,
    rollout_metrics,
    trajectory_record,
    truncation_rule,
)
from agentrl_jax.train.evaluation import summarize
from agentrl_jax.train.hindsight import Judge, Verdict, apply_prm_reward, judge_metrics
from agentrl_jax.train.multihost import gather_objects, is_multihost, put_global, to_host
from agentrl_jax.train.old_policy import OldPolicy, staleness_stats
from agentrl_jax.train.sft import batch_arrays
from agentrl_jax.train.step import (
    LossSettings,
    forward_logprobs,
    init_train_state,
    make_optimizer,
    update_step,
)
from agentrl_jax.train.teacher import (
    hindsight_contexts,
    teacher_advantages,
    teacher_logprobs,
)

logger = logging.getLogger(__name__)

def loss_settings(config: Config) -> LossSettings:
    """The static objective of the update, from the algorithm config.

    The loss's hyper-parameters are the ones it declared at registration, read from the
    config, plus ``algorithm.loss_hparams`` (``losses.registry.loss_hparams``).
    """
    a = config.algorithm
    correction_hparams: dict[str, Any] = {}
    if a.correction in ("tis", "mis"):
        correction_hparams = {"cap": a.correction_cap, "level": a.correction_level}
    elif a.correction == "icepop":
        correction_hparams = {"low": a.correction_floor, "high": a.correction_cap, "level": a.correction_level}
    return LossSettings(
        loss=a.loss,
        hparams=tuple(sorted(loss_hparams(a.loss, config).items())),
        aggregation=a.aggregation,
        temperature=config.rollout.temperature,
        kl_coef=a.kl_coef,
        kl_kind=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        correction=a.correction,
        correction_hparams=tuple(sorted(correction_hparams.items())),
    )


class RLTrainer:
    """Owns the policy state, the rollout driver and the update functions of one run."""

    def __init__(self, config: Config, *, graphdef, params, tokenizer, driver, env_factory, train_tasks,
                 eval_tasks, metrics_writer, checkpointer=None, reference_params=None, teacher=None,
                 judge: Judge | None = None, mesh=None, engine_params: Callable[[Any], Any] | None = None):
        self.config = config
        self.graphdef = graphdef
        self.tokenizer = tokenizer
        self.driver = driver
        self.env_factory = env_factory
        self.train_tasks = train_tasks
        self.eval_tasks = eval_tasks
        self.writer = metrics_writer
        self.checkpointer = checkpointer
        self.reference_params = reference_params
        self.teacher = teacher  # (graphdef, frozen params) when config.hybrid.mode != "none"
        self.judge = judge
        # Training arrays go onto this mesh; the engine may live on a host-local one
        # (multi-host), reached through `engine_params`.
        self.mesh = mesh
        self.engine_params = engine_params or (lambda params: params)
        self.settings = loss_settings(config)
        self.optimizer, self.schedule = make_optimizer(config.optimizer, config.total_steps)
        self.state = init_train_state(params, self.optimizer, config.seed)
        self.loop = AgentLoop(
            driver,
            tokenizer,
            max_new_tokens_per_turn=config.rollout.max_new_tokens_per_turn,
            max_total_tokens=config.rollout.max_sequence_length,
            truncation=truncation_rule(config),
        )
        from agentrl_jax.data import BatchIterator

        # data.prompts_per_step is global; each host draws its share of every global batch.
        self.data = BatchIterator(train_tasks, batch_size=config.data.prompts_per_step // jax.process_count(),
                                  seed=config.data.shuffle_seed, shard_index=jax.process_index(),
                                  shard_count=jax.process_count())
        self._update_fns: dict[tuple, Any] = {}
        self._logprob_fn = jax.jit(
            functools.partial(forward_logprobs, temperature=config.rollout.temperature), static_argnums=(0,)
        )
        self.version = 0
        # JSON merged into every checkpoint's extra (train() keeps the start evaluation there).
        self.checkpoint_extra: dict[str, Any] = {}
        self.preempted = False  # set when a stop request ended run() early (a checkpoint was saved)
        a = config.async_rl
        self.old_policy = OldPolicy(a, a.max_staleness if a.enabled else 0)
        self.last_token_staleness: np.ndarray | None = None

    # ---------------------------------------------------------------- rollouts

    def sampling(self, seed: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=seed)

    async def rollout(self, tasks: list[dict], step: int, first_group: int = 0) -> list[Trajectory]:
        """G trajectories per task, all in flight at once; group ids from ``first_group``."""
        G = self.config.algorithm.group_size
        groups = await asyncio.gather(
            *[
                self.loop.run_group(self.env_factory, task, G, self.sampling(seed=hash((self.config.seed, step, i))
                                                                              & 0x7FFFFFFF), group_id=i)
                for i, task in enumerate(tasks, start=first_group)
            ]
        )
        return [t for g in groups for t in g]

    def exchange(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Multi-host: every host gets every host's trajectories (group ids made global)."""
        offset = jax.process_index() * (self.config.data.prompts_per_step // jax.process_count())
        for t in trajectories:
            t.group_id += offset
        return [t for host in gather_objects(trajectories) for t in host]

    async def collect(self, step: int, tasks: list[dict] | None = None) -> tuple[list[Trajectory], dict[str, float]]:
        """This step's trajectories (of ``tasks``, default: the next prompts); with DAPO dynamic
        sampling, only informative groups.

        Dynamic sampling (Yu et al. 2025, DAPO sec. 3.2) drops groups whose rewards are all
        equal (zero advantage, no gradient) and draws more prompts, at most
        ``max_sampling_rounds`` times, until ``prompts_per_step`` groups remain. If every
        round comes back uninformative the step trains on what it has (counted).
        """
        a, P = self.config.algorithm, self.config.data.prompts_per_step
        trajectories = await self.rollout(next(self.data) if tasks is None else tasks, step)
        if not a.dynamic_sampling:
            return trajectories, {}
        groups = group_trajectories(trajectories)
        drawn = len(groups)
        kept = [g for g in groups if informative(g)]
        rounds = 0
        while len(kept) < P and rounds < a.max_sampling_rounds:
            rounds += 1
            more = group_trajectories(await self.rollout(next(self.data), step, first_group=rounds * P))
            drawn += len(more)
            kept += [g for g in more if informative(g)]
        stats = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/kept_groups": float(min(len(kept), P)),
                 "dynamic_sampling/dropped_groups": float(drawn - len(kept)),
                 "dynamic_sampling/fell_back": float(not kept)}
        if not kept:
            logger.warning("dynamic sampling: no informative group after %d extra rounds; training on the last draw",
                           rounds)
            return trajectories, stats
        out = []
        for new_id, group in enumerate(kept[:P]):
            for t in group:
                t.group_id = new_id
                out.append(t)
        return out, stats

    async def evaluate(self, tasks: list[dict], *, label: str) -> dict[str, float]:
        e = self.config.eval
        tasks = tasks[: e.num_tasks] if e.num_tasks else tasks
        k = e.samples_per_task
        sampling = SamplingParams(temperature=e.temperature, seed=1234)
        groups = await asyncio.gather(
            *[self.loop.run_group(self.env_factory, task, k, sampling, group_id=i) for i, task in enumerate(tasks)]
        )
        results = {
            str(i): [
                {
                    # An episode cut short or crashed never answered: incorrect, whatever its reward.
                    "correct": bool(t.reward_components.get("correct", t.reward > 0))
                    and not t.truncated and t.finish_reason != "env_error",
                    "tool_calls": t.tool_stats.calls,
                    "num_sampled_tokens": t.num_sampled_tokens,
                    "truncated": t.truncated,
                    "env_error": t.finish_reason == "env_error",
                }
                for t in g
            ]
            for i, g in enumerate(groups)
        }
        ks = sorted({1, k})
        summary = summarize(results, ks=ks)
        logger.info("eval %s: %s", label, json.dumps({k_: round(v, 4) for k_, v in summary.items()}))
        return summary

    # ---------------------------------------------------------------- updates

    def _put(self, value) -> jax.Array:
        """A host array (identical on every host) onto the training mesh."""
        value = np.asarray(value)
        return jnp.asarray(value) if self.mesh is None else put_global(value, self.mesh)

    def _logprobs(self, params, arrays: dict, micro_rows: int, graphdef=None) -> np.ndarray:
        """Tempered logprobs [R, T] of ``arrays['targets']``, in micro-batches, as numpy."""
        rows = arrays["input_ids"].shape[0]
        parts = []
        for start in range(0, rows, micro_rows):
            part = {k: self._put(np.asarray(v[start : start + micro_rows])) for k, v in arrays.items()}
            parts.append(to_host(self._logprob_fn(graphdef or self.graphdef, params, part)))
        return np.concatenate(parts, axis=0)

    async def judge_episodes(self, trajectories: list[Trajectory], step: int) -> tuple[list[Verdict], dict]:
        """PRM judge after the episodes: bridge thoughts, optional PRM reward, metrics."""
        h = self.config.hybrid
        verdicts = await self.judge(trajectories)
        if h.prm_weight > 0:
            apply_prm_reward(trajectories, verdicts, h.prm_weight)
        malformed = [v for v in verdicts if v.status in ("malformed", "error")]
        if malformed:
            logger.info("judge: %d of %d answers malformed or failed (no hint), e.g. %r",
                        len(malformed), len(verdicts), malformed[0].raw[:200])
        hinted = [(t, v) for t, v in zip(trajectories, verdicts) if v.hint is not None]
        if hinted and h.sample_hints and step % max(self.config.logging.log_every, 1) == 0:
            self.writer.write_text(step + 1, {
                f"hint_{i}": f"{v.hint}\n\n---\n{self.tokenizer.decode(t.token_ids.tolist())}"
                for i, (t, v) in enumerate(hinted[: h.sample_hints])
            })
        return verdicts, judge_metrics(verdicts)

    def _teacher_advantages(self, trajectories, verdicts, batch, old_logprobs, micro_rows):
        """OPD / hybrid advantages [R, T] from the teacher's logprobs (seeds/000 sec. 4.5)."""
        h = self.config.hybrid
        hints = [v.hint for v in verdicts] if verdicts is not None else None
        contexts = hindsight_contexts(trajectories, hints, self.tokenizer, mode=h.mode,
                                      placement=h.hint_placement, hint_format=h.hint_format)
        graphdef, params = self.teacher
        teacher_logp, has_teacher = teacher_logprobs(
            lambda arrays: self._logprobs(params, arrays, micro_rows, graphdef=graphdef),
            trajectories, contexts, batch.shape, row_multiple=micro_rows, pad_token_id=self.tokenizer.pad_token_id,
        )
        adv, metrics = teacher_advantages(h.mode, batch.advantages, teacher_logp, np.asarray(old_logprobs),
                                          batch.loss_mask, has_teacher, lam=h.lam)
        metrics["opd/teacher_fraction"] = float(has_teacher[: len(trajectories)].mean())
        return jnp.asarray(adv), metrics

    def _update_fn(self, rows: int, micro: int):
        key = (rows, micro)
        if key not in self._update_fns:
            self._update_fns[key] = jax.jit(
                functools.partial(
                    update_step,
                    graphdef=self.graphdef,
                    optimizer=self.optimizer,
                    settings=self.settings,
                    num_micro_batches=micro,
                    num_sequences=None,
                ),
                donate_argnums=(0,),
            )
        return self._update_fns[key]

    def train_on(self, trajectories: list[Trajectory], step: int,
                 verdicts: list[Verdict] | None = None) -> dict[str, float]:
        """Build the batch from finished trajectories and run the jitted updates.

        With ``config.hybrid.mode`` set, the advantages mix in the teacher's signal
        (judge ``verdicts`` carry the bridge thoughts of the hindsight teacher).
        """
        a = self.config.algorithm
        records = [trajectory_record(t) for t in trajectories]
        rows_needed = a.minibatches * max(a.micro_batch_size, 1)
        if a.dynamic_sampling:
            # A step may keep fewer groups: pad to the full row count so the update compiles once.
            rows_needed = self.config.data.prompts_per_step * a.group_size
        batch = build_batch(records, row_multiple=rows_needed, pad_token_id=self.tokenizer.pad_token_id)
        if not batch.loss_mask.any():
            return self._empty_step(step, trajectories)
        rewards = np.asarray([t.reward for t in trajectories], np.float32)
        group_ids = np.asarray([t.group_id for t in trajectories], np.int32)
        trained = np.asarray([not t.masked for t in trajectories], bool)
        batch = batch.replace(advantages=compute_advantages(self.config, batch, rewards, group_ids, trained))
        arrays = batch_arrays(batch, device=False)
        rows = batch.shape[0]
        per_minibatch = rows // a.minibatches
        micro_rows = a.micro_batch_size or per_minibatch
        forward_inputs = {k: arrays[k] for k in ("input_ids", "positions", "segment_ids", "targets")}
        arrays["old_logprobs"] = self.old_policy.logprobs(
            self._logprobs, self.state.params, self.version, forward_inputs, batch.params_versions,
            batch.loss_mask, micro_rows)
        if self.settings.kl_coef > 0:
            arrays["ref_logprobs"] = self._logprobs(self.reference_params, forward_inputs, micro_rows)
        teacher_metrics: dict[str, float] = {}
        if self.config.hybrid.mode != "none":
            advantages, teacher_metrics = self._teacher_advantages(
                trajectories, verdicts, batch, arrays["old_logprobs"], micro_rows)
            arrays["advantages"] = np.asarray(advantages)
        max_response = int(batch.loss_mask.sum(axis=1).max()) or 1
        rng = np.random.default_rng([self.config.seed, step])
        collected: list[dict] = []
        empty_minibatches = 0
        for _ in range(a.ppo_epochs):
            order = rng.permutation(rows)
            for mb in range(a.minibatches):
                idx = order[mb * per_minibatch : (mb + 1) * per_minibatch]
                if not arrays["loss_mask"][idx].any():
                    # only masked / padding rows: an optimizer step on zero gradients would still move
                    # the params (Adam's momentum, weight decay)
                    empty_minibatches += 1
                    continue
                minibatch = {k: self._put(v[idx]) for k, v in arrays.items()}
                normalizer = self._put(global_normalizer(
                    arrays["loss_mask"][idx], a.aggregation,
                    max_response_length=int(a.loss_normalizer) or max_response,
                ))
                fn = self._update_fn(per_minibatch, per_minibatch // micro_rows)
                self.state, metrics = fn(self.state, minibatch, normalizer)
                collected.append(metrics)
        collected = [{k: float(to_host(v)) for k, v in m.items()} for m in collected]
        out = {k: float(np.mean([m[k] for m in collected])) for k in collected[0]}
        out["skipped_updates"] = float(sum(m["skipped"] for m in collected) + empty_minibatches)
        out["learning_rate"] = float(self.schedule(int(to_host(self.state.step))))
        out["train_tokens"] = float(batch.loss_mask.sum())
        mismatch = np.abs(np.asarray(arrays["old_logprobs"]) - batch.rollout_logprobs) * batch.loss_mask
        out["logprob_gap_train_infer"] = float(mismatch.sum() / max(batch.loss_mask.sum(), 1))
        # The same gap over the trajectories sampled entirely by one older version: ~0 when the
        # old logprobs are exact (old_logprobs='snapshot'), the staleness otherwise.
        stale = np.asarray([_single_stale_version(v, m, self.version) for v, m in
                            zip(batch.params_versions, batch.loss_mask)], bool)
        if stale.any():
            out["old_policy/gap_stale_rows"] = float(mismatch[stale].sum() / batch.loss_mask[stale].sum())
        out.update(teacher_metrics)
        masked = [out[k] for k in ("mis_masked_frac", "icepop_masked_frac") if k in out]
        out.update(self.old_policy.after_update(self.state.params, step, 1.0 - masked[0] if masked else None))
        version_stats, self.last_token_staleness = staleness_stats(
            batch.params_versions, batch.loss_mask, self.version, len(records))
        out.update(version_stats)
        return out

    def _empty_step(self, step: int, trajectories: list[Trajectory]) -> dict[str, float]:
        """No episode trains a token (all masked, e.g. every one ran out of context): no update.

        An optimizer step on zero gradients would still move the params (Adam's momentum,
        weight decay), so the step is skipped outright and counted.
        """
        a = self.config.algorithm
        logger.warning("step %d: all %d episodes are masked (truncated or environment errors); no update",
                       step, len(trajectories))
        self.last_token_staleness = None
        return {"skipped_updates": float(a.ppo_epochs * a.minibatches), "train/empty_batch": 1.0,
                "train_tokens": 0.0, "learning_rate": float(self.schedule(int(to_host(self.state.step))))}

    async def sync_weights(self) -> None:
        """Push the new params to the engine as a new version.

        The engine re-lays them out into its own buffers (``Engine.load_params`` never
        aliases the caller's arrays), so the next update may donate the trainer's state
        while decoding goes on with these (async rollouts).
        """
        self.version += 1
        await self.driver.update_params(self.engine_params(self.state.params), self.version)

    # ---------------------------------------------------------------- the loop

    async def run(self, start_step: int = 0) -> None:
        """RL steps ``start_step .. total_steps``: synchronous, or the async pipeline (``async_rl``)."""
        self.check_roles()
        if self.config.async_rl.enabled:
            from agentrl_jax.train.pipeline import AsyncPipeline

            await AsyncPipeline(self).run(start_step)
            return
        a = self.config.async_rl
        for step in range(start_step, self.config.total_steps):
            t0 = time.perf_counter()
            if a.offload_optimizer:
                self.state = self._place_optimizer_state("pinned_host")
            trajectories, sampling_stats = await self.collect(step)
            if is_multihost():
                trajectories = self.exchange(trajectories)
            t_rollout = time.perf_counter() - t0
            verdicts, judge_stats = None, {}
            if self.judge is not None:
                verdicts, judge_stats = await self.judge_episodes(trajectories, step)
            if a.release_kv_cache:
                self.driver.release_cache()
            if a.offload_optimizer:
                self.state = self._place_optimizer_state(None)
            t1 = time.perf_counter()
            metrics = self.train_on(trajectories, step, verdicts)
            jax.block_until_ready(self.state.params)
            t_update = time.perf_counter() - t1
            t2 = time.perf_counter()
            await self.sync_weights()
            t_sync = time.perf_counter() - t2
            metrics.update(sampling_stats)
            metrics.update(judge_stats)
            metrics["time/judge"] = t1 - t0 - t_rollout
            metrics.update({"time/rollout": t_rollout, "time/update": t_update, "time/sync": t_sync,
                            "time/step": time.perf_counter() - t0})
            metrics["throughput/sampled_tokens_per_s"] = (
                sum(t.num_sampled_tokens for t in trajectories) / max(t_rollout, 1e-9))
            if await self.end_step(step, trajectories, metrics):
                return

    def check_roles(self) -> None:
        """The models the config asks for are attached (``train()`` does it; a hand-built trainer
        must too): nothing the config asks for is silently skipped, nothing fails mid-run."""
        c = self.config
        missing = [(key, role) for key, role, needed, present in (
            ("algorithm.kl_coef", "reference_params", c.algorithm.kl_coef > 0, self.reference_params is not None),
            ("hybrid.mode", "teacher", c.hybrid.mode != "none", self.teacher is not None),
            ("hybrid.judge", "judge", c.hybrid.judge != "none", self.judge is not None),
        ) if needed and not present]
        if missing:
            raise ConfigError("; ".join(f"{key} needs RLTrainer.{role}, which is not set" for key, role in missing)
                              + " (train() attaches them; a trainer built by hand must set them before run())")

    async def end_step(self, step: int, trajectories: list[Trajectory], metrics: dict[str, float],
                       data_state: Any = None) -> bool:
        """Metrics, periodic evaluation and checkpoint after ``step``; True when preempted (saved).

        ``data_state``: the data iterator's position to checkpoint (default: its current one;
        the async pipeline passes the position before the prompts not trained yet).
        """
        c = self.config
        metrics.update(rollout_metrics(trajectories))
        metrics["throughput/trajectories_per_s"] = len(trajectories) / max(metrics.get("time/step", 0.0), 1e-9)
        if step % max(c.logging.log_every, 1) == 0:
            self.writer.write(step + 1, metrics)
            if c.async_rl.enabled and self.last_token_staleness is not None and len(self.last_token_staleness):
                self.writer.write_histograms(step + 1, {"async/token_staleness": self.last_token_staleness})
            if c.logging.sample_trajectories:
                self.writer.write_text(step + 1, {
                    f"sample_{i}": self.tokenizer.decode(t.token_ids.tolist())
                    for i, t in enumerate(trajectories[: c.logging.sample_trajectories])
                })
        if c.eval.every_steps and (step + 1) % c.eval.every_steps == 0 and step + 1 < c.total_steps:
            ev = await self.evaluate(self.eval_tasks, label=f"step {step + 1}")
            self.writer.write(step + 1, {f"eval/{k}": v for k, v in ev.items()})
        # The last step is saved once, by train() after the final evaluation (with the results).
        if self.checkpointer is not None and step + 1 < c.total_steps:
            saved_every = c.checkpoint.every_steps and (step + 1) % c.checkpoint.every_steps == 0
            stop = self.checkpointer.should_stop()
            if saved_every or stop:
                self.save(step + 1, data_state=data_state)
            if stop:
                logger.warning("preemption requested: saved step %d, stopping", step + 1)
                self.preempted = True
                return True
        return False

    def _place_optimizer_state(self, memory_kind: str | None):
        """The train state with its optimizer state moved to ``memory_kind`` (None: device memory)."""

        def move(x):
            sharding = getattr(x, "sharding", None)
            if not isinstance(sharding, jax.sharding.NamedSharding):
                return x
            kind = memory_kind or next(iter(sharding.device_set)).default_memory().kind
            return x if sharding.memory_kind == kind else jax.device_put(x, sharding.with_memory_kind(kind))

        return self.state.replace(opt_state=jax.tree.map(move, self.state.opt_state))

    def save(self, step: int, extra: dict | None = None, data_state: Any = None) -> None:
        if self.checkpointer is None:
            return
        data_state = self.data.get_state() if data_state is None else data_state
        self.checkpointer.save(step, self.state, data_state=data_state, config_dict=to_dict(self.config),
                               extra={"version": self.version, **self.checkpoint_extra, **(extra or {})},
                               force=True)


def _single_stale_version(versions: np.ndarray, mask: np.ndarray, current: int) -> bool:
    """A row whose sampled tokens all come from one params version older than ``current``."""
    sampled = versions[mask > 0]
    return bool(len(sampled)) and sampled.min() == sampled.max() < current
