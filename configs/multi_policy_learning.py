"""The solver-checker recipe sized for the learning comparison on CPU cores
(bench/multi_policy_learning.py, docs/multi_policy.md "Does the team learn?").

configs/retool_small_cpu.py's tiny scratch decoders (~0.2M parameters each), two policies,
each with an SFT cold start on its own demonstrations:
- the solver on the scripted-solver programs (as retool_small);
- the checker format-only: verdicts in the exact format the episode parses, ACCEPT or REJECT
  drawn 50/50 independently of the transcript's answer (envs/solver_checker.py
  checker_demonstrations), so it starts well-formed and at chance; RL teaches the judgment.
Then GRPO in the solver-checker episode, the solver on the first device, the checker on the
second, trained at once; a held-out evaluation every ``eval.every_steps`` steps.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python launch/tpu_pod.py --config configs/multi_policy_learning.py

The solo arm of the comparison is this Config without ``multi_policy`` (the solver alone in
the ReTool episode, same model, SFT, optimizer, batch and evaluation).
"""

import dataclasses
import pathlib

from agentrl_jax.config import Config, load_config
from agentrl_jax.config.policies import MultiPolicyConfig, PolicyConfig

POLICIES = (
    PolicyConfig(name="solver", actors=("solver",), share=0.5),
    # Format only: a short SFT is enough for one line; a higher RL rate for its short replies.
    PolicyConfig(name="checker", actors=("checker",), share=0.5,
                 overrides=("sft.steps=40", "optimizer.learning_rate=3e-4")),
)


def get_config() -> Config:
    config = load_config(str(pathlib.Path(__file__).with_name("retool_small_cpu.py")), [
        "name=multi_policy_learning", "output_dir=runs/multi_policy_learning", "total_steps=16",
        "rollout.max_sequence_length=512", "rollout.max_new_tokens_per_turn=64", "environment.max_turns=3",
        "eval.every_steps=4", "eval.num_tasks=16", "eval.samples_per_task=2", "checkpoint.every_steps=0",
        "logging.tensorboard=false", "logging.progress=false"])
    return dataclasses.replace(config, multi_policy=MultiPolicyConfig(policies=POLICIES))
