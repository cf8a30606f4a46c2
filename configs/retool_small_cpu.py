"""configs/retool_small.py at a size a 2-core CPU runs in a few minutes (the test's variant).

Same pipeline, same environment and data generators; a ~0.2M-parameter model, fewer tasks,
demonstrations and steps. It shows the pipeline end to end, not learning.

    python launch/tpu_pod.py --config configs/retool_small_cpu.py
"""

import pathlib

from agentrl_jax.config import Config, load_config

CPU_OVERRIDES = [
    "name=retool_small_cpu", "output_dir=runs/retool_small_cpu", "total_steps=4",
    "model.scratch.vocab_size=512", "model.scratch.hidden_size=64", "model.scratch.intermediate_size=128",
    "model.scratch.num_layers=2", "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1",
    "model.scratch.head_dim=32", "rollout.max_concurrent=32", "rollout.steps_per_dispatch=8",
    "rollout.kv_cache_bytes=0", "data.prompts_per_step=4", "algorithm.group_size=4", "algorithm.minibatches=1",
    "environment.num_train_tasks=400", "environment.num_eval_tasks=16", "environment.num_demonstrations=200",
    "environment.sandbox.workers=4", "eval.num_tasks=16", "eval.samples_per_task=2", "sft.steps=60",
    "sft.batch_size=16", "sft.learning_rate=3e-3", "logging.sample_trajectories=1", "logging.tensorboard=false",
]


def get_config() -> Config:
    return load_config(str(pathlib.Path(__file__).with_name("retool_small.py")), CPU_OVERRIDES)
