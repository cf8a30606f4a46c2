"""The ``collect`` stage and the evaluation: episodes through the agent loop, on the policy
the rollout driver holds.

``collect`` draws G trajectories per prompt, all in flight at once (continuous batching,
tool calls in the sandbox pool), with DAPO dynamic sampling when configured; the judge
(``judge``) reads the finished episodes before the batch is built.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import jax
import numpy as np

from agentrl_jax.config import Config, EvalConfig
from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.envs.base import Environment, Trajectory
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.train.episodes import group_trajectories, informative
from agentrl_jax.train.evaluation import summarize
from agentrl_jax.train.guidance.hindsight import (
    Judge,
    Verdict,
    apply_prm_reward,
    judge_metrics,
)
from agentrl_jax.train.multihost import gather_objects

logger = logging.getLogger(__name__)

# rollout(tasks, first_group) -> G trajectories per task, group ids from first_group
Rollout = Callable[[list[dict], int], Awaitable[list[Trajectory]]]


def rollout_fn(config: Config, agent_loop: AgentLoop, env_factory: Callable[[], Environment], step: int) -> Rollout:
    """Step ``step``'s rollouts: G trajectories per task; sampling seeds from (seed, step, group).

    The group in the seed is the task's place in the global batch (this host's i-th task is
    global task ``i * hosts + host``, as ``BatchIterator`` deals them), so every host count
    samples the same trajectories for a step.
    """
    r, G = config.rollout, config.algorithm.group_size
    hosts, host = jax.process_count(), jax.process_index()

    async def rollout(tasks: list[dict], first_group: int = 0) -> list[Trajectory]:
        groups = await asyncio.gather(*[
            agent_loop.run_group(env_factory, task, G, SamplingParams(
                temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                seed=hash((config.seed, step, i * hosts + host)) & 0x7FFFFFFF), group_id=i)
            for i, task in enumerate(tasks, start=first_group)
        ])
        return [t for g in groups for t in g]

    return rollout


async def collect(config: Config, rollout: Rollout, tasks: list[dict],
                  draw: Callable[[], list[dict]]) -> tuple[list[Trajectory], dict[str, float]]:
    """The trajectories of ``tasks``; with DAPO dynamic sampling, only informative groups.

    Dynamic sampling (Yu et al. 2025, DAPO sec. 3.2) drops groups whose rewards are all
    equal (zero advantage, no gradient) and ``draw``s more prompts, at most
    ``max_sampling_rounds`` times, until ``prompts_per_step`` groups remain. If every
    round comes back uninformative the step trains on what it has (counted).
    """
    algorithm, P = config.algorithm, config.data.prompts_per_step
    trajectories = await rollout(tasks, 0)
    if not algorithm.dynamic_sampling:
        return trajectories, {}
    groups = group_trajectories(trajectories)
    drawn = len(groups)
    kept = [g for g in groups if informative(g)]
    rounds = 0
    while len(kept) < P and rounds < algorithm.max_sampling_rounds:
        rounds += 1
        more = group_trajectories(await rollout(draw(), rounds * P))
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


def exchange(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Multi-host: every host gets every host's trajectories, in global-batch order.

    Group ids become the tasks' places in the global batch (``rollout_fn``), and the
    trajectories are ordered by them: the batch every host builds is the one a single process
    builds from the same tasks, row for row.
    """
    hosts, host = jax.process_count(), jax.process_index()
    for t in trajectories:
        t.group_id = t.group_id * hosts + host
    gathered = [t for part in gather_objects(trajectories) for t in part]
    batch = sorted(gathered, key=lambda t: t.group_id)  # stable: a group's samples keep their order
    digests = gather_objects(batch_digest(batch))
    if len(set(digests)) > 1:  # SPMD over differing host values would train silently on garbage
        raise RuntimeError(f"the hosts built different batches (digests by process: {digests})")
    logger.info("batch digest %s (%d trajectories, the same on all %d hosts)", digests[0], len(batch), hosts)
    return batch


def batch_digest(trajectories: list[Trajectory]) -> str:
    """A hash of what the update reads from a batch: group ids, tokens, masks, versions, rewards."""
    h = hashlib.sha256()
    for t in trajectories:
        h.update(np.asarray([t.group_id, t.masked], np.int64).tobytes())
        h.update(np.float64(t.reward).tobytes())
        for array in (t.token_ids, t.loss_mask, t.rollout_logprobs, t.params_versions):
            h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:16]


async def judge(config: Config, prm_judge: Judge, writer: Any, tokenizer: Any, trajectories: list[Trajectory],
                step: int, policy: tuple[Any, int]) -> tuple[list[Verdict], dict[str, float]]:
    """PRM judge after the episodes: bridge thoughts, optional PRM reward, metrics; a few hints
    with their episodes go to ``writer`` (``hybrid.sample_hints``).

    ``policy``: the (params, version) the driver holds, handed back by a judge that decodes
    with its own params.
    """
    h = config.hybrid
    verdicts = await prm_judge(trajectories, policy)
    if h.prm_weight > 0:
        apply_prm_reward(trajectories, verdicts, h.prm_weight)
    leaked = [v for v in verdicts if v.status == "leaked"]
    if leaked:
        logger.info("judge: %d of %d hints stated the answer (refused by the leakage guard), e.g. %r",
                    len(leaked), len(verdicts), leaked[0].raw[:200])
    malformed = [v for v in verdicts if v.status in ("malformed", "error")]
    if malformed:
        logger.info("judge: %d of %d answers malformed or failed (no hint), e.g. %r",
                    len(malformed), len(verdicts), malformed[0].raw[:200])
    hinted = [(t, v) for t, v in zip(trajectories, verdicts) if v.hint is not None]
    if hinted and h.sample_hints and step % max(config.logging.log_every, 1) == 0:
        writer.write_text(step + 1, {
            f"hint_{i}": f"{v.hint}\n\n---\n{tokenizer.decode(t.token_ids.tolist())}"
            for i, (t, v) in enumerate(hinted[: h.sample_hints])
        })
    return verdicts, judge_metrics(verdicts)


#: The evaluation's sampling seeds derive from this and the task's index, never from the
#: run's seed or step: see ``eval_seed``.
EVAL_SEED = 1234


def eval_seed(task_index: int) -> int:
    """The sampling seed of held-out task ``task_index`` (its k samples: ``run_group``'s streams).

    Each task has its own seed, so two tasks (even with the same prompt) draw independent
    samples: one shared seed made sample j of every task use one random stream, which
    correlates the tasks' results and leaves fewer effective samples. The seed is the same at
    every evaluation of a run and in every run: the start and end evaluations (and two arms
    of an ablation) are paired on common random numbers, so their difference is the policy's,
    not the sampler's.
    """
    # A tuple of ints hashes the same in every process (PYTHONHASHSEED randomizes only str and
    # bytes hashes) and on every CPython >= 3.8; the ablation's evaluations depend on these values.
    return hash((EVAL_SEED, task_index)) & 0x7FFFFFFF


async def evaluate(eval_config: EvalConfig, agent_loop: AgentLoop, env_factory: Callable[[], Environment],
                   tasks: list[dict], *, label: str) -> dict[str, float]:
    """pass@k / avg@k and tool use of the policy the driver holds, on held-out ``tasks``."""
    e = eval_config
    tasks = tasks[: e.num_tasks] if e.num_tasks else tasks
    k = e.samples_per_task
    groups = await asyncio.gather(*[
        agent_loop.run_group(env_factory, task, k,
                                SamplingParams(temperature=e.temperature, seed=eval_seed(i)), group_id=i)
        for i, task in enumerate(tasks)
    ])
    results = {
        str(i): [
            {
                # An episode cut short or crashed never answered: incorrect, whatever its reward.
                "correct": bool(t.reward_components.get("correct", t.reward > 0))
                and not t.truncated and t.finish_reason != "env_error",
                "tool_calls": t.tool_stats.calls,
                "tool_errors": t.tool_stats.errors + t.tool_stats.timeouts,
                "num_sampled_tokens": t.num_sampled_tokens,
                "truncated": t.truncated,
                "env_error": t.finish_reason == "env_error",
            }
            for t in g
        ]
        for i, g in enumerate(groups)
    }
    summary = summarize(results, ks=sorted({1, k}))
    splits = sorted({str(t["split"]) for t in tasks if "split" in t})
    if len(splits) > 1:  # tasks that say which held-out split they belong to: scored per split too
        for name in splits:
            subset = {i: r for i, r in results.items() if str(tasks[int(i)].get("split")) == name}
            summary.update({f"{name}/{k_}": v for k_, v in summarize(subset, ks=sorted({1, k})).items()})
    logger.info("eval %s: %s", label, json.dumps({k_: round(v, 4) for k_, v in summary.items()}))
    return summary
