"""A new environment brings its own config section, without editing the library.

The section and the environment live in a user config file (written here to tmp_path):
``environment.name=parity`` selects the section, its fields are set with ``--set`` and
checked at load, and the real trainer (tiny scratch model, 8 fake CPU devices) runs two
steps of it through ``train(config)``, building the environment from the section.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from agentrl_jax.config import (Config, ConfigError, EnvironmentConfig, apply_overrides, describe, from_dict,
                                load_config, register_environment, to_dict)

USER_CONFIG = '''
"""A user's environment: the reward is whether the final turn's length is a multiple of `modulus`."""
import dataclasses
from dataclasses import dataclass

from agentrl_jax.config import EnvironmentConfig, config_field, load_config, register_environment, require
from agentrl_jax.envs.base import Environment, StepResult, ToolStats


class ParityEnv(Environment):
    """Two turns: the first is answered "ok" (a tool call), the second is graded."""

    def __init__(self, modulus):
        self.modulus, self.turn = modulus, 0

    async def reset(self, task):
        self.turn = 0
        return [{"role": "user", "content": task["question"]}]

    async def step(self, action_text):
        self.turn += 1
        if self.turn == 1:
            return StepResult("<interpreter>ok</interpreter>", 0.0, False, tool_stats=ToolStats(calls=1))
        right = len(action_text) % self.modulus == 0
        return StepResult("", float(right), True, finish_reason="graded", correct=right,
                          reward_components={"parity": float(right)}, tool_stats=ToolStats(calls=1))


@register_environment("parity")
@dataclass(frozen=True)
class ParityEnvConfig(EnvironmentConfig):
    name: str = config_field("parity", "Which environment runs the episodes.")
    modulus: int = config_field(2, "parity: the final turn's length must be a multiple of this.")
    num_tasks: int = config_field(32, "parity: generated tasks per split.")
    generates_tasks = True

    def validate(self):
        super().validate()
        require(self.modulus >= 1, self._path("modulus"), f"must be >= 1, got {self.modulus}")

    def make_tasks(self, config, split):
        return [{"question": f"{split} task {i}: write a word", "answer": ""} for i in range(self.num_tasks)]

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        return lambda: ParityEnv(self.modulus)


def get_config():
    base = load_config("demo")
    return dataclasses.replace(base, name="parity", environment=EnvironmentConfig(name="parity", max_turns=2))
'''

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
    "rollout.max_concurrent=8", "rollout.max_new_tokens_per_turn=6", "rollout.max_sequence_length=96",
    "rollout.steps_per_dispatch=2", "data.prompts_per_step=2", "algorithm.group_size=4",
    "eval.num_tasks=2", "eval.samples_per_task=1", "sft.steps=0", "checkpoint.resume=false",
    "logging.sample_trajectories=0", "total_steps=2",
]


@pytest.fixture(scope="module")
def user_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "parity.py"
    path.write_text(USER_CONFIG)
    return path


def test_section_fields_are_set_and_validated_at_load(user_config):
    config = load_config(str(user_config), ["environment.modulus=3", "environment.max_turns=4"])
    env = config.environment
    assert type(env).__name__ == "ParityEnvConfig" and env.modulus == 3 and env.max_turns == 4
    with pytest.raises(ConfigError, match=r"environment\.modulus: must be >= 1, got 0"):
        load_config(str(user_config), ["environment.modulus=0"])
    with pytest.raises(ConfigError, match=r"environment\.modulus: expected an int"):
        load_config(str(user_config), ["environment.modulus=two"])
    # a key of another environment's section names the environment that has it
    with pytest.raises(ConfigError, match=r"'min_digits' is a field of environment\.name='arithmetic'"):
        load_config(str(user_config), ["environment.min_digits=3"])
    # a Config built in Python is checked the same way
    with pytest.raises(ConfigError, match=r"environment\.modulus"):
        dataclasses.replace(config, environment=EnvironmentConfig(name="parity", modulus=-1))
    # switching from the command line keeps the shared fields and takes the new section's
    demo = load_config("demo")
    switched = apply_overrides(demo, ["environment.name=parity", "environment.modulus=5"])
    assert switched.environment.modulus == 5 and switched.environment.max_turns == demo.environment.max_turns
    assert switched.environment.sandbox == demo.environment.sandbox
    assert from_dict(to_dict(switched)) == switched
    assert "environment.modulus = 2" in describe(Config)


def test_registration_checks_the_section():
    with pytest.raises(TypeError, match="must default to 'other'"):
        @register_environment("other")
        @dataclasses.dataclass(frozen=True)
        class Misnamed(EnvironmentConfig):
            def make_env_factory(self, config, *, pool, verifier, count_tokens):
                raise AssertionError

    with pytest.raises(TypeError, match="must implement make_env_factory"):
        @register_environment("arithmetic")
        @dataclasses.dataclass(frozen=True)
        class NoFactory(EnvironmentConfig):
            pass

    with pytest.raises(ConfigError, match=r"environment\.name: unknown environment 'nope'; registered: .*arithmetic"):
        EnvironmentConfig(name="nope")
    # a section whose name selects another class is refused
    with pytest.raises(ConfigError, match=r"environment\.name: 'retool' selects ReToolEnvConfig"):
        dataclasses.replace(EnvironmentConfig(name="arithmetic"), name="retool")


@pytest.mark.slow  # ~60 s on 2 cores (compiles a tiny model)
def test_a_user_environment_trains_end_to_end(user_config, tmp_path):
    from agentrl_jax.train.run import train

    out = tmp_path / "run"
    config = load_config(str(user_config), TINY + [f"output_dir={out}", "environment.modulus=2"])
    train(config)
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        # the environment's own finish reason, reward component and tool stats reach the metrics
        assert m["rollout/finish/graded"] + m.get("rollout/finish/max_tokens", 0.0) == pytest.approx(1.0)
        assert m["rollout/finish/graded"] > 0
        assert 0.0 <= m["reward/parity"] <= 1.0 and m["tools/use_rate"] == 1.0
