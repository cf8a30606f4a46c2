"""Two SmolLM2-135M-Instruct policies in one episode: a solver that writes programs and a checker
that reads its transcript (the solver-checker episode, envs/solver_checker.py, on the program
tasks of configs/smollm2_tools.py).

- the solver: configs/smollm2_tools.py's recipe (the GGUF file, a cold start on the scripted
  solver's demonstrations in the model's chat template, then GRPO in the ReTool episode);
- the checker: the same pretrained model, cold-started on the right verdicts
  (``checker_cold_start='labeled'``) of the solver's demonstrations, half of them shown with the
  final answer miscopied (``checker_miscopied=0.5``: on the scratch models this is the cold start
  whose judgment survives a learning solver, docs/multi_policy.md "A checker that checks"), then
  Dr. GRPO on its role reward alone, balanced over the two classes of first answers.

Status: the pipeline runs end to end from the GGUF file at smoke size on CPU
(tests/e2e/test_multi_policy_smollm2.py, slow); whether both policies learn at this size is
not measured yet.

    python -m agentrl_jax.assets smollm2 ~/models/smollm2
    python launch/tpu_pod.py --config configs/multi_policy_smollm2.py          # 2 GPUs: a policy each
    python launch/tpu_pod.py --config configs/multi_policy_smollm2.py \\
        --set multi_policy.policies.solver.share=0 --set multi_policy.policies.checker.share=0   # 1 GPU
"""

import dataclasses
import pathlib

from agentrl_jax.config import Config, load_config
from agentrl_jax.config.policies import MultiPolicyConfig, PolicyConfig

POLICIES = (
    PolicyConfig(name="solver", actors=("solver",), share=0.5),
    # The verdict is one line the pretrained model already can write: a shorter cold start than the
    # solver's 120 steps. Dr. GRPO: the group mean only (docs/multi_policy.md "How the recipe got here").
    PolicyConfig(name="checker", actors=("checker",), share=0.5,
                 overrides=("sft.steps=60", "algorithm.advantage=drgrpo")),
)


def get_config() -> Config:
    config = load_config(str(pathlib.Path(__file__).with_name("smollm2_tools.py")),
                         ["name=multi_policy_smollm2", "output_dir=runs/multi_policy_smollm2"])
    return dataclasses.replace(config, multi_policy=MultiPolicyConfig(
        policies=POLICIES, checker_team_reward=False, checker_cold_start="labeled", checker_miscopied=0.5))
