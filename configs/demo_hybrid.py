"""The demo (configs/demo.py) with the Retool-RL hybrid advantage (docs/hybrid.md).

Same task, model and GRPO settings as the demo (its SFT data also has hint-following
demonstrations, below); after each episode a judge
writes a bridge thought, the frozen post-SFT policy (the reference) scores the sampled
tokens under [prompt + hint + response], and trajectories with a hint get
A_t = A_grpo + lambda * (log pi_teacher(y_t) - log pi(y_t)); the others keep pure GRPO.

The judge here is a SCRIPTED ORACLE (``ArithmeticOracleJudge``), not a model: a ~1M
parameter model cannot write useful hints. It goes through the same PRM interface as the
model judge (same judge-text format and parser, same hint-length limit) and reads only
what a model judge would see: the task, the trajectory with the interpreter's feedback and
the outcome. Its hints: "I should call the interpreter: <code>print(a*b)</code>" when the
policy answered from memory, the exact expression when the code was wrong, "copy the
printed result" when the result was not copied. A quarter of the SFT demonstrations carry
such a hint and follow it (``environment.demo_hint_fraction``), so the teacher can read one.

    python launch/tpu_pod.py --config configs/demo_hybrid.py
"""

import dataclasses
from pathlib import Path

from agentrl_jax.config import HybridConfig, load_config


def get_config():
    config = load_config(str(Path(__file__).with_name("demo.py")))
    return dataclasses.replace(
        config,
        name="demo_hybrid",
        output_dir="runs/demo_hybrid",
        # a quarter of the SFT demonstrations carry the oracle's hint and follow it, so the
        # post-SFT policy, the teacher, can read a hint (docs/hybrid.md)
        environment=dataclasses.replace(config.environment, demo_hint_fraction=0.25),
        hybrid=HybridConfig(
            mode="hybrid",
            lam=1.0,
            teacher="reference",
            teacher_dtype="float32",
            judge="oracle",
            max_hint_tokens=48,
            hint_placement="user_message",
            hint_format="\nHint: {hint}",
            prm_weight=0.0,  # the oracle's score is the outcome itself; no double counting
        ),
    )
