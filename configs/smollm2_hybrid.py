"""The hindsight-OPD ablation on the real pretrained model (protocol in docs/hybrid.md, "On the real model").

The SmolLM2-135M-Instruct recipe of configs/smollm2_tools.py (the program tasks in the ReTool
inline layout, cold-start SFT on scripted-solver demonstrations, then GRPO), with the hybrid
section the arms of ``bench/hybrid_ablation.py --config configs/smollm2_hybrid.py`` override.
As it stands (``hybrid.mode='none'``) a run is the GRPO arm. The hint arms use the program
oracle (``train/guidance/program_oracle.py``): a natural-language bridge thought, appended to
the user message of the model's own ChatML template, read by the frozen post-SFT policy.

Unlike the scratch model of configs/hybrid_ablation.py, no SFT demonstration carries a hint:
the question is whether a pretrained instruct model reads a plain-English hint without being
taught the format.

    bash bench/hybrid_smollm2.sh OUT GGUF_FILE          # SFT per seed, diagnostic, arms, table
"""

import dataclasses
from pathlib import Path

from agentrl_jax.config import HybridConfig, load_config

#: The policy prompted as its own judge (``hybrid.judge=policy``): short, in plain words, one example.
JUDGE_TEMPLATE = """Here is a problem and one attempt at it.

Problem: {problem}

Attempt:
{trajectory}

Outcome: {outcome}.

Write one short sentence, in the first person, that says what the attempt should have done \
differently, inside \\boxed{{}}. For example: \\boxed{{I should write a Python program that \
computes it and copy the printed number.}} If the attempt is correct, answer \\boxed{{-1}}. \
Never write the final answer."""


def get_config():
    config = load_config(str(Path(__file__).with_name("smollm2_tools.py")))
    return dataclasses.replace(
        config,
        name="smollm2_hybrid",
        output_dir="runs/smollm2_hybrid",
        total_steps=8,
        # gradient accumulation over 16-row micro-batches: the same update, a quarter of the activation
        # memory, so four runs share one 80 GB card
        algorithm=dataclasses.replace(config.algorithm, micro_batch_size=16),
        eval=dataclasses.replace(config.eval, num_tasks=64, samples_per_task=4),
        # only the final checkpoint (1.4 GB a run) and no export but the SFT's (bench/hybrid_ablation.py asks for it)
        checkpoint=dataclasses.replace(config.checkpoint, every_steps=0, export_hf=False),
        hybrid=HybridConfig(
            mode="none",
            lam=0.3,
            teacher="reference",
            teacher_dtype="float32",  # the recipe's reference dtype: the teacher shares the frozen copy
            judge="none",
            judge_template=JUDGE_TEMPLATE,
            judge_max_new_tokens=64,
            max_hint_tokens=64,
            hint_placement="user_message",
            hint_format="\n\nHint: {hint}",
            hint_only_failed=False,
            prm_weight=0.0,
        ),
    )
