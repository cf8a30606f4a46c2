"""The embedded default: a tiny model learns *when* to call a Python interpreter.

Runs on a laptop CPU (2 cores, ~10 minutes):

1. A byte-level BPE tokenizer (digits split) is trained on the task corpus and a ~1M
   parameter Qwen3-style decoder is initialized from scratch (saved as HF directories).
2. SFT cold start on demonstrations of the arithmetic task: half of them call the
   interpreter (`<code>print(a*b)</code>`, then copy the `<interpreter>` result into
   `\\boxed{}`), half answer from memory — right for small numbers, usually wrong for long
   ones. The demonstrator picks its style regardless of the task.
3. GRPO with the interpreter in the loop: the policy is rewarded for correct answers, so
   it has to learn when the tool pays off and how to read its output.
4. Held-out pass@1 and tool-use rate before and after RL, printed as a table and saved to
   `<output_dir>/results.json`.
"""

from agentrl_jax.config import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EnvironmentConfig,
    EvalConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    SandboxConfig,
    SFTConfig,
)


def get_config() -> Config:
    return Config(
        name="demo",
        seed=0,
        output_dir="runs/demo",
        total_steps=40,
        model=ModelConfig(compute_dtype="float32", param_dtype="float32", remat="none"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        rollout=RolloutConfig(
            max_concurrent=64,
            max_prompt_length=64,
            max_sequence_length=128,
            max_new_tokens_per_turn=32,
            temperature=1.0,
            steps_per_dispatch=8,
            cache_dtype="float32",
        ),
        algorithm=AlgorithmConfig(advantage="grpo", loss="ppo", group_size=8, minibatches=1),
        optimizer=OptimizerConfig(learning_rate=3e-4, grad_clip=1.0),
        data=DataConfig(prompts_per_step=8),
        environment=EnvironmentConfig(
            name="arithmetic",
            max_turns=3,
            max_tool_calls=2,
            max_observation_tokens=16,
            outcome_scheme="binary",
            min_digits=2,
            max_digits=4,
            num_train_tasks=3000,
            num_eval_tasks=120,
            demo_tool_fraction=0.5,
            sandbox=SandboxConfig(workers=8, timeout_s=2.0, memory_mb=512),
        ),
        checkpoint=CheckpointConfig(every_steps=0, max_to_keep=2, resume=False),
        logging=LoggingConfig(sample_trajectories=2),
        eval=EvalConfig(every_steps=0, num_tasks=120, samples_per_task=4, temperature=1.0),
        sft=SFTConfig(steps=300, batch_size=64, learning_rate=2e-3, max_length=256),
    )
