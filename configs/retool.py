"""ReTool: RL with a code interpreter on competition math (Feng et al. 2025,
"ReTool: Reinforcement Learning for Strategic Tool Use in LLMs", arXiv:2504.11536).

Start from a ReTool SFT checkpoint of a Qwen3-4B-class model (cold start on
code-integrated reasoning traces), train with GRPO on DAPO-Math-17k-style problems, and
evaluate on AIME-style held-out problems with pass@k. The three paths are required:

    python launch/tpu_pod.py --config retool \\
        --set model.path=/data/qwen3-4b-retool-sft \\
        --set data.train_path=/data/dapo_math_17k.parquet \\
        --set data.eval_path=/data/aime_2024.jsonl

Settings follow the ReTool recipe: outcome reward +1/-1 from a verified `\\boxed{}`
answer, the interpreter output masked from the loss, clip-higher (0.2 / 0.28),
token-level loss, no KL, learning rate 1e-6, 16k-token context. Group size, batch size and
lengths are those of the Retool-RL case study (G = 8 samples, 512 prompts... scaled here to 64 prompts
per step so one TPU v5p-64 / 8xH100 host fits; raise data.prompts_per_step on larger slices).
"""

from agentrl_jax.config import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EnvironmentConfig,
    EvalConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    SandboxConfig,
)


def get_config() -> Config:
    return Config(
        name="retool",
        seed=0,
        output_dir="runs/retool",
        total_steps=400,
        model=ModelConfig(path="", compute_dtype="bfloat16", param_dtype="float32", remat="full"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        rollout=RolloutConfig(
            max_concurrent=256,
            # decode lanes: 128 sequences decode per step, the other slots wait ready (prefilled, or
            # between tool calls) and take the lane of a turn that stops, on the device. 256 multi-turn
            # episodes with 100 ms tools decode faster this way than with a lane per slot (docs/benchmarks.md,
            # "Decode lanes")
            decode_batch=128,
            max_prompt_length=1024,
            max_sequence_length=16384,
            max_new_tokens_per_turn=4096,
            temperature=1.0,
            steps_per_dispatch=16,
        ),
        algorithm=AlgorithmConfig(
            advantage="grpo",
            loss="ppo",
            aggregation="token-mean",
            group_size=8,
            eps_low=0.2,
            eps_high=0.28,
            kl_coef=0.0,
            minibatches=4,
            micro_batch_size=4,
        ),
        optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=10, weight_decay=0.01, grad_clip=1.0),
        data=DataConfig(train_path="", eval_path="", format="dapo", prompts_per_step=64),
        environment=EnvironmentConfig(
            name="retool",
            max_turns=16,
            max_tool_calls=12,
            max_observation_tokens=1024,
            outcome_scheme="pm1",
            sandbox=SandboxConfig(workers=64, timeout_s=10.0, memory_mb=4096),
        ),
        checkpoint=CheckpointConfig(every_steps=20, max_to_keep=3, export_hf=True),
        eval=EvalConfig(every_steps=20, num_tasks=0, samples_per_task=8, temperature=1.0),
    )
