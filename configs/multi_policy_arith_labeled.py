"""configs/multi_policy_arith.py with a checker that starts RL judging: its SFT verdicts are the
right ones (``multi_policy.checker_cold_start='labeled'``) on the solver's demonstrations, over
more steps than the format-only cold start needs. Everything else is the recipe's.

The format-only checker of the recipe never learned to judge in RL (balanced accuracy ~0.5,
docs/multi_policy.md "Does the team learn?"). This asks the other question: given a checker
that judges the scripted solver's answers, does the team then beat its solver trained alone,
and does RL keep or sharpen the checker's judgment on the policy's own answers?

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python launch/tpu_pod.py --config configs/multi_policy_arith_labeled.py
"""

import dataclasses
import pathlib

from agentrl_jax.config import Config, load_config


def get_config() -> Config:
    config = load_config(str(pathlib.Path(__file__).with_name("multi_policy_arith.py")),
                         ["name=multi_policy_arith_labeled", "output_dir=runs/multi_policy_arith_labeled"])
    mp = config.multi_policy
    # The judgment takes longer to learn than the format (40 steps): 200 steps of 16.
    policies = tuple(dataclasses.replace(p, overrides=tuple(o for o in p.overrides if not o.startswith("sft.steps="))
                                         + ("sft.steps=200",)) if p.name == "checker" else p for p in mp.policies)
    return dataclasses.replace(config, multi_policy=dataclasses.replace(mp, policies=policies,
                                                                        checker_cold_start="labeled"))
