"""Multi-policy pieces without a model: the config (``multi_policy.policies``), each policy's
rows out of multi-actor episodes, its advantages (groups per actor, never across roles), and
the checker's balanced role reward."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from agentrl_jax.config import (
    Config,
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    to_dict,
)
from agentrl_jax.config.policies import MultiPolicyConfig, PolicyConfig, policy_config
from agentrl_jax.envs.base import Trajectory
from agentrl_jax.envs.multi_actor import MultiActorEpisode, MultiActorResult
from agentrl_jax.envs.solver_checker import balanced_verdict_weights
from agentrl_jax.train.multi_policy.team import (
    policy_trajectories,
    team_metrics,
    weigh_verdicts,
)
from agentrl_jax.train.rl.stages import build_step_batch

ACTORS = ("solver", "checker")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def with_policies(*policies, **kw) -> Config:
    return dataclasses.replace(Config(), multi_policy=MultiPolicyConfig(policies=tuple(policies), **kw))


def test_no_policies_is_the_single_policy_config_and_policies_round_trip():
    assert not Config().multi_policy.enabled
    config = with_policies(PolicyConfig(name="solver", actors=("solver",), devices=(0, 1)),
                           PolicyConfig(name="checker", actors=("checker",), overrides=("optimizer.learning_rate=1e-3",)))
    assert from_dict(to_dict(config)) == config
    own = policy_config(config, config.multi_policy.policies[1])
    assert own.optimizer.learning_rate == 1e-3 and not own.multi_policy.enabled
    assert own.output_dir == f"{config.output_dir}/policies/checker"


def test_a_policys_own_settings_from_the_command_line():
    team = load_config(str(CONFIGS / "multi_policy_arith.py"), [
        "multi_policy.policies.checker.optimizer.learning_rate=1e-3",
        "multi_policy.policies.checker.algorithm.advantage=grpo",  # over the config file's drgrpo
        "optimizer.learning_rate=1e-4",  # the run's, under every policy's own
        "multi_policy.policies.solver.share=0", "multi_policy.policies.solver.devices=[1]"])
    solver, checker = team.multi_policy.policies
    assert (solver.share, solver.devices, solver.overrides) == (0, (1,), ())
    assert checker.overrides[-2:] == ("optimizer.learning_rate=1e-3", "algorithm.advantage=grpo")
    own = [policy_config(team, p) for p in team.multi_policy.policies]
    assert [c.optimizer.learning_rate for c in own] == [1e-4, 1e-3]
    assert [c.algorithm.advantage for c in own] == ["grpo", "grpo"] and own[1].sft.steps == 40
    assert team.multi_policy.placement(2) == [(1,), (0,)]  # the checker's share: the first block


@pytest.mark.parametrize("item, message", [
    ("multi_policy.policies.judge.optimizer.learning_rate=1", "override 'multi_policy.policies.judge.optimizer."
                                                             "learning_rate': no policy named 'judge'; the run's "
                                                             "policies are solver, checker"),
    ("multi_policy.policies.checker.optimizer.learning_rat=1", "multi_policy.policies[checker]: override "
                                                              "'optimizer.learning_rat': unknown key"),
    ("multi_policy.policies.checker.data.prompts_per_step=2", "override 'multi_policy.policies.checker.data."
                                                             "prompts_per_step': after the policy's name expected"),
    ("multi_policy.policies.checker.optimizer=1", "override 'multi_policy.policies.checker.optimizer': after"),
    ("multi_policy.policies.checker.share=half", "multi_policy.policies.checker.share: expected a float"),
])
def test_a_bad_policy_setting_from_the_command_line_is_one_line(item, message):
    with pytest.raises(ConfigError) as e:
        load_config(str(CONFIGS / "multi_policy_arith.py"), [item])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="no policy named 'checker'; the run's policies are \\(none"):
        load_config(str(CONFIGS / "demo.py"), ["multi_policy.policies.checker.optimizer.learning_rate=1"])


@pytest.mark.parametrize("fields, message", [
    (dict(overrides=("data.prompts_per_step=2",)),
     "multi_policy.policies[p].overrides: 'data.prompts_per_step=2': a policy sets only"),
    (dict(overrides=("optimizer.learning_rat=1",)),
     "multi_policy.policies[p]: override 'optimizer.learning_rat': unknown key"),
    (dict(overrides=("algorithm.minibatches=3",)),
     "multi_policy.policies[p]: algorithm.minibatches (3) must divide"),
    (dict(actors=()), "multi_policy.policies[p].actors: must name at least one actor"),
    (dict(devices=(0, 1), share=0.5), "multi_policy.policies[p].share: 0.5 must be in [0, 1], and not given with"),
])
def test_each_policy_is_validated_as_a_single_policy_config_in_one_line(fields, message):
    with pytest.raises(ConfigError) as e:
        with_policies(PolicyConfig(**{"name": "p", "actors": ("a",), **fields}))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_arithmetic_team_config_is_the_demo_with_a_checker():
    team = load_config(str(CONFIGS / "multi_policy_arith.py"))
    solver, checker = (policy_config(team, p) for p in team.multi_policy.policies)
    assert team.environment.name == "arithmetic" and team.multi_policy.placement(2) == [(0,), (1,)]
    assert (checker.sft.steps, checker.sft.max_length) == (40, 320) and solver.sft == team.sft
    assert (solver.algorithm.advantage, checker.algorithm.advantage) == ("grpo", "drgrpo")
    # The solo arm (no multi_policy) is configs/demo.py but for the context the checker's prompts
    # need, the evaluation every 10 steps (for the curves) and the names.
    solo = dataclasses.replace(team, multi_policy=MultiPolicyConfig())
    assert solo == apply_overrides(load_config(str(CONFIGS / "demo.py")), [
        "name=multi_policy_arith", "output_dir=runs/multi_policy_arith", "rollout.max_prompt_length=256",
        "rollout.max_sequence_length=384", "eval.every_steps=10", "logging.progress=false"])


def test_one_actor_one_policy_and_what_the_run_does_not_do_are_errors():
    with pytest.raises(ConfigError, match="each actor is played by one policy; \\['a'\\]"):
        with_policies(PolicyConfig(name="p", actors=("a",)), PolicyConfig(name="q", actors=("a",)))
    with pytest.raises(ConfigError, match="^hybrid.judge: is not supported with multi_policy"):
        apply_overrides(with_policies(PolicyConfig(name="p", actors=("a",))), ["hybrid.judge=oracle",
                                                                               "environment.name=arithmetic"])
    with pytest.raises(ConfigError, match=r"^multi_policy.policies\[p\].sft.steps: SFT of a policy is supported"):
        with_policies(PolicyConfig(name="p", actors=("a",), overrides=("sft.steps=5", "algorithm.kl_coef=0.1")))
    with_policies(PolicyConfig(name="p", actors=("a",), overrides=("sft.steps=5",)))  # no KL, own views: fine


@pytest.mark.parametrize("fields, message", [
    (dict(checker_reward="fair"), "multi_policy.checker_reward: got 'fair'; allowed values are 'balanced', "),
    (dict(checker_cold_start="labels"), "multi_policy.checker_cold_start: got 'labels'; allowed values are 'format', "),
    (dict(solver_second_tries=1.5), "multi_policy.solver_second_tries: 1.5 must be in [0, 1]"),
    (dict(frozen=("q",)), "multi_policy.frozen: ['q'] names policies that are not among ['p']"),
    (dict(frozen=("p",)), "multi_policy.frozen: ['p'] freezes every policy; at least one must train"),
    (dict(alternate_every=-1), "multi_policy.alternate_every: -1 must be >= 0"),
    (dict(checker_tool_calls=-1), "multi_policy.checker_tool_calls: -1 must be >= 0"),
    (dict(checker_miscopied=1.5), "multi_policy.checker_miscopied: 1.5 must be in [0, 1]"),
    (dict(solver_second_tries=0.5, critique_retries=0),
     "multi_policy.solver_second_tries (0.5) teaches second tries, which need multi_policy.critique_retries >= 1"),
    (dict(solver_second_tries=0.5, environment="retool"), "multi_policy.solver_second_tries (0.5) writes second "
                                                          "tries for environment.name='arithmetic' only, not 'retool'"),
])
def test_the_checker_reward_and_the_solvers_second_tries_are_validated_in_one_line(fields, message):
    environment = [f"environment.name={fields.pop('environment')}"] if "environment" in fields else []
    with pytest.raises(ConfigError) as e:
        apply_overrides(with_policies(PolicyConfig(name="p", actors=("a",)), **fields), environment)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert MultiPolicyConfig().checker_reward == "balanced" and MultiPolicyConfig().solver_second_tries == 0
    assert MultiPolicyConfig().checker_cold_start == "format"


def test_the_miscopied_recipe_is_the_labeled_one_with_a_longer_checker_cold_start_that_has_no_shortcut():
    """configs/multi_policy_arith_miscopied.py is what the documented runs set on the command line."""
    recipe = load_config(str(CONFIGS / "multi_policy_arith_miscopied.py"))
    ran = load_config(str(CONFIGS / "multi_policy_arith_labeled.py"), [
        "name=multi_policy_arith_miscopied", "output_dir=runs/multi_policy_arith_miscopied",
        "multi_policy.policies.checker.sft.steps=2000", "multi_policy.checker_miscopied=0.5"])
    assert recipe == ran
    checker = policy_config(recipe, recipe.multi_policy.policies[1])
    assert (checker.sft.steps, recipe.multi_policy.checker_cold_start) == (2000, "labeled")


def test_the_checkers_interpreter_cold_start_is_the_arithmetic_demos_and_checked_with_every_override():
    items = ["multi_policy.checker_tool_calls=1", "environment.name=retool_small", "multi_policy.solver_second_tries=0"]
    with pytest.raises(ConfigError) as e:
        load_config(str(CONFIGS / "multi_policy_arith.py"), items)
    assert str(e.value).startswith("multi_policy.checker_tool_calls (1) with the checker's SFT (policy 'checker') "
                                   "writes its programs for environment.name='arithmetic' only, not 'retool_small'")
    # without the checker's SFT (e.g. a pretrained checker) any code environment will do; the
    # policy's own override counts though it comes after the run's items that need it
    team = load_config(str(CONFIGS / "multi_policy_arith.py"), items + ["multi_policy.policies.checker.sft.steps=0"])
    assert team.multi_policy.checker_tool_calls == 1 and team.environment.name == "retool_small"
    assert MultiPolicyConfig().checker_tool_calls == 0


@pytest.mark.parametrize("items, message", [
    (["async_rl.mode=stream"], "multi_policy.policies[solver].async_rl: mode='stream', placement='colocated': "
                               "several policies run async_rl.mode='step' with placement='colocated' only"),
    (["async_rl.placement=disaggregated"], "multi_policy.policies[solver].async_rl: mode='step', "
                                           "placement='disaggregated'"),
    (["multi_policy.policies.checker.async_rl.max_staleness=2"],
     "multi_policy.policies[checker].async_rl.max_staleness (2) the multi-policy pipeline collects one step ahead"),
])
def test_async_rollouts_per_policy_are_one_step_ahead_and_colocated(items, message):
    base = ["async_rl.enabled=true", "async_rl.max_staleness=1", "algorithm.correction=tis"]
    team = load_config(str(CONFIGS / "multi_policy_arith.py"), base + ["multi_policy.policies.checker.async_rl."
                                                                       "max_staleness=0"])
    assert [policy_config(team, p).async_rl.max_staleness for p in team.multi_policy.policies] == [1, 0]
    with pytest.raises(ConfigError) as e:
        load_config(str(CONFIGS / "multi_policy_arith.py"), base + items)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_placement_by_devices_or_share_decides_concurrent_or_time_shared():
    halves = with_policies(PolicyConfig(name="s", actors=("s",), share=0.5),
                           PolicyConfig(name="c", actors=("c",), share=0.5)).multi_policy
    assert halves.placement(8) == [(0, 1, 2, 3), (4, 5, 6, 7)] and halves.concurrent(8)
    with pytest.raises(ConfigError, match="share: no device left"):
        halves.placement(1)
    shared = with_policies(PolicyConfig(name="s", actors=("s",)), PolicyConfig(name="c", actors=("c",))).multi_policy
    assert shared.placement(2) == [(0, 1), (0, 1)] and not shared.concurrent(2)
    forced = dataclasses.replace(shared, schedule="concurrent")
    with pytest.raises(ConfigError, match="'concurrent' needs every policy on devices of its own"):
        forced.concurrent(2)


def row(actor_index: int, tokens: int, reward: float, group: int) -> Trajectory:
    """A two-token prompt and ``tokens`` sampled tokens."""
    ids = np.arange(2 + tokens, dtype=np.int32)
    mask = np.r_[np.zeros(2), np.ones(tokens)].astype(np.int8)
    return Trajectory(prompt_token_ids=ids[:2], token_ids=ids, loss_mask=mask,
                      rollout_logprobs=-mask.astype(np.float32), params_versions=np.where(mask > 0, 0, -1),
                      reward=reward, group_id=group * len(ACTORS) + actor_index,
                      task_metadata={"actor": ACTORS[actor_index]})


def episodes(rewards: list[list[tuple[float, float]]]) -> list[MultiActorEpisode]:
    """Episodes of tasks (outer list) x samples; (solver, checker) reward each."""
    out = []
    for task, samples in enumerate(rewards):
        for solver, checker in samples:
            result = MultiActorResult(None, done=True, rewards={"solver": solver, "checker": checker},
                                      metrics={"critique/wrong_first": 1.0, "critique/wrong_to_right": solver})
            out.append(MultiActorEpisode(ACTORS, {}, result, {"solver": row(0, 3, solver, task),
                                                              "checker": row(1, 2, checker, task)}))
    return out


def grpo_reference(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """(r - group mean) / (unbiased group std + 1e-6), 0 for an all-equal group (NumPy)."""
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        r = rewards[groups == g]
        out[groups == g] = 0.0 if np.all(r == r[0]) else (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    return out


@pytest.mark.parametrize("self_play", [False, True])
def test_each_policy_gets_its_actors_rows_and_advantages_per_actor_group(self_play):
    config = dataclasses.replace(Config(), algorithm=dataclasses.replace(Config().algorithm, group_size=3,
                                                                         minibatches=1),
                                 data=dataclasses.replace(Config().data, prompts_per_step=2))
    eps = episodes([[(1.0, 2.0), (0.0, 1.0), (0.0, 0.0)], [(1.0, 1.0), (1.0, 1.0), (0.0, 2.0)]])
    policies = {"team": ACTORS} if self_play else {"solver": ("solver",), "checker": ("checker",)}
    for actors in policies.values():
        rows = policy_trajectories(eps, actors)
        assert [t.task_metadata["actor"] for t in rows] == [a for _ in eps for a in actors]
        batch = build_step_batch(config, rows, pad_token_id=0)
        rewards = np.asarray([t.reward for t in rows], np.float32)
        expected = grpo_reference(rewards, np.asarray([t.group_id for t in rows]))
        sampled = batch.loss_mask[:len(rows)] > 0
        got = np.asarray(batch.advantages)[:len(rows)]
        for i in range(len(rows)):  # one advantage per row, on its sampled tokens
            np.testing.assert_allclose(got[i][sampled[i]], expected[i], rtol=1e-5, atol=1e-6)
    if self_play:  # the checker's 2.0 never enters the solver's baseline: groups per actor
        assert len({t.group_id for t in policy_trajectories(eps, ACTORS)}) == 4


def test_team_metrics_average_the_episodes_and_rate_the_critiques():
    metrics = team_metrics(episodes([[(1.0, 0.0), (0.0, 0.0), (0.0, 0.0), (1.0, 0.0)]]))
    assert metrics["critique/wrong_to_right_rate"] == 0.5 and metrics["team/masked_episodes"] == 0.0


def test_balanced_weights_pay_a_constant_verdict_half_whatever_the_share_of_right_answers():
    # one right first answer of four: 1 / (2 x 1/4) = 2 for it, 1 / (2 x 3/4) = 2/3 for the wrong ones
    np.testing.assert_allclose(balanced_verdict_weights([True, False, False, False]), [2, 2 / 3, 2 / 3, 2 / 3])
    for right in ([True, False, False, False], [True] * 9 + [False], [True, False]):
        weights, right = balanced_verdict_weights(right), np.asarray(right)
        assert np.mean(weights * right) == pytest.approx(0.5)  # accept all: right on the right ones
        assert np.mean(weights * ~right) == pytest.approx(0.5)  # reject all
        assert np.mean(weights) == pytest.approx(1.0)  # every verdict right
    np.testing.assert_allclose(balanced_verdict_weights([False, False]), [1, 1])  # one class: plain accuracy
    assert balanced_verdict_weights([]).size == 0


def judged_episodes(cases: list[tuple[bool, bool, float]]) -> list[MultiActorEpisode]:
    """(first answer right, verdict right, team reward) per episode, scored as SolverCheckerEnv scores
    them with role_reward 1 (the checker's reward: team + verdict)."""
    out = []
    for first, right, team in cases:
        result = MultiActorResult(None, done=True, rewards={"solver": team, "checker": team + right},
                                  reward_components={"checker": {"team": team, "verdict": float(right)}},
                                  metrics={"team/first_correct": float(first), "checker/accuracy": float(right)})
        checker = dataclasses.replace(row(1, 2, team + right, 0), reward_components={"team": team,
                                                                                    "verdict": float(right)})
        out.append(MultiActorEpisode(ACTORS, {}, result, {"solver": row(0, 3, team, 0), "checker": checker}))
    return out


@pytest.mark.parametrize("rule", ["balanced", "accuracy"])
def test_the_checkers_role_reward_is_weighed_by_its_class_within_the_step(rule):
    # right first answers: accepted (team 1); wrong ones: rejected and turned right, rejected, accepted
    eps = judged_episodes([(True, True, 1.0), (False, True, 1.0), (False, True, 0.0), (False, False, 0.0)])
    config = with_policies(PolicyConfig(name="p", actors=("a",)), role_reward=0.5, checker_reward=rule)
    weigh_verdicts(config, eps)
    got = [e.trajectories["checker"].reward for e in eps]
    if rule == "accuracy":  # as the episode scored them
        assert got == [2.0, 2.0, 1.0, 0.0]
    else:  # team + 0.5 x weight x verdict: weights 2 (right first answers), 2/3 (wrong ones)
        np.testing.assert_allclose(got, [1 + 0.5 * 2, 1 + 0.5 * 2 / 3, 0.5 * 2 / 3, 0.0])
        alone = judged_episodes([(True, True, 1.0), (False, True, 1.0), (False, True, 0.0), (False, False, 0.0)])
        weigh_verdicts(dataclasses.replace(config, multi_policy=dataclasses.replace(
            config.multi_policy, checker_team_reward=False)), alone)  # the role reward alone
        np.testing.assert_allclose([e.trajectories["checker"].reward for e in alone], [1, 1 / 3, 1 / 3, 0])
    assert [e.trajectories["solver"].reward for e in eps] == [1.0, 1.0, 0.0, 0.0]
    # balanced accuracy: right on 1 of 1 right first answers, on 2 of 3 wrong ones
    metrics = team_metrics(eps)
    assert metrics["checker/balanced_accuracy"] == pytest.approx((1 + 2 / 3) / 2)
    assert metrics["checker/accepts_right"] == 1.0 and metrics["checker/rejects_wrong"] == pytest.approx(2 / 3)
    only_wrong = team_metrics(eps[1:])  # no right first answer: no balanced accuracy, no accepts_right
    assert "checker/balanced_accuracy" not in only_wrong and "checker/accepts_right" not in only_wrong
    assert only_wrong["checker/rejects_wrong"] == pytest.approx(2 / 3)


def test_alternating_turns_train_one_policy_at_a_time_and_skip_the_frozen():
    three = [PolicyConfig(name=n, actors=(n,)) for n in ("a", "b", "c")]
    mp = MultiPolicyConfig(policies=tuple(three))
    assert [mp.frozen_at(s) for s in (0, 7)] == [set(), set()]  # the default: all train at every step
    assert dataclasses.replace(mp, frozen=("b",)).frozen_at(3) == {"b"}
    turns = dataclasses.replace(mp, alternate_every=2, frozen=("b",))  # a, a, c, c, a, a, ...
    assert [sorted({"a", "b", "c"} - turns.frozen_at(s)) for s in range(6)] == [["a"], ["a"], ["c"], ["c"], ["a"], ["a"]]


def test_policies_share_a_tokenizer_object_where_theirs_agree_and_differ_only_in_own_views(tmp_path):
    from chat_formats import CORPUS, FORMATS, build_tokenizer

    from agentrl_jax.train.multi_policy.run import policy_tokenizers

    for name, fmt, size in (("a", "qwen3", 400), ("b", "qwen3", 400), ("c", "llama3.1", 300)):
        build_tokenizer(FORMATS[fmt], tmp_path / name, texts=list(CORPUS), vocab_size=size)
    specs = [PolicyConfig(name="solver", actors=("solver",)), PolicyConfig(name="checker", actors=("checker",))]
    config = with_policies(*specs)
    same = policy_tokenizers(config, [(config, str(tmp_path / "a")), (config, str(tmp_path / "b"))])
    assert same["solver"] is same["checker"]  # one token space: one object
    own = policy_tokenizers(config, [(config, str(tmp_path / "a")), (config, str(tmp_path / "c"))])
    assert own["checker"].vocab_size == 300 and own["solver"].vocab_size == 400
    shared = with_policies(*specs, shared_view=True)
    with pytest.raises(ConfigError) as e:
        policy_tokenizers(shared, [(shared, str(tmp_path / "a")), (shared, str(tmp_path / "c"))])
    assert str(e.value).startswith("multi_policy.policies[checker]: its tokenizer differs from 'solver''s, but "
                                   "multi_policy.shared_view=true writes every turn into one view")
