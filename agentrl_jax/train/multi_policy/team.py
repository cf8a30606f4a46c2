"""The team's episodes: the multi-actor environment of a run, collecting a step's episodes,
splitting them into each policy's trajectories, their metrics, and the held-out evaluation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.envs.multi_actor import (
    MultiActorEnvironment,
    MultiActorEpisode,
    MultiActorLoop,
)
from agentrl_jax.envs.retool import ReToolEnv
from agentrl_jax.envs.solver_checker import (
    CHECKER,
    SOLVER,
    SolverCheckerEnv,
    balanced_verdict_weights,
    checker_demonstrations,
    first_answer_part,
    with_second_tries,
)
from agentrl_jax.rollout.sampling import SamplingParams


def team_env_factory(config: Config, pool: Any, verifier: Any,
                     count_tokens: Callable[[str], int]) -> Callable[[], MultiActorEnvironment]:
    """A zero-argument constructor of the run's multi-actor episode (``multi_policy.episode``):
    the solver plays the run's own environment (``environment.*``: arithmetic, retool, ...,
    as a single-policy run of the same Config would), which must be a ReTool-style episode
    (its inline transcript is what the checker reads)."""
    mp = config.multi_policy
    solver_env = config.environment.make_env_factory(config, pool=pool, verifier=verifier, count_tokens=count_tokens)
    kind = type(solver_env())
    if not issubclass(kind, ReToolEnv):
        raise ConfigError(f"environment: the solver-checker episode needs a ReTool-style solver (a ReToolEnv, inline "
                          f"layout), but environment.name={config.environment.name!r} with layout "
                          f"{config.environment.layout!r} plays {kind.__name__}")
    return lambda: SolverCheckerEnv(solver_env(), retries=mp.critique_retries, role_reward=mp.role_reward,
                                    shared_view=mp.shared_view, checker_team_reward=mp.checker_team_reward,
                                    checker_tool_calls=mp.checker_tool_calls)


def demonstrations(config: Config, tasks: list[dict]) -> dict[str, list[list[dict[str, str]]]]:
    """SFT conversations per actor: the environment's solver demonstrations (a
    ``multi_policy.solver_second_tries`` share of the wrong ones going on with the episode's
    rejection note and a second try that calls the interpreter), and the checker's verdicts on
    their first-answer parts (``envs.solver_checker.checker_demonstrations``): drawn from the
    run's seed independently of the answers, or with ``multi_policy.checker_cold_start='labeled'``
    the right ones, on a ``multi_policy.checker_miscopied`` share of them with the final answer
    miscopied; with ``multi_policy.checker_tool_calls`` each verdict after a program that prints
    the task's result (the arithmetic demonstration's tool turns)."""
    solver = config.environment.make_demonstrations(config, tasks)
    if solver is None:
        raise ConfigError(f"sft.steps: environment.name={config.environment.name!r} writes no demonstrations for "
                          "the solver-checker episode; set sft.steps=0")
    mp = config.multi_policy
    check_turns = None
    if mp.checker_tool_calls or mp.solver_second_tries:
        from agentrl_jax.envs.arithmetic import ArithmeticEnv, demonstration  # the only writer (a config check)

        fenced = ArithmeticEnv.config_from(config).fenced
    if mp.checker_tool_calls:  # a program printing the task's result, its output, then the verdict
        check_turns = lambda task: demonstration(task, "tool", None, fenced=fenced)[:2]  # noqa: E731
    checker = checker_demonstrations(solver, tasks[:len(solver)], seed=config.seed,
                                     labeled=mp.checker_cold_start == "labeled", check_turns=check_turns,
                                     miscopied=mp.checker_miscopied)
    if mp.solver_second_tries:
        rng = np.random.default_rng([config.seed, 42])
        solver = with_second_tries(solver, tasks[:len(solver)],
                                   lambda task: demonstration(task, "tool", rng, fenced=fenced),
                                   fraction=mp.solver_second_tries, seed=config.seed)
    return {SOLVER: solver, CHECKER: checker}


def scratch_corpus(config: Config, demos: Mapping[str, list[list[dict[str, str]]]],
                   tasks: Sequence[dict]) -> list[str]:
    """The texts a scratch tokenizer is trained on: what a single-policy run of the same Config
    trains its own on (the first-answer parts of the solver's demonstrations with ``sft.steps``,
    which are the environment's demonstrations, else the questions), so that a team and the
    solver trained alone start from one tokenizer and one initial model; the checker's prompts
    and the solver's rejection notes are read in that token space."""
    conversations = [first_answer_part(c) for c in demos.get(SOLVER, [])] if config.sft.steps else []
    return [m["content"] for conv in conversations for m in conv] or [str(t["question"]) for t in tasks]


def weigh_verdicts(config: Config, episodes: Sequence[MultiActorEpisode]) -> None:
    """``multi_policy.checker_reward='balanced'``: each checker row's role reward for a right
    verdict times its class's weight among the step's scored episodes
    (``envs.solver_checker.balanced_verdict_weights``); the episodes' own rewards use weight 1."""
    mp = config.multi_policy
    if mp.checker_reward != "balanced":
        return
    judged = [e for e in episodes if CHECKER in e.trajectories and not e.result.masked]
    weights = balanced_verdict_weights([bool(e.result.metrics["team/first_correct"]) for e in judged])
    for episode, weight in zip(judged, weights):
        row = episode.trajectories[CHECKER]
        components = row.reward_components
        team = components["team"] * mp.checker_team_reward
        row.reward = team + mp.role_reward * float(weight) * components["verdict"]
        components["verdict_weight"] = float(weight)


async def collect_team(config: Config, loop: MultiActorLoop, env_factory: Callable[[], MultiActorEnvironment],
                       tasks: Sequence[dict], step: int, *, num_samples: int | None = None,
                       temperature: float | None = None) -> list[MultiActorEpisode]:
    """``num_samples`` (default ``algorithm.group_size``) episodes per task, all in flight at
    once; sampling seeds from (seed, step, task), as the single-policy collect draws them."""
    r = config.rollout
    groups = await asyncio.gather(*[
        loop.run_group(env_factory, task, num_samples or config.algorithm.group_size, SamplingParams(
            temperature=r.temperature if temperature is None else temperature, top_k=r.top_k, top_p=r.top_p,
            seed=hash((config.seed, step, i)) & 0x7FFFFFFF), group_id=i)
        for i, task in enumerate(tasks)])
    return [episode for group in groups for episode in group]


def policy_trajectories(episodes: Sequence[MultiActorEpisode], actors: Sequence[str]) -> list[Trajectory]:
    """The trajectories of a policy that plays ``actors``: one row per episode and actor that
    acted, in episode order (group ids are per actor: ``MultiActorLoop``)."""
    return [e.trajectories[a] for e in episodes for a in actors if a in e.trajectories]


def team_metrics(episodes: Sequence[MultiActorEpisode], prefix: str = "") -> dict[str, float]:
    """The episodes' own metrics averaged (checker accuracy, first / final correct, ...),
    ``critique/wrong_to_right_rate``: of the wrong first answers the checker rejected, the
    fraction whose second try was correct (absent when there were none), and
    ``checker/accepts_right`` and ``checker/rejects_wrong``: the share of right first answers
    accepted and of wrong ones rejected (each absent when its class did not occur), and
    ``checker/balanced_accuracy``: their mean (0.5 for a constant verdict; absent unless both
    occurred)."""
    results = [e.result for e in episodes if not e.result.masked]
    keys = sorted({k for r in results for k in r.metrics})
    out = {f"{prefix}{k}": float(np.mean([r.metrics.get(k, 0.0) for r in results])) for k in keys}
    sums = {k: sum(r.metrics.get(k, 0.0) for r in results) for k in ("critique/wrong_first", "critique/wrong_to_right")}
    if sums["critique/wrong_first"]:
        out[f"{prefix}critique/wrong_to_right_rate"] = sums["critique/wrong_to_right"] / sums["critique/wrong_first"]
    judged = [r.metrics for r in results if "checker/accuracy" in r.metrics]
    classes = [[m["checker/accuracy"] for m in judged if m["team/first_correct"] == c] for c in (0.0, 1.0)]
    for name, judged_right in (("rejects_wrong", classes[0]), ("accepts_right", classes[1])):
        if judged_right:  # the two halves of the balanced accuracy, each where its class occurred
            out[f"{prefix}checker/{name}"] = float(np.mean(judged_right))
    if all(classes):  # the mean over right and wrong first answers of the share judged right
        out[f"{prefix}checker/balanced_accuracy"] = float(np.mean([np.mean(c) for c in classes]))
    out[f"{prefix}team/masked_episodes"] = float(len(episodes) - len(results))
    return out


async def evaluate_team(config: Config, loop: MultiActorLoop, env_factory: Callable[[], MultiActorEnvironment],
                        tasks: Sequence[dict]) -> dict[str, float]:
    """Held-out: ``eval.samples_per_task`` episodes of the first ``eval.num_tasks`` tasks at
    ``eval.temperature``. ``team/final_correct`` is the team's pass@1; ``team/first_correct``
    the solver's own (its answer before any critique)."""
    e = config.eval
    episodes = await collect_team(config, loop, env_factory, list(tasks[:e.num_tasks]), -1,
                                  num_samples=e.samples_per_task, temperature=e.temperature)
    return {"num_tasks": float(min(e.num_tasks, len(tasks))), **team_metrics(episodes)}


def prefixed(name: str, metrics: Mapping[str, float]) -> dict[str, float]:
    return {f"{name}/{k}": v for k, v in metrics.items()}
