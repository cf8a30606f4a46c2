"""The solver-checker recipe at configs/retool_small.py's size, for one or two GPUs
(docs/multi_policy.md): two ~25M-parameter scratch decoders, each SFT'd on its own
demonstrations (the solver on the scripted-solver programs, the checker on verdicts about
them), then GRPO in the solver-checker episode, each policy on half of the devices (2+).

    python launch/tpu_pod.py --config configs/multi_policy_small.py

The solver alone (the comparison's baseline) is configs/retool_small.py with the same seed.
"""

import dataclasses
import pathlib

from agentrl_jax.config import Config, load_config
from agentrl_jax.config.policies import MultiPolicyConfig, PolicyConfig


def get_config() -> Config:
    config = load_config(str(pathlib.Path(__file__).with_name("retool_small.py")), [
        "name=multi_policy_small", "output_dir=runs/multi_policy_small", "rollout.max_sequence_length=768",
        "checkpoint.every_steps=10", "checkpoint.max_to_keep=2"])
    policies = (PolicyConfig(name="solver", actors=("solver",), share=0.5),
                PolicyConfig(name="checker", actors=("checker",), share=0.5, overrides=("sft.steps=300",)))
    return dataclasses.replace(config, multi_policy=MultiPolicyConfig(policies=policies))
