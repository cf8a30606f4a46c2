"""ReTool + hybrid RL: PRM judge, hindsight bridge thoughts and on-policy distillation.

The Retool-RL recipe of
"Agentic RL (Part III): Architecture Analysis of Verl and SkyRL to Retool-RL Case Practice"
(sections 3-4): start from a ReTool SFT checkpoint
(the case study's: qwen3-4b-retool-sft, Qwen3-4B-Instruct after 3 epochs on JoeYing/ReTool-SFT),
run outcome GRPO with the interpreter in the loop (configs/retool.py), and add

- a PRM judge after each episode: the frozen reference (the SFT model) reads the problem,
  the trajectory with the interpreter's feedback and the outcome, and answers
  ``\\boxed{-1}`` (no intervention; the case study saw this on 60-65% of trajectories) or a
  short bridge thought, e.g. "I should define the variable 'x' as a symbol using
  symbols('x') before using it in the summation." (judge="reference": no extra model;
  the case study: "completely eliminating the reliance on strong external models");
- the hindsight teacher: the same reference scores the sampled response tokens under
  [prompt + bridge thought + response] (the hint appended to the user message: "appending
  this bridge thought to the reference model's prompt");
- the hybrid advantage A_t = A_grpo + lambda * (log pi_teacher(y_t) - log pi(y_t)) on
  trajectories with a hint, pure GRPO elsewhere;
- the judge's PRM score (0..1) added to the outcome reward with a small weight.

    python launch/tpu_pod.py --config retool_hybrid \\
        --set model.path=/data/qwen3-4b-retool-sft \\
        --set data.train_path=/data/dapo_math_17k.parquet \\
        --set data.eval_path=/data/aime_2024.jsonl

What the case study states and what is our choice:
- stated: base model and SFT data, outcome GRPO baseline, judge = the reference model,
  ``\\boxed{-1}`` for no intervention, hint fraction 35-40%, teacher context
  [prompt + bridge thought + response], A = A_grpo + lambda * A_opd, pass@8 on AIME 2024
  as the metric (eval.samples_per_task=8), best checkpoint early (step 6 of ~12; the case study
  recommends early stopping or lr decay, hence the cosine schedule and checkpoints every
  2 steps here).
- not stated, chosen here: lambda = 1.0 (both terms at their natural scale: a GRPO
  advantage is O(1), a per-token log-ratio is O(1) nats on a hinted token), hint limit
  64 tokens (the case study's examples are 15-30 tokens), greedy judge with 512 new tokens,
  PRM weight 0.1 (well below the +-1 outcome so the ranking stays outcome-driven),
  teacher / judge in bfloat16.
"""

import dataclasses
from pathlib import Path

from agentrl_jax.config import CheckpointConfig, HybridConfig, OptimizerConfig


def get_config():
    # The paths are left to the command line; load_config checks them after the overrides.
    base = _retool()
    return dataclasses.replace(
        base,
        name="retool_hybrid",
        output_dir="runs/retool_hybrid",
        optimizer=OptimizerConfig(learning_rate=1e-6, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1,
                                  weight_decay=0.01, grad_clip=1.0),
        checkpoint=CheckpointConfig(every_steps=2, max_to_keep=10, export_hf=True),
        hybrid=HybridConfig(
            mode="hybrid",
            lam=1.0,
            teacher="reference",
            teacher_dtype="bfloat16",
            judge="reference",
            judge_template="",  # the built-in JUDGE_TEMPLATE (agentrl_jax/train/guidance/hindsight.py)
            judge_max_new_tokens=512,
            judge_temperature=0.0,
            max_hint_tokens=64,
            hint_placement="user_message",
            hint_format="\n\nHint (a correction from hindsight): {hint}",
            prm_weight=0.1,
            sample_hints=4,
        ),
    )


def _retool():
    import importlib.util

    path = Path(__file__).with_name("retool.py")
    spec = importlib.util.spec_from_file_location("agentrl_jax_config_retool_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()
