"""The solver-checker team on the embedded demo's arithmetic tasks (configs/demo.py), sized for
the learning comparison on CPU cores (bench/multi_policy_learning.py, docs/multi_policy.md
"Does the team learn?").

The demo's recipe unchanged (the scratch tokenizer trained on its demonstrations, the ~1M
parameter decoder, the SFT cold start, GRPO, the held-out tasks and samples), with two
policies, each from the same scratch initialization:
- the solver: SFT on the demo's demonstrations (half call the interpreter, half answer from
  memory), every one whose memory answer is wrong going on with the episode's rejection note
  and a second try that calls the interpreter (``solver_second_tries``: the first-answer parts
  are the demo's demonstrations exactly), then GRPO in the solver-checker episode
  (envs/solver_checker.py) over the demo's arithmetic episode;
- the checker: a format-only SFT (ACCEPT or REJECT drawn 50/50 independently of the answer:
  envs/solver_checker.py checker_demonstrations), then Dr. GRPO on its role reward alone for a
  right verdict, weighted by the inverse share of its class within the step
  (``checker_reward='balanced'``, the default: a constant verdict earns half of the maximum);
  without the team reward (``checker_team_reward=False``), which pays rejecting everything
  once the second tries are as often right as the first answers (docs/multi_policy.md).
The solver on the first device, the checker on the second, trained at once.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python launch/tpu_pod.py --config configs/multi_policy_arith.py

The solo arm of the comparison is this Config without ``multi_policy``: the demo itself, but
for the longer context the checker's prompts and the second tries need (it changes neither
the demo's episodes nor its batches, which are padded to their longest row) and the held-out
evaluation every ``eval.every_steps`` steps.
"""

import dataclasses
import pathlib

from agentrl_jax.config import Config, load_config
from agentrl_jax.config.policies import MultiPolicyConfig, PolicyConfig

POLICIES = (
    PolicyConfig(name="solver", actors=("solver",), share=0.5),
    # One line in a fixed format: a short SFT is enough (the demo's 300 steps teach the solver's
    # turns). Its conversations (~240 tokens: the instruction spelled in short pieces) are longer
    # than the solver's, and SFT rows are padded to sft.max_length: a smaller batch.
    # Dr. GRPO for the checker (group mean, no std): GRPO's per-group std gives a group of
    # one class (a task whose first answers are all wrong) the same pull as a mixed one, which
    # undoes the balanced role reward and pushes a checker that does not read to reject all
    # (docs/multi_policy.md "Does the team learn?").
    PolicyConfig(name="checker", actors=("checker",), share=0.5,
                 overrides=("sft.steps=40", "sft.batch_size=16", "sft.max_length=320", "algorithm.advantage=drgrpo")),
)


def get_config() -> Config:
    config = load_config(str(pathlib.Path(__file__).with_name("demo.py")), [
        "name=multi_policy_arith", "output_dir=runs/multi_policy_arith",
        # The checker reads the problem and the transcript after an English instruction that the
        # demo's tokenizer (trained on its arithmetic demonstrations) spells in short pieces.
        "rollout.max_prompt_length=256", "rollout.max_sequence_length=384",
        "eval.every_steps=10", "logging.progress=false"])
    return dataclasses.replace(config, multi_policy=MultiPolicyConfig(policies=POLICIES, solver_second_tries=1.0,
                                                                      checker_team_reward=False))
