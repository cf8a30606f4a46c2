"""The regime of the hindsight-OPD ablation (protocol in docs/hybrid.md).

The demo task made hard for GRPO: operands of 3-4 digits (an answer from memory is never
right, only an exactly copied interpreter result is), and an SFT demonstrator that rarely
calls the tool, so at the start many GRPO groups of 8 are all wrong and give no gradient.
(Protocol v2: v1's 3-5 digits and 200 SFT steps left a start policy that could not copy a
result at all, pass@1 0.000; docs/hybrid.md "Ablation protocol" says how that was found.)
A quarter of the SFT demonstrations carry the oracle judge's bridge thought and follow it
(``environment.demo_hint_fraction``), so the post-SFT policy, the teacher of every hybrid
arm, has learned to read a hint. Every arm starts from the same exported SFT policy; the
arms differ only in the ``hybrid`` overrides of ``bench/hybrid_ablation.py``. With
``hybrid.mode='none'`` (as here) a run is the GRPO arm.

    python bench/hybrid_ablation.py --out runs/hybrid_ablation        # the whole ablation
"""

import dataclasses
from pathlib import Path

from agentrl_jax.config import HybridConfig, load_config


def get_config():
    config = load_config(str(Path(__file__).with_name("demo.py")))
    return dataclasses.replace(
        config,
        name="hybrid_ablation",
        output_dir="runs/hybrid_ablation",
        total_steps=30,
        environment=dataclasses.replace(
            config.environment, min_digits=3, max_digits=4, demo_tool_fraction=0.2, demo_hint_fraction=0.25),
        sft=dataclasses.replace(config.sft, steps=300),
        eval=dataclasses.replace(config.eval, num_tasks=60, samples_per_task=4),
        hybrid=HybridConfig(
            mode="none",
            lam=0.3,
            teacher="reference",
            teacher_dtype="float32",
            judge="none",
            max_hint_tokens=48,
            hint_placement="user_message",
            hint_format="\nHint: {hint}",
            prm_weight=0.0,
        ),
    )
