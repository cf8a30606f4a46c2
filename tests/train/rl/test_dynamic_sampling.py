"""DAPO dynamic sampling in the collect stage: scripted rewards, the real selection logic."""

import asyncio

import numpy as np

from agentrl_jax.config import Config, apply_overrides
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.train.rl.collect import collect


def _traj(group_id, reward):
    ids = np.array([1, 2, 3], np.int32)
    return Trajectory(prompt_token_ids=ids[:1], token_ids=ids, loss_mask=np.array([0, 1, 1], np.int8),
                      rollout_logprobs=np.zeros(3, np.float32), params_versions=np.zeros(3, np.int32),
                      reward=reward, group_id=group_id)


def _collect(config, draws):
    """`draws`: per call of rollout, the rewards of each group (list of lists)."""
    calls = iter(draws)

    async def rollout(tasks, first_group=0):
        groups = next(calls)
        return [_traj(first_group + i, r) for i, rewards in enumerate(groups) for r in rewards]

    return asyncio.run(collect(config, rollout, ["task"], lambda: ["task"]))


def test_keeps_informative_groups_and_draws_more():
    config = apply_overrides(Config(), ["data.prompts_per_step=2", "algorithm.group_size=2",
                                        "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"])
    draws = [[[1, 1], [0, 1]], [[0, 0], [0, 0]], [[1, 0], [1, 0]]]
    trajs, stats = _collect(config, draws)
    assert sorted({t.group_id for t in trajs}) == [0, 1]  # renumbered, exactly P groups
    assert all(len({t.reward for t in trajs if t.group_id == g}) == 2 for g in (0, 1))
    assert stats["dynamic_sampling/rounds"] == 2
    assert stats["dynamic_sampling/dropped_groups"] == 3


def test_off_returns_the_draw_unchanged():
    config = apply_overrides(Config(), ["data.prompts_per_step=2", "algorithm.group_size=2"])
    trajs, stats = _collect(config, [[[1, 1], [0, 0]]])
    assert len(trajs) == 4 and stats == {}


def test_all_uninformative_falls_back_and_counts():
    config = apply_overrides(Config(), ["data.prompts_per_step=1", "algorithm.group_size=2",
                                        "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=1"])
    trajs, stats = _collect(config, [[[1, 1]], [[0, 0]]])
    assert len(trajs) == 2 and stats["dynamic_sampling/fell_back"] == 1.0
