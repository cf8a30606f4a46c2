"""Hint-following SFT demonstrations of the arithmetic demo (docs/hybrid.md): format, mix, config."""

import numpy as np
import pytest

from agentrl_jax.config import Config, ConfigError, apply_overrides
from agentrl_jax.envs import ArithmeticEnv, bridge_thought, demonstration, make_tasks
from agentrl_jax.envs.arithmetic import MISTAKES, arithmetic_demonstrations
from agentrl_jax.envs.retool import initial_messages
from agentrl_jax.rewards import hint_leaks_answer


def demo_config(*overrides):
    return apply_overrides(Config(), ["environment.min_digits=2", "environment.max_digits=4", *overrides])


def test_bridge_thoughts_never_state_the_answer():
    tasks = [t for d in (2, 3, 4, 5) for t in make_tasks(100, d, seed=3)]
    for task in tasks:
        for mistake in MISTAKES:
            assert not hint_leaks_answer(bridge_thought(task, mistake), task["answer"]), (task, mistake)
    with pytest.raises(ValueError, match="mistake must be one of"):
        bridge_thought(tasks[0], "typo")


def test_hinted_demonstrations_carry_the_judges_hint_and_follow_it():
    config = demo_config("environment.demo_hint_fraction=0.3", "environment.demo_tool_fraction=0.5")
    tasks = make_tasks(600, 3, seed=0)
    conversations = arithmetic_demonstrations(config, tasks)
    hinted, tool, memory = 0, 0, 0
    for task, conv in zip(tasks, conversations):
        user = conv[0]
        assert user["role"] == "user" and user["content"].startswith(task["question"])
        suffix = user["content"][len(task["question"]):]
        if suffix:
            hinted += 1
            assert suffix in {config.hybrid.hint_format.format(hint=bridge_thought(task, m)) for m in MISTAKES}
            # the assistant follows it: the exact expression, then the printed result copied
            assert conv[1:] == demonstration(task, "tool", np.random.default_rng(0))
        elif len(conv) == 4:
            tool += 1
        else:
            memory += 1
    assert abs(hinted / len(tasks) - 0.3) < 0.06
    assert abs(tool / (tool + memory) - 0.5) < 0.08  # the unhinted keep their tool/memory mix


def test_without_hints_the_demonstrations_are_the_old_ones():
    """demo_hint_fraction=0 draws the same random stream as before hints existed."""
    config = demo_config("environment.demo_tool_fraction=0.5")
    tasks = make_tasks(200, 4, seed=1)
    rng = np.random.default_rng([config.seed, 7])
    env_cfg = ArithmeticEnv.config_from(config)
    old = []
    for task in tasks:
        style = "tool" if rng.random() < 0.5 else "memory"
        old.append(initial_messages(env_cfg, task) + demonstration(task, style, rng, fenced=env_cfg.fenced))
    assert arithmetic_demonstrations(config, tasks) == old


def test_hint_fraction_is_validated_against_the_teachers_placement():
    for overrides, message in [
        (["environment.demo_hint_fraction=1.5"], "environment.demo_hint_fraction"),
        (["environment.demo_hint_fraction=0.3", "hybrid.hint_placement=assistant_prefix"],
         "environment.demo_hint_fraction"),
        # hinted demonstrations are written in the inline layout only
        (["environment.demo_hint_fraction=0.3", "environment.layout=native"], "environment.demo_hint_fraction"),
    ]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            demo_config(*overrides)
    assert demo_config("environment.demo_hint_fraction=0.3").environment.demo_hint_fraction == 0.3
