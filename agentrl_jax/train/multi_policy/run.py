"""``train_multi(config)``: several policies trained on one multi-actor episode (docs/multi_policy.md).

    tasks, the sandbox pool and verifier                        shared by the run
    per policy: its Config, devices (sub-mesh), model,          train/multi_policy/policy.py
                tokenizer (one object for policies whose tokenizers agree), engine
                + driver, train state, roles, step functions
    resume: every policy at the newest step all of them saved
    start evaluation (team pass@1, the solver's own, the checker's accuracy)
    each step:
      collect: G episodes per prompt; each turn decoded by    train/multi_policy/team.py, envs/multi_actor.py
               the acting policy's engine, tokens tagged by actor;
               the checker's role reward weighed over the step   team.weigh_verdicts
      split:   each policy's rows (its actors' tokens trained)  team.policy_trajectories
      train:   each policy's build batch / logprobs / update    train/rl/loop.py train_step
               (its own advantages, groups per actor), at once
               on disjoint sub-meshes or one after the other
      push:    each policy's new params to its own engine
      log, checkpoint every policy (same step, same data position)
    final evaluation; per-policy checkpoint and HF export; results.json

Rollouts are synchronous by default (every trained token sampled by the version it trains).
With ``async_rl.enabled`` and a policy's ``async_rl.max_staleness`` of 1 (run-wide, or its own
through its overrides), the next step's episodes are collected while that policy trains, on its
weights from before the update (one step off-policy; its new weights are pushed once that
collection is done, so the run stays deterministic). A policy whose bound is 0 trains first and
pushes before the next collection starts: each policy's staleness is bounded by its own
setting. Before an evaluation, a checkpoint and the last step nothing runs ahead, so a resumed
run repeats the uninterrupted one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.config.policies import policy_config
from agentrl_jax.envs.multi_actor import MultiActorLoop
from agentrl_jax.envs.solver_checker import SOLVER
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.rewards.verifier import MathVerifier
from agentrl_jax.train import lora, setup
from agentrl_jax.train.episodes import rollout_metrics
from agentrl_jax.train.metrics import MetricsWriter
from agentrl_jax.train.multi_policy.policy import (
    Policy,
    build_policy,
    checkpoint_dir,
    cold_start,
    finish_build,
    model_assets,
    restore,
)
from agentrl_jax.train.multi_policy.team import (
    collect_team,
    demonstrations,
    evaluate_team,
    policy_trajectories,
    prefixed,
    scratch_corpus,
    team_env_factory,
    team_metrics,
    weigh_verdicts,
)
from agentrl_jax.train.rl import stages
from agentrl_jax.train.rl.loop import train_step

logger = logging.getLogger(__name__)


def train_multi(config: Config, *, make_env: Any = None) -> dict[str, Any]:
    """Run the configured multi-policy job; returns the results dict also written to results.json.

    ``make_env``: refused (a custom single-actor environment; the run plays ``multi_policy.episode``).
    """
    if make_env is not None:
        raise ConfigError("train(make_env=...): a custom environment is for a single-policy run; "
                          "multi_policy.policies plays multi_policy.episode")
    return asyncio.run(train_multi_async(config))


async def train_multi_async(config: Config) -> dict[str, Any]:
    t_start = time.perf_counter()
    out = Path(config.output_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    train_tasks, eval_tasks, _ = setup.load_task_data(config)
    demos = demonstrations(config, train_tasks) if any(
        policy_config(config, spec).sft.steps for spec in config.multi_policy.policies) else {}
    assets = [model_assets(config, spec, scratch_corpus(config, demos, train_tasks))
              for spec in config.multi_policy.policies]
    tokenizers = policy_tokenizers(config, [(own, tokenizer_dir) for own, _, tokenizer_dir in assets])
    if not config.checkpoint.resume:
        _start_over(config, out)
    placement = config.multi_policy.placement(len(jax.devices()))
    policies = [build_policy(own, spec, devices, model_dir, tokenizers[spec.name], out=out)
                for (own, model_dir, _), spec, devices in zip(assets, config.multi_policy.policies, placement)]
    start_step = resume_step(config, policies)
    writer = MetricsWriter(out / "metrics", total_steps=config.total_steps,
                           purge_step=start_step + 1 if start_step else None)
    v = config.environment.verifier
    async with contextlib.AsyncExitStack() as stack:
        for policy in policies:
            await stack.enter_async_context(policy.driver)
        verifier = stack.enter_context(MathVerifier(num_workers=v.workers, timeout_s=v.timeout_s,
                                                    memory_mb=v.memory_mb))
        pool = await stack.enter_async_context(setup.make_sandbox(config))
        team = _Team(config, out, policies, tokenizers, writer, train_tasks, eval_tasks, demos)
        count_tokens = lambda s: len(team.loop.tokenizer(SOLVER).encode(s))  # noqa: E731  (the solver's tokens)
        results = await team.run(team_env_factory(config, pool, verifier, count_tokens=count_tokens), start_step)
    for policy in policies:
        policy.checkpointer.wait_until_finished()
        policy.checkpointer.close()
    writer.close()
    results["total_seconds"] = time.perf_counter() - t_start
    _write_outputs(config, out, policies, tokenizers, results)
    return results


def policy_tokenizers(config: Config, assets: list[tuple[Config, str]]) -> dict[str, Tokenizer]:
    """Each policy's tokenizer, by name, from (its Config, its tokenizer directory): policies
    whose vocabularies and chat templates are the same share one object. Different ones are
    fine while each actor has its own view (its turns are in its policy's tokens, what it reads
    of another's is text); with ``multi_policy.shared_view`` they are one error line."""
    out: dict[str, Tokenizer] = {}
    for spec, (own, directory) in zip(config.multi_policy.policies, assets, strict=True):
        tok = Tokenizer(directory, chat_template_kwargs=own.model.chat_template_kwargs)
        same = [t for t in out.values() if t.hf.get_vocab() == tok.hf.get_vocab()
                and t.hf.chat_template == tok.hf.chat_template and t.chat_template_kwargs == tok.chat_template_kwargs]
        if not same and out and config.multi_policy.shared_view:
            raise ConfigError(f"multi_policy.policies[{spec.name}]: its tokenizer differs from "
                              f"{next(iter(out))!r}'s, but multi_policy.shared_view=true writes every turn into one "
                              "view (one token space); give the policies one tokenizer or set shared_view=false")
        out[spec.name] = same[0] if same else tok
    return out


def resume_step(config: Config, policies: list[Policy]) -> int:
    """The step to resume from: the newest one every policy saved (0: start over)."""
    if not config.checkpoint.resume:
        return 0
    saved = [set(p.checkpointer.all_steps()) for p in policies]
    common = set.intersection(*saved) if saved else set()
    if not common and any(saved):
        raise ConfigError("checkpoint.resume: the policies have no checkpoint step in common ("
                          + ", ".join(f"{p.name}: {sorted(s)}" for p, s in zip(policies, saved))
                          + "); set checkpoint.resume=false to start over")
    step = max(common, default=0)
    if step > config.total_steps:
        raise ConfigError(f"total_steps: {config.total_steps} is below the step of the checkpoint to resume ({step})")
    return step


class _Team:
    """The run on built policies: resume, the evaluations, the steps, the checkpoints."""

    def __init__(self, config, out, policies, tokenizers, writer, train_tasks, eval_tasks, demos):
        self.config, self.out, self.policies, self.tokenizers, self.writer = config, out, policies, tokenizers, writer
        self.train_tasks, self.eval_tasks, self.demos = train_tasks, eval_tasks, demos
        self.actor_policy = {a: p.name for p in policies for a in p.spec.actors}
        r = config.rollout
        self.loop = MultiActorLoop({p.name: p.driver for p in policies}, self.actor_policy, tokenizers,
                                   max_new_tokens_per_turn=r.max_new_tokens_per_turn,
                                   max_total_tokens=r.max_sequence_length)
        self.concurrent = config.multi_policy.concurrent(len(jax.devices()))

    async def run(self, env_factory, start_step: int) -> dict[str, Any]:
        from agentrl_jax.data import BatchIterator

        c = self.config
        results: dict[str, Any] = {"config": c.name, "seed": c.seed, "schedule": "concurrent" if self.concurrent
                                   else "time_shared"}
        data = BatchIterator(self.train_tasks, batch_size=c.data.prompts_per_step, seed=c.data.shuffle_seed)
        if not start_step:
            for policy in (p for p in self.policies if p.config.sft.steps):
                await cold_start(policy, self.tokenizers[policy.name],
                                 [d for a in policy.spec.actors for d in self.demos.get(a, [])], self.out)
        for policy in self.policies:
            if start_step:
                restored = await restore(policy, start_step)
                data.set_state(restored.data_state)
                results.update(json.loads(restored.extra.get("results", "{}")))
            finish_build(policy, self.tokenizers[policy.name], start_step=start_step, train_tasks=self.train_tasks,
                         eval_tasks=self.eval_tasks, writer=self.writer)
        missing = sorted(set(env_factory().actors) - set(self.actor_policy))
        if missing:
            raise ConfigError(f"multi_policy.policies: no policy plays the episode's actors {missing}")
        for policy in self.policies:  # after its frozen models are placed, as the single-policy run
            warm = await setup.warm_up_rollout(policy.config, policy.driver, policy.mesh)
            if warm is not None:
                results.setdefault("rollout_warmup", {})[policy.name] = warm
        if not start_step:
            results["start"] = await evaluate_team(c, self.loop, env_factory, self.eval_tasks)
            self.writer.write(0, prefixed("eval", results["start"]))
        t0 = self.mark = time.perf_counter()
        pending = None  # the next step's episodes, collected while this step trains (async_rl)
        for step in range(start_step, c.total_steps):
            collected = await (pending or self.collect(env_factory, step, next(data)))
            evaluate = bool(c.eval.every_steps) and (step + 1) % c.eval.every_steps == 0 and step + 1 < c.total_steps
            save = step + 1 < c.total_steps and bool(c.checkpoint.every_steps) and (
                (step + 1) % c.checkpoint.every_steps == 0)
            # a policy that may lag trains while the next step's episodes are collected; at a boundary
            # (an evaluation, a checkpoint, the end) nothing is in flight
            ahead = any(map(self.lag, self.policies)) and step + 1 < c.total_steps and not (evaluate or save)
            pending = await self.step(step, collected, collect_next=(
                lambda step=step: self.collect(env_factory, step + 1, next(data))) if ahead else None)
            if evaluate:
                ev = await evaluate_team(c, self.loop, env_factory, self.eval_tasks)
                self.writer.write(step + 1, prefixed("eval", ev))
            if save:
                self.save(step + 1, data.get_state(), results)
            self.mark = time.perf_counter()  # the next step's time starts after them
        results["rl_seconds"] = time.perf_counter() - t0
        results["end"] = await evaluate_team(c, self.loop, env_factory, self.eval_tasks)
        self.writer.write(c.total_steps, prefixed("eval", results["end"]))
        if start_step < c.total_steps:
            self.save(c.total_steps, data.get_state(), results)
        return results

    def lag(self, policy: Policy) -> int:
        """The versions ``policy``'s trained tokens may lag its params: its own ``async_rl``."""
        own = policy.config.async_rl
        return own.max_staleness if own.enabled else 0

    async def collect(self, env_factory, step: int, tasks: list[dict]) -> tuple[list, float]:
        """The step's episodes (the checker's verdicts weighed) and the seconds they took."""
        t0 = time.perf_counter()
        episodes = await collect_team(self.config, self.loop, env_factory, tasks, step)
        weigh_verdicts(self.config, episodes)
        return episodes, time.perf_counter() - t0

    async def step(self, step: int, collected: tuple[list, float], collect_next=None) -> asyncio.Task | None:
        """Each policy's train step (at once, or one after the other) on the collected episodes,
        then its weights to its engine; returns the next step's collection when ``collect_next``
        starts it here.

        The policies whose bound is 0 train and push first; then the next collection starts
        (``collect_next``) while the others train, and their weights are pushed once it is done.
        """
        episodes, t_rollout = collected
        t0 = time.perf_counter()
        rows = {p.name: policy_trajectories(episodes, p.spec.actors) for p in self.policies}
        frozen = self.config.multi_policy.frozen_at(step)

        def train(policy: Policy):
            if policy.name in frozen:  # it acts, never learns: its state and engine stay as they are
                return policy.state, {}
            t = time.perf_counter()
            state, metrics, _ = train_step(policy.rl, policy.state, policy.version, step, rows[policy.name], None)
            return state, {**metrics, "time/update": time.perf_counter() - t}

        async def train_and_push(policies: list[Policy], before_push=None) -> None:
            if self.concurrent:
                done = await asyncio.gather(*(asyncio.to_thread(train, p) for p in policies))
            else:
                done = [await asyncio.to_thread(train, p) for p in policies]
            if before_push is not None:
                await asyncio.wait([before_push])  # the collection in flight keeps the weights it started with
            for policy, (state, policy_metrics) in zip(policies, done):
                trained[policy.name] = policy_metrics
                if policy.name not in frozen:
                    policy.state = state
                    policy.version = await stages.push_weights(policy.driver, lambda p: p, state.params,
                                                               policy.version)
                    policy.rl.old_policy.on_version(policy.version, state.params)

        trained: dict[str, dict[str, float]] = {}
        lagging = [p for p in self.policies if self.lag(p)] if collect_next is not None else []
        await train_and_push([p for p in self.policies if p not in lagging])
        pending = asyncio.ensure_future(collect_next()) if collect_next is not None else None
        try:
            await train_and_push(lagging, before_push=pending)
        except BaseException:
            if pending is not None:
                pending.cancel()
            raise
        now = time.perf_counter()
        metrics = team_metrics(episodes)
        for policy in self.policies:
            policy_metrics = trained[policy.name]
            if rows[policy.name]:  # rewards, lengths, ... of its own rows
                policy_metrics.update(rollout_metrics(rows[policy.name]))
            policy_metrics.update({f"rollout/engine/{k}": float(v) for k, v in policy.driver.stats().items()})
            metrics.update(prefixed(policy.name, policy_metrics))
        elapsed = now - self.mark  # since the previous step ended: its collection ran meanwhile when ahead
        metrics.update({"time/rollout": t_rollout, "time/train": now - t0, "time/step": elapsed,
                        "throughput/trajectories_per_s": len(episodes) / max(elapsed, 1e-9)})
        self.mark = now
        self.writer.write(step + 1, metrics)
        if self.config.logging.sample_trajectories:  # each actor's view of the first episodes of as many groups
            firsts = episodes[::self.config.algorithm.group_size][:self.config.logging.sample_trajectories]
            self.writer.write_text(step + 1, {f"{actor}/sample_{i}": self.loop.tokenizer(actor).decode(
                                                  t.token_ids.tolist())
                                              for i, e in enumerate(firsts) for actor, t in e.trajectories.items()})
        return pending

    def save(self, step: int, data_state, results: dict[str, Any]) -> None:
        for policy in self.policies:
            stages.save(policy.checkpointer, policy.config, policy.rl.roles, policy.state, policy.version, step,
                        data_state=data_state, extra={"results": json.dumps(results)})


def _start_over(config: Config, out: Path) -> None:
    """Without resume: what an earlier run left (metrics, checkpoints, exports, results) goes,
    so the outputs are this run's alone; a scratch model's assets stay (made from the seed)."""
    paths = [out / "metrics", out / "export", out / "results.json"]
    paths += [checkpoint_dir(spec, out) for spec in config.multi_policy.policies]
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
            logger.warning("starting over: removed %s of an earlier run (resume with checkpoint.resume=true)", path)
        elif path.exists():
            path.unlink()


def _write_outputs(config: Config, out: Path, policies: list[Policy], tokenizers: dict[str, Tokenizer],
                   results: dict[str, Any]) -> None:
    """Each policy's HF export (``checkpoint.export_hf``: ``export/<policy>``) and results.json."""
    if config.checkpoint.export_hf:
        for policy in policies:
            for directory in lora.export(policy.state.params, policy.model_config, out / "export" / policy.name,
                                         base_model=policy.config.model.path):
                tokenizers[policy.name].hf.save_pretrained(directory)
    if jax.process_index() == 0:
        (out / "results.json.tmp").write_text(json.dumps(results, indent=2))
        os.replace(out / "results.json.tmp", out / "results.json")
