"""How truncated and crashed episodes train.

Units on hand-built trajectories (advantages, loss normalizer, metrics, dynamic sampling),
and whole runs of the real trainer (tiny scratch model, real engine and driver on the fake
CPU devices) with an environment that answers some tasks and never answers others.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from agentrl_jax.config import Config, ConfigError, apply_overrides, load_config
from agentrl_jax.envs.base import Environment, StepResult, Trajectory
from agentrl_jax.losses import global_normalizer
from agentrl_jax.train.batch import build_batch
from agentrl_jax.train.episodes import (
    compute_advantages,
    informative,
    rollout_metrics,
    trajectory_record,
    truncation_rule,
)
from agentrl_jax.train.guidance.teacher import Teacher
from agentrl_jax.train.rl import Roles


def _traj(group_id, reward, *, sampled=2, finish="answer", masked=False):
    n = 1 + sampled
    return Trajectory(prompt_token_ids=np.array([1], np.int32), token_ids=np.arange(1, n + 1, dtype=np.int32),
                      loss_mask=np.array([0] + [1] * sampled, np.int8), rollout_logprobs=np.zeros(n, np.float32),
                      params_versions=np.zeros(n, np.int32), reward=reward, group_id=group_id,
                      finish_reason=finish, masked=masked)


def _grpo_reference(rewards):
    r = np.asarray(rewards, np.float64)
    if r.max() == r.min():
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=1) + 1e-6)


def _batch_and_advantages(config, trajectories, row_multiple=1):
    batch = build_batch([trajectory_record(t) for t in trajectories], row_multiple=row_multiple)
    rewards = np.asarray([t.reward for t in trajectories], np.float32)
    groups = np.asarray([t.group_id for t in trajectories], np.int32)
    trained = np.asarray([not t.masked for t in trajectories])
    return batch, compute_advantages(config, batch, rewards, groups, trained)


def test_a_masked_episode_trains_no_token_and_leaves_its_group_baseline():
    config = Config()
    group = [_traj(0, 1.0), _traj(0, -1.0), _traj(0, -1.0), _traj(0, -1.0, finish="max_tokens", masked=True)]
    other = [_traj(1, 1.0, sampled=3), _traj(1, -1.0, sampled=5)]
    batch, adv = _batch_and_advantages(config, group + other, row_multiple=8)
    per_row = adv.sum(axis=1) / np.maximum(batch.loss_mask.sum(axis=1), 1)
    # the group's mean/std are those of its three graded episodes, not of four
    np.testing.assert_allclose(per_row[:3], _grpo_reference([1.0, -1.0, -1.0]), rtol=1e-5)
    np.testing.assert_allclose(per_row[4:6], _grpo_reference([1.0, -1.0]), rtol=1e-5)
    assert not batch.loss_mask[3].any() and not adv[3].any() and not adv[6:].any()
    # the token-mean denominator counts only trained tokens: 2 + 2 + 2 + 3 + 5
    assert float(global_normalizer(batch.loss_mask, "token-mean")) == 14.0
    assert float(global_normalizer(batch.loss_mask, "seq-mean-token-mean")) == 5.0


@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp", "drgrpo"])
def test_masked_rows_are_invisible_to_every_estimator(advantage):
    """Masking an episode gives the same advantages as leaving it out of the batch."""
    config = apply_overrides(Config(), [f"algorithm.advantage={advantage}"])
    kept = [_traj(0, 1.0), _traj(0, 0.0), _traj(0, 0.5), _traj(1, 2.0), _traj(1, 0.0)]
    masked = [_traj(0, -5.0, masked=True), _traj(1, 9.0, finish="env_error", masked=True)]
    _, with_masked = _batch_and_advantages(config, kept[:3] + masked[:1] + kept[3:] + masked[1:])
    _, without = _batch_and_advantages(config, kept)
    np.testing.assert_allclose(np.delete(with_masked, [3, 6], axis=0), without, rtol=1e-6)
    assert not with_masked[[3, 6]].any()


def test_an_all_masked_batch_gives_zero_advantages_without_nan():
    config = Config()
    batch, adv = _batch_and_advantages(config, [_traj(0, -1.0, masked=True), _traj(0, 0.0, masked=True)])
    assert not batch.loss_mask.any() and not adv.any() and np.isfinite(adv).all()
    assert float(global_normalizer(batch.loss_mask, "token-mean")) == 0.0


def test_rollout_metrics_count_every_ending():
    trajectories = [_traj(0, 1.0), _traj(0, -1.0, finish="no_answer"),
                    _traj(0, -1.0, finish="max_tokens", masked=True),
                    _traj(1, -1.0, finish="context_overflow", masked=True),
                    _traj(1, 0.0, finish="env_error", masked=True),
                    _traj(1, -1.0, finish="max_turns"), _traj(1, 0.0, finish="my_reason")]
    m = rollout_metrics(trajectories)
    assert m["rollout/truncated"] == 2 and m["rollout/env_errors"] == 1 and m["rollout/masked_episodes"] == 3
    assert m["rollout/finish/answer"] == pytest.approx(1 / 7) and m["rollout/finish/my_reason"] == pytest.approx(1 / 7)
    assert m["rollout/finish/max_tokens"] == pytest.approx(1 / 7)
    assert sum(v for k, v in m.items() if k.startswith("rollout/finish/")) == pytest.approx(1.0)
    assert m["rollout/finish/env_error"] == pytest.approx(1 / 7)


def test_rollout_metrics_error_recovery():
    """Of the episodes with a failed tool call, the share that still ended correct (truncated ones never do)."""
    from agentrl_jax.envs.base import ToolStats

    trajectories = [_traj(0, 1.0), _traj(0, 1.0), _traj(0, -1.0), _traj(1, 1.0, finish="max_tokens")]
    for t, stats in zip(trajectories, [ToolStats(2, 1, 0), ToolStats(1, 0, 0), ToolStats(1, 0, 1), ToolStats(2, 1, 0)]):
        t.tool_stats = stats
    m = rollout_metrics(trajectories)
    assert m["tools/error_episode_rate"] == pytest.approx(3 / 4)
    assert m["tools/error_recovery_rate"] == pytest.approx(1 / 3)
    assert "tools/error_recovery_rate" not in rollout_metrics(trajectories[1:2])


def test_dynamic_sampling_looks_at_trained_episodes_only():
    assert not informative([_traj(0, 1.0), _traj(0, -1.0, masked=True)])
    assert informative([_traj(0, 1.0), _traj(0, -1.0), _traj(0, -1.0, masked=True)])


@pytest.mark.parametrize("overrides, rule", [
    ([], "penalize"),  # the demo: binary outcome, a wrong answer scores 0 as before
    (["environment.outcome_scheme=pm1"], "mask"),
    (["environment.outcome_scheme=pm1", "algorithm.truncated_episodes=penalize"], "penalize"),
    (["algorithm.truncated_episodes=mask"], "mask"),
])
def test_auto_masks_when_a_wrong_answer_scores_below_zero(overrides, rule):
    assert truncation_rule(load_config("demo", overrides)) == rule


def test_a_trainer_without_the_models_its_config_needs_refuses_to_run():
    config = apply_overrides(Config(), ["hybrid.mode=opd", "algorithm.kl_coef=0.1"])
    with pytest.raises(ConfigError, match=r"algorithm\.kl_coef needs Roles\.reference.*"
                                          r"hybrid\.mode needs Roles\.teacher"):
        Roles(policy=None).check(config)
    Roles(policy=None, reference={}, teacher=Teacher(None, "reference", frozen={})).check(config)


# ---------------------------------------------------------------- whole runs

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
    "rollout.max_concurrent=8", "rollout.max_new_tokens_per_turn=6", "rollout.max_sequence_length=64",
    "rollout.max_prompt_length=32", "rollout.steps_per_dispatch=2",
    "data.prompts_per_step=2", "algorithm.group_size=4", "optimizer.learning_rate=0.02",
    "environment.num_train_tasks=64", "environment.num_eval_tasks=2", "environment.outcome_scheme=pm1",
    "eval.num_tasks=2", "eval.samples_per_task=2", "sft.steps=0", "checkpoint.resume=false",
    "logging.sample_trajectories=0", "total_steps=2",
]


class AnswersEvenOperands(Environment):
    """Answers on the second turn when the task's first operand is even (reward: the parity of
    the sampled text's length, +1/-1); otherwise never answers, so the context runs out. Scores
    a cut-short episode as ReTool does under pm1: -1."""

    def __init__(self, answer_all: bool = False, answer_none: bool = False):
        self.answer_all, self.answer_none = answer_all, answer_none

    async def reset(self, task):
        self.turn = 0
        self.answers = self.answer_all or (not self.answer_none and int(task["a"]) % 2 == 0)
        return [{"role": "user", "content": task["question"]}]

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.answers and self.turn == 2:
            right = len(action_text) % 2 == 0
            return StepResult("", 1.0 if right else -1.0, True, finish_reason="answer", correct=right)
        return StepResult("<interpreter>ok</interpreter>", 0.0, False)

    def truncated_result(self, finish_reason, num_sampled_tokens):
        return StepResult("", -1.0, True, finish_reason=finish_reason, correct=False,
                          reward_components={"outcome": -1.0})


def _run(out: Path, *overrides: str, **env_kwargs) -> tuple[list[dict], dict]:
    from agentrl_jax.train.run import train

    config = load_config("demo", TINY + [f"output_dir={out}", *overrides])
    results = train(config, make_env=lambda *_: (lambda: AnswersEvenOperands(**env_kwargs)))
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout/trajectories" in r], results


def _finite(rows):
    return all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))


@pytest.mark.slow
def test_truncated_episodes_train_nothing_under_mask_and_everything_under_penalize(tmp_path):
    """Two 2-step runs (about 4 minutes on 2 busy cores)."""
    masked, _ = _run(tmp_path / "mask")
    penalized, _ = _run(tmp_path / "penalize", "algorithm.truncated_episodes=penalize")
    assert _finite(masked) and _finite(penalized)
    for m, p in zip(masked, penalized):
        # the same episodes (same seeds, and the first step's weights are the same)
        assert m["rollout/truncated"] == p["rollout/truncated"] > 0
        assert m["rollout/masked_episodes"] == m["rollout/truncated"] and p["rollout/masked_episodes"] == 0
        assert m["rollout/finish/answer"] + m["rollout/finish/max_tokens"] + m["rollout/finish/context_overflow"] \
            == pytest.approx(1.0)
        # penalize trains every sampled token; mask only the answered episodes'
        assert p["train_tokens"] == p["rollout/sampled_tokens"]
        assert 0 < m["train_tokens"] < m["rollout/sampled_tokens"]
        if m["step"] == 1:
            assert m["train_tokens"] < p["train_tokens"]


def test_a_step_where_every_episode_is_masked_makes_no_update(tmp_path):
    """Every episode runs out of context: no update compiles or runs, no NaN anywhere."""
    rows, results = _run(tmp_path / "none", answer_none=True)
    assert _finite(rows) and len(rows) == 2
    for r in rows:
        assert r["rollout/masked_episodes"] == r["rollout/trajectories"] == 8
        assert r["train/empty_batch"] == 1.0 and r["train_tokens"] == 0.0 and r["skipped_updates"] == 1.0
        assert "loss" not in r
    # truncated evaluation episodes count as incorrect
    assert results["end"]["pass_at_1"] == 0.0 and results["end"]["truncated_rate"] == 1.0


@pytest.mark.slow
def test_the_async_pipeline_counts_the_same_endings(tmp_path):
    """A synchronous and an async run at max_staleness=0 (about 4 minutes on 2 busy cores)."""
    sync, _ = _run(tmp_path / "sync")
    pipelined, _ = _run(tmp_path / "async", "async_rl.enabled=true", "async_rl.max_staleness=0")
    for s, p in zip(sync, pipelined):
        for key in ("rollout/truncated", "rollout/masked_episodes", "rollout/env_errors", "rollout/finish/answer",
                    "train_tokens", "loss"):
            assert p[key] == pytest.approx(s[key], rel=1e-6), key
