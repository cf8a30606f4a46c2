"""configs/multi_policy_arith_labeled.py with a checker whose cold start cannot take a shortcut:
half of its SFT transcripts show the final answer with one digit miscopied
(``multi_policy.checker_miscopied=0.5``: wrong, and told from a right answer only by its digits),
over 2000 SFT steps. Everything else is the labeled recipe's.

The labeled checker learns to tell the scripted solver's guesses from memory from its programs
without reading a number, and beside a learning solver, whose mistakes become right programs
with the result miscopied, its judgment erodes (held-out balanced accuracy ~0.75 -> ~0.53, every
seed). This one keeps and sharpens it while the solver learns: 0.60 -> 0.67 over 6 seeds, 5 of
them up (docs/multi_policy.md "A checker that checks").

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python launch/tpu_pod.py --config configs/multi_policy_arith_miscopied.py
"""

import dataclasses
import pathlib

from agentrl_jax.config import Config, load_config


def get_config() -> Config:
    config = load_config(str(pathlib.Path(__file__).with_name("multi_policy_arith_labeled.py")), [
        "name=multi_policy_arith_miscopied", "output_dir=runs/multi_policy_arith_miscopied",
        "multi_policy.policies.checker.sft.steps=2000"])
    return dataclasses.replace(config, multi_policy=dataclasses.replace(config.multi_policy, checker_miscopied=0.5))
