"""Two policies, one episode: a solver writes programs and answers, a checker reads its
transcript and accepts or sends back a one-line critique (docs/multi_policy.md).

The retool_small program tasks (envs/program_tasks.py) in the solver-checker episode
(envs/solver_checker.py): the solver's turns are the ReTool episode (programs run in the
sandbox); the checker answers ACCEPT or "REJECT: <why>", and after a rejection the solver
gets one more try. Team reward 1 for a correct final answer (both policies); the checker
also gets ``multi_policy.role_reward`` for a right verdict on the solver's first answer.

Each policy is a scratch Qwen3-style decoder with its own optimizer, GRPO groups and
checkpoints, on its own half of the devices (trained at once). With
``multi_policy.schedule=time_shared`` and ``share=0`` both sit on all devices and train one
after the other. At this size, from scratch and without SFT, it shows the pipeline end to
end, not learning.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python launch/tpu_pod.py --config configs/multi_policy_demo.py
"""

import dataclasses
import pathlib

from agentrl_jax.config import Config, load_config
from agentrl_jax.config.policies import MultiPolicyConfig, PolicyConfig

POLICIES = (
    PolicyConfig(name="solver", actors=("solver",), share=0.5),
    PolicyConfig(name="checker", actors=("checker",), share=0.5, overrides=("optimizer.learning_rate=3e-4",)),
)


def get_config() -> Config:
    config = load_config(str(pathlib.Path(__file__).with_name("retool_small_cpu.py")), [
        "name=multi_policy_demo", "output_dir=runs/multi_policy_demo", "sft.steps=0", "total_steps=4",
        "rollout.max_sequence_length=384", "rollout.max_new_tokens_per_turn=48", "environment.max_turns=3",
        "eval.num_tasks=8", "eval.samples_per_task=2", "checkpoint.every_steps=2", "checkpoint.max_to_keep=2"])
    return dataclasses.replace(config, multi_policy=MultiPolicyConfig(policies=POLICIES))
